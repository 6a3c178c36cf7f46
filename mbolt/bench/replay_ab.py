"""The cold replay A/B on synthetic models (scripts/bench_ab.py): the models and their files, the
arms per queue depth and read mode, the predictions to pre-register, the registered and the
exploratory runs, the decode run and its law, and the goals' summary. One invocation's seed and
tags travel in a `ReplayRun`."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mbolt.bench.ab import run_ab, write_result
from mbolt.bench.arms import Arm
from mbolt.bench.predict import predict_vs_measured
from mbolt.bench.probe import load_probe
from mbolt.bench.stats import StopRule, aa_ok, aa_row
from mbolt.core.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench"))
RESULTS = ROOT / "results"
PROMPTS = ROOT / "mbolt" / "data" / "prompts.jsonl"

MODELS = {
    "s64k": dict(synth=dict(n_layers=16, n_experts=64, n_used=8, hidden=128, expert_ff=128, n_heads=4,
                            n_kv_heads=2, head_dim=32, dense_ff=128, expert_type="F32", structure="planted"),
                 engine="reference", prompts=8, new_tokens=8, phase="all", held_tokens=80, rounds=5,
                 configs=[(1, False), (4, False), (1, True), (4, True)]),
    "q30b": dict(synth=dict(preset="qwen3-30b-a3b", n_layers=4, fast_random=True, structure="planted"),
                 engine="llama.cpp", prompts=6, new_tokens=24, phase="decode", held_tokens=24, rounds=3,
                 configs=[(1, False), (4, True)]),
}


NOISE_NOTE = "2 shared cores, ~7 other workers running on the machine: timings are noisy"
QUIET_NOTE = "no other jobs on the machine during the run (2 cores)"
# configs without a pre-registration run the pre-registrations' protocol (many short rounds, adaptive
# stop), with a 10-minute budget
UNREGISTERED_STOP = dict(min_rounds=24, max_rounds=600, time_budget_s=600, precision=0.03)
UNREGISTERED_TOKENS_PER_ROUND = 8
# twice the reads of `mbolt probe`'s default, in 6 interleaved repeats: a tighter spread between probes
# run back to back (scripts/bench_probe_conditions.py -> results/probe_conditions.json)
PROBE_ARGS = dict(size_mb=256, repeats=6, reads_mb=32)


@dataclass(frozen=True)
class ReplayRun:
    """One invocation's names. --seed/--tag: a fresh synthetic model (new planted groups, new
    weights, so a new trace) whose results, pre-registrations and probe carry the tag, so earlier
    runs are never overwritten; model_tag is the models' directory suffix (the tag unless a re-run
    of earlier models under new pre-registrations names other models)."""

    seed: int = 0
    tag: str = ""
    model_tag: str = ""
    quiet_machine: bool = False

    @property
    def probe(self) -> Path:
        return RESULTS / f"probe_{self.tag}.json" if self.tag else RESULTS / "probe.json"

    @property
    def noise_note(self) -> str:
        return QUIET_NOTE if self.quiet_machine else NOISE_NOTE

    def paths(self, name: str) -> dict:
        d = BENCH / (f"{name}_{self.model_tag}" if self.model_tag else name)
        return {"dir": d, "stock": d / "stock.gguf", "trace": d / "full.mbtrace", "held": d / "held.mbtrace",
                "plan": d / "plan.json", "reorder-tsp": d / "reorder-tsp.gguf", "packed-tsp": d / "packed-tsp.gguf",
                "packed-id": d / "packed-id.gguf"}

    def summary_name(self, suffix: str = "") -> str:
        return f"ab_summary{suffix}" + (f"_{self.tag}" if self.tag else "") + ".json"

    def cfg_name(self, name: str, qd: int, direct: bool) -> str:
        return f"ab_{name}_qd{qd}_{'direct' if direct else 'buffered'}" + (f"_{self.tag}" if self.tag else "")


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def prepare(run: ReplayRun, name: str, spec: dict) -> dict:
    from mbolt.synth.synth import SynthConfig, write_synth
    from mbolt.core.plan import save_plan
    from mbolt.core.trace import split_trace
    from mbolt.layout.plan import make_plan
    from mbolt.rewrite.reorder import reorder
    from mbolt.core.mbtrace import read_trace, write_trace
    from mbolt.trace.tracer import trace_prompts

    p = run.paths(name)
    p["dir"].mkdir(parents=True, exist_ok=True)
    sy = dict(spec["synth"], seed=run.seed)
    cfg = SynthConfig.from_preset(sy.pop("preset"), **sy) if "preset" in sy else SynthConfig(**sy)
    t0 = time.perf_counter()
    write_synth(p["stock"], cfg)
    log(name, "model written", f"{p['stock'].stat().st_size / 1e6:.0f} MB", f"{time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    info = trace_prompts(p["stock"], PROMPTS, p["trace"], max_new_tokens=spec["new_tokens"], engine=spec["engine"],
                         limit=spec["prompts"])
    log(name, "traced", info["prefill_tokens"], "prefill +", info["decode_tokens"], "decode tokens",
        f"{time.perf_counter() - t0:.1f}s")
    tr = read_trace(p["trace"])
    plan = make_plan(tr, "tsp", train_frac=0.5, phase=spec["phase"])
    save_plan(p["plan"], plan)
    _, held, split = split_trace(tr, train_frac=0.5, phase=spec["phase"])
    held = held.select(np.arange(held.n_tokens) < spec["held_tokens"])
    write_trace(p["held"], held)
    ident = np.tile(np.arange(cfg.n_experts, dtype=np.int32), (cfg.n_layers, 1))
    for arm, perm, layout in (("reorder-tsp", plan.perm, "reorder"), ("packed-tsp", plan.perm, "packed"),
                              ("packed-id", ident, "packed")):
        reorder(p["stock"], p[arm], perm, heat=None, method="tsp" if perm is plan.perm else "identity",
                layout=layout, force=True, sidecar=False)
    log(name, "rewritten: reorder-tsp, packed-tsp, packed-id; held-out tokens", held.n_tokens, split)
    return {"split": split, "held_tokens": held.n_tokens, "trace": info}


def arms_for(run: ReplayRun, name: str, qd: int, direct: bool) -> list[Arm]:
    p = run.paths(name)
    arms = [Arm("stock", str(p["stock"]), io_threads=qd, direct=direct)]
    for a in ("reorder-tsp", "packed-tsp", "packed-id"):
        arms.append(Arm(a, str(p[a]), io_threads=qd, direct=direct))
    if qd == 1 and not direct:
        arms.append(Arm("os", str(p["stock"]), mode="os"))
    return arms


def predictions(run: ReplayRun, name: str, qd: int, direct: bool, tokens_per_round: int = 0) -> list[dict]:
    """Predicted I/O time per token and speedup of every arm (evaluator counts + probe cost, the
    burst figures for QD1 buffered when the probe has them), no measuring. With tokens_per_round
    (the pre-registration's protocol): the median over one cycle of rounds of the per-round
    predicted ratios, the speedup definition `ab` measures."""
    from dataclasses import asdict

    from mbolt.bench.predict import predict_rounds, predicted_speedups
    from mbolt.core.mbtrace import read_trace

    held = read_trace(run.paths(name)["held"])
    pr = load_probe(run.probe)
    arms = [asdict(a) for a in arms_for(run, name, qd, direct) if a.mode != "os"]
    cycle = -(-held.n_tokens // tokens_per_round) if tokens_per_round else 1
    pred = predict_rounds(arms, held, pr, {a["name"]: list(range(cycle)) for a in arms}, tokens_per_round)
    out = []
    for a in arms:
        p = pred[a["name"]]
        mor, rom = predicted_speedups(pred, arms[0]["name"], a["name"])
        out.append({"arm": a["name"], "reads_per_token": p["all"]["reads_per_token"],
                    "mb_per_token": p["all"]["bytes_per_token"] / 1e6,
                    "device_mb_per_token": p["all"]["device_bytes_per_token"] / 1e6, "io_ms_per_token": p["T_all"] * 1e3,
                    "speedup": mor, "ratio_of_medians": rom, "cost_source": p["cost_source"]})
    return out


def run_config(run: ReplayRun, name: str, spec: dict, qd: int, direct: bool) -> dict:
    from mbolt.bench.prereg import check_and_lock, load_prereg, verdict
    from mbolt.core.mbtrace import read_trace

    p = run.paths(name)
    cname = run.cfg_name(name, qd, direct)
    held = read_trace(p["held"])
    pre = ROOT / "prereg" / f"{cname}.toml"
    pr = None
    arms = arms_for(run, name, qd, direct)
    if pre.exists():
        os.environ.setdefault("MBOLT_BENCH", str(BENCH))
        pr = load_prereg(pre)
        lock = check_and_lock(pr)
        log(cname, "pre-registered:", pre.name, "sha256", pr.sha256[:16], "run", lock["runs"])
        arms = pr.arms
    t0 = time.perf_counter()
    if pr:
        stop = StopRule(rounds=pr.rounds, min_rounds=pr.min_rounds, max_rounds=pr.max_rounds,
                        time_budget_s=pr.time_budget, precision=pr.precision)
        tokens_per_round = int(pr.raw.get("tokens_per_round", 0))
    else:  # not registered: the same adaptive protocol, a shorter budget
        stop, tokens_per_round = StopRule(**UNREGISTERED_STOP), UNREGISTERED_TOKENS_PER_ROUND
    res = run_ab(arms, trace=held, stop=stop, name=cname, seed=pr.seed if pr else 0,
                 prereg=pr.to_dict() if pr else None, trace_path=str(p["held"]), tokens_per_round=tokens_per_round)
    res.prediction = predict_vs_measured(res, held, run.probe)
    if pr:
        res.prereg["result"] = verdict(pr, res.summary)
    res.notes.append(run.noise_note)
    write_result(RESULTS / f"{cname}.json", res)
    _log_summary(cname, res, t0)
    if pr:
        log("  prereg:", res.prereg["result"])
    return res.to_dict()


def run_explore(run: ReplayRun, names: list[str], tokens_per_round: int = 8) -> dict:
    """Not pre-registered, run after the registered configs: the same arms and tokens, but many
    short rounds (tokens_per_round held-out tokens each, cycling) so that the neighbours' bursts
    of I/O land on every arm, and the os arm in its own comparison (its 8 MiB read-around
    disturbed the arm after it in the mixed runs)."""
    from mbolt.core.mbtrace import read_trace

    out = {}
    for n in names:
        spec = MODELS[n]
        p = run.paths(n)
        held = read_trace(p["held"])
        tpr = tokens_per_round if n == "s64k" else 4
        rounds = spec["rounds"] * held.n_tokens // tpr
        for qd, direct in spec["configs"]:
            cname = run.cfg_name(n, qd, direct) + "_fine"
            arms = [a for a in arms_for(run, n, qd, direct) if a.mode != "os"]
            t0 = time.perf_counter()
            res = run_ab(arms, trace=held, rounds=rounds, name=cname, trace_path=str(p["held"]),
                         tokens_per_round=tpr)
            res.prediction = predict_vs_measured(res, held, run.probe)
            res.notes.append("exploratory (not pre-registered): many short rounds; 2 shared cores, ~7 other "
                             "workers running on the machine")
            write_result(RESULTS / f"{cname}.json", res)
            out[cname] = res.to_dict()
            _log_summary(cname, res, t0)
        if spec["configs"][0] == (1, False):
            cname = f"ab_{n}_os_vs_stock_fine"
            arms = [Arm("stock", str(p["stock"])), Arm("os", str(p["stock"]), mode="os")]
            t0 = time.perf_counter()
            res = run_ab(arms, trace=held, rounds=max(4, rounds // 4), name=cname, trace_path=str(p["held"]),
                         tokens_per_round=tpr)
            res.notes.append("exploratory: mmap page faults (kernel read-around, read_ahead_kb of the device) "
                             "vs explicit buffered preadv of the same stock file")
            write_result(RESULTS / f"{cname}.json", res)
            out[cname] = res.to_dict()
            _log_summary(cname, res, t0)
    summary = summarise_goals(run, {k.replace("_fine", ""): v for k, v in out.items() if k.endswith("_fine")})
    write_text_atomic(RESULTS / run.summary_name("_fine"), json.dumps(summary, indent=1) + "\n")
    log(json.dumps(summary["goals"], indent=1))
    return out


def _ci(x: dict) -> str:
    ci = x.get("speedup_ci95")
    return f"CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else "no CI (< 10 rounds)"


def _log_summary(cname, res, t0):
    log(cname, f"{time.perf_counter() - t0:.1f}s", f"{res.stop['rounds']} rounds, stopped: {res.stop['reason']}")
    for s in res.summary:
        log(f"  {s['arm']:<18} io {s['io_ms_per_token_median']:8.3f} ms/tok  reads/tok {s['reads_per_token']:7.1f}  "
            f"speedup (median of ratios) {s['median_of_ratios']:.3f} {_ci(s)}  ratio of medians "
            f"{s['ratio_of_medians']:.3f}")
    for f in res.flags:
        log("  flag:", f)


def run_decode(run: ReplayRun, name: str = "s64k", rounds: int = 12) -> dict:
    """Cold decode (engine compute + store I/O), stock vs reorder(tsp) vs packed(tsp), QD1 buffered;
    the law's decomposition per arm: s = stock I/O share of decode time, g = the arm's I/O gain,
    and 1/((1-s)+s/g) next to the measured end-to-end speedup (a consistency check of the law,
    since s and g come from the same run)."""
    from mbolt.bench.ab import load_prompt_ids

    p = run.paths(name)
    treated = ("reorder-tsp", "packed-tsp")
    arms = [Arm("stock", str(p["stock"]))] + [Arm(a, str(p[a])) for a in treated]
    prompts = [ids[:16] for ids in load_prompt_ids(str(p["stock"]), PROMPTS, 1)]  # short prefill
    t0 = time.perf_counter()
    res = run_ab(arms, mode="decode", prompts=prompts, n_new=8, rounds=rounds,
                 name=f"ab_{name}_decode_qd1_buffered" + (f"_{run.tag}" if run.tag else ""))
    from mbolt.bench.predict import decode_law

    st = _arm(res.to_dict(), "stock")
    s_share = st["io_ms_per_token_median"] / st["wall_ms_per_token_median"]
    # the non-I/O term: time per read spent outside I/O, from the replay A/B of the same files
    # (independent of this run); this run's own estimate is in res.non_io
    rep = RESULTS / f"{run.cfg_name(name, 1, False)}.json"
    c = None
    if rep.exists():
        ni = json.loads(rep.read_text()).get("non_io") or {}
        c = ni.get("per_read_us") if ni.get("estimable") else None
    res.prediction = []
    for a in treated:
        tr = _arm(res.to_dict(), a)
        g = st["io_ms_per_token_median"] / tr["io_ms_per_token_median"]
        pred = 1.0 / ((1 - s_share) + s_share / g)
        row = {"law": "speedup = 1/((1-s) + s/g)", "s": s_share, "g": g, "pred_speedup": pred,
               "meas_speedup": tr["median_of_ratios"], "speedup_error": tr["median_of_ratios"] / pred - 1, "arm": a,
               "non_io_ms_per_token": {"stock": st["wall_ms_per_token_median"] - st["io_ms_per_token_median"],
                                       a: tr["wall_ms_per_token_median"] - tr["io_ms_per_token_median"]}}
        if c is not None:
            p2 = decode_law(st["wall_ms_per_token_median"], st["io_ms_per_token_median"], st["reads_per_token"],
                            tr["io_ms_per_token_median"], tr["reads_per_token"], c * 1e-3)  # ms per token, c: us -> ms
            row.update({"law_non_io": "speedup = wall_base / (other + io_arm + reads_arm * c), c from " + rep.name,
                        "non_io_per_read_us": c, "pred_speedup_non_io": p2,
                        "speedup_error_non_io": tr["median_of_ratios"] / p2 - 1})
        res.prediction.append(row)
    res.notes.append(run.noise_note)
    write_result(RESULTS / f"{res.name}.json", res)
    log(res.name, f"{time.perf_counter() - t0:.1f}s", json.dumps(res.prediction))
    for x in res.summary:
        log(f"  {x['arm']:<18} wall {x['wall_ms_per_token_median']:8.2f} ms/tok io {x['io_ms_per_token_median']:7.2f} "
            f"ttft {x['ttft_ms_median']:7.1f} ms speedup {x['speedup_vs_baseline_median']:.3f} {_ci(x)}")
    return res.to_dict()


def _arm(res: dict, arm: str) -> dict | None:
    return next((s for s in res["summary"] if s["arm"] == arm), None)


def _aa_ok(res: dict | None) -> bool | None:
    return aa_ok((res or {}).get("summary", []))


def summarise_goals(run: ReplayRun, out: dict) -> dict:
    """The issue's goals against the measured numbers (misses reported as misses). A goal whose
    run failed its A/A control (+-3%) is marked `aa_ok: false`: not evidence either way."""
    g = {}
    b1 = out.get(run.cfg_name("s64k", 1, False))
    d1 = out.get(run.cfg_name("s64k", 1, True))
    if b1:
        s = _arm(b1, "packed-tsp")
        g["packed_tsp_vs_stock_qd1_buffered"] = {"goal": 1.4, "measured": s["speedup_vs_baseline_median"],
                                                 "ci95": s["speedup_ci95"], "met": s["speedup_vs_baseline_median"] >= 1.4,
                                                 "aa_ok": _aa_ok(b1)}
    if d1:
        s = _arm(d1, "packed-tsp")
        g["packed_tsp_vs_stock_qd1_direct"] = {"goal": 1.8, "measured": s["speedup_vs_baseline_median"],
                                               "ci95": s["speedup_ci95"], "met": s["speedup_vs_baseline_median"] >= 1.8,
                                               "aa_ok": _aa_ok(d1)}
    if b1:
        ref = _arm(b1, "stock")["io_ms_per_token_median"]
        best = None
        for k, r in out.items():
            if not k.startswith("ab_s64k"):
                continue
            s = _arm(r, "packed-tsp")
            if s and (best is None or s["io_ms_per_token_median"] < best[1]):
                best = (k, s["io_ms_per_token_median"])
        g["best_packed_tsp_vs_stock_qd1_buffered"] = {"goal": 2.5, "config": best[0], "measured": ref / best[1],
                                                      "met": ref / best[1] >= 2.5,
                                                      "aa_ok": bool(_aa_ok(b1) and _aa_ok(out.get(best[0]))),
                                                      "note": "ratio of medians from different runs (each its own "
                                                              "balanced rounds)"}
    aa = {}
    pred = {}
    for k, r in out.items():
        a = aa_row(r["summary"])
        if a:
            aa[k] = {"median": a["speedup_vs_baseline_median"], "ci95": a["speedup_ci95"],
                     "within_3pct": _aa_ok(r)}
        for row in r.get("prediction") or []:
            if row.get("speedup_error") is not None:
                pred[f"{k}/{row['arm']}"] = {"pred": row["pred_speedup"], "meas": row["meas_speedup"],
                                             "error": row["speedup_error"], "within_10pct": abs(row["speedup_error"]) <= 0.10}
    g["aa_within_3pct"] = aa
    g["prediction_within_10pct"] = pred
    # drive limit: best arm's I/O time per token vs bytes/token / best probe bandwidth
    pr = load_probe(run.probe)
    best_bw = max(f["best_mb_per_s"] for f in pr["fits"].values()) * 1e6
    lim = {}
    for k, r in out.items():
        s = min((x for x in r["summary"] if x.get("rounds") and not x["arm"].endswith("(A/A)") and x["arm"] != "os"),
                key=lambda x: x["io_ms_per_token_median"])
        floor_ms = s["mb_per_token"] * 1e6 / best_bw * 1e3
        lim[k] = {"arm": s["arm"], "io_ms": s["io_ms_per_token_median"], "bw_floor_ms": floor_ms,
                  "ratio": s["io_ms_per_token_median"] / floor_ms, "within_1.25x": s["io_ms_per_token_median"] <= 1.25 * floor_ms}
    g["best_arm_vs_drive_limit"] = lim
    return {"goals": g, "configs": list(out), "environment_note": run.noise_note}

def log_predictions(run: ReplayRun, names: list[str], tokens_per_round: int) -> None:
    """The predictions of every config of `names`, one line per arm (the figures to pre-register)."""
    for n in names:
        for qd, direct in MODELS[n]["configs"]:
            log(run.cfg_name(n, qd, direct))
            for r in predictions(run, n, qd, direct, tokens_per_round):
                log(f"  {r['arm']:<12} reads/tok {r['reads_per_token']:7.1f}  MB/tok {r['mb_per_token']:7.3f} "
                    f"(device {r['device_mb_per_token']:7.3f})  "
                    f"io {r['io_ms_per_token']:8.3f} ms/tok  speedup (median of per-round ratios) "
                    f"{r['speedup']:.3f}  ratio of medians {r['ratio_of_medians']:.3f}  [{r['cost_source']}]")


def summarise_stored(run: ReplayRun, names: list[str]) -> None:
    """The goal tables re-derived from the stored results (no measuring), the registered runs' and
    the exploratory (_fine) ones'; a summary keeps the seconds its run took."""
    for suffix, dst in (("", run.summary_name()), ("_fine", run.summary_name("_fine"))):
        out = {}
        for n in names:
            for qd, direct in MODELS[n]["configs"]:
                f = RESULTS / f"{run.cfg_name(n, qd, direct)}{suffix}.json"
                if f.exists():
                    out[run.cfg_name(n, qd, direct)] = json.loads(f.read_text())
        if not out:  # no results of this protocol for these models: nothing to summarise
            continue
        summary = summarise_goals(run, out)
        old = RESULTS / dst
        if old.exists():
            summary["seconds"] = json.loads(old.read_text()).get("seconds")
        write_text_atomic(old, json.dumps(summary, indent=1) + "\n")
        log(dst, json.dumps({k: v for k, v in summary["goals"].items() if "met" in v}, indent=1))


def run_configs(run: ReplayRun, names: list[str], only: set[str]) -> None:
    """Every config of `names` (or those in `only`, e.g. qd4_buffered), then the goals' summary."""
    t0 = time.perf_counter()
    out = {}
    for n in names:
        for qd, direct in MODELS[n]["configs"]:
            c = f"qd{qd}_{'direct' if direct else 'buffered'}"
            f = RESULTS / f"{run.cfg_name(n, qd, direct)}.json"
            if only and c not in only:  # not re-run: its earlier result (if any) stays in the summary
                if f.exists():
                    out[run.cfg_name(n, qd, direct)] = json.loads(f.read_text())
                continue
            out[run.cfg_name(n, qd, direct)] = run_config(run, n, MODELS[n], qd, direct)
    summary = summarise_goals(run, out)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    write_text_atomic(RESULTS / run.summary_name(), json.dumps(summary, indent=1) + "\n")
    log(json.dumps(summary["goals"], indent=1))
