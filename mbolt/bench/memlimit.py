"""The benchmark models, workloads and steps run under a real memory limit, shared by
scripts/bench_memlimit.py (sessions, steady decoding, drives) and scripts/bench_kernel.py (the
kernel layout, issue 54): the synthetic models and their files, plain llama.cpp's readahead sweep,
one A/B configuration, the decode routing of the workload's text and the bound it allows."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mbolt.bench.ab import load_prompt_ids, run_ab
from mbolt.bench.ab_llama import ORDINARY_UID
from mbolt.bench.arms import Arm
from mbolt.bench.paired import row
from mbolt.core.memlimit import readahead

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench")) / "memlimit"
PROMPTS = ROOT / "mbolt" / "data" / "prompts.jsonl"
SHARED = ROOT.parent / "shared" / "data" / "mbolt"  # the full profiles, where this checkout has them
PROFILE_30B = ROOT / "mbolt" / "data" / "coactivation_qwen3-30b-a3b.8layers.json"  # 8 of 48 layers: one per model layer
PROFILE_80B = SHARED / "coactivation_qwen3-next-80b-a3b.json"  # all 48 layers (16 model layers map over them)
# dense_type F16: the attention matrices of Qwen3-30B shapes in F32 would make the dense share
# three times a real Q4_K_M file's. Routing like real models (synth --routing-like): the 864 KiB
# model follows Qwen3-30B-A3B's co-activation profile, the 72 KiB model Qwen3-Next-80B's; all three
# reuse experts from token to token as the real Qwen3-30B-A3B trace does (the profile's default
# reuse target, mbolt/data/reuse_qwen3-30b-a3b.json: LRU hits at 16 / 27 / 51 slots and consecutive
# overlap at top-6, fitted at top-6 of their own routers; q72's 4 heads: 3 lag heads and the window).
MODELS = {
    "q864": dict(preset="qwen3-30b-a3b", n_layers=8, fast_random=True, dense_type="F16", routing_like=PROFILE_30B),
    # attention narrowed (4 heads of 128) so the dense share stays near a real model's (~5%): with
    # Qwen3-30B's 32 heads it was 26% of the file, more than a 25% budget (run 1)
    "q72": dict(preset="qwen3-30b-a3b", n_layers=16, n_experts=512, n_used=10, expert_ff=64, n_heads=4,
                n_kv_heads=1, head_dim=128, fast_random=True, dense_type="F16", routing_like=PROFILE_80B),
    # typed as llama-quantize types a Q4_K_M file (synth.mixes): the dense tensors quantized too
    "q4km": dict(preset="qwen3-30b-a3b", n_layers=8, fast_random=True, expert_type="Q4_K_M", dense_type="Q4_K_M",
                 routing_like=PROFILE_30B),
    # q4km with the attention of layers 1-7 (all zeros: only layer 0's carries the planted routing)
    # in the mix's types, as a real Q4_K_M types it, not F16: 268 of q4km's 313 MB of dense weights
    # were that F16 attention, where a real Q4_K_M file's attention is about a quarter of it
    "q4kmq": dict(preset="qwen3-30b-a3b", n_layers=8, fast_random=True, expert_type="Q4_K_M", dense_type="Q4_K_M",
                  routing_like=PROFILE_30B, typed_zero_attention=True),
    # Qwen3-Next-80B-A3B's routed experts at their real size, its co-activation profile
    "q512km": dict(preset="qwen3-30b-a3b", n_layers=8, n_experts=512, n_used=10, expert_ff=512, fast_random=True,
                   expert_type="Q4_K_M", dense_type="Q4_K_M", routing_like=PROFILE_80B),
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


# plain llama.cpp at its best: its readahead swept over 4 KiB-1 MiB in every workload (a short run per
# window, plain arms only), wide enough that the best window is inside the range, not on its edge
# (drives run 2 put plain's best on sata at 8 KiB, then the lower edge: 4 KiB, one page, was added)
READAHEADS = (1024, 512, 256, 128, 64, 32, 16, 8, 4)
SWEEP_TOKENS, SWEEP_ROUNDS = 64, 2  # the sweep picks plain's best; the figures are measured after it
AS_SHIPPED_KB = 128


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def paths(name: str) -> dict:
    d = BENCH / name
    return {"dir": d, "stock": d / "stock.gguf", "train": d / "train.mbtrace", "plan": d / "plan.json",
            "reorder": d / "reorder.gguf", "kernel": d / "reorder.kl.gguf"}


def limit_of(name: str, frac: float, what: str = "") -> tuple[dict, int, int]:
    """The model's files, its stock file's size and the memory limit at `frac` of it (logged)."""
    p = paths(name)
    size = p["stock"].stat().st_size
    ram = int(size * frac)
    log(f"{name}: {what}budget {100 * frac:.0f}% of {size / 2**30:.2f} GiB ({ram / 2**30:.2f} GiB)")
    return p, size, ram


def prepare(name: str) -> None:
    from mbolt.core.mbtrace import read_trace
    from mbolt.core.moe_map import moe_map
    from mbolt.core.plan import save_plan
    from mbolt.core.prompts import read_prompts
    from mbolt.synth.synth import SynthConfig, write_synth
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
    give_to_ordinary_user(p)
    log(name, "ready:", p["stock"].stat().st_size, "bytes")


def give_to_ordinary_user(p: dict) -> None:
    """The models belong to uid nobody, as a user's downloaded model is theirs: the ordinary-user
    arm can then see the page cache's residency of its file (ab_llama.check_ordinary_user); root's
    arms read them as before."""
    import pwd

    if os.geteuid() != 0:
        return  # the models are their maker's already
    try:
        user = pwd.getpwnam(ORDINARY_UID)
    except KeyError:
        return
    for k in ("stock", "reorder", "kernel"):
        if p[k].exists():  # a model without a layout has no reorder file
            os.chown(p[k], user.pw_uid, user.pw_gid)


# ---- one configuration ----


def compact(d: dict) -> dict:
    """The A/B result with each round's tokens as a hash (every arm's tokens are equal, or run_ab refused)."""
    for r in d["rounds"]:
        r.pop("generated", None)
    return d


def run_ab_config(name: str, arms: list[Arm], w: Workload, rounds: int, ram: int, seed: int, aa: bool,
                  drive: str = "") -> dict:
    p = paths(name)
    prompts = load_prompt_ids(str(p["stock"]), None, 1, engine="llama.cpp", forced=w.prompt, n_new=w.new,
                              followup=w.followup)
    res = run_ab(arms, mode="decode", engine="llama.cpp", rounds=rounds, prompts=prompts, n_new=w.new, ram=ram,
                 forced=w.prompt, followup=w.followup, n_ctx=w.n_ctx, seed=seed, aa=aa, drive=drive,
                 name=f"memlimit_{name}" + (f"_{drive}" if drive else ""),
                 progress=lambda d, t, r: log(f"  {d}/{t} {r.arm} r{r.round}: ttft {r.ttft_s:.1f} s, "
                                              f"{r.tokens / r.wall_s:.2f} tok/s"
                                              + (f", follow-up {r.followup_ttft_s:.2f} s" if r.followup_ttft_s else "")))
    return compact(res.to_dict())


def sweep_plain(name: str, arms: list[Arm], w: Workload, ram: int, seed: int, drive: str = "",
                tokens: int = SWEEP_TOKENS) -> dict:
    """plain llama.cpp's readahead swept (READAHEADS; a short run of `tokens` per window, plain arms
    only: it only picks the window that suits plain best). {window KiB: {"arms": {arm: decode tok/s,
    ttft}, "ab": the run}}."""
    out = {}
    for ra in READAHEADS:
        with readahead(paths(name)["stock"], ra) as held:
            log(f"  sweep: plain at readahead {held} KiB" + (f" ({drive})" if drive else ""))
            d = run_ab_config(name, arms, replace(w, new=tokens), SWEEP_ROUNDS, ram, seed, aa=False, drive=drive)
        out[held] = {"arms": {a.name: {"decode_tokens_per_s": row(d, a.name)["decode_tokens_per_s"],
                                       "ttft_s": row(d, a.name)["ttft_s"]} for a in arms}, "ab": d}
    return out


def sweep_summary(swept: dict, tokens: int = SWEEP_TOKENS) -> dict:
    return {"windows_kb": list(swept), "tokens": tokens, "rounds": SWEEP_ROUNDS,
            "plain": {str(ra): v["arms"] for ra, v in swept.items()}}


def json_default(o):
    return str(o) if isinstance(o, Path) else float(o)


def slots_of(d: dict, arm: str = "mbolt-stock") -> int | None:
    """The runtime's decode slots per layer (median over rounds, at the end of each)."""
    xs = [r["decode_slots"] for r in d["rounds"] if r["arm"] == arm and not r["rejected"] and r.get("decode_slots")]
    return int(np.median(xs)) if xs else None


_ROUTING: dict = {}


def routing_of(name: str, w: Workload):
    """The decode routing of the workload's text on the stock file (a Trace); the same text routes
    the same way, so it is recorded once per run."""
    from mbolt.runtime.measured import record_routing

    p = paths(name)
    key = (name, w.prompt, w.new)
    if key not in _ROUTING:
        prompts = load_prompt_ids(str(p["stock"]), None, 1, engine="llama.cpp", forced=w.prompt, n_new=w.new)
        _ROUTING[key] = record_routing(p["stock"], prompts, w.new, forced=w.prompt)
    return _ROUTING[key]


def bound_of(name: str, w: Workload, slots: int, compute_s: float, bandwidth: float) -> dict:
    """What the machine allows at this cache size: MIN's misses on the same routing (the fewest
    any cache of `slots` per layer could have, started full: the runtime decodes after a prompt
    pass that filled its cache), read at the drive's sequential bandwidth, overlapped with the warm
    compute time per token."""
    from mbolt.bench.bound import decode_bound, miss_bytes_per_token
    from mbolt.core.moe_map import moe_map

    mm = moe_map(paths(name)["stock"])
    routing = routing_of(name, w)
    per_layer = np.zeros(mm.n_layers)  # dense layers read no experts
    for l in mm.moe_layers:
        per_layer[l.index] = l.expert_bytes
    miss = miss_bytes_per_token(routing, slots, per_layer, prefilled=True)
    b = decode_bound(compute_s, miss, bandwidth)
    return {"slots": slots, "min_miss_bytes_per_token": miss, "min_start": "prefilled", "compute_s_per_token": compute_s,
            "bandwidth_bytes_per_s": bandwidth, "io_s_per_token": b.io_s, "tokens_per_s": b.tok_s, "limit": b.limit}



def kernel_of(name: str, source: str = "reorder") -> Path:
    """Where `prepare_kernel(name, source)` writes the kernel layout: SOURCE.kl.gguf beside the
    source (the reorder file's is paths()["kernel"])."""
    src = paths(name)[source]
    return src.with_name(src.stem + ".kl.gguf")


def prepare_kernel(name: str, source: str = "reorder") -> Path:
    """The `source` file ("reorder", or "stock" where a model has no reorder file) in this llama.cpp
    build's kernel layout (`mbolt repack`), beside it as SOURCE.kl.gguf; made once."""
    from mbolt.rewrite.kernel import write_kernel
    from mbolt.runtime.binding import lib
    from mbolt.runtime.kernel_load import this_build

    p, k = paths(name), kernel_of(name, source)
    if not k.exists():
        log(name, f"kernel layout (mbolt repack) of the {source} file")
        write_kernel(p[source], k, this_build(lib()))
        give_to_ordinary_user({**p, "kernel": k})
    return k


# The kernel layout's benchmark (scripts/bench_kernel.py) and its probes measure these: a
# 2,000-token prompt, then 256 fed tokens
KERNEL_WORKLOAD = Workload(2000, 256, 0)


def kernel_warm_arms(name: str) -> list[Arm]:
    p = paths(name)
    return [Arm("warm-mapped", str(p["stock"]), mode="os", warm=True),
            Arm("warm-repacked", str(p["stock"]), mode="os", warm=True, repacked=True),
            Arm("kernel-warm", str(p["kernel"]), warm=True),
            Arm("kernel-warm-rows", str(p["kernel"]), warm=True, io_threads=4, rows=True)]


def kernel_limited_arms(name: str) -> list[Arm]:
    p = paths(name)
    plain = Arm("plain", str(p["stock"]), mode="os")
    kernel = Arm("mbolt-kernel", str(p["kernel"]))
    return [plain, replace(plain, name="plain (A/A)", control_of="plain"), kernel,
            replace(kernel, name="mbolt-kernel (A/A)", control_of="mbolt-kernel"),
            Arm("mbolt-kernel-rows", str(p["kernel"]), io_threads=4, rows=True),
            Arm("mbolt-mapped", str(p["reorder"]), io_threads=4, asynchronous=True)]
