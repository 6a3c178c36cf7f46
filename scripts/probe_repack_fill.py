"""Exploratory probe (issue 35; no results file): experts held in llama.cpp's repacked layout,
filled one expert at a time by the caller, as a streaming runtime would.

llama.cpp's default load puts Q4_0/Q4_K/IQ4_NL weights in the CPU backend's repack buffer
(anonymous memory, interleaved rows, faster kernels: `scripts/bench_repack.py`) and fills all of it
at load. Here the load's progress callback drops that buffer's pages as they are written
(MADV_DONTNEED: the load never holds more than one tensor), an eval callback finds the expert
tensors at the first graph, and each expert is then written through `ggml_backend_tensor_set` on
a view of its rows (the repack buffer repacks what it is given; an expert's rows keep their
offset). The logits are compared with llama.cpp's own repacked load, bit for bit.

    python scripts/probe_repack_fill.py $MBOLT_BENCH/memlimit/q864/stock.gguf

Binding-specific (llama-cpp-python 0.3.36): the ggml_tensor layout of runtime.binding, libggml's
public ggml_backend_tensor_set. Each mode runs in a process of its own.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MADV_DONTNEED = 4
N_PROMPT, N_DECODE = 512, 128


def big_anonymous_maps(min_bytes: int = 256 << 20) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for ln in f:
            parts = ln.split()
            a, b = (int(x, 16) for x in parts[0].split("-"))
            if b - a >= min_bytes and len(parts) < 6:  # no path: anonymous
                out.append((a, b))
    return out


def run(path: str, mode: str) -> dict:
    """mode "default": llama.cpp's own load (repacked at load); "filled": the buffer dropped at
    load, then every expert written one by one."""
    from gguf import GGUFReader

    from mbolt.runtime.arm import own_bytes
    from mbolt.runtime.binding import GgmlTensor, lib
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.kernel_load import find_weights

    L = lib()  # refuses a llama-cpp-python other than the one whose ggml_tensor layout this reads

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)
    def drop_as_loaded(progress, user):
        for a, b in big_anonymous_maps():
            libc.madvise(a, b - a, MADV_DONTNEED)
        return True

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    if mode == "filled":
        mp.progress_callback = drop_as_loaded
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise SystemExit(f"{path}: llama.cpp could not load the model")
    try:
        anon_load = own_bytes(("RssAnon:",))
        info = {t.name: int(t.data_offset) for t in GGUFReader(path).tensors}
        # the expert tensors, from the sources of a first graph's nodes (runtime.kernel_load)
        experts = find_weights(L, model, {name for name in info if name.endswith("_exps.weight")})
        fill_s, n, repack = 0.0, 0, []
        if mode == "filled":
            raw = np.memmap(path, dtype=np.uint8, mode="r")
            from mbolt.bench.warm_loop import repack_expert

            t0 = time.perf_counter()
            for name, ptr in experts.items():
                g = GgmlTensor.from_address(ptr)
                e_bytes = int(g.nb[2])
                for e in range(int(g.ne[2])):
                    # the expert's bytes land in memory first (as a runtime's read would), then only
                    # the repack is timed
                    src = np.array(raw[info[name] + e * e_bytes: info[name] + (e + 1) * e_bytes])
                    repack.append(repack_expert(ptr, g.data + e * e_bytes, e_bytes, src))
                    n += 1
            fill_s = time.perf_counter() - t0
        ids = [3 + i % 240 for i in range(N_PROMPT + N_DECODE)]
        # decoded as the commands decode: the runtime's driver (plain llama.cpp over this model), one
        # prompt pass of N_PROMPT tokens, then the rest fed one decode step each
        with open_driver(path, reads=False, evict=False, repacked=True, llama_model=model, n_ctx=1024,
                         n_ubatch=N_PROMPT, n_threads=2) as d:
            steps = d.decode(ids[:N_PROMPT], N_DECODE, fed=ids[N_PROMPT:])
            t0 = time.perf_counter()
            logits = [next(steps)[1]]
            t1 = time.perf_counter()
            logits += [lg for _, lg in steps]
            prompt_s, steps_s = t1 - t0, time.perf_counter() - t1
        logits = np.stack(logits)
        fill_mb = sum(int(GgmlTensor.from_address(p).nb[3]) for p in experts.values()) >> 20 if n else 0
    finally:
        L.llama_model_free(model)
    out = Path(f"/tmp/probe_repack_fill.{mode}.npy")
    np.save(out, logits)
    return {"mode": mode, "anon_after_load_mb": anon_load >> 20, "experts_filled": n, "fill_s": fill_s,
            "fill_mb": fill_mb,
            "prompt_tokens_per_s": N_PROMPT / prompt_s, "decode_tokens_per_s": N_DECODE / steps_s,
            "repack_s": sum(repack), "repack_us_per_expert": float(np.median(repack) * 1e6) if repack else 0.0,
            "logits": str(out)}


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--mode":
        print(json.dumps(run(sys.argv[3], sys.argv[2])))
        return 0
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a GGUF with repackable expert types (Q4_0, Q4_K, IQ4_NL)")
    if not ap.parse_args().model.is_file():
        ap.error(f"{sys.argv[1]}: no such file")
    res = {}
    for mode in ("default", "filled"):
        r = subprocess.run([sys.executable, __file__, "--mode", mode, sys.argv[1]], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"error: the {mode} run failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
            return 2
        res[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    a, b = (np.load(res[m]["logits"]) for m in ("default", "filled"))
    for m, r in res.items():
        print(f"{m}: anonymous memory after load {r['anon_after_load_mb']} MB; prompt {r['prompt_tokens_per_s']:.1f} "
              f"tok/s, decode {r['decode_tokens_per_s']:.2f} tok/s"
              + (f"; {r['experts_filled']} experts ({r['fill_mb']} MB) filled in {r['fill_s']:.2f} s, of which the "
                 f"repack {r['repack_s']:.2f} s ({r['repack_us_per_expert']:.0f} us per expert, median)"
                 if r["fill_s"] else ""))
    print(f"logits, {len(a)} positions: max |difference| {float(np.abs(a - b).max())}, "
          f"{'identical' if np.array_equal(a, b) else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
