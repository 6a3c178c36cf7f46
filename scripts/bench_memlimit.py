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
           is reused), --ctx-size 4096. Arms at 40% and 128 KiB readahead:
             plain-512     llama.cpp as a user streaming a model larger than RAM runs it: mapped, no
                           repacking, no callback, n_ubatch 512 (its default) -- the baseline
             plain-2048    the same at n_ubatch 2048 (fewer passes over the experts, a larger buffer)
             mbolt         the runtime as shipped (stock file, budget from the cgroup): the headline arm
             mbolt (A/A)   the same again
             mbolt-user    the same as an ordinary user (no CAP_IPC_LOCK, RLIMIT_MEMLOCK 8 MiB)
             mbolt-2048    the runtime asked for 2048-token passes (what a larger micro-batch buys)
             + plain-512 (A/A)
           and, without a limit and with the file in memory, warm-512 and warm-2048 (the compute alone).
  decode   a 64-token prompt, then 256 fed tokens (steady decoding), --ctx-size 4096.

Models (in $MBOLT_BENCH/memlimit, default /tmp/mbolt-bench; never in git):
  q864   Qwen3-30B-A3B shapes (128 experts, k=8, hidden 2048, expert ff 768), Q4_0: 864 KiB slices
  q72    512 experts, k=10, hidden 2048, expert ff 64, Q4_0: 72 KiB slices (a fine-grained model)
The plan is a llama.cpp trace of training prompts (the first 24 of prompts.jsonl).

  python scripts/bench_memlimit.py prepare [--models q864,q72]
  python scripts/bench_memlimit.py session [--models q864,q72] [--rounds 3]
  python scripts/bench_memlimit.py smoke      # a tiny model, one round of the session: checks the script

Goals of the session workload (issue 26, pre-registered in prereg/memlimit_session.toml): at 40% and
128 KiB readahead on both models, mbolt's TTFT of the 2,000-token prompt <= 1.15x its warm TTFT;
decode after it >= 1.5x the better plain arm, the same tokens; the follow-up's TTFT <= 1.15x
max(its warm TTFT, the bytes it read / the drive's sequential bandwidth); the prompt's read
bandwidth >= 70% of the drive's sequential bandwidth measured in the same run; the ordinary user
within 10% of root's decode tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.ab import load_prompt_ids, run_ab  # noqa: E402
from mbolt.bench.arms import Arm  # noqa: E402
from mbolt.bench.predict import law_holds, law_predicts_no_change, throttled_layout_law  # noqa: E402
from mbolt.bench.stats import aa_row  # noqa: E402
from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.core.memlimit import readahead  # noqa: E402

BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench")) / "memlimit"
RESULTS = ROOT / "results"
PROMPTS = ROOT / "mbolt" / "data" / "prompts.jsonl"
SHARED = ROOT.parent / "shared" / "data" / "mbolt"  # the full profiles, where this checkout has them
PROFILE_30B = ROOT / "mbolt" / "data" / "coactivation_qwen3-30b-a3b.8layers.json"  # 8 of 48 layers: one per model layer
PROFILE_80B = SHARED / "coactivation_qwen3-next-80b-a3b.json"  # all 48 layers (16 model layers map over them)
# dense_type F16: the attention matrices of Qwen3-30B shapes in F32 would make the dense share
# three times a real Q4_K_M file's. Routing like real models (synth --routing-like): the 864 KiB
# model follows Qwen3-30B-A3B's co-activation profile, the 72 KiB model Qwen3-Next-80B's.
MODELS = {
    "q864": dict(preset="qwen3-30b-a3b", n_layers=8, fast_random=True, dense_type="F16", routing_like=PROFILE_30B),
    # attention narrowed (4 heads of 128) so the dense share stays near a real model's (~5%): with
    # Qwen3-30B's 32 heads it was 26% of the file, more than a 25% budget (run 1)
    "q72": dict(preset="qwen3-30b-a3b", n_layers=16, n_experts=512, n_used=10, expert_ff=64, n_heads=4,
                n_kv_heads=1, head_dim=128, fast_random=True, dense_type="F16", routing_like=PROFILE_80B),
    # typed as llama-quantize types a Q4_K_M file (gguf.mixes): the dense tensors quantized too
    "q4km": dict(preset="qwen3-30b-a3b", n_layers=8, fast_random=True, expert_type="Q4_K_M", dense_type="Q4_K_M",
                 routing_like=PROFILE_30B),
    "smoke": dict(arch="qwen3moe", n_layers=2, n_experts=64, n_used=4, hidden=1024, expert_ff=256, n_heads=4,
                  n_kv_heads=2, head_dim=32, dense_ff=256, expert_type="Q4_0", fast_random=True, structure="planted"),
}
TRAIN_PROMPTS = 24


@dataclass(frozen=True)
class Workload:
    prompt: int  # tokens prefilled (time to first token)
    new: int  # tokens fed one at a time (decode tok/s)
    followup: int  # tokens of a follow-up turn on the same context (0: none)
    n_ctx: int = 4096


WORKLOADS = {"session": Workload(2000, 256, 200), "decode": Workload(64, 256, 0)}
SESSION_GOALS = {"ttft_over_warm_max": 1.15, "decode_over_plain_min": 1.5, "followup_over_bound_max": 1.15,
                 "prompt_bw_share_min": 0.70, "user_over_root_min": 0.90}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def paths(name: str) -> dict:
    d = BENCH / name
    return {"dir": d, "stock": d / "stock.gguf", "train": d / "train.mbtrace", "plan": d / "plan.json",
            "reorder": d / "reorder.gguf"}


def prepare(name: str) -> None:
    from mbolt.core.mbtrace import read_trace
    from mbolt.core.moe_map import moe_map
    from mbolt.core.plan import save_plan
    from mbolt.core.prompts import read_prompts
    from mbolt.gguf.synth import SynthConfig, write_synth
    from mbolt.layout.evaluate import geometry_from_model
    from mbolt.layout.plan import make_plan
    from mbolt.rewrite.reorder import reorder_file
    from mbolt.trace.tracer import trace_prompts

    from mbolt.layout.stats import routing_target

    p = paths(name)
    p["dir"].mkdir(parents=True, exist_ok=True)
    spec = dict(MODELS[name])
    if "routing_like" in spec:
        if not Path(spec["routing_like"]).exists():
            raise SystemExit(f"{spec['routing_like']}: the routing profile is missing (../shared/data/mbolt)")
        spec["routing_like"] = routing_target(spec["routing_like"])
    log(name, "synth")
    cfg = SynthConfig.from_preset(spec.pop("preset"), **spec) if "preset" in spec else SynthConfig(**spec)
    write_synth(p["stock"], cfg)
    log(name, "trace (llama.cpp, training prompts: the first", TRAIN_PROMPTS, "of prompts.jsonl)")
    trace_prompts(p["stock"], read_prompts(PROMPTS)[:TRAIN_PROMPTS], p["train"], max_new_tokens=16,
                  engine="llama.cpp")
    mm = moe_map(p["stock"])
    plan = make_plan(read_trace(p["train"]), "tsp", train_frac=1.0, phase="all",
                     geometry=geometry_from_model(mm, "reorder"))
    save_plan(p["plan"], plan)
    log(name, "reorder")
    reorder_file(p["stock"], p["reorder"], plan=p["plan"], layout="reorder", force=True)
    log(name, "ready:", p["stock"].stat().st_size, "bytes")


# ---- the drive, measured in the same run ----


def sequential_read(path: Path, nbytes: int = 1 << 30) -> dict:
    """The drive's sequential read bandwidth on the model file's first `nbytes`, cold: (a) as the
    runtime's reader reads (posix_fadvise WILLNEED in the pieces the kernel takes whole, then each
    piece's last byte awaited), (b) one thread of 4 MiB preadv (what dd does). Bytes per second of
    each, and the better of the two."""
    from mbolt.core.pagecache import evict, willneed_bytes

    size = path.stat().st_size
    n = min(nbytes, size)
    out = {"bytes": n}
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        evict(path)
        step = willneed_bytes(path)
        t = time.perf_counter()
        for off in range(0, n, step):
            os.posix_fadvise(fd, off, min(step, n - off), os.POSIX_FADV_WILLNEED)
        for off in range(0, n, step):
            os.pread(fd, 1, min(off + step, n) - 1)
        out["willneed_bytes_per_s"] = n / (time.perf_counter() - t)
        evict(path)
        buf = bytearray(4 << 20)
        t = time.perf_counter()
        for off in range(0, n, len(buf)):
            os.preadv(fd, [memoryview(buf)[:min(len(buf), n - off)]], off)
        out["pread_4m_bytes_per_s"] = n / (time.perf_counter() - t)
    finally:
        os.close(fd)
        evict(path)
    out["bytes_per_s"] = max(out["willneed_bytes_per_s"], out["pread_4m_bytes_per_s"])
    return out


# ---- one configuration ----


def session_arms(name: str) -> list[Arm]:
    stock = str(paths(name)["stock"])
    mbolt = Arm("mbolt", stock, io_threads=4, asynchronous=True)
    return [Arm("plain-512", stock, mode="os"), Arm("plain-2048", stock, mode="os", n_ubatch=2048), mbolt,
            replace(mbolt, name="mbolt (A/A)", control_of="mbolt"), replace(mbolt, name="mbolt-user", user=True),
            replace(mbolt, name="mbolt-2048", n_ubatch=2048)]


def warm_arms(name: str) -> list[Arm]:
    stock = str(paths(name)["stock"])
    return [Arm("warm-512", stock, mode="os", warm=True), Arm("warm-2048", stock, mode="os", warm=True, n_ubatch=2048)]


def _compact(d: dict) -> dict:
    """The A/B result with each round's tokens as a hash (every arm's tokens are equal, or run_ab refused)."""
    for r in d["rounds"]:
        r.pop("generated", None)
    return d


def run_ab_config(name: str, arms: list[Arm], w: Workload, rounds: int, ram: int, seed: int, aa: bool) -> dict:
    p = paths(name)
    prompts = load_prompt_ids(str(p["stock"]), None, 1, engine="llama.cpp", forced=w.prompt, n_new=w.new,
                              followup=w.followup)
    res = run_ab(arms, mode="decode", engine="llama.cpp", rounds=rounds, prompts=prompts, n_new=w.new, ram=ram,
                 forced=w.prompt, followup=w.followup, n_ctx=w.n_ctx, seed=seed, aa=aa, name=f"memlimit_{name}",
                 progress=lambda d, t, r: log(f"  {d}/{t} {r.arm} r{r.round}: ttft {r.ttft_s:.1f} s, "
                                              f"{r.tokens / r.wall_s:.2f} tok/s"
                                              + (f", follow-up {r.followup_ttft_s:.2f} s" if r.followup_ttft_s else "")))
    return _compact(res.to_dict())


def row(d: dict, arm: str) -> dict:
    return next(r for r in d["summary"] if r["arm"] == arm)


def pair_ratio(d: dict, a: str, b: str, key=lambda r: r["tokens"] / r["wall_s"]) -> float | None:
    """Median over rounds of key(a) / key(b) in the same round."""
    by = {(r["arm"], r["round"]): r for r in d["rounds"] if not r["rejected"] and r["tokens"]}
    xs = [key(x) / key(by[(b, k)]) for (arm, k), x in by.items() if arm == a and (b, k) in by and key(by[(b, k)])]
    return float(np.median(xs)) if xs else None


def tokens_identical(*ds: dict) -> bool:
    hashes = {r["tokens_sha256"] for d in ds for r in d["rounds"] if not r["rejected"]}
    return len(hashes) == 1


def session(name: str, rounds: int, frac: float = 0.4, ra_kb: int = 128, seed: int = 0) -> dict:
    """The session workload on one model: warm, the drive, then the arms under the limit."""
    w = WORKLOADS["session"]
    p = paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * frac)
    log(f"{name}: session, budget {100 * frac:.0f}% ({ram / 2**30:.2f} GiB), readahead {ra_kb} KiB")
    with readahead(p["stock"], ra_kb) as ra:
        drive0 = sequential_read(p["stock"])
        log(f"  drive: {drive0['bytes_per_s'] / 1e6:.0f} MB/s sequential")
        log("  warm (no limit, the file in memory)")
        warm = run_ab_config(name, warm_arms(name), w, rounds, 0, seed, aa=False)
        log("  under the limit")
        lim = run_ab_config(name, session_arms(name), w, rounds, ram, seed, aa=True)
        drive1 = sequential_read(p["stock"])
    bw = max(drive0["bytes_per_s"], drive1["bytes_per_s"])
    m, wm = row(lim, "mbolt"), row(warm, "warm-512")
    plains = [row(lim, "plain-512"), row(lim, "plain-2048")]
    best_decode = max(plains, key=lambda r: r["decode_tokens_per_s"])
    best_ttft = min(plains, key=lambda r: r["ttft_s"])
    mrounds = [r for r in lim["rounds"] if r["arm"] == "mbolt" and not r["rejected"]]
    follow_bytes = float(np.median([r["followup_bytes"] for r in mrounds]))
    follow_bound = max(wm["followup_ttft_s"], follow_bytes / bw)
    user = pair_ratio(lim, "mbolt-user", "mbolt")
    aa_plain = aa_row(lim["summary"])
    out = {
        "model": name, "workload": vars(w), "file_bytes": size, "budget_frac": frac, "budget_bytes": ram,
        "readahead_kb": ra, "rounds": rounds, "drive": {"before": drive0, "after": drive1, "sequential_bytes_per_s": bw},
        "headline_arm": "mbolt",
        "ttft_s": {"mbolt": m["ttft_s"], "warm_512": wm["ttft_s"], "warm_2048": row(warm, "warm-2048")["ttft_s"],
                   "plain_512": plains[0]["ttft_s"], "plain_2048": plains[1]["ttft_s"]},
        "ttft_over_warm": m["ttft_s"] / wm["ttft_s"],
        "ttft_over_best_plain": m["ttft_s"] / best_ttft["ttft_s"],
        "decode_tokens_per_s": {r["arm"]: r["decode_tokens_per_s"] for r in lim["summary"]},
        "decode_over_best_plain": m["decode_tokens_per_s"] / best_decode["decode_tokens_per_s"],
        "decode_over_best_plain_same_round": pair_ratio(lim, "mbolt", best_decode["arm"]),
        "best_plain_decode_arm": best_decode["arm"], "best_plain_ttft_arm": best_ttft["arm"],
        "followup_ttft_s": {"mbolt": m["followup_ttft_s"], "warm_512": wm["followup_ttft_s"],
                            "plain_512": plains[0]["followup_ttft_s"], "plain_2048": plains[1]["followup_ttft_s"]},
        "followup_read_bytes": follow_bytes, "followup_bound_s": follow_bound,
        "followup_over_bound": m["followup_ttft_s"] / follow_bound,
        "prompt_read_mb_per_s": m.get("prompt_read_mb_per_s"),
        "prompt_bw_share": (m.get("prompt_read_mb_per_s") or 0) * 1e6 / bw,
        "user_over_root": user,
        "aa": {"plain": aa_plain["speedup_vs_baseline_median"] if aa_plain else None,
               "mbolt": pair_ratio(lim, "mbolt (A/A)", "mbolt")},
        "peak_after_load_bytes": {r["arm"]: r.get("peak_after_load_bytes_max") for r in lim["summary"]},
        "tokens_identical": tokens_identical(lim, warm),
        "warm": warm, "limited": lim,
    }
    g = SESSION_GOALS
    out["goals"] = [
        {"goal": "TTFT <= 1.15x warm", "value": out["ttft_over_warm"], "met": out["ttft_over_warm"] <= g["ttft_over_warm_max"]},
        {"goal": "decode >= 1.5x the better plain", "value": out["decode_over_best_plain"],
         "met": out["decode_over_best_plain"] >= g["decode_over_plain_min"]},
        {"goal": "follow-up TTFT <= 1.15x max(warm, bytes/BW)", "value": out["followup_over_bound"],
         "met": out["followup_over_bound"] <= g["followup_over_bound_max"]},
        {"goal": "prompt read bandwidth >= 70% of sequential", "value": out["prompt_bw_share"],
         "met": out["prompt_bw_share"] >= g["prompt_bw_share_min"]},
        {"goal": "ordinary user within 10% of root (decode)", "value": user,
         "met": user is not None and user >= g["user_over_root_min"]},
        {"goal": "the same tokens in every arm", "value": out["tokens_identical"], "met": out["tokens_identical"]},
    ]
    return out


def _json(o):
    return str(o) if isinstance(o, Path) else float(o)


def run_session(models: list[str], rounds: int, out_dir: Path, frac: float = 0.4) -> None:
    for name in models:
        if not paths(name)["reorder"].exists():
            raise SystemExit(f"{name}: run `prepare` first")
        res = session(name, rounds, frac)
        res.update({"benchmark": "sessions under a real memory limit (issue 26)", "script": "scripts/bench_memlimit.py",
                    "synth": MODELS[name], "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"})
        path = out_dir / f"session_{name}.json"
        write_text_atomic(path, json.dumps(res, indent=1, default=_json) + "\n")
        log("wrote", path)
        for g in res["goals"]:
            v = g["value"]
            log(f"  {name}: {g['goal']}: {v if not isinstance(v, float) else round(v, 3)}: "
                f"{'met' if g['met'] else 'MISSED'}")


# ---- steady decoding (issue 28): the readahead swept for plain, the bound beside the figures ----

DECODE_GOALS = {"q864": 2.0, "q72": 3.0, "q4km": 2.0}  # default runtime over plain tuned, 40%, real-like routing
READAHEADS = (128, 64, 32, 16)
SWEEP_TOKENS, SWEEP_ROUNDS = 64, 2  # the readahead sweep picks plain's best; the headline is measured after it


def decode_arms(name: str, full: bool) -> list[Arm]:
    p = paths(name)
    mbolt = Arm("mbolt-stock", str(p["stock"]), io_threads=4, asynchronous=True)
    arms = [Arm("plain-stock", str(p["stock"]), mode="os"), mbolt,
            replace(mbolt, name="mbolt-stock (A/A)", control_of="mbolt-stock")]
    if full:
        arms += [Arm("plain-reorder", str(p["reorder"]), mode="os"),
                 Arm("mbolt-reorder", str(p["reorder"]), io_threads=4, asynchronous=True)]
    return arms


def slots_of(d: dict, arm: str = "mbolt-stock") -> int | None:
    """The runtime's decode slots per layer (median over rounds, at the end of each)."""
    xs = [r["decode_slots"] for r in d["rounds"] if r["arm"] == arm and not r["rejected"] and r.get("decode_slots")]
    return int(np.median(xs)) if xs else None


_ROUTING: dict = {}


def bound_of(name: str, w: Workload, slots: int, compute_s: float, bandwidth: float) -> dict:
    """What the machine allows at this cache size: MIN's misses on the same routing (the fewest
    any cache of `slots` per layer could have), read at the drive's sequential bandwidth, overlapped
    with the warm compute time per token."""
    from mbolt.bench.bound import decode_bound, miss_bytes_per_token
    from mbolt.core.moe_map import moe_map
    from mbolt.runtime.driver import record_routing

    p = paths(name)
    mm = moe_map(p["stock"])
    key = (name, w.prompt, w.new)
    if key not in _ROUTING:  # the same text routes the same way: recorded once per run
        prompts = load_prompt_ids(str(p["stock"]), None, 1, engine="llama.cpp", forced=w.prompt, n_new=w.new)
        _ROUTING[key] = record_routing(p["stock"], prompts, w.new, mm=mm, forced=w.prompt)
    routing = _ROUTING[key]
    per_layer = np.zeros(mm.n_layers)  # dense layers read no experts
    for l in mm.moe_layers:
        per_layer[l.index] = l.expert_bytes
    miss = miss_bytes_per_token(routing, slots, per_layer)
    b = decode_bound(compute_s, miss, bandwidth)
    return {"slots": slots, "min_miss_bytes_per_token": miss, "compute_s_per_token": compute_s,
            "bandwidth_bytes_per_s": bandwidth, "io_s_per_token": b.io_s, "tokens_per_s": b.tok_s, "limit": b.limit}


def decode(name: str, rounds: int, frac: float = 0.4, seed: int = 0, sweep: bool = True) -> dict:
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
    swept = {}
    if sweep:
        short = replace(w, new=SWEEP_TOKENS)
        for ra in READAHEADS:
            with readahead(p["stock"], ra) as held:
                log(f"  sweep: plain at readahead {held} KiB")
                d = run_ab_config(name, [Arm("plain-stock", str(p["stock"]), mode="os")], short, SWEEP_ROUNDS, ram,
                                  seed, aa=False)
            swept[held] = {"plain_tokens_per_s": row(d, "plain-stock")["decode_tokens_per_s"], "ab": d}
    tuned = max(swept, key=lambda ra: swept[ra]["plain_tokens_per_s"]) if swept else 128
    configs = {}
    for ra in sorted({128, tuned}, reverse=True):
        with readahead(p["stock"], ra) as held:
            drive = sequential_read(p["stock"])
            log(f"  readahead {held} KiB ({'as shipped' if ra == 128 else 'plain tuned'}): drive "
                f"{drive['bytes_per_s'] / 1e6:.0f} MB/s")
            d = run_ab_config(name, decode_arms(name, full=True), w, rounds, ram, seed, aa=True)
        configs[ra] = {"readahead_kb": held, "drive": drive, "ab": d}
    full, best = configs[128]["ab"], configs[tuned]["ab"]
    compute_s = 1.0 / row(warm, "warm")["decode_tokens_per_s"]
    bw = max(c["drive"]["bytes_per_s"] for c in configs.values())
    out = {"model": name, "workload": vars(w), "file_bytes": size, "budget_frac": frac, "budget_bytes": ram,
           "rounds": rounds, "headline_arm": "mbolt-stock", "plain_tuned_readahead_kb": tuned,
           "sweep": {"tokens": SWEEP_TOKENS, "rounds": SWEEP_ROUNDS,
                     "plain_tokens_per_s": {ra: v["plain_tokens_per_s"] for ra, v in swept.items()}},
           "warm_tokens_per_s": row(warm, "warm")["decode_tokens_per_s"],
           "decode_tokens_per_s": {ra: {r["arm"]: r.get("decode_tokens_per_s") for r in c["ab"]["summary"]}
                                   for ra, c in configs.items()},
           "headline": pair_ratio(best, "mbolt-stock", "plain-stock"),
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
    aa = [v for c in out["aa"].values() for v in c.values() if v is not None]
    goal = DECODE_GOALS.get(name, 2.0)
    out["goals"] = [
        {"goal": f"mbolt-stock >= {goal}x plain tuned", "value": out["headline"],
         "met": out["headline"] is not None and out["headline"] >= goal},
        {"goal": "A/A within 5% (plain and mbolt)", "value": max(abs(a - 1) for a in aa) if aa else None,
         "met": bool(aa) and max(abs(a - 1) for a in aa) <= 0.05},
        {"goal": "mbolt >= 70% of the bound at 128 KiB", "value": out.get("share_of_bound"),
         "met": out.get("share_of_bound") is not None and out["share_of_bound"] >= 0.70},
        {"goal": "the same tokens in every arm", "value": out["tokens_identical"], "met": out["tokens_identical"]},
    ]
    return out


def drives(name: str, rounds: int, frac: float = 0.4, seed: int = 0) -> dict:
    """The drive profiles (core.blkio, set once each arm's model has loaded): plain and the runtime,
    on the stock and the reorder file, the slice-size law's prediction of the layout's gain, and
    the bound at the profile's bandwidth."""
    from mbolt.core.blkio import profile

    w = replace(WORKLOADS["decode"], new=64)  # at 125 MB/s plain decodes well under a token per second
    p = paths(name)
    ram = int(p["stock"].stat().st_size * frac)
    with readahead(p["stock"], 128):
        log(f"{name}: warm (no limit, the file in memory): the compute alone")
        warm = run_ab_config(name, [Arm("warm", str(p["stock"]), mode="os", warm=True)], w, rounds, 0, seed, aa=False)
    compute_s = 1.0 / row(warm, "warm")["decode_tokens_per_s"]
    out = {"model": name, "workload": vars(w), "budget_frac": frac, "budget_bytes": ram, "rounds": rounds,
           "readahead_kb": 128, "headline_arm": "mbolt-stock", "warm_tokens_per_s": 1.0 / compute_s,
           "warm": warm, "profiles": {}}
    goals = []
    for prof in ("cloud", "sata"):
        lim = profile(prof)
        log(f"{name}: drive profile {prof} ({lim})")
        arms = [Arm("plain-stock", str(p["stock"]), mode="os"), Arm("plain-reorder", str(p["reorder"]), mode="os"),
                Arm("mbolt-stock", str(p["stock"]), io_threads=4, asynchronous=True),
                Arm("mbolt-reorder", str(p["reorder"]), io_threads=4, asynchronous=True)]
        with readahead(p["stock"], 128):
            prompts = load_prompt_ids(str(p["stock"]), None, 1, engine="llama.cpp", forced=w.prompt, n_new=w.new)
            res = run_ab(arms, mode="decode", engine="llama.cpp", rounds=rounds, prompts=prompts, n_new=w.new,
                         ram=ram, forced=w.prompt, n_ctx=w.n_ctx, seed=seed, aa=False, drive=prof,
                         name=f"drive_{name}_{prof}",
                         progress=lambda d, t, r: log(f"  {d}/{t} {r.arm} r{r.round}: {r.tokens / r.wall_s:.2f} tok/s"))
        d = _compact(res.to_dict())
        pr = {"limits": vars(lim), "ab": d,
              "over_plain": pair_ratio(d, "mbolt-stock", "plain-stock"),
              "layout_gain": {"plain": pair_ratio(d, "plain-reorder", "plain-stock"),
                              "mbolt": pair_ratio(d, "mbolt-reorder", "mbolt-stock")},
              "law": {k: law_gain(d, f"{k}-stock", f"{k}-reorder", lim) for k in ("plain", "mbolt")}}
        slots = slots_of(d)
        if slots and lim.bps:
            pr["bound"] = bound_of(name, w, slots, compute_s, lim.bps)
            pr["share_of_bound"] = row(d, "mbolt-stock")["decode_tokens_per_s"] / pr["bound"]["tokens_per_s"]
        out["profiles"][prof] = pr
        goals.append({"goal": f"{prof}: mbolt-stock >= 1.8x plain-stock", "value": pr["over_plain"],
                      "met": pr["over_plain"] is not None and pr["over_plain"] >= 1.8})
        for k in ("plain", "mbolt"):
            lw = pr["law"][k]
            goals.append({"goal": f"{prof}: {k} layout gain within 10% of the law's "
                                  f"({'1.00 +- 0.05' if lw['predicted_gain'] and law_predicts_no_change(lw['predicted_gain']) else 'predicted'})",
                          "value": [lw["measured_gain"], lw["predicted_gain"]],
                          "met": law_holds(lw["measured_gain"], lw["predicted_gain"])})
        goals.append({"goal": f"{prof}: mbolt >= 70% of the bound", "value": pr.get("share_of_bound"),
                      "met": pr.get("share_of_bound") is not None and pr["share_of_bound"] >= 0.70})
    out["tokens_identical"] = tokens_identical(warm, *(v["ab"] for v in out["profiles"].values()))
    goals.append({"goal": "the same tokens in every arm", "value": out["tokens_identical"],
                  "met": out["tokens_identical"]})
    out["goals"] = goals
    return out


def law_gain(d: dict, stock: str, reorder: str, lim) -> dict:
    """The slice-size law's prediction of reorder over stock on the throttled drive
    (predict.throttled_layout_law), from each arm's decode reads and bytes as the kernel served
    them after the first decode step (medians over rounds), beside the measured gain."""

    def per_token(arm):
        rs = [r for r in d["rounds"] if r["arm"] == arm and not r["rejected"] and r.get("drive_decode_tokens")]
        if not rs:
            return None
        n = [r["drive_decode_tokens"] for r in rs]
        return (float(np.median([r["drive_decode_reads"] / k for r, k in zip(rs, n)])),
                float(np.median([r["drive_decode_bytes"] / k for r, k in zip(rs, n)])),
                float(np.median([r["tokens"] / r["wall_s"] for r in rs])))

    a, b = per_token(stock), per_token(reorder)
    law = throttled_layout_law(a, b[:2], lim.iops, lim.bps) if a and b else {"predicted_gain": None}
    law.update({"served_per_token": {"stock": a and a[:2], "reorder": b and b[:2]},
                "measured_gain": pair_ratio(d, reorder, stock)})
    return law


def run_named(stage: str, models: list[str], rounds: int) -> None:
    fn = {"decode": decode, "drives": drives}[stage]
    for name in models:
        if not paths(name)["reorder"].exists():
            raise SystemExit(f"{name}: run `prepare` first")
        res = fn(name, rounds)
        res.update({"benchmark": {"decode": "steady decoding under a real memory limit (issue 28)",
                                  "drives": "drive profiles under a real memory limit (issue 28)"}[stage],
                    "script": "scripts/bench_memlimit.py", "synth": MODELS[name],
                    "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"})
        path = RESULTS / f"{'memlimit' if stage == 'decode' else 'drives'}_{name}.json"
        write_text_atomic(path, json.dumps(res, indent=1, default=_json) + "\n")
        log("wrote", path)
        for g in res.get("goals", []):
            log(f"  {name}: {g['goal']}: {g['value']}: {'met' if g['met'] else 'MISSED'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "session", "decode", "drives", "smoke"])
    ap.add_argument("--models", default="q864,q72")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    models = a.models.split(",")
    if a.stage == "smoke":
        global WORKLOADS
        prepare("smoke")
        WORKLOADS = {**WORKLOADS, "session": Workload(300, 16, 40, 1024)}
        out = Path(os.environ.get("TMPDIR", "/tmp")) / "mbolt-memlimit-smoke"
        out.mkdir(exist_ok=True)
        run_session(["smoke"], 1, out, frac=4.0)  # the engine alone takes more than this tiny file
        return
    if a.stage == "prepare":
        for m in models:
            prepare(m)
        return
    if a.stage == "session":
        run_session(models, a.rounds, RESULTS)
    else:
        run_named(a.stage, models, a.rounds)


if __name__ == "__main__":
    main()
