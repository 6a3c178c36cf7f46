"""The full-depth model (issue 35, items 1 and 5) -> results/deep_q48.json.

Qwen3-30B-A3B's real shape at its real depth: all 48 layers of 128 experts (k=8, hidden 2048,
expert ff 768), typed as llama-quantize types a Q4_K_M file (experts Q4_K, down Q6_K, dense
quantized too), routing like the real model's 48-layer co-activation profile (synth
--routing-like): about 19 GB, under $MBOLT_BENCH, never in git. Per-layer costs weigh five to ten
times more here than in the 8-16-layer files of bench_memlimit.py, whose protocol this is (every
arm-round a fresh process in a memory cgroup, the file's pages dropped before every cold arm,
teacher-forced on the same text, flash attention on, no repacking, same-round ratios):

  warm     the file in memory, inside a cgroup larger than the file: plain llama.cpp (mapped, no
           callback) and the runtime as shipped, whose budget is then larger than the model (every
           expert it reads stays cached): the hot path at full depth, with A/A twins of both
  limited  a cgroup of 40% of the file, readahead 128 KiB: plain llama.cpp and the runtime as
           shipped (async reads, QD4, budget from the cgroup), A/A twins of both; beside them the
           runtime's own bytes at the drive's sequential bandwidth plus the warm compute ("reads
           then compute") and MIN's bound at the runtime's slot count

  peers    ik_llama.cpp (bench.peers: the registry's package, when `bench_memlimit.py prepare` has
           installed it): warm, and under the same limit and readahead mapped (with its A/A), fed the
           same token ids the same way (the prompt, then one token per llama_decode), after the mbolt
           arms of the same stage

A 64-token prompt, then 32 fed tokens: plain decodes about one token per second at this depth.
Not run here, and said so in the result: plain's readahead sweep (128 KiB was plain's best window
on q864 and q4km, whose experts are this model's), the session workload, the reorder file (no
training trace at this size).

  tuned    plain at its best at this depth (issue 33): plain's readahead swept over bench_memlimit's
           windows (4 KiB-1 MiB, 2 rounds of the workload's 32 tokens each, plain only), then at
           plain's best window the limited stage's arms (plain, the runtime, their A/A twins) and
           ik_llama.cpp's (mapped with its A/A); no warm stage

    python scripts/bench_deep.py prepare                                # $MBOLT_BENCH/memlimit/q48
    python scripts/bench_deep.py prepare --tensor-order converter       # .../q48c: down, gate, up per block
    python scripts/bench_deep.py run --prereg prereg/memlimit_deep.toml [--rounds 3] [--dry-run]
    python scripts/bench_deep.py warm --prereg PREREG [--rounds 5]   # the warm stage alone -> deep_q48_warm.json
    python scripts/bench_deep.py tuned --prereg PREREG [--rounds 3]  # plain tuned -> deep_q48_tuned.json
    python scripts/bench_deep.py smoke    # one round on bench_memlimit's smoke model: checks the script

The pre-registration binds as bench_memlimit.py's do (committed, locked, a clean tree, its goals
read from the file).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_memlimit as ml  # noqa: E402  (the protocol and its helpers)

from mbolt.bench import peers  # noqa: E402
from mbolt.bench.arms import Arm  # noqa: E402
from mbolt.bench.memlimit import SHARED, compact, give_to_ordinary_user, json_default  # noqa: E402
from mbolt.bench.paired import best_window, pair_ratio, pair_stats, row, tokens_identical  # noqa: E402
from mbolt.bench.prereg import gate_run, load_bench_prereg, run_record, write_result  # noqa: E402
from mbolt.bench.probe import sequential_read  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402
from mbolt.core.memlimit import readahead  # noqa: E402

NAME = "q48"
PROFILE = SHARED / "coactivation_qwen3-30b-a3b.json"  # all 48 layers (the 8-layer reduction ships in git)
SPEC = dict(preset="qwen3-30b-a3b", n_layers=48, fast_random=True, expert_type="Q4_K_M", dense_type="Q4_K_M")
WORKLOAD = ml.Workload(64, 32, 0)
READAHEAD_KB = 128
GOALS = ("warm_over_plain_warm_min", "reads_then_compute_share_min", "over_plain_tuned_min", "aa_within")
PEER_GOAL = "over_best_peer_min"  # required when the peer is installed
RESULT = ml.RESULTS / f"deep_{NAME}.json"
WARM_GOALS = ("warm_over_plain_warm_min", "aa_within")
WARM_RESULT = ml.RESULTS / f"deep_{NAME}_warm.json"
TUNED_GOALS = ("over_plain_tuned_min", "aa_within")
TUNED_RESULT = ml.RESULTS / f"deep_{NAME}_tuned.json"
NOT_RUN = ("plain's readahead sweep (128 KiB, plain's best on q864 and q4km, whose experts are this model's)",
           "the session workload", "the reorder file (no training trace at this size)")


def prepare(name: str = NAME, tensor_order: str = "use") -> None:
    """The model under $MBOLT_BENCH/memlimit/NAME; tensor_order "converter": each block's routed
    tensors in the order llama.cpp's converter writes real models (down, gate, up), as q48c."""
    from mbolt.synth.synth import SynthConfig, write_synth
    from mbolt.layout.stats import routing_target

    p = ml.paths(name)
    if p["stock"].exists():
        ml.log(f"{p['stock']}: there already ({p['stock'].stat().st_size} bytes)")
        return
    if not PROFILE.exists():
        raise SystemExit(f"{PROFILE}: the 48-layer routing profile is missing (../shared/data/mbolt)")
    p["dir"].mkdir(parents=True, exist_ok=True)
    ml.log(name, "synth (48 layers, about 19 GB)")
    write_synth(p["stock"], SynthConfig.from_preset(SPEC["preset"], **{k: v for k, v in SPEC.items() if k != "preset"},
                                                      routing_like=routing_target(PROFILE), tensor_order=tensor_order))
    give_to_ordinary_user(p)
    ml.log(name, "ready:", p["stock"].stat().st_size, "bytes")


def cache_file(path: Path) -> None:
    """Read the whole file once: the warm arms find every page in memory."""
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def warm_limit(size: int) -> int:
    """A cgroup larger than the file (the runtime's budget then holds every expert), below the machine."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(size * 1.2, 2 << 30), total - (1 << 30)))


def beyond_plain_us(d: dict, arm: str, base: str, n_layers: int) -> float | None:
    """Median over rounds of (arm's time per token - base's) per MoE layer, in microseconds."""
    def per_token(a):
        return {r["round"]: r["wall_s"] / r["tokens"] for r in d["rounds"] if r["arm"] == a and not r["rejected"]}
    x, y = per_token(arm), per_token(base)
    diffs = [(x[k] - y[k]) / n_layers * 1e6 for k in x if k in y]
    return float(np.median(diffs)) if diffs else None


def warm_stage(name: str, plain: Arm, mbolt: Arm, rounds: int, warm_ram: int, seed: int) -> dict:
    """plain llama.cpp and the runtime with the file in memory (read first: a warm arm under a
    limit is not evicted first, bench.ab_llama.run_in_group), A/A twins of both."""
    cache_file(ml.paths(name)["stock"])
    return ml.run_ab_config(name, [replace(plain, name="plain-warm", warm=True),
                                   replace(mbolt, name="mbolt-warm", warm=True),
                                   replace(mbolt, name="mbolt-warm (A/A)", warm=True, control_of="mbolt-warm")],
                            WORKLOAD, rounds, warm_ram, seed, aa=True)


def warm_figures(warm: dict, n_moe: int) -> dict:
    """The warm stage's figures: the runtime over plain warm (same-round ratios), its cost beyond
    plain per MoE layer and token, the twins' A/A."""
    return {"warm_over_plain_warm": pair_stats(warm, "mbolt-warm", "plain-warm"),
            "warm_beyond_plain_us_per_moe_layer": beyond_plain_us(warm, "mbolt-warm", "plain-warm", n_moe),
            "aa": {a: pair_ratio(warm, f"{a} (A/A)", a) for a in ("plain-warm", "mbolt-warm")}}


def budget_frac(name: str) -> float:
    return 4.0 if name == "smoke" else 0.4  # smoke: the engine alone is larger than 40% of its file


def deep_arms(stock: str, suffix: str = "") -> tuple[Arm, Arm]:
    """plain llama.cpp (mapped) and the runtime as shipped (async reads, QD4)."""
    return Arm(f"plain{suffix}", stock, mode="os"), Arm(f"mbolt{suffix}", stock, io_threads=4, asynchronous=True)


def aa_goal(g, aa: dict, twins: str) -> dict:
    spread = max((abs(v - 1) for v in aa.values() if v is not None), default=None)
    return {"goal": f"A/A within {g('aa_within'):.0%} ({twins} twins)", "value": spread,
            "met": spread is not None and spread <= g("aa_within")}


def tokens_goal(out: dict) -> dict:
    return {"goal": "the same tokens in every arm", "value": out["tokens_identical"], "met": out["tokens_identical"]}


def peer_goal(pr, out: dict, prefix: str = "") -> list[dict]:
    """issue 35's ">= 2x the best peer arm", required of a real run when the peer is installed."""
    if "peers" not in out or PEER_GOAL not in pr.goals:
        return []
    vs = out["peers"]["mbolt_over_best_peer"]
    return [{"goal": f"{prefix}mbolt-stock >= {pr.goal(PEER_GOAL)}x the best peer arm", "value": vs,
             "met": vs is not None and vs >= pr.goal(PEER_GOAL)}]


def warm_goal(g, value) -> dict:
    return {"goal": f"warm: the runtime >= {g('warm_over_plain_warm_min')}x plain warm (hot path at full depth)",
            "value": value, "met": value is not None and value >= g("warm_over_plain_warm_min")}


def run_warm(rounds: int, pr, name: str = NAME, seed: int = 0) -> dict:
    """The warm stage alone: the hot path at full depth (issue 35's ">= 0.95x plain warm")."""
    from mbolt.core.moe_map import moe_map

    p = ml.paths(name)
    stock, size = str(p["stock"]), p["stock"].stat().st_size
    n_moe, warm_ram = len(moe_map(stock).moe_layers), warm_limit(size)
    with readahead(p["stock"], READAHEAD_KB):
        ml.log(f"{name}: warm, inside a cgroup of {warm_ram / 2**30:.1f} GiB (the file read into memory first)")
        warm = warm_stage(name, *deep_arms(stock), rounds, warm_ram, seed)
    g = pr.goal
    out = {"model": name, "synth": SPEC, "workload": vars(WORKLOAD), "file_bytes": size, "moe_layers": n_moe,
           "warm_limit_bytes": warm_ram, "rounds": rounds,
           "decode_tokens_per_s": {r_["arm"]: r_.get("decode_tokens_per_s") for r_ in warm["summary"]},
           "device_bytes_per_token": {r_["arm"]: r_.get("device_bytes_per_token") for r_ in warm["summary"]},
           **warm_figures(warm, n_moe), "tokens_identical": tokens_identical(warm), "warm": compact(warm)}
    out["goals"] = [warm_goal(g, out["warm_over_plain_warm"]["median"]), aa_goal(g, out["aa"], "two"), tokens_goal(out)]
    return out


def run_tuned(rounds: int, pr, name: str = NAME, seed: int = 0) -> dict:
    """plain at its best at full depth: its readahead swept, then at its best window plain, the
    runtime and their twins (same-round ratios), ik_llama.cpp's arms after them."""
    p = ml.paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * budget_frac(name))
    plain, mbolt = deep_arms(str(p["stock"]), "-stock")
    ml.log(f"{name}: plain's readahead swept under the limit ({ram / 2**30:.2f} GiB)")
    swept = ml.sweep_plain(name, [plain], WORKLOAD, ram, seed, tokens=WORKLOAD.new)
    tuned = best_window(swept)
    with readahead(p["stock"], tuned) as held:
        drive0 = sequential_read(p["stock"])
        ml.log(f"{name}: readahead {held} KiB (plain tuned): drive {drive0['bytes_per_s'] / 1e6:.0f} MB/s sequential")
        lim = ml.run_ab_config(name, [plain, mbolt, replace(mbolt, name="mbolt-stock (A/A)", control_of="mbolt-stock")],
                               WORKLOAD, rounds, ram, seed, aa=True)  # aa: plain's twin too
        peer = ml.peer_arms(name, WORKLOAD, rounds, ram, seed)
        drive1 = sequential_read(p["stock"])
    m = row(lim, "mbolt-stock")
    out = {"model": name, "synth": SPEC, "routing_like": str(PROFILE.name), "workload": vars(WORKLOAD),
           "file_bytes": size, "budget_bytes": ram, "rounds": rounds, "plain_tuned_readahead_kb": held,
           "sweep": ml.sweep_summary(swept, WORKLOAD.new),
           "drive": {"before": drive0, "after": drive1,
                     "sequential_bytes_per_s": max(drive0["bytes_per_s"], drive1["bytes_per_s"])},
           "ratio_definition": "per round: an arm / its baseline of the same round; the median of those",
           "decode_tokens_per_s": {r["arm"]: r.get("decode_tokens_per_s") for r in lim["summary"]},
           "over_plain_tuned": pair_stats(lim, "mbolt-stock", "plain-stock"),
           "aa": {a: pair_ratio(lim, f"{a} (A/A)", a) for a in ("plain-stock", "mbolt-stock")},
           "tokens_identical": tokens_identical(lim), "limited": compact(lim),
           "sweep_runs": {str(ra): v["ab"] for ra, v in swept.items()},
           "not_run": ["a warm stage (results/deep_q48.json and deep_q48_warm.json have it)"]}
    if peer:
        out["peer_limited"] = peer
        out["peers"] = peers.peers_beside(m["decode_tokens_per_s"], None, peer, None)
    g, over = pr.goal, out["over_plain_tuned"]["median"]
    out["goals"] = [
        {"goal": f"mbolt-stock >= {g('over_plain_tuned_min')}x plain tuned ({held} KiB)", "value": over,
         "met": over is not None and over >= g("over_plain_tuned_min")},
        aa_goal(g, out["aa"], "two"), tokens_goal(out), *peer_goal(pr, out)]
    return out


def run(rounds: int, pr, name: str = NAME, seed: int = 0) -> dict:
    from mbolt.core.moe_map import moe_map

    p = ml.paths(name)
    stock, size = str(p["stock"]), p["stock"].stat().st_size
    n_moe = len(moe_map(stock).moe_layers)
    frac = budget_frac(name)
    ram, warm_ram = int(size * frac), warm_limit(size)
    plain, mbolt = deep_arms(stock)
    with readahead(p["stock"], READAHEAD_KB) as held:
        ml.log(f"{name}: warm, inside a cgroup of {warm_ram / 2**30:.1f} GiB (the file {size / 2**30:.1f} GiB "
               "read into memory first)")
        warm = warm_stage(name, plain, mbolt, rounds, warm_ram, seed)
        peer_warm = ml.peer_arms(name, WORKLOAD, rounds, 0, seed, warm=True)
        drive0 = sequential_read(p["stock"])
        ml.log(f"{name}: under the limit ({ram / 2**30:.2f} GiB), readahead {held} KiB: drive "
               f"{drive0['bytes_per_s'] / 1e6:.0f} MB/s sequential")
        lim = ml.run_ab_config(name, [replace(plain, name="plain-stock"), replace(mbolt, name="mbolt-stock"),
                                      replace(mbolt, name="mbolt-stock (A/A)", control_of="mbolt-stock")],
                               WORKLOAD, rounds, ram, seed, aa=True)
        peer = ml.peer_arms(name, WORKLOAD, rounds, ram, seed) if peer_warm else None
        drive1 = sequential_read(p["stock"])
    bw = max(drive0["bytes_per_s"], drive1["bytes_per_s"])
    compute_s = 1.0 / row(warm, "plain-warm")["decode_tokens_per_s"]
    m = row(lim, "mbolt-stock")
    out = {"model": name, "synth": SPEC, "routing_like": str(PROFILE.name), "workload": vars(WORKLOAD),
           "file_bytes": size, "moe_layers": n_moe, "budget_frac": frac, "budget_bytes": ram,
           "warm_limit_bytes": warm_ram, "rounds": rounds, "readahead_kb": held, "not_run": list(NOT_RUN),
           "drive": {"before": drive0, "after": drive1, "sequential_bytes_per_s": bw},
           "ratio_definition": "per round: an arm / its baseline of the same round; the median of those",
           "decode_tokens_per_s": {"warm": {r["arm"]: r.get("decode_tokens_per_s") for r in warm["summary"]},
                                   "limited": {r["arm"]: r.get("decode_tokens_per_s") for r in lim["summary"]}},
           **warm_figures(warm, n_moe), "over_plain": pair_stats(lim, "mbolt-stock", "plain-stock"),
           "tokens_identical": tokens_identical(warm, lim), "warm": compact(warm), "limited": compact(lim)}
    out["aa"].update({a: pair_ratio(lim, f"{a} (A/A)", a) for a in ("plain-stock", "mbolt-stock")})
    if m.get("device_bytes_per_token"):
        rtc = 1.0 / (m["device_bytes_per_token"] / bw + compute_s)
        out["reads_then_compute"] = {"device_bytes_per_token": m["device_bytes_per_token"],
                                     "bandwidth_bytes_per_s": bw, "compute_s_per_token": compute_s,
                                     "tokens_per_s": rtc, "share": m["decode_tokens_per_s"] / rtc}
    if peer:
        out["peer_warm"], out["peer_limited"] = peer_warm, peer
        out["peers"] = peers.peers_beside(m["decode_tokens_per_s"], row(warm, "plain-warm")["decode_tokens_per_s"],
                                          peer, peer_warm)
    slots = ml.slots_of(lim)
    if slots:
        out["bound"] = ml.bound_of(name, WORKLOAD, slots, compute_s, bw)
        out["share_of_bound"] = m["decode_tokens_per_s"] / out["bound"]["tokens_per_s"]
    g = pr.goal
    warm_r, over = out["warm_over_plain_warm"]["median"], out["over_plain"]["median"]
    share = out.get("reads_then_compute", {}).get("share")
    out["goals"] = [
        warm_goal(g, warm_r),
        {"goal": f"limited: mbolt-stock >= {g('reads_then_compute_share_min'):.0%} of reads then compute",
         "value": share, "met": share is not None and share >= g("reads_then_compute_share_min")},
        {"goal": f"limited: mbolt-stock >= {g('over_plain_tuned_min')}x plain (128 KiB)", "value": over,
         "met": over is not None and over >= g("over_plain_tuned_min")},
        aa_goal(g, out["aa"], "four"), tokens_goal(out), *peer_goal(pr, out, "limited: ")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "run", "warm", "tuned", "smoke"])
    ap.add_argument("--tensor-order", choices=["use", "converter"], default="use",
                    help="prepare: each block's routed tensors as llama.cpp uses them (q48) or as its converter "
                         "writes real models: down, gate, up (q48c)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prereg", type=Path, default=ml.ROOT / "prereg" / "memlimit_deep.toml",
                    help="the run's pre-registration, committed and locked")
    ap.add_argument("--dry-run", action="store_true", help="check the pre-registration, the tree and the goals")
    a = ap.parse_args()
    if a.stage == "prepare":
        prepare(NAME + ("c" if a.tensor_order == "converter" else ""), a.tensor_order)
        return
    if a.stage == "smoke":  # checks the script, not a figure: the goals are read, nothing is gated
        ml.prepare("smoke")
        for fn in (run, run_tuned):
            for g in fn(1, load_bench_prereg(a.prereg), "smoke")["goals"]:
                ml.log(f"  smoke: {g['goal']}: {g['value']}")
        return
    try:
        fn, result, goals = {"warm": (run_warm, WARM_RESULT, WARM_GOALS), "tuned": (run_tuned, TUNED_RESULT, TUNED_GOALS),
                             "run": (run, RESULT, GOALS)}[a.stage]
        judged = list(goals) + ([PEER_GOAL] if a.stage != "warm" and peers.find_ik() else [])
        pr, lock = gate_run(a.prereg, ml.ROOT, judged, result, count_run=not a.dry_run)
        if not ml.paths(NAME)["stock"].exists():
            raise SystemExit(f"{ml.paths(NAME)['stock']}: run `prepare` first")
        if a.dry_run:
            print(f"pre-registration {pr.path}: committed, locked ({pr.sha256[:16]}), tree clean, goals present; "
                  f"{a.rounds} rounds of: " + ("plain's readahead swept, then plain-stock, mbolt-stock (+ A/A twins)"
                                                if a.stage == "tuned" else "warm plain-warm, mbolt-warm (+ A/A twins)")
                  + ("" if a.stage != "run" else
                  "; limited plain-stock, mbolt-stock (+ A/A twins)" + (
                      "; ik_llama.cpp warm, mapped (+ A/A)" if peers.find_ik()
                      else "; ik_llama.cpp not installed: no peers")))
            return
        rec = run_record(pr, lock, ml.ROOT, ml.paths(NAME)["stock"])
        res = fn(a.rounds, pr)
        res.update({"benchmark": "the full-depth model under a real memory limit and warm (issue 35)",
                    "script": "scripts/bench_deep.py", "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"})
        write_result(pr, rec, result, res, default=json_default)
        ml.log("wrote", result)
        for g in res["goals"]:
            v = g["value"]
            ml.log(f"  {g['goal']}: {v if not isinstance(v, float) else round(v, 3)}: {'met' if g['met'] else 'MISSED'}")
    except MboltError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
