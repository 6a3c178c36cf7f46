"""The kernel layout inside the runtime (issue 54) -> results/kernel_<model>.json.

The runtime streams a kernel-layout file (`mbolt repack` of the reorder file: experts stored as
llama.cpp's CPU backend repacks them, read straight into its buffers), beside what users run
instead. One workload: a 2,000-token prompt of held-out text (its time to first token), then 256
fed tokens (decode tok/s), --ctx-size 4096, every engine fed the same token ids.

  warm     no limit, the file in memory: the compute alone.
             warm-mapped     llama.cpp over the mapped file (its kernels for the file's pages)
             warm-repacked   llama.cpp's default load (its repacked kernels; the whole model in memory)
             kernel-warm     the runtime on the kernel-layout file, its experts pages of the file's map
                             (paged), every one brought in before it runs
             kernel-warm-rows  the same with its experts read into llama.cpp's buffers (O_DIRECT rows)
           and ik_llama.cpp warm (bench.peers).
  limited  a memory cgroup of 40% of the stock file; the model's pages dropped before every arm;
           plain llama.cpp's readahead swept first (bench.memlimit.sweep_plain), every arm then at
           plain's best window (plain tuned):
             plain            llama.cpp as users run a model larger than RAM (mapped, n_ubatch 512) + A/A
             mbolt-kernel     the runtime on the kernel-layout file, paged (the headline arm) + A/A:
                              llama.cpp's tensors point into the file's map; misses asked of the page
                              cache (WILLNEED), its faults wait page by page; evictions give pages back
             mbolt-kernel-rows  the same file, its misses read into llama.cpp's buffers (O_DIRECT,
                              up/down rows behind the gate/up matmuls: run 1's mbolt-kernel)
             mbolt-mapped     the runtime on the reorder file, as shipped before the kernel layout
           and ik_llama.cpp mapped (+ A/A) at n_ubatch 512 (its default) and 2048.
The bound: the larger of the kernel layout's warm compute per token and MIN's bytes per token
(the fewest any cache of the runtime's decode slots could read on this routing) at the drive's
sequential rate (bench.memlimit.bound_of).

Goals come from the pre-registration's [goals] (GOALS below; {model}: the model's name); the
gate (bench.prereg.gate_run) refuses an unlocked or uncommitted file, a dirty tree, a missing goal,
another llama.cpp build than the one it names, and a model already measured under it.

  python scripts/bench_kernel.py prepare [--models q4km]     # bench_memlimit's files + the kernel layout
  python scripts/bench_kernel.py run --models q4km --rounds 5 --prereg prereg/kernel_q4km.toml [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench import peers  # noqa: E402
from mbolt.bench.arms import Arm  # noqa: E402
from mbolt.bench.memlimit import (AS_SHIPPED_KB, KERNEL_WORKLOAD, bound_of, json_default, kernel_limited_arms,  # noqa: E402
                                  kernel_warm_arms, limit_of, log, paths, prepare, prepare_kernel, run_ab_config,
                                  slots_of, sweep_plain, sweep_summary)
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, ttft_of  # noqa: E402
from mbolt.bench.prereg import BenchPrereg, gate_run, run_record, write_result  # noqa: E402
from mbolt.bench.probe import sequential_read  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402
from mbolt.core.memlimit import readahead  # noqa: E402

RESULTS = ROOT / "results"
FRAC = 0.4
GOALS = ("warm_decode_over_repacked_min", "warm_prompt_over_fastest_load_min", "{model}_over_best_peer_min",
         "share_of_bound_min", "ttft_over_ik_max", "aa_within")


IK_ARMS = [peers.PeerArm("ik-mapped"), peers.PeerArm("ik-mapped (A/A)", control_of="ik-mapped"),
           peers.PeerArm("ik-mapped-2048", n_ubatch=2048)]


def ik_runs(name: str, rounds: int, ram: int, seed: int, warm: bool) -> dict | None:
    peer = peers.find_ik()
    if peer is None:
        log(f"  peers: no ik_llama.cpp in {peers.default_venv()} (`prepare` installs it): no peer arms")
        return None
    p = paths(name)
    w = KERNEL_WORKLOAD
    ids = peers.arm_ids(p["stock"], w.prompt, w.new)
    log(f"  peers: ik_llama.cpp {'warm' if warm else 'under the limit'}")
    return peers.run_peers(peer, [peers.IK_WARM] if warm else IK_ARMS, p["stock"], ids[:w.prompt],
                           ids[w.prompt:w.prompt + w.new], rounds=rounds, ram=0 if warm else ram,
                           n_ctx=w.n_ctx, seed=seed,
                           progress=lambda d, t, r: log(f"  {d}/{t} {r['arm']} r{r['round']}: ttft {r['ttft_s']:.2f} s, "
                                                        f"{r['decode_tokens_per_s']:.2f} tok/s"))


def peer_summary(d: dict | None) -> dict:
    """Each ik arm's median decode tok/s and TTFT over its rounds that were cold (bench.peers.run_peers)."""
    return {s["arm"]: {"decode_tokens_per_s": s["decode_tokens_per_s"], "ttft_s": s["ttft_s"]}
            for s in (d or {}).get("summary", [])}


def measure(name: str, rounds: int, pr: BenchPrereg, seed: int = 0) -> dict:
    w = KERNEL_WORKLOAD
    p, size, ram = limit_of(name, FRAC)
    with readahead(p["stock"], AS_SHIPPED_KB):
        log("  warm (no limit, the file in memory): the compute alone")
        warm = run_ab_config(name, kernel_warm_arms(name), w, rounds, 0, seed, aa=False)
        ik_warm = peer_summary(ik_runs(name, rounds, 0, seed, warm=True))
    # plain's window for decoding: a short prompt, 64 tokens a window (it only picks plain's best)
    swept = sweep_plain(name, [Arm("plain", str(p["stock"]), mode="os")], replace(w, prompt=64), ram, seed)
    tuned = best_window(swept)
    with readahead(p["stock"], tuned) as held:
        drive = sequential_read(p["stock"])
        log(f"  under the limit, readahead {held} KiB (plain tuned): drive {drive['bytes_per_s'] / 1e6:.0f} MB/s")
        lim = run_ab_config(name, kernel_limited_arms(name), w, rounds, ram, seed, aa=False)  # the A/A arms are in the list
        ik_raw = ik_runs(name, rounds, ram, seed, warm=False)
    ik = peer_summary(ik_raw)
    k, kw = row(lim, "mbolt-kernel"), row(warm, "kernel-warm")
    warm_names = [a.name for a in kernel_warm_arms(name)]
    rates = {a: row(warm, a)["decode_tokens_per_s"] for a in warm_names}
    ttfts = {a: row(warm, a)["ttft_s"] for a in warm_names}
    fastest_load = min(ttfts["warm-mapped"], ttfts["warm-repacked"])
    plain_rate = row(lim, "plain")["decode_tokens_per_s"]
    ik_rate = ik.get("ik-mapped", {}).get("decode_tokens_per_s")
    best_peer = max((r for r in (plain_rate, ik_rate) if r), default=None)
    ik_ttft = min((v["ttft_s"] for v in ik.values() if v["ttft_s"]), default=None)
    slots = slots_of(lim, "mbolt-kernel")
    bound = bound_of(name, w, slots, 1.0 / rates["kernel-warm"], drive["bytes_per_s"]) if slots else None
    aa = {"plain": pair_ratio(lim, "plain (A/A)", "plain"),
          "mbolt-kernel": pair_ratio(lim, "mbolt-kernel (A/A)", "mbolt-kernel"),
          "ik-mapped": (ik_raw or {}).get("aa", {}).get("ik-mapped (A/A)")}
    out = {"model": name, "workload": vars(w), "file_bytes": size, "kernel_file_bytes": p["kernel"].stat().st_size,
           "budget_frac": FRAC, "budget_bytes": ram, "rounds": rounds, "headline_arm": "mbolt-kernel",
           "plain_tuned_readahead_kb": tuned, "drive": drive, "sweep": sweep_summary(swept),
           "warm_decode_tokens_per_s": rates, "warm_ttft_s": ttfts, "ik_warm": ik_warm,
           "limited": {r["arm"]: {k2: r.get(k2) for k2 in ("decode_tokens_per_s", "ttft_s", "device_bytes_per_token",
                                                           "read_share_s", "kernels")} for r in lim["summary"]},
           "ik": ik, "best_peer_tokens_per_s": best_peer, "bound": bound, "aa": aa,
           "kernel_over_plain": pair_stats(lim, "mbolt-kernel", "plain"),
           "kernel_over_mapped_runtime": pair_ratio(lim, "mbolt-kernel", "mbolt-mapped"),
           "kernel_over_kernel_rows": pair_ratio(lim, "mbolt-kernel", "mbolt-kernel-rows"),
           "kernel_ttft_over_plain": pair_ratio(lim, "mbolt-kernel", "plain", key=ttft_of),
           "tokens_agreement_across_kernels": row(lim, "plain").get("tokens_agreement_across_kernels"),
           "warm": warm, "limited_run": lim, "ik_run": ik_raw, "sweep_runs": {str(ra): v["ab"] for ra, v in swept.items()}}
    vs_peer = k["decode_tokens_per_s"] / best_peer if best_peer else None
    share = k["decode_tokens_per_s"] / bound["tokens_per_s"] if bound else None
    aas = [v for v in aa.values() if v is not None]
    g = pr.goal
    out["goals"] = [
        {"goal": f"kernel-warm decode >= {g('warm_decode_over_repacked_min')}x llama.cpp's repacked load",
         "value": rates["kernel-warm"] / rates["warm-repacked"],
         "met": rates["kernel-warm"] / rates["warm-repacked"] >= g("warm_decode_over_repacked_min")},
        {"goal": f"kernel-warm prompt >= {g('warm_prompt_over_fastest_load_min')}x the faster of llama.cpp's loads",
         "value": fastest_load / kw["ttft_s"], "met": fastest_load / kw["ttft_s"] >= g("warm_prompt_over_fastest_load_min")},
        {"goal": f"mbolt-kernel >= {g(f'{name}_over_best_peer_min')}x the best peer arm (plain tuned, ik mapped)",
         "value": vs_peer, "met": vs_peer is not None and vs_peer >= g(f"{name}_over_best_peer_min")},
        {"goal": f"mbolt-kernel >= {g('share_of_bound_min'):.0%} of the overlapped bound", "value": share,
         "met": share is not None and share >= g("share_of_bound_min")},
        {"goal": f"mbolt-kernel TTFT <= {g('ttft_over_ik_max')}x ik_llama.cpp's best", "value":
            k["ttft_s"] / ik_ttft if ik_ttft else None, "met": bool(ik_ttft) and k["ttft_s"] / ik_ttft <= g("ttft_over_ik_max")},
        {"goal": f"A/A within {g('aa_within'):.0%} (plain, mbolt-kernel, ik)", "value": max(abs(a - 1) for a in aas) if aas else None,
         "met": bool(aas) and max(abs(a - 1) for a in aas) <= g("aa_within")},
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "run"])
    ap.add_argument("--models", default="q4km")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prereg", type=Path, default=None, help="the run's pre-registration, committed and locked")
    ap.add_argument("--dry-run", action="store_true", help="check the gate, print the plan, measure nothing")
    a = ap.parse_args()
    models = a.models.split(",")
    try:
        if a.stage == "prepare":
            peers.install_ik()
            for m in models:
                if not paths(m)["reorder"].exists():
                    prepare(m)
                prepare_kernel(m)
            return
        if a.prereg is None:
            raise MboltError("run needs --prereg (a committed, locked pre-registration)")
        out = {m: RESULTS / f"kernel_{m}.json" for m in models}
        pr, lock = gate_run(a.prereg, ROOT, [k.format(model=m) for m in models for k in GOALS], list(out.values()),
                            count_run=not a.dry_run)
        for m in models:
            if not paths(m)["kernel"].exists():
                raise MboltError(f"{m}: run `prepare` first")
        if a.dry_run:
            print(f"pre-registration {pr.path}: committed, locked ({pr.sha256[:16]}), tree clean, goals present")
            for m in models:
                print(f"  {m}: warm: " + ", ".join(x.name for x in kernel_warm_arms(m)) + "; limited: "
                      + ", ".join(x.name for x in kernel_limited_arms(m)) + ", " + ", ".join(x.name for x in IK_ARMS))
            return
        for m in models:
            rec = run_record(pr, lock, ROOT, paths(m)["stock"])
            res = measure(m, a.rounds, pr)
            res.update({"benchmark": "the kernel layout in the runtime (issue 54)", "script": "scripts/bench_kernel.py",
                        "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"})
            write_result(pr, rec, out[m], res, default=json_default)
            log("wrote", out[m])
            for goal in res["goals"]:
                v = goal["value"]
                log(f"  {m}: {goal['goal']}: {round(v, 3) if isinstance(v, float) else v}: "
                    f"{'met' if goal['met'] else 'MISSED'}")
    except MboltError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
