"""Warm decode tokens/s: the numpy reference engine vs llama.cpp on the same synthetic file.

Both engines run in one invocation, side by side, with the same thread count (numpy's BLAS is
pinned through OPENBLAS/OMP/MKL_NUM_THREADS before numpy is imported), at two geometries:
  tiny      the test geometry (SynthConfig defaults: 4 layers x 8 experts, k=2, hidden 64)
  qwen3-30b Qwen3-30B-A3B shapes (hidden 2048, 128 experts, k=8, expert_ff 768, 32/4 heads x 128)
            scaled to a few layers, Q4_0 experts, fast_random weights (routing is random-ish,
            the arithmetic is the same).
Warm: a short prompt is prefilled and a few decode steps are run before the timed decode steps.
A cProfile of the reference engine's decode says where its time goes. -> results/engine.json

usage: python scripts/bench_engine.py [--threads 1] [--layers 2] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--tokens", type=int, default=16)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--out", default="results/engine.json")
args = ap.parse_args()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402

import numpy as np  # noqa: E402

from mbolt.bench.env import engine_builds  # noqa: E402
from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.reference import load_model  # noqa: E402
from mbolt.synth.synth import SynthConfig, write_synth  # noqa: E402
from mbolt.runtime.driver import open_driver  # noqa: E402

PROMPT = [116, 104, 101, 32, 116, 105, 110, 32]  # "the tin "


def geometries(layers: int) -> dict[str, SynthConfig]:
    return {
        "tiny": SynthConfig(expert_type="Q4_0", seed=1),
        "qwen3-30b-a3b-shaped": SynthConfig.from_preset("qwen3-30b-a3b", n_layers=layers, fast_random=True, seed=1),
    }


def decode_ref(m, n_warm, n):
    cache = m.new_cache()
    logits = m.forward(PROMPT, cache)
    for _ in range(n_warm):
        logits = m.forward([int(np.argmax(logits))], cache)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = m.forward([int(np.argmax(logits))], cache)
    return n / (time.perf_counter() - t0)


def decode_llama(d, n_warm, n):
    """The driver's greedy loop (Driver.decode: the prompt pass, then decode steps), as the
    commands run it; timed from the end of the warm-up steps."""
    d.forget()
    t0 = time.perf_counter()
    for i, _ in enumerate(d.decode(PROMPT, n_warm + n)):
        if i == n_warm:
            t0 = time.perf_counter()
    return n / (time.perf_counter() - t0)


# where decode time goes: cumulative time of these functions over the profiled decode steps,
# as a share of Model.forward's (they nest: expert ⊃ dequantize + linear, attn ⊃ linear, ...)
PARTS = {
    "forward": "total", "expert": "experts: dequantize + matmuls", "dequantize": "dequantize (experts)",
    "fetch": "expert fetch (mmap slices)", "linear": "all matmuls incl. activation rounding",
    "round_activations": "activation rounding (Q8_0)", "attn": "attention block (qkv, rope, softmax, out)",
    "router_logits": "router logits", "select": "softmax + top-k", "rms_norm": "norms",
}


def profile_ref(m, n):
    cache = m.new_cache()
    logits = m.forward(PROMPT, cache)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        logits = m.forward([int(np.argmax(logits))], cache)
    pr.disable()
    cum = {}
    for (file, line, fn), (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items():
        if fn in PARTS and "mbolt" in file:
            cum[fn] = cum.get(fn, 0.0) + ct
    total = cum.get("forward", 1e-12)
    share = {PARTS[k]: round(v / total, 3) for k, v in sorted(cum.items(), key=lambda kv: -kv[1]) if k != "forward"}
    return share, total / n


def main() -> None:
    res = {"threads": args.threads, "decode_tokens": args.tokens, "warmup_tokens": args.warmup,
           "prompt_tokens": len(PROMPT), "kv_cache": "llama.cpp default (F16); engine F32",
           "engines": engine_builds(), "geometries": {}}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for name, cfg in geometries(args.layers).items():
            path = Path(tmp) / f"{name}.gguf"
            t0 = time.perf_counter()
            write_synth(path, cfg)
            size = path.stat().st_size
            print(f"{name}: wrote {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
            m = load_model(path)
            # plain llama.cpp with its default load (the repacked kernels), as before the driver ran it
            with open_driver(path, reads=False, evict=False, repacked=True, n_ctx=256, n_threads=args.threads) as d:
                # side by side, alternating, two rounds each
                ref, lla = [], []
                for _ in range(2):
                    ref.append(decode_ref(m, args.warmup, args.tokens))
                    lla.append(decode_llama(d, args.warmup, args.tokens))
            prof, sec_per_tok = profile_ref(m, max(2, args.tokens // 4))
            g = {
                "file_bytes": size, "n_layers": cfg.n_layers, "n_experts": cfg.n_experts, "k": cfg.n_used,
                "hidden": cfg.hidden, "expert_ff": cfg.expert_ff, "heads": [cfg.n_heads, cfg.n_kv_heads, cfg.head_dim],
                "expert_type": cfg.expert_type,
                "reference_tok_s": round(float(np.median(ref)), 2), "llama_cpp_tok_s": round(float(np.median(lla)), 2),
                "reference_runs": [round(x, 2) for x in ref], "llama_cpp_runs": [round(x, 2) for x in lla],
                "ratio_reference_over_llama": round(float(np.median(ref) / np.median(lla)), 3),
                "reference_profile_share": prof,
                "reference_profiled_s_per_token": round(sec_per_tok, 4),
            }
            res["geometries"][name] = g
            print(json.dumps({name: g}, indent=1), flush=True)
            m.close()
    out = ROOT / args.out
    out.parent.mkdir(exist_ok=True)
    write_text_atomic(out, json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
