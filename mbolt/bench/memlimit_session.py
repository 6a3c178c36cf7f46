"""The session workload under a real memory limit (scripts/bench_memlimit.py session): its arms,
ik_llama.cpp's time to first token on the same prompt, and the record with its goals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mbolt.bench import peer_prompt, peers
from mbolt.bench.arms import Arm
from mbolt.bench.memlimit import AS_SHIPPED_KB, Workload, limit_of, log, paths, run_ab_config, sweep_plain, sweep_summary
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, tokens_identical, ttft_of
from mbolt.bench.prereg import BenchPrereg
from mbolt.bench.probe import sequential_read
from mbolt.bench.stats import aa_row
from mbolt.core.memlimit import readahead


def session_arms(name: str) -> list[Arm]:
    stock = str(paths(name)["stock"])
    mbolt = Arm("mbolt", stock, io_threads=4, asynchronous=True)
    return [Arm("plain-512", stock, mode="os"), Arm("plain-2048", stock, mode="os", n_ubatch=2048), mbolt,
            replace(mbolt, name="mbolt (A/A)", control_of="mbolt"), replace(mbolt, name="mbolt-user", user=True),
            replace(mbolt, name="mbolt-512", n_ubatch=512)]


def warm_arms(name: str) -> list[Arm]:
    stock = str(paths(name)["stock"])
    return [Arm("warm-512", stock, mode="os", warm=True), Arm("warm-2048", stock, mode="os", warm=True, n_ubatch=2048)]


def session(name: str, w: Workload, rounds: int, pr: BenchPrereg, frac: float = 0.4, seed: int = 0) -> dict:
    """The session workload on one model: warm; plain's readahead swept (both plain arms, the
    session's prompt, a short decode); then every arm under the limit at 128 KiB (as shipped) and
    at plain's best windows for decode and for TTFT ("plain tuned"), the drive measured at each.
    Ratios against plain are paired: per round, mbolt over plain of the same round, at the same
    readahead; the median of those (pair_stats)."""
    p, size, ram = limit_of(name, frac, "session, ")
    with readahead(p["stock"], AS_SHIPPED_KB):
        log("  warm (no limit, the file in memory)")
        warm = run_ab_config(name, warm_arms(name), w, rounds, 0, seed, aa=False)
    swept = sweep_plain(name, session_arms(name)[:2], w, ram, seed)
    tuned = {"decode": best_window(swept), "ttft": best_window(swept, "ttft_s")}
    configs = {}
    for ra in sorted({AS_SHIPPED_KB, *tuned.values()}, reverse=True):
        with readahead(p["stock"], ra) as held:
            drive0 = sequential_read(p["stock"])
            log(f"  under the limit, readahead {held} KiB: drive {drive0['bytes_per_s'] / 1e6:.0f} MB/s sequential")
            lim = run_ab_config(name, session_arms(name), w, rounds, ram, seed, aa=True)
            drive1 = sequential_read(p["stock"])
        configs[ra] = {"readahead_kb": held, "drive": {"before": drive0, "after": drive1}, "limited": lim}
    peer_ttft = peer_prompts(name, w, rounds, ram, seed, sorted({AS_SHIPPED_KB, tuned["ttft"]}, reverse=True), configs,
                             min(row(warm, a)["ttft_s"] for a in ("warm-512", "warm-2048")))
    shipped = configs[AS_SHIPPED_KB]["limited"]
    bw = max(max(c["drive"]["before"]["bytes_per_s"], c["drive"]["after"]["bytes_per_s"]) for c in configs.values())
    m = row(shipped, "mbolt")
    wm = min((row(warm, a) for a in ("warm-512", "warm-2048")), key=lambda r: r["ttft_s"])  # the warm compute
    plains = ("plain-512", "plain-2048")

    def best_plain(d: dict, metric: str) -> str:
        return (max if metric == "decode_tokens_per_s" else min)(plains, key=lambda a: row(d, a)[metric])

    dec_cfg, ttft_cfg = configs[tuned["decode"]]["limited"], configs[tuned["ttft"]]["limited"]
    dec_arm, ttft_arm = best_plain(dec_cfg, "decode_tokens_per_s"), best_plain(ttft_cfg, "ttft_s")
    headline_decode = pair_stats(dec_cfg, "mbolt", dec_arm)
    headline_ttft = pair_stats(ttft_cfg, "mbolt", ttft_arm, key=ttft_of)
    mrounds = [r for r in shipped["rounds"] if r["arm"] == "mbolt" and not r["rejected"]]
    follow_bytes = float(np.median([r["followup_bytes"] for r in mrounds]))
    follow_warm = min(row(warm, a)["followup_ttft_s"] for a in ("warm-512", "warm-2048"))
    follow_bound = max(follow_warm, follow_bytes / bw)
    user = pair_ratio(shipped, "mbolt-user", "mbolt")
    aa_plain = aa_row(shipped["summary"])
    out = {
        "model": name, "workload": vars(w), "file_bytes": size, "budget_frac": frac, "budget_bytes": ram,
        "rounds": rounds, "as_shipped_readahead_kb": AS_SHIPPED_KB,
        "plain_tuned_readahead_kb": tuned, "sweep": sweep_summary(swept),
        "drive": {"sequential_bytes_per_s": bw}, "headline_arm": "mbolt",
        "ratio_definition": "per round: mbolt / plain of the same round at the same readahead; the median of those",
        "decode_over_plain_tuned": headline_decode, "ttft_over_plain_tuned": headline_ttft,
        "best_plain_decode_arm": dec_arm, "best_plain_ttft_arm": ttft_arm,
        "over_plain_as_shipped": {
            "decode": pair_stats(shipped, "mbolt", best_plain(shipped, "decode_tokens_per_s")),
            "ttft": pair_stats(shipped, "mbolt", best_plain(shipped, "ttft_s"), key=ttft_of)},
        "ttft_s": {"mbolt": m["ttft_s"], "warm_512": row(warm, "warm-512")["ttft_s"],
                   "warm_2048": row(warm, "warm-2048")["ttft_s"], "warm": wm["ttft_s"],
                   **{f"{a}@{ra}": row(c["limited"], a)["ttft_s"] for ra, c in configs.items() for a in plains}},
        "ttft_over_warm": m["ttft_s"] / wm["ttft_s"],
        "ttft_over_warm_definition": "ratio of medians over the faster warm arm: the warm arms run apart (no limit), "
                                     "not in the same rounds",
        "decode_tokens_per_s": {ra: {r["arm"]: r.get("decode_tokens_per_s") for r in c["limited"]["summary"]}
                                for ra, c in configs.items()},
        "followup_ttft_s": {"mbolt": m["followup_ttft_s"], "warm": follow_warm,
                            **{a: row(shipped, a)["followup_ttft_s"] for a in plains}},
        "followup_read_bytes": follow_bytes, "followup_bound_s": follow_bound,
        "followup_over_bound": m["followup_ttft_s"] / follow_bound,
        "prompt_read_mb_per_s": m.get("prompt_read_mb_per_s"),
        "prompt_bw_share": (m.get("prompt_read_mb_per_s") or 0) * 1e6 / bw,
        "user_over_root": user,
        "aa": {"plain": aa_plain["speedup_vs_baseline_median"] if aa_plain else None,
               "mbolt": pair_ratio(shipped, "mbolt (A/A)", "mbolt")},
        "peak_after_load_bytes": {r["arm"]: r.get("peak_after_load_bytes_max") for r in shipped["summary"]},
        "tokens_identical": tokens_identical(warm, *(c["limited"] for c in configs.values())),
        "peers_ttft": peer_ttft, "warm": warm, "configs": {str(ra): c for ra, c in configs.items()},
        "sweep_runs": {str(ra): v["ab"] for ra, v in swept.items()},
    }
    g = pr.goal
    dec = headline_decode["median"]
    out["goals"] = [
        {"goal": f"TTFT <= {g('ttft_over_warm_max')}x warm", "value": out["ttft_over_warm"],
         "met": out["ttft_over_warm"] <= g("ttft_over_warm_max")},
        {"goal": f"decode >= {g('decode_over_best_plain_min')}x the better plain, plain tuned (same-round ratio)",
         "value": dec, "met": dec is not None and dec >= g("decode_over_best_plain_min")},
        {"goal": f"follow-up TTFT <= {g('followup_over_bound_max')}x max(warm, bytes/BW)",
         "value": out["followup_over_bound"], "met": out["followup_over_bound"] <= g("followup_over_bound_max")},
        {"goal": f"prompt read bandwidth >= {g('prompt_read_bw_share_min'):.0%} of sequential",
         "value": out["prompt_bw_share"], "met": out["prompt_bw_share"] >= g("prompt_read_bw_share_min")},
        {"goal": f"ordinary user (uid nobody) >= {g('user_over_root_min')}x root's decode", "value": user,
         "met": user is not None and user >= g("user_over_root_min")},
        {"goal": "the same tokens in every arm", "value": out["tokens_identical"], "met": out["tokens_identical"]},
    ]
    return out


def peer_prompts(name: str, w: Workload, rounds: int, ram: int, seed: int, windows: list[int], configs: dict,
                 llama_warm_ttft_s: float) -> dict | None:
    """ik_llama.cpp's time to first token on the session's prompt (bench.peer_prompt): warm once,
    then under the limit at each readahead the mbolt arms ran at, each beside mbolt's TTFT there;
    None (said in the log) without the peer `prepare` installs."""
    peer = peers.find_ik()
    if peer is None:
        log(f"  peers: no ik_llama.cpp in {peers.default_venv()} (`prepare` installs it): no peer TTFT")
        return None
    p = paths(name)
    prompt = peers.arm_ids(p["stock"], w.prompt, w.new, w.followup)[:w.prompt]  # the mbolt arms' prompt
    report = lambda d, t, r: log(f"  {d}/{t} {r['arm']} r{r['round']}: ttft {r['ttft_s']:.2f} s "  # noqa: E731
                                 f"({r['prompt_tokens']} tokens)")
    with readahead(p["stock"], AS_SHIPPED_KB):
        log("  peers: ik_llama.cpp's TTFT warm (no limit, the file in memory)")
        warm = peer_prompt.run_prompt_peers(peer, peer_prompt.warm_prompt_arms(), p["stock"], prompt, rounds=rounds,
                                            ram=0, n_ctx=w.n_ctx, seed=seed, progress=report)
    out = {"warm": warm, "limited": {}, "beside": {}}
    for ra in windows:
        with readahead(p["stock"], ra) as held:
            log(f"  peers: ik_llama.cpp's TTFT under the limit, readahead {held} KiB")
            lim = peer_prompt.run_prompt_peers(peer, peer_prompt.prompt_arms(), p["stock"], prompt, rounds=rounds,
                                               ram=ram, n_ctx=w.n_ctx, seed=seed, progress=report)
        out["limited"][ra] = lim
        out["beside"][ra] = peer_prompt.ttft_beside(row(configs[ra]["limited"], "mbolt")["ttft_s"], llama_warm_ttft_s,
                                                    lim, warm)
    return out
