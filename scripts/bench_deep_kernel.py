"""The kernel layout at full depth (issue 54) -> results/deep_q48_kernel.json.

bench_deep.py's full-depth model (q48: Qwen3-30B-A3B's shape at 48 layers, Q4_K_M-like, 19.4 GB,
routing like the real model's) and its workload (a 64-token prompt, then 32 fed tokens), under a
memory cgroup of 40% of the file, with the kernel layout: the stock file in this llama.cpp build's
kernel layout (`mbolt repack`; no reorder file at this size), streamed paged (the default).

  plain's readahead swept (4 KiB-1 MiB, 2 rounds each, plain only, as bench_deep.py's tuned stage), then at plain's best window
  ("plain tuned"), side by side in every round: plain + A/A, mbolt-kernel + A/A, mbolt-stock (the
  mapped runtime as shipped); ik_llama.cpp mapped + A/A after them, at the same window and limit.
  No warm stage: the bound and the warm goals are bench_kernel.py's, on the 8-layer files.

    python scripts/bench_deep.py prepare && python scripts/bench_deep_kernel.py prepare
    python scripts/bench_deep_kernel.py run --prereg PREREG [--rounds 5] [--dry-run]

`ttft`: the time to first token of a 2,000-token prompt at this depth (issue 54: "<= ik_llama.cpp's"),
then 8 fed tokens, under the same limit -> results/deep_q48_kernel_ttft.json. At one readahead
(--readahead, the `run` stage's plain tuned window): mbolt-kernel + A/A, mbolt-stock (the mapped
runtime: its prompt passes on llama.cpp's kernels for the stock layout), ik_llama.cpp mapped at
-ub 2048 + A/A; then ik at -ub 2048 once more at --peer-readahead (the device's own window, as
users run it untuned: a large window reads a prompt's layers faster and its decode slower).

    python scripts/bench_deep_kernel.py ttft --prereg PREREG [--rounds 5] [--readahead 64] [--peer-readahead 8192]

The pre-registration binds as bench_deep.py's do (committed, locked, a clean tree, its goals read
from the file: over_best_peer_min, aa_within).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deep as deep  # noqa: E402  (the model, its workload and helpers)

from mbolt.bench import peers  # noqa: E402
from mbolt.bench.arms import Arm  # noqa: E402
from mbolt.bench.memlimit import compact, json_default, kernel_of, log, paths, prepare_kernel, sweep_plain, sweep_summary  # noqa: E402
from mbolt.bench.memlimit import run_ab_config  # noqa: E402
from mbolt.bench.memlimit_decode import peer_arms  # noqa: E402
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, ttft_of  # noqa: E402
from mbolt.bench.prereg import gate_run, run_record, write_result  # noqa: E402
from mbolt.bench.probe import sequential_read  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402
from mbolt.core.memlimit import readahead  # noqa: E402

NAME = deep.NAME
GOALS = ("over_best_peer_min", "aa_within")
RESULT = deep.ml.RESULTS / f"deep_{NAME}_kernel.json"
TTFT_GOALS = ("ttft_over_ik_max", "aa_within")
TTFT_RESULT = deep.ml.RESULTS / f"deep_{NAME}_kernel_ttft.json"
TTFT_WORKLOAD = deep.ml.Workload(2000, 8, 0)


def kernel_path(name: str = NAME) -> Path:
    return kernel_of(name, "stock")  # no reorder file at this size


def measure(rounds: int, pr, name: str = NAME, seed: int = 0) -> dict:
    p = paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * deep.budget_frac(name))
    w = deep.WORKLOAD
    plain, mapped = deep.deep_arms(str(p["stock"]), "-stock")
    kernel = Arm("mbolt-kernel", str(kernel_path(name)))
    log(f"{name}: plain's readahead swept under the limit ({ram / 2**30:.2f} GiB)")
    swept = sweep_plain(name, [plain], w, ram, seed, tokens=w.new)
    with readahead(p["stock"], best_window(swept)) as held:
        drive0 = sequential_read(p["stock"])
        log(f"{name}: readahead {held} KiB (plain tuned): drive {drive0['bytes_per_s'] / 1e6:.0f} MB/s sequential")
        lim = run_ab_config(name, [plain, kernel, replace(kernel, name="mbolt-kernel (A/A)", control_of="mbolt-kernel"),
                                   mapped], w, rounds, ram, seed, aa=True)  # aa: plain's twin too
        peer = peer_arms(name, w, rounds, ram, seed)
        drive1 = sequential_read(p["stock"])
    k = row(lim, "mbolt-kernel")["decode_tokens_per_s"]
    ik = {s["arm"]: s["decode_tokens_per_s"] for s in peer["summary"]} if peer else {}
    best = max([row(lim, "plain-stock")["decode_tokens_per_s"]] + [v for a, v in ik.items() if "(A/A)" not in a and v])
    aa = {a: pair_ratio(lim, f"{a} (A/A)", a) for a in ("plain-stock", "mbolt-kernel")}
    if ik.get("ik-mapped") and ik.get("ik-mapped (A/A)"):
        aa["ik-mapped"] = ik["ik-mapped (A/A)"] / ik["ik-mapped"]  # a ratio of medians: ik's rounds are its own
    rs = [r for r in lim["rounds"] if r["arm"] == "mbolt-kernel" and not r["rejected"]]
    out = {"model": name, "synth": deep.SPEC, "routing_like": str(deep.PROFILE.name), "workload": vars(w),
           "file_bytes": size, "kernel_file_bytes": kernel_path(name).stat().st_size, "budget_bytes": ram,
           "rounds": rounds, "plain_tuned_readahead_kb": held, "sweep": sweep_summary(swept, w.new),
           "drive": {"before": drive0, "after": drive1},
           "ratio_definition": "per round: an arm / its baseline of the same round, the median of those; ik: "
                               "ratios of medians (its arms run after the mbolt arms)",
           "decode_tokens_per_s": {r["arm"]: r.get("decode_tokens_per_s") for r in lim["summary"]},
           "ttft_s": {r["arm"]: r.get("ttft_s") for r in lim["summary"]}, "ik_decode_tokens_per_s": ik,
           "kernel_over_plain_tuned": pair_stats(lim, "mbolt-kernel", "plain-stock"),
           "kernel_over_mapped_runtime": pair_stats(lim, "mbolt-kernel", "mbolt-stock"),
           "best_peer_tokens_per_s": best, "kernel_over_best_peer": k / best if k else None,
           "kernel_peak_bytes": [r.get("peak_bytes") for r in rs], "kernel_reclaimed": [r.get("reclaimed") for r in rs],
           "aa": aa, "tokens_agreement_across_kernels": row(lim, "plain-stock").get("tokens_agreement_across_kernels"), "limited": compact(lim), "peer_limited": peer,
           "sweep_runs": {str(ra): v["ab"] for ra, v in swept.items()},
           "not_run": ["a warm stage: the bound and the warm goals are bench_kernel.py's, on the 8-layer files"]}
    g, over = pr.goal, out["kernel_over_best_peer"]
    out["goals"] = [{"goal": f"mbolt-kernel >= {g('over_best_peer_min')}x the best peer arm (plain tuned at {held} KiB, "
                             "ik mapped)", "value": over, "met": over is not None and over >= g("over_best_peer_min")},
                    deep.aa_goal(g, aa, "three")]  # tokens: the same within each kind of kernels, or no result (check_same_tokens)
    return out


def ttft(rounds: int, pr, window: int, peer_window: int, name: str = NAME, seed: int = 0) -> dict:
    p = paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * deep.budget_frac(name))
    w = TTFT_WORKLOAD
    _, mapped = deep.deep_arms(str(p["stock"]), "-stock")
    kernel = Arm("mbolt-kernel", str(kernel_path(name)))
    ids = peers.arm_ids(p["stock"], w.prompt, w.new)
    ik = peers.find_ik()
    if ik is None:
        raise MboltError(f"no ik_llama.cpp in {peers.default_venv()}: this stage measures against it")

    def ik_rounds(arms):
        return peers.run_peers(ik, arms, p["stock"], ids[:w.prompt], ids[w.prompt:], rounds=rounds, ram=ram,
                               n_ctx=w.n_ctx, seed=seed, progress=lambda d, t, r: log(
                                   f"  {d}/{t} {r['arm']} r{r['round']}: ttft {r['ttft_s']:.2f} s"))

    with readahead(p["stock"], window) as held:
        log(f"{name}: a {w.prompt}-token prompt under the limit ({ram / 2**30:.2f} GiB), readahead {held} KiB")
        lim = run_ab_config(name, [kernel, replace(kernel, name="mbolt-kernel (A/A)", control_of="mbolt-kernel"),
                                   mapped], w, rounds, ram, seed, aa=False)
        at = ik_rounds([peers.PeerArm("ik-2048", n_ubatch=2048),
                        peers.PeerArm("ik-2048 (A/A)", n_ubatch=2048, control_of="ik-2048")])
    with readahead(p["stock"], peer_window) as peer_held:
        log(f"  ik_llama.cpp at readahead {peer_held} KiB")
        wide = ik_rounds([peers.PeerArm(f"ik-2048@{peer_window}", n_ubatch=2048)])

    ttfts = {s["arm"]: s.get("ttft_s") for d in (lim, at, wide) for s in d["summary"]}
    best_ik = min(v for a, v in ttfts.items() if a.startswith("ik-") and "(A/A)" not in a and v)
    aa = {"mbolt-kernel": pair_ratio(lim, "mbolt-kernel (A/A)", "mbolt-kernel", key=ttft_of),
          "ik-2048": peers.aa_of(at["summary"], "ttft_s")["ik-2048 (A/A)"]}
    over = ttfts["mbolt-kernel"] / best_ik
    g = pr.goal
    out = {"model": name, "workload": vars(w), "file_bytes": size, "budget_bytes": ram, "rounds": rounds,
           "readahead_kb": held, "peer_readahead_kb": peer_held, "ttft_s": ttfts, "best_ik_ttft_s": best_ik,
           "kernel_over_best_ik": over, "kernel_over_ik_same_window": ttfts["mbolt-kernel"] / ttfts["ik-2048"],
           "kernel_over_mapped_runtime": pair_ratio(lim, "mbolt-kernel", "mbolt-stock", key=ttft_of),
           "decode_tokens_per_s": {**{r["arm"]: r.get("decode_tokens_per_s") for r in lim["summary"]},
                                   **{s["arm"]: s["decode_tokens_per_s"] for d in (at, wide) for s in d["summary"]}},
           "aa": aa, "limited": compact(lim), "peer": at, "peer_wide": wide,
           "ratio_definition": "medians over rounds; the kernel arm's A/A and its ratio to the mapped runtime "
                               "per round (same round), the rest ratios of medians (ik's rounds are its own)"}
    out["goals"] = [{"goal": f"mbolt-kernel TTFT <= {g('ttft_over_ik_max')}x ik_llama.cpp's best (-ub 2048 at "
                             f"{held} and {peer_held} KiB)", "value": over, "met": over <= g("ttft_over_ik_max")},
                    deep.aa_goal(g, aa, "two")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "run", "ttft"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prereg", type=Path, default=None, help="the run's pre-registration, committed and locked")
    ap.add_argument("--dry-run", action="store_true", help="check the gate, print the plan, measure nothing")
    ap.add_argument("--readahead", type=int, default=64, help="ttft: the window (KiB) of every arm but the last "
                    "(default 64: plain tuned in results/deep_q48_kernel.json)")
    ap.add_argument("--peer-readahead", type=int, default=8192, help="ttft: the window (KiB) of ik's last arm "
                    "(default 8192: this machine's own)")
    a = ap.parse_args()
    try:
        if a.stage == "prepare":
            if not paths(NAME)["stock"].exists():
                raise MboltError(f"{paths(NAME)['stock']}: run `python scripts/bench_deep.py prepare` first")
            prepare_kernel(NAME, "stock")
            return
        if a.prereg is None:
            raise MboltError("run needs --prereg (a committed, locked pre-registration)")
        if not kernel_path().exists():
            raise MboltError(f"{kernel_path()}: run `prepare` first")
        if a.stage == "ttft":
            goals, result, plan = TTFT_GOALS, TTFT_RESULT, ""
            about = {"benchmark": "a 2,000-token prompt on the kernel layout at full depth (issue 54)",
                     "script": "scripts/bench_deep_kernel.py ttft"}
        else:
            goals, result = GOALS, RESULT
            plan = (f"; plain's readahead swept, then {a.rounds} rounds of plain-stock, mbolt-kernel (+ A/A twins), "
                    "mbolt-stock; " + ("ik_llama.cpp mapped (+ A/A)" if peers.find_ik() else "ik_llama.cpp not installed"))
            about = {"benchmark": "the kernel layout at full depth under a real memory limit (issue 54)",
                     "script": "scripts/bench_deep_kernel.py",
                     "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"}
        pr, lock = gate_run(a.prereg, deep.ml.ROOT, list(goals), result, count_run=not a.dry_run)
        if a.dry_run:
            print(f"pre-registration {pr.path}: committed, locked ({pr.sha256[:16]}), tree clean, goals present{plan}")
            return
        rec = run_record(pr, lock, deep.ml.ROOT, paths(NAME)["stock"])
        res = ttft(a.rounds, pr, a.readahead, a.peer_readahead) if a.stage == "ttft" else measure(a.rounds, pr)
        res.update(about)
        write_result(pr, rec, result, res, default=json_default)
        log("wrote", result)
        for goal in res["goals"]:
            v = goal["value"]
            log(f"  {goal['goal']}: {round(v, 3) if isinstance(v, float) else v}: {'met' if goal['met'] else 'MISSED'}")
    except MboltError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
