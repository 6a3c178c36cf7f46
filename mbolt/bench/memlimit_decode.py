"""Steady decoding under a real memory limit (scripts/bench_memlimit.py decode, issue 28): plain's
readahead swept, every arm at 128 KiB (as shipped) and at plain tuned's window, ik_llama.cpp's arms
beside them, the bound, and the record with its goals."""

from __future__ import annotations

from dataclasses import replace

from mbolt.bench import peers
from mbolt.bench.arms import Arm
from mbolt.bench.memlimit import (AS_SHIPPED_KB, Workload, bound_of, log, paths, run_ab_config, slots_of, sweep_plain,
                                  sweep_summary)
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, tokens_identical
from mbolt.bench.prereg import BenchPrereg
from mbolt.bench.probe import sequential_read
from mbolt.core.memlimit import readahead


def decode_arms(name: str, full: bool) -> list[Arm]:
    p = paths(name)
    mbolt = Arm("mbolt-stock", str(p["stock"]), io_threads=4, asynchronous=True)
    arms = [Arm("plain-stock", str(p["stock"]), mode="os"), mbolt,
            replace(mbolt, name="mbolt-stock (A/A)", control_of="mbolt-stock")]
    if full:
        arms += [Arm("plain-reorder", str(p["reorder"]), mode="os"),
                 Arm("mbolt-reorder", str(p["reorder"]), io_threads=4, asynchronous=True)]
    return arms


def peer_arms(name: str, w: Workload, rounds: int, ram: int, seed: int, warm: bool = False) -> dict | None:
    """ik_llama.cpp's arms (bench.peers) on the token ids the mbolt arms are fed (the workload's
    prompt, then its fed tokens one per decode), at the same budget and readahead; None (said in
    the log) without the peer `prepare` installs."""
    peer = peers.find_ik()
    if peer is None:
        log(f"  peers: no ik_llama.cpp in {peers.default_venv()} (`prepare` installs it): no peer arms")
        return None
    p = paths(name)
    log(f"  peers: ik_llama.cpp {'warm (no limit, the file in memory)' if warm else 'under the limit'}")
    return peers.peer_decode(peer, p["stock"], peers.arm_ids(p["stock"], w.prompt, w.new), prompt_tokens=w.prompt,
                             new_tokens=w.new, n_ctx=w.n_ctx, rounds=rounds, ram=ram, seed=seed, warm=warm,
                             progress=lambda d, t, r: log(f"  {d}/{t} {r['arm']} r{r['round']}: "
                                                          f"{r['decode_tokens_per_s']:.2f} tok/s"))


def decode(name: str, w: Workload, rounds: int, pr: BenchPrereg, frac: float = 0.4, seed: int = 0,
           sweep: bool = True) -> dict:
    """Steady decoding at 40%: the compute alone (warm); plain llama.cpp's readahead swept (a short
    run per readahead, plain only: it picks the one that suits plain best); then the full protocol
    (every arm, `rounds` rounds, 256 fed tokens, A/A for plain and mbolt) at 128 KiB (as shipped)
    and at plain's best readahead ("plain tuned"), where the headline is measured side by side."""
    p = paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * frac)
    log(f"{name}: decode, budget {100 * frac:.0f}% ({ram / 2**30:.2f} GiB)")
    with readahead(p["stock"], 128):
        log("  warm (no limit, the file in memory): the compute alone")
        warm = run_ab_config(name, [Arm("warm", str(p["stock"]), mode="os", warm=True)], w, rounds, 0, seed, aa=False)
        peer_warm = peer_arms(name, w, rounds, 0, seed, warm=True)
    swept = sweep_plain(name, [Arm("plain-stock", str(p["stock"]), mode="os")], w, ram, seed) if sweep else {}
    tuned = best_window(swept) if swept else AS_SHIPPED_KB
    configs = {}
    for ra in sorted({128, tuned}, reverse=True):
        with readahead(p["stock"], ra) as held:
            drive = sequential_read(p["stock"])
            log(f"  readahead {held} KiB ({'as shipped' if ra == 128 else 'plain tuned'}): drive "
                f"{drive['bytes_per_s'] / 1e6:.0f} MB/s")
            d = run_ab_config(name, decode_arms(name, full=True), w, rounds, ram, seed, aa=True)
            # the peers at plain tuned's readahead, where the headline is measured (at 128 KiB too
            # when that is plain's best): half the run's time otherwise
            peer = peer_arms(name, w, rounds, ram, seed) if peer_warm and ra == tuned else None
        configs[ra] = {"readahead_kb": held, "drive": drive, "ab": d, "peers": peer}
    full, best = configs[128]["ab"], configs[tuned]["ab"]
    compute_s = 1.0 / row(warm, "warm")["decode_tokens_per_s"]
    bw = max(c["drive"]["bytes_per_s"] for c in configs.values())
    out = {"model": name, "workload": vars(w), "file_bytes": size, "budget_frac": frac, "budget_bytes": ram,
           "rounds": rounds, "headline_arm": "mbolt-stock", "plain_tuned_readahead_kb": tuned,
           "sweep": sweep_summary(swept),
           "warm_tokens_per_s": row(warm, "warm")["decode_tokens_per_s"],
           "decode_tokens_per_s": {ra: {r["arm"]: r.get("decode_tokens_per_s") for r in c["ab"]["summary"]}
                                   for ra, c in configs.items()},
           "headline": pair_ratio(best, "mbolt-stock", "plain-stock"),
           "headline_same_round": pair_stats(best, "mbolt-stock", "plain-stock"),
           "over_plain_as_shipped": pair_ratio(full, "mbolt-stock", "plain-stock"),
           "aa": {ra: {"plain": pair_ratio(c["ab"], "plain-stock (A/A)", "plain-stock"),
                       "mbolt": pair_ratio(c["ab"], "mbolt-stock (A/A)", "mbolt-stock")} for ra, c in configs.items()},
           "reorder_over_stock": {ra: {"plain": pair_ratio(c["ab"], "plain-reorder", "plain-stock"),
                                       "mbolt": pair_ratio(c["ab"], "mbolt-reorder", "mbolt-stock")}
                                  for ra, c in configs.items()},
           "tokens_identical": tokens_identical(warm, *(c["ab"] for c in configs.values())),
           "warm": warm, "configs": {str(ra): c for ra, c in configs.items()},
           "sweep_runs": {str(ra): v["ab"] for ra, v in swept.items()}}
    slots = slots_of(full)
    if slots:
        out["bound"] = bound_of(name, w, slots, compute_s, bw)
        out["share_of_bound"] = row(full, "mbolt-stock")["decode_tokens_per_s"] / out["bound"]["tokens_per_s"]
    # issue 35's yardstick: the runtime's own device bytes per token at the drive's sequential
    # bandwidth measured in this run, then the warm compute, one after the other
    out["reads_then_compute"] = {}
    for ra, c in configs.items():
        m = row(c["ab"], "mbolt-stock")
        if m.get("device_bytes_per_token"):
            rtc = 1.0 / (m["device_bytes_per_token"] / bw + compute_s)
            out["reads_then_compute"][ra] = {"device_bytes_per_token": m["device_bytes_per_token"],
                                             "bandwidth_bytes_per_s": bw, "compute_s_per_token": compute_s,
                                             "tokens_per_s": rtc, "share": m["decode_tokens_per_s"] / rtc}
    aa = [v for c in out["aa"].values() for v in c.values() if v is not None]
    goal, aa_within, share = pr.goal(f"{name}_over_plain_tuned_min"), pr.goal("aa_within"), \
        pr.goal("share_of_bound_at_128k_min")
    out["goals"] = [
        {"goal": f"mbolt-stock >= {goal}x plain tuned", "value": out["headline"],
         "met": out["headline"] is not None and out["headline"] >= goal},
        {"goal": f"A/A within {aa_within:.0%} (plain and mbolt)", "value": max(abs(a - 1) for a in aa) if aa else None,
         "met": bool(aa) and max(abs(a - 1) for a in aa) <= aa_within},
        {"goal": f"mbolt >= {share:.0%} of the bound at 128 KiB", "value": out.get("share_of_bound"),
         "met": out.get("share_of_bound") is not None and out["share_of_bound"] >= share},
        {"goal": "the same tokens in every arm", "value": out["tokens_identical"], "met": out["tokens_identical"]},
    ]
    if "reads_then_compute_share_min" in pr.goals and out["reads_then_compute"]:
        rtc_goal, rtc = pr.goal("reads_then_compute_share_min"), out["reads_then_compute"].get(tuned)
        out["goals"].append({"goal": f"mbolt-stock >= {rtc_goal:.0%} of reads then compute (plain tuned's readahead)",
                             "value": rtc and rtc["share"], "met": bool(rtc) and rtc["share"] >= rtc_goal})
    if peer_warm:
        out["peer_warm"] = peer_warm
        out["peers"] = {ra: peers.peers_beside(row(c["ab"], "mbolt-stock")["decode_tokens_per_s"],
                                               out["warm_tokens_per_s"], c["peers"], peer_warm)
                        for ra, c in configs.items() if c["peers"]}
        vs, peer_goal = out["peers"][tuned]["mbolt_over_best_peer"], pr.goal(f"{name}_over_best_peer_min")
        out["goals"].append({"goal": f"mbolt-stock >= {peer_goal}x the best peer arm (plain tuned)",
                             "value": vs, "met": vs is not None and vs >= peer_goal})
    return out
