"""Exploratory probe (issue 55; not pre-registered, no results file): an agent's long prefix restored
from `mbolt serve --prompt-cache` after a restart, under a real memory limit.

The workload of issue 55's agent benchmark on one model: a prefix of PREFIX tokens of real text
(the held-out text of bench_serve.py; a system prompt and tool schemas stand for it), then a
200-token user turn, then a 256-token reply (sampled at temperature 1 with a fixed seed,
`ignore_eos`), through /v1/completions (the bench models have no chat template: the whole prompt is
the saved prefix). Per round, each server a fresh process in a memory cgroup of 40% of the file,
the model's pages dropped first:
  cold      an empty cache directory: prefix + turn A evaluated (and saved when the reply ends);
  restored  the server restarted on that directory, the cache file's pages dropped too: prefix +
            turn B, its prefix read back from the file;
  warm      no limit, the file in memory: prefix + turn A once, then prefix + turn B, whose 200
            new tokens are the compute a restore cannot avoid.
The bound of a restore: the cache file at the drive's sequential rate (measured on the model file,
cold) plus the warm arm's time to first token.

    python scripts/probe_agent_prefix.py [--model q4km] [--rounds 2] [--prefix 8000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serve import Served, bench_model, log, session_text_ids  # noqa: E402
from mbolt.core.memlimit import MemoryGroup  # noqa: E402
from mbolt.core.pagecache import evict  # noqa: E402

TURN, REPLY, SEED = 200, 256, 1234


def drive_rate(path: Path, n: int = 1 << 30) -> float:
    """Bytes per second of a cold sequential read of the first `n` bytes of `path` (8 MiB reads)."""
    evict(path)
    t0, done = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while done < n:
            b = f.read(8 << 20)
            if not b:
                break
            done += len(b)
    rate = done / (time.perf_counter() - t0)
    evict(path)
    return rate


def arm(model: Path, ram: int | None, cache: Path, prompts: list[list[int]], ctx: int) -> list[dict]:
    """One server on `cache`, the prompts one after the other. `ram` None: warm (no limit, the
    file read into memory first); else in a memory group of `ram` bytes, the model's and the cache
    files' pages dropped first."""
    import contextlib
    import subprocess

    evict(model)
    for f in cache.glob("*"):
        evict(f)
    if ram is None:
        subprocess.run(["cat", str(model)], stdout=subprocess.DEVNULL, check=True)
    out = []
    with contextlib.ExitStack() as stack:
        g = stack.enter_context(MemoryGroup(ram)) if ram is not None else None
        srv = Served(model, False, g, ctx=ctx, extra=("--prompt-cache", str(cache)))
        try:
            for p in prompts:
                r = srv.turn(p, REPLY, SEED)
                r.pop("text")
                r["stats"] = {k: v for k, v in srv.metrics().items() if "prompt" in k or "cached" in k}
                out.append(r)
        finally:
            err = srv.stop()
    if "Traceback" in err:
        raise SystemExit(err[-2000:])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="q4km")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=8000)
    a = ap.parse_args()
    import llama_cpp

    model, size, ram = bench_model(a.model)
    log("llama.cpp:", llama_cpp.llama_print_system_info().decode().strip())
    ids = session_text_ids(model, a.prefix + 2 * TURN)
    prefix = ids[:a.prefix]
    turn_a, turn_b = ids[a.prefix:a.prefix + TURN], ids[a.prefix + TURN:a.prefix + 2 * TURN]
    ctx = a.prefix + TURN + REPLY + 64
    rate = drive_rate(model)
    log(f"{model.name}: {size >> 20} MiB, budget {ram >> 20} MiB, drive {rate / 1e9:.2f} GB/s sequential (cold)")
    rows = []
    for r in range(a.rounds):
        d = Path(tempfile.mkdtemp(prefix="agent-cache-"))
        try:
            cold = arm(model, ram, d, [prefix + turn_a], ctx)[0]
            files = sorted(d.glob("*.kv"))
            kv = sum(f.stat().st_size for f in files)
            restored = arm(model, ram, d, [prefix + turn_b], ctx)[0]
        finally:
            shutil.rmtree(d, ignore_errors=True)
        d = Path(tempfile.mkdtemp(prefix="agent-warm-"))
        try:
            warm = arm(model, None, d, [prefix + turn_a, prefix + turn_b], ctx)[1]
        finally:
            shutil.rmtree(d, ignore_errors=True)
        bound = kv / rate + warm["ttft_s"]
        row = {"round": r, "cold": cold, "restored": restored, "warm_200": warm, "cache_files": len(files),
               "kv_bytes": kv, "drive_bytes_per_s": rate, "bound_s": bound,
               "restored_over_cold": restored["ttft_s"] / cold["ttft_s"], "restored_over_bound": restored["ttft_s"] / bound,
               "decode_restored_over_cold": restored["decode_tokens_per_s"] / cold["decode_tokens_per_s"]}
        rows.append(row)
        log(f"round {r}: cold ttft {cold['ttft_s']:.2f} s, restored {restored['ttft_s']:.2f} s "
            f"({row['restored_over_cold']:.3f}x cold, {row['restored_over_bound']:.2f}x the bound {bound:.2f} s: "
            f"{kv >> 20} MiB of KV + warm 200 tokens {warm['ttft_s']:.2f} s); decode {cold['decode_tokens_per_s']:.2f} "
            f"-> {restored['decode_tokens_per_s']:.2f} tok/s; cached tokens "
            f"{restored['stats'].get('cached_tokens', '?')}")
    print(json.dumps(rows, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
