"""`mbolt predict`: the gain of a layout before rewriting, from the trace and the probe.

Counts come from THE evaluator (`mbolt.layout.evaluate.evaluate`, which merges with the shared
`merge_ranges_batched`); time comes from the probe's per-read cost:

    io time per token  T = reads/token * t_op + bytes/token / BW        (t_op, BW at the arm's QD/mode)
    per-cold-expert gain  g = T_stock / T_layout
                          ~= 1 + saved_ops * t_op / (slice_bytes / BW)  (DESIGN.md's law, per expert)
    end-to-end speedup = 1 / ((1 - s) + s / g),  s = share of decode time spent on cold reads

In replay mode (I/O only) s = 1 and the speedup is g. A packed file pads expert slots; the store
reads through the padding, so predicted bytes add it (padding x merged neighbours).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mbolt.bench.probe import cost, load_probe
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.layout.evaluate import evaluate, geometry_from_model
from mbolt.core.trace import Trace


def counts(trace: Trace, perm: np.ndarray, mm: MoeMap, layout: str, gap: int = 0, cache_slots: int = 0,
           pad: int = 0, rewritten: bool = False) -> dict:
    """Reads, bytes and useful bytes per token of `trace` over a file of this geometry; device
    bytes with the pages the reads straddle (`rewritten`: an mbolt rewrite of `mm`, whose slices
    all start on a page, rather than `mm` itself)."""
    geo = geometry_from_model(mm, "packed" if layout == "packed" else "reorder")
    ev = evaluate(trace, perm, geo, gap=max(gap, pad), cache_slots=cache_slots)
    if layout == "packed" and pad:
        # evaluate() assumes slots of exactly expert_bytes; the file pads them by `pad`, so
        # positions are farther apart by pad each: every expert merged into a run reads a pad
        ev["bytes_per_token"] = ev["useful_bytes_per_token"] + pad * max(ev["misses_per_token"] - ev["reads_per_token"], 0.0)
    # The device reads whole pages (buffered: the page cache; O_DIRECT: the store aligns each read):
    # a read starting inside a page reads one page more. Converters align tensors to 32 B only, so a
    # stock file's slices straddle pages; mbolt's rewrites start every slice on a page.
    share = 0.0 if rewritten else unaligned_read_share(mm, layout)
    ev["device_bytes_per_token"] = ev["bytes_per_token"] + PAGE * ev["reads_per_token"] * share
    return ev


PAGE = 4096


def unaligned_read_share(mm: MoeMap, layout: str) -> float:
    """Share of reads that start inside a page: reads spread evenly over a layer's regions (one per
    role in the reorder layout, the slot in packed), so the share of regions whose slices are not
    all page aligned, averaged over the MoE layers."""
    shares = []
    for layer in mm.moe_layers:
        ws = layer.weights[:1] if layout == "packed" else layer.weights
        shares.append(np.mean([not t.aligned or (t.stride or t.slice_bytes) % PAGE != 0 for t in ws]))
    return float(np.mean(shares)) if shares else 0.0


def io_time(reads: float, nbytes: float, t_op: float, bw: float) -> float:
    return reads * t_op + nbytes / bw


def store_io(c: dict, probe_d: dict, direct: bool, qd: int, n_calls: int) -> tuple[float, float, float, float]:
    """Predicted seconds per token for the store reading counts `c` (from `counts`) in `n_calls`
    calls per token (one per MoE layer) with `qd` threads: (seconds, t_op, BW, ops per read).
    Time = ops x t_op + device bytes / BW (whole pages: what the drive reads)."""
    n = max(n_calls, 1)
    t_op, bw, opr = reader_cost(probe_d, direct, qd, c["reads_per_token"] / n, c["bytes_per_token"] / n)
    return io_time(c["reads_per_token"] * opr, c["device_bytes_per_token"], t_op, bw), t_op, bw, opr


def reader_cost(probe_d: dict, direct: bool, qd: int, reads_per_call: float,
                bytes_per_call: float = 0.0) -> tuple[float, float, float]:
    """(t_op, BW, ops per read) of the store's reader issuing `reads_per_call` merged reads
    (`bytes_per_call` bytes) per layer with `qd` threads.

    With qd > 1 the store splits long reads into pieces of >= 256 KiB and >= bytes/qd
    (`core.ranges.split_jobs`), so a call issues about max(reads, bytes/piece) operations, and
    only min(qd, ops) are in flight: the per-op cost is interpolated between the probe's QD1
    and QD`qd` figures by that parallelism.
    """
    t1, b1 = cost(probe_d, direct, 1)
    if qd <= 1:
        return t1, b1, 1.0
    from mbolt.core.ranges import SPLIT_MIN

    piece = max(SPLIT_MIN, bytes_per_call / qd)
    ops = max(reads_per_call, bytes_per_call / piece) if bytes_per_call else reads_per_call
    tq, bq = cost(probe_d, direct, qd)
    par = min(float(qd), max(1.0, ops))
    f = (par - 1.0) / (qd - 1.0)
    return t1 + (tq - t1) * f, 1.0 / (1.0 / b1 + (1.0 / bq - 1.0 / b1) * f), ops / max(reads_per_call, 1e-12)


def law(saved_ops_per_expert: float, slice_bytes: float, t_op: float, bw: float, s: float = 1.0) -> tuple[float, float]:
    """DESIGN.md: g ~= 1 + saved_ops * t_op / (slice_bytes / BW); speedup = 1/((1-s) + s/g)."""
    g = 1.0 + saved_ops_per_expert * t_op / (slice_bytes / bw)
    return g, end_to_end(g, s)


def end_to_end(g: float, s: float) -> float:
    """Decode speedup when a share s of decode time is reads that get g times faster."""
    return 1.0 / ((1.0 - s) + s / g)


def throttled_io_s(reads: float, nbytes: float, iops: float | None, bps: float | None) -> float:
    """Seconds per token a throttled drive needs for `reads` operations and `nbytes` bytes: the
    cgroup caps operations and bytes separately (token buckets), so the binding one sets the time
    (the disk underneath is faster than either cap)."""
    return max(reads / iops if iops else 0.0, nbytes / bps if bps else 0.0)


def throttled_layout_law(stock: tuple[float, float, float], layout_ratio: tuple[float, float],
                         probe_cost: tuple[float, float], iops: float | None, bps: float | None) -> dict:
    """The slice-size law on a throttled drive, as a prediction: the reorder file's decode gain over
    the stock file from what is known before the reorder arm runs. `stock` = the STOCK arm's
    measured (reads, bytes, tok/s) per token; `layout_ratio` = (reads, bytes) of the reorder file
    over the stock file as the layout evaluator counts them on the same routing
    (`layout_read_ratios`); `probe_cost` = (t_op s, BW B/s) of the drive from `mbolt probe`.
    The reorder arm's reads are the stock arm's scaled by the layout's ratio, never its own
    measured ones. Each file's I/O time per token is the slowest of the drive's own cost
    (reads x t_op + bytes / BW) and the profile's caps (`throttled_io_s`); s = the stock arm's
    share of time in its I/O (at most 1), g = stock I/O time / reorder I/O time,
    gain = 1/((1-s) + s/g)."""
    t_op, bw = probe_cost
    reorder = (stock[0] * layout_ratio[0], stock[1] * layout_ratio[1])

    def io_s(reads: float, nbytes: float) -> float:
        return max(io_time(reads, nbytes, t_op, bw), throttled_io_s(reads, nbytes, iops, bps))

    io_stock, io_reorder = io_s(*stock[:2]), io_s(*reorder)
    s = min(1.0, io_stock * stock[2])
    g = io_stock / io_reorder if io_reorder > 0 else None
    return {"inputs": "stock arm's measured reads and bytes, the layout's read and byte ratios, the probe's cost",
            "predicted_per_token": {"reorder_reads": reorder[0], "reorder_bytes": reorder[1]},
            "probe_cost": {"t_op_s": t_op, "bw_bytes_per_s": bw},
            "io_s_per_token": {"stock": io_stock, "reorder": io_reorder}, "s": s, "g": g,
            "predicted_gain": end_to_end(g, s) if g else None}


def layout_read_ratios(trace: Trace, stock_mm: MoeMap, reorder_mm: MoeMap, gap: int = 0,
                       cache_slots: int = 0) -> tuple[float, float]:
    """(reads, device bytes) per token of the reorder file over the stock file on `trace`, as the
    evaluator counts them (`counts`: the same merge rule and cache for both files). The layout's
    effect on reads, known before either file is read."""
    def of(mm: MoeMap, rewritten: bool) -> dict:
        rm = mm.route_map
        return counts(trace, rm.perm, mm, rm.layout if rm.layout != "stock" else "reorder", gap, cache_slots,
                      mm.moe_layers[0].slot_padding, rewritten=rewritten)

    a, b = of(stock_mm, False), of(reorder_mm, True)
    if not a["reads_per_token"] or not a["device_bytes_per_token"]:
        from mbolt.core.errors import MboltError

        raise MboltError("layout law: the stock file reads nothing on this trace (every expert cached)")
    return b["reads_per_token"] / a["reads_per_token"], b["device_bytes_per_token"] / a["device_bytes_per_token"]


def law_predicts_no_change(predicted: float) -> bool:
    """The law's gain is under 5% either way: then it is tested as 1.00 +- 0.05."""
    return abs(predicted - 1.0) < 0.05


def law_holds(measured: float | None, predicted: float | None, within: float = 0.10) -> bool:
    """Issue 28's test of the law: the measured gain within 10% of the predicted one, or within
    1.00 +- 0.05 where the law predicts a change under 5%."""
    if measured is None or predicted is None:
        return False
    if law_predicts_no_change(predicted):
        return abs(measured - 1.0) <= 0.05
    return abs(measured / predicted - 1.0) <= within


def decode_law(wall_base: float, io_base: float, reads_base: float, io_arm: float, reads_arm: float,
               non_io_per_read_s: float = 0.0) -> float:
    """End-to-end decode speedup of an arm over the baseline, per token:

        wall = other + io + reads * c        (c: time per read spent outside I/O, e.g. bookkeeping)
        speedup = wall_base / (other + io_arm + reads_arm * c),  other = wall_base - io_base - reads_base * c

    With c = 0 this is DESIGN.md's 1/((1-s) + s/g), s = io_base/wall_base, g = io_base/io_arm."""
    other = wall_base - io_base - reads_base * non_io_per_read_s
    return wall_base / (other + io_arm + reads_arm * non_io_per_read_s)


def predict(model: str, plan_path: str | None, trace: Trace, probe_path: str, *, layouts=("reorder", "packed"),
            qd: int = 1, direct: bool = False, gap: int = 0, cache_slots: int = 0, s: float = 1.0,
            trace_name: str = "trace") -> dict:
    """Predicted reads/token, bytes/token, g and speedup of the plan's layouts vs the stock file."""
    from mbolt.core.compat import check_compatible

    mm = moe_map(model)
    check_compatible(trace, mm, trace_name)
    plan = None
    if plan_path is not None:
        from mbolt.core.plan import load_plan

        plan = load_plan(plan_path)
        check_compatible(plan, mm, str(plan_path))
    rm = mm.route_map
    pr = load_probe(probe_path)
    t_op, bw = cost(pr, direct, qd)
    n_calls = len(mm.moe_layers)
    base_perm = rm.perm  # the file as it is (stock: identity)
    base = counts(trace, base_perm, mm, rm.layout if rm.layout != "stock" else "reorder", gap, cache_slots)
    rows = [{"layout": f"{rm.layout} (this file)", **_timed(base, pr, direct, qd, n_calls)}]
    if plan is not None:
        perm = np.asarray(plan.perm)
        ident = np.tile(np.arange(mm.n_experts), (mm.n_layers, 1))
        pad = _packed_pad(mm)
        for lay in layouts:
            for name, p in ((f"{lay}({plan.method})", perm), (f"{lay}(identity)", ident)):
                if lay == "reorder" and p is ident:
                    continue
                c = counts(trace, p, mm, lay, gap, cache_slots, pad if lay == "packed" else 0, rewritten=True)
                rows.append({"layout": name, **_timed(c, pr, direct, qd, n_calls)})
    T0 = rows[0]["io_ms_per_token"]
    miss0 = base["misses_per_token"]
    # the law's slice: the mean expert bytes of a missed expert (layers of mixed types differ)
    slice_b = base["useful_bytes_per_token"] / max(miss0, 1e-12)
    for r in rows:
        g = T0 / r["io_ms_per_token"] if r["io_ms_per_token"] else float("nan")
        r["g_measured_model"] = g
        saved = (base["reads_per_token"] - r["reads_per_token"]) / max(miss0, 1e-12)
        r["saved_ops_per_expert"] = saved
        r["g_law"], _ = law(saved, slice_b, t_op, bw, s)
        r["speedup"] = end_to_end(g, s)
    return {"model": str(model), "plan": str(plan_path) if plan_path else None, "tokens": trace.n_tokens,
            "reader": {"qd": qd, "direct": direct, "gap": gap, "cache_slots": cache_slots},
            "t_op_us": t_op * 1e6, "bw_mb_s": bw / 1e6, "s": s, "expert_bytes": slice_b, "rows": rows,
            "probe": str(probe_path)}


def _timed(c: dict, pr: dict, direct: bool, qd: int, n_calls: int) -> dict:
    T, t_op, bw, opr = store_io(c, pr, direct, qd, n_calls)
    return {"reads_per_token": c["reads_per_token"], "bytes_per_token": c["bytes_per_token"],
            "hit_rate": c["hit_rate"], "t_op_us": t_op * 1e6, "bw_mb_s": bw / 1e6, "ops_per_token": c["reads_per_token"] * opr,
            "device_bytes_per_token": c["device_bytes_per_token"], "io_ms_per_token": T * 1e3}


def _packed_pad(mm: MoeMap) -> int:
    """Padding per expert slot the rewriter will use for a packed file (4 KiB / 512 B slots)."""
    from mbolt.core.packed import slot_stride

    # layers of other types have other slots: the widest padding bounds what a merge reads through
    return max(int(slot_stride(layer.expert_bytes)[0] - layer.expert_bytes) for layer in mm.moe_layers)


def predict_rounds(arms: list[dict], trace: Trace, probe_d: dict, rounds_of: dict[str, list[int]],
                   tokens_per_round: int = 0) -> dict[str, dict]:
    """Per arm (dicts with name, path, mode, gap, cache_slots, resident_frac, direct, io_threads):
    predicted I/O time per token of every round it ran (`per_round`: round -> seconds, each on
    the round's own slice of tokens, `ab.round_tokens`), the reads per token of those rounds, the
    whole trace's counts, and the per-read cost used. os arms are left out (layout-blind)."""
    from mbolt.bench.runners import round_tokens

    slices: dict[int, Trace] = {}

    def tokens_of(k: int) -> Trace:
        key = (k * tokens_per_round) % trace.n_tokens if tokens_per_round and tokens_per_round < trace.n_tokens else 0
        if key not in slices:
            slices[key] = round_tokens(trace, k, tokens_per_round)
        return slices[key]

    out = {}
    for a in arms:
        if a["mode"] == "os":
            continue
        mm = moe_map(a["path"])
        rm = mm.route_map
        pad = mm.moe_layers[0].slot_padding
        slots = a["cache_slots"] if a.get("resident_frac") is None else int(round(a["resident_frac"] * mm.n_experts))
        lay = rm.layout if rm.layout != "stock" else "reorder"
        n = len(mm.moe_layers)

        def timed(tr: Trace) -> tuple[dict, float, tuple]:
            c = counts(tr, rm.perm, mm, lay, a["gap"], slots, pad)
            T, t_op, bw, _ = store_io(c, probe_d, a["direct"], a["io_threads"], n)
            return c, T, (t_op, bw)

        c_all, T_all, cost_ = timed(trace)
        memo: dict[int, tuple] = {}
        per, reads = {}, []
        for k in rounds_of.get(a["name"], []):
            tr = tokens_of(k)
            if id(tr) not in memo:
                memo[id(tr)] = timed(tr)
            c, T, _ = memo[id(tr)]
            per[k] = T
            reads.append(c["reads_per_token"])
        out[a["name"]] = {"per_round": per, "reads": reads, "all": c_all, "T_all": T_all, "t_op": cost_[0],
                          "bw": cost_[1], "cost_source": "burst probe (scattered reads back to back)"
                          if probe_d.get("burst_fits") and not a["direct"] and a["io_threads"] <= 1
                          else "random-read probe"}
    return out


def predicted_speedups(pred: dict[str, dict], base: str, arm: str) -> tuple[float | None, float | None]:
    """(median of per-round predicted ratios, ratio of the predicted medians) of `arm` vs `base`
    over the rounds both ran: the two speedup definitions of `ab`, predicted."""
    bT, aT = pred.get(base, {}).get("per_round", {}), pred.get(arm, {}).get("per_round", {})
    ks = sorted(set(bT) & set(aT))
    if not ks:
        return None, None
    mor = float(np.median([bT[k] / aT[k] for k in ks if aT[k] > 0]))
    rom = float(np.median([bT[k] for k in ks]) / np.median([aT[k] for k in ks]))
    return mor, rom


def predict_vs_measured(result, trace: Trace | None, probe_path) -> list[dict]:
    """Per arm of an `ab` result: predicted reads and I/O time per token next to the measured,
    each arm predicted from its own file's route map with the probe's per-read cost.

    Like with like: the measured speedup is the median over rounds of per-round ratios, each
    round on its own slice of tokens, so the predicted one is the median over the same rounds of
    the predicted ratios on the same slices (`pred_speedup`); `pred_ratio_of_medians` stands
    beside the measured `ratio_of_medians`. Reads and times per token are medians over rounds too
    (`pred_reads_per_token_all`: over the whole trace)."""
    if trace is None:
        return []
    d = result if isinstance(result, dict) else result.to_dict()
    pr = load_probe(probe_path)
    tpr = int(d["trace"].get("tokens_per_round", 0)) if d.get("trace") else 0
    base = d["arms"][0]["name"]
    metric = d["metric"]
    rounds_of: dict[str, list[int]] = {}
    for r in d["rounds"]:
        if not r["rejected"]:
            rounds_of.setdefault(r["arm"], []).append(r["round"])
    pred = predict_rounds([a for a, s in zip(d["arms"], d["summary"]) if s.get("rounds")], trace, pr, rounds_of, tpr)
    rows = []
    for a, s in zip(d["arms"], d["summary"]):
        p = pred.get(a["name"])
        if p is None:
            rows.append({"arm": a["name"], "note": "os arm: layout-blind page faults, no prediction"
                         if a["mode"] == "os" else "no valid rounds"})
            continue
        mor, rom = predicted_speedups(pred, base, a["name"])
        meas = s.get("median_of_ratios", s.get("speedup_vs_baseline_median"))
        rows.append({"arm": a["name"], "pred_reads_per_token": float(np.median(p["reads"])),
                     "pred_reads_per_token_all": p["all"]["reads_per_token"],
                     "meas_reads_per_token": s["reads_per_token"],
                     "pred_bytes_per_token": p["all"]["bytes_per_token"],
                     "meas_bytes_per_token": s["mb_per_token"] * 1e6,
                     "pred_device_bytes_per_token": p["all"]["device_bytes_per_token"],
                     "meas_device_bytes_per_token": (s.get("device_mb_per_token") or 0) * 1e6 or None,
                     "pred_ms_per_token": float(np.median(list(p["per_round"].values()))) * 1e3,
                     "meas_ms_per_token": s[f"{metric}_per_token_ms_median"],
                     "pred_speedup": mor, "meas_speedup": meas,
                     "pred_ratio_of_medians": rom, "meas_ratio_of_medians": s.get("ratio_of_medians"),
                     "speedup_definition": "median of per-round ratios (pred_speedup and meas_speedup alike)",
                     "speedup_error": (meas / mor - 1) if meas and mor else None,
                     "t_op_us": p["t_op"] * 1e6, "bw_mb_s": p["bw"] / 1e6, "cost_source": p["cost_source"]})
    return rows


def measured_s(ab_json) -> float:
    """s measured by `ab --engine llama.cpp`: the read share of decode time of its first arm
    with explicit reads (the law's reference)."""
    import json

    from mbolt.core.errors import MboltError

    try:
        d = json.loads(Path(ab_json).read_text())
    except (OSError, ValueError) as e:
        raise MboltError(f"{ab_json}: not a readable ab result ({e})") from None
    row = next((r for r in d.get("summary", []) if r.get("read_share_s") is not None), None)
    if d.get("engine") != "llama.cpp" or row is None:
        raise MboltError(f"{ab_json}: no arm with a measured read share (an `ab --engine llama.cpp` result "
                         "with an explicit-read arm is needed)")
    return float(row["read_share_s"])


def predict_llama(result, trace: Trace, probe_path) -> list[dict]:
    """`ab --engine llama.cpp`: the slice-size law per arm, next to the measurement.

    The reference R is the first arm with explicit reads (an os arm reads what the kernel's
    readahead decides: no layout prediction). For every reading arm X the evaluator counts
    X's reads and bytes on `trace` (the routing llama.cpp computed, original ids) and the probe
    prices them: g = T_R / T_X. s is R's measured share of decode time spent in the reads, and
    the law predicts X's decode time per token as R's measured one times (1 - s) + s / g, i.e. a
    speedup 1 / ((1 - s) + s / g); measured: the median per-round ratio of R's decode time per
    token over X's.
    """
    pr = load_probe(probe_path)
    summ = {s["arm"]: s for s in result.summary}
    ref = next((a for a in result.arms if a["mode"] != "os" and summ[a["name"]].get("rounds")
                and summ[a["name"]].get("read_share_s") is not None), None)
    if ref is None:
        return []
    s_ref = summ[ref["name"]]["read_share_s"]
    per = {(r.arm, r.round): r.wall_s / r.tokens for r in result.rounds if not r.rejected and r.tokens}
    rounds = sorted({k for _, k in per})
    T = {}
    rows = []
    for a in result.arms:
        if a["mode"] == "os" or not summ[a["name"]].get("rounds"):
            rows.append({"arm": a["name"], "note": "os arm: layout-blind page faults, no prediction"})
            continue
        mm = moe_map(a["path"])
        rm = mm.route_map
        c = counts(trace, rm.perm, mm, rm.layout if rm.layout != "stock" else "reorder", a["gap"], a["cache_slots"])
        T[a["name"]], t_op, bw, _ = store_io(c, pr, False, a["io_threads"], len(mm.moe_layers))
        rows.append({"arm": a["name"], "pred_reads_per_token": c["reads_per_token"],
                     "meas_reads_per_token": summ[a["name"]]["reads_per_token"],
                     "pred_bytes_per_token": c["bytes_per_token"],
                     "meas_bytes_per_token": summ[a["name"]]["mb_per_token"] * 1e6,
                     "pred_device_bytes_per_token": c["device_bytes_per_token"],
                     "pred_io_ms_per_token": T[a["name"]] * 1e3,
                     "meas_io_ms_per_token": summ[a["name"]]["io_ms_per_token_median"],
                     "t_op_us": t_op * 1e6, "bw_mb_s": bw / 1e6, "s": s_ref, "reference": ref["name"]})
    ref_ms = summ[ref["name"]]["wall_ms_per_token_median"]
    for r in rows:
        if r["arm"] not in T:
            continue
        g = T[ref["name"]] / T[r["arm"]] if T[r["arm"]] else float("nan")
        sp = end_to_end(g, s_ref)
        ratios = [per[(ref["name"], k)] / per[(r["arm"], k)] for k in rounds
                  if (ref["name"], k) in per and (r["arm"], k) in per]
        meas = float(np.median(ratios)) if ratios else None
        r.update({"g": g, "pred_speedup": sp, "meas_speedup": meas,
                  "pred_ms_per_token": ref_ms / sp, "meas_ms_per_token": summ[r["arm"]]["wall_ms_per_token_median"],
                  "speedup_error": (meas / sp - 1) if meas else None})
    return rows
