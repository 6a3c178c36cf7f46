"""Drive profiles under a real memory limit (scripts/bench_memlimit.py drives): plain and the
runtime on the stock and the reorder file under each throttled profile (core.blkio), the slice-size
law's prediction of the layout's gain beside the measured one, and the bound at the profile's
bandwidth."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from mbolt.bench.arms import Arm
from mbolt.bench.memlimit import (AS_SHIPPED_KB, Workload, bound_of, log, paths, routing_of, run_ab_config, slots_of,
                                  sweep_plain, sweep_summary)
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, tokens_identical
from mbolt.bench.predict import law_holds, law_predicts_no_change, layout_read_ratios, throttled_layout_law
from mbolt.bench.prereg import BenchPrereg
from mbolt.core.memlimit import readahead


def drive_arms(name: str) -> list[Arm]:
    p = paths(name)
    return [Arm("plain-stock", str(p["stock"]), mode="os"), Arm("plain-reorder", str(p["reorder"]), mode="os"),
            Arm("mbolt-stock", str(p["stock"]), io_threads=4, asynchronous=True),
            Arm("mbolt-reorder", str(p["reorder"]), io_threads=4, asynchronous=True)]


def drives(name: str, w: Workload, rounds: int, pr: BenchPrereg, probe_path: Path, frac: float = 0.4,
           seed: int = 0) -> dict:
    """The drive profiles (core.blkio, set once each arm's model has loaded): per profile plain's
    readahead swept under it, then plain and the runtime on the stock and the reorder file at
    128 KiB (as shipped) and at plain's best window (plain tuned); the slice-size law's
    prediction of the layout's gain (from the probe's cost, the stock arm's reads and the
    layout's read ratios: never the reorder arm's own reads) and the bound at the profile's
    bandwidth."""
    from mbolt.bench.probe import load_probe
    from mbolt.core.blkio import profile

    w = replace(w, new=64)  # the decode workload; at 125 MB/s plain decodes well under a token per second
    p = paths(name)
    probe_d = load_probe(probe_path)
    ram = int(p["stock"].stat().st_size * frac)
    with readahead(p["stock"], AS_SHIPPED_KB):
        log(f"{name}: warm (no limit, the file in memory): the compute alone")
        warm = run_ab_config(name, [Arm("warm", str(p["stock"]), mode="os", warm=True)], w, rounds, 0, seed, aa=False)
    compute_s = 1.0 / row(warm, "warm")["decode_tokens_per_s"]
    out = {"model": name, "workload": vars(w), "budget_frac": frac, "budget_bytes": ram, "rounds": rounds,
           "as_shipped_readahead_kb": AS_SHIPPED_KB, "headline_arm": "mbolt-stock", "warm_tokens_per_s": 1.0 / compute_s,
           "probe": str(probe_path), "warm": warm, "profiles": {}}
    g_plain, g_law, g_bound = pr.goal("mbolt_over_plain_min"), pr.goal("layout_gain_within_law"), \
        pr.goal("share_of_bound_min")
    goals = []
    for prof in ("cloud", "sata"):
        lim = profile(prof)
        log(f"{name}: drive profile {prof} ({lim})")
        swept = sweep_plain(name, drive_arms(name)[:1], w, ram, seed, drive=prof)
        tuned = best_window(swept)
        configs = {}
        for ra in sorted({AS_SHIPPED_KB, tuned}, reverse=True):
            with readahead(p["stock"], ra) as held:
                log(f"  {prof}, readahead {held} KiB ({'as shipped' if ra == AS_SHIPPED_KB else 'plain tuned'})")
                d = run_ab_config(name, drive_arms(name), w, rounds, ram, seed, aa=False, drive=prof)
            c = {"readahead_kb": held, "ab": d, "over_plain": pair_stats(d, "mbolt-stock", "plain-stock"),
                 "layout_gain": {"plain": pair_ratio(d, "plain-reorder", "plain-stock"),
                                 "mbolt": pair_ratio(d, "mbolt-reorder", "mbolt-stock")}}
            slots = slots_of(d)
            c["law"] = {k: law_gain(name, w, d, k, lim, probe_d, slots or 0, gap=held * 1024 if k == "plain" else 0)
                        for k in ("plain", "mbolt")}
            if slots and lim.bps:
                c["bound"] = bound_of(name, w, slots, compute_s, lim.bps)
                c["share_of_bound"] = row(d, "mbolt-stock")["decode_tokens_per_s"] / c["bound"]["tokens_per_s"]
            configs[ra] = c
        out["profiles"][prof] = {"limits": vars(lim), "plain_tuned_readahead_kb": tuned, "sweep": sweep_summary(swept),
                                 "sweep_runs": {str(ra): v["ab"] for ra, v in swept.items()},
                                 "configs": {str(ra): c for ra, c in configs.items()}}
        vs = configs[tuned]["over_plain"]["median"]
        goals.append({"goal": f"{prof}: mbolt-stock >= {g_plain}x plain-stock, plain tuned ({tuned} KiB)",
                      "value": vs, "met": vs is not None and vs >= g_plain})
        for ra, c in configs.items():
            for k in ("plain", "mbolt"):
                lw = c["law"][k]
                band = ("1.00 +- 0.05" if lw["predicted_gain"] and law_predicts_no_change(lw["predicted_gain"])
                        else "predicted")
                goals.append({"goal": f"{prof} at {ra} KiB: {k} layout gain within {g_law:.0%} of the law's ({band})",
                              "value": [lw["measured_gain"], lw["predicted_gain"]],
                              "met": law_holds(lw["measured_gain"], lw["predicted_gain"], within=g_law)})
        sb = configs[AS_SHIPPED_KB].get("share_of_bound")
        goals.append({"goal": f"{prof}: mbolt >= {g_bound:.0%} of the bound", "value": sb,
                      "met": sb is not None and sb >= g_bound})
    out["tokens_identical"] = tokens_identical(warm, *(c["ab"] for v in out["profiles"].values()
                                                       for c in v["configs"].values()))
    goals.append({"goal": "the same tokens in every arm", "value": out["tokens_identical"],
                  "met": out["tokens_identical"]})
    out["goals"] = goals
    return out


def served_per_token(d: dict, arm: str) -> tuple[float, float, float] | None:
    """An arm's decode reads and bytes per token as the kernel served them after the first decode
    step, and its tok/s (medians over rounds)."""
    rs = [r for r in d["rounds"] if r["arm"] == arm and not r["rejected"] and r.get("drive_decode_tokens")]
    if not rs:
        return None
    n = [r["drive_decode_tokens"] for r in rs]
    return (float(np.median([r["drive_decode_reads"] / k for r, k in zip(rs, n)])),
            float(np.median([r["drive_decode_bytes"] / k for r, k in zip(rs, n)])),
            float(np.median([r["tokens"] / r["wall_s"] for r in rs])))


def law_gain(name: str, w: Workload, d: dict, kind: str, lim, probe_d: dict, slots: int, gap: int) -> dict:
    """The slice-size law's prediction of reorder over stock on the throttled drive
    (predict.throttled_layout_law) for `kind` (plain or mbolt): the STOCK arm's served reads and
    bytes, the layout's read and byte ratios on the run's routing (predict.layout_read_ratios;
    plain's window merges what lies within its readahead, `gap`) and the probe's per-operation
    cost at the arm's queue depth. The reorder arm's measured reads are shown beside it, never used."""
    from mbolt.bench.probe import cost
    from mbolt.core.moe_map import moe_map

    p = paths(name)
    stock, reorder = served_per_token(d, f"{kind}-stock"), served_per_token(d, f"{kind}-reorder")
    measured = pair_ratio(d, f"{kind}-reorder", f"{kind}-stock")
    if stock is None:
        return {"predicted_gain": None, "measured_gain": measured, "why": "no served counts of the stock arm"}
    ratio = layout_read_ratios(routing_of(name, w), moe_map(p["stock"]), moe_map(p["reorder"]), gap=gap,
                               cache_slots=slots)
    qd = 1 if kind == "plain" else 4
    law = throttled_layout_law(stock, ratio, cost(probe_d, False, qd), lim.iops, lim.bps)
    law.update({"layout_ratio": {"reads": ratio[0], "bytes": ratio[1], "gap": gap, "cache_slots": slots},
                "probe_qd": qd, "served_per_token": {"stock": stock[:2], "reorder": reorder and reorder[:2]},
                "measured_gain": measured})
    return law
