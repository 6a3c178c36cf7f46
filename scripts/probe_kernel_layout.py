"""Exploratory probe (issue 54; not pre-registered, no results file): a kernel-layout file in
llama.cpp's own buffers against llama.cpp's loads of the stock file, warm.

Arms, each a fresh process, in this order per round:
- mapped:   the stock file mapped, repacking off (the runtime's path today);
- repacked: llama.cpp's default load of the stock file (repacked at load, on the CPU);
- kernel:   the kernel-layout file (`mbolt repack`) loaded through runtime.kernel_load and filled
            with plain reads (no repacking).
Each: load, a 256-token prompt in one pass, then 48 one-token decodes (2 threads). The kernel arm's
logits are compared with the repacked arm's, bit for bit. Then, per expert of one layer's gate
tensor: the time to put it in place from the kernel-layout file (a read into its rows) against
llama.cpp's repack of the stock bytes (`ggml_backend_tensor_set` on a view of its rows), both
from memory already read: what a miss costs on the CPU beyond its read.

    python scripts/probe_kernel_layout.py STOCK.gguf KERNEL.gguf [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_PROMPT, N_DECODE, THREADS = 256, 48, 2


def _measure(stock: str, model) -> tuple[np.ndarray, float, float, float]:
    """The prompt in one pass, then one decode step per token, on the runtime's driver (plain
    llama.cpp over `model`, the stock file's map describing it)."""
    from mbolt.runtime.driver import open_driver

    ids = [3 + (7 * i) % 240 for i in range(N_PROMPT + N_DECODE)]
    with open_driver(stock, reads=False, evict=False, repacked=True, llama_model=model, n_ctx=1024,
                     n_ubatch=N_PROMPT, n_threads=THREADS) as d:
        steps = d.decode(ids[:N_PROMPT], N_DECODE, fed=ids[N_PROMPT:])
        c0, t0 = time.process_time(), time.perf_counter()
        logits = [next(steps)[1]]
        t1 = time.perf_counter()
        logits += [lg for _, lg in steps]
        t2 = time.perf_counter()
        cpu = time.process_time() - c0
    return np.stack(logits), N_PROMPT / (t1 - t0), N_DECODE / (t2 - t1), cpu / (N_PROMPT + N_DECODE)


def _expert_costs(km, stock: str) -> dict:
    """Per expert of blk.0's gate: a read into its rows from the kernel file (page cache) against
    llama.cpp's repack of the stock bytes through ggml_backend_tensor_set."""
    from gguf import GGUFReader

    from mbolt.bench.warm_loop import repack_expert

    name = next(n for n in km.places if n.endswith("ffn_gate_exps.weight") and n.startswith("blk.0."))
    if name not in km.kernel.layouts:
        return {}
    p = km.places[name]
    n_exp = next(t.ne[2] for t in km.kernel.header.tensors if t.name == name)
    slice_bytes = p.nbytes // n_exp
    info = {t.name: int(t.data_offset) for t in GGUFReader(stock).tensors}
    raw = np.memmap(stock, dtype=np.uint8, mode="r")
    # the ggml_tensor of `name`, found again on a tiny graph (kernel_load keeps addresses only)
    from mbolt.runtime.kernel_load import find_weights

    t_ptr = find_weights(km.L, km.model, {name})[name]
    reads, repacks = [], []
    for e in range(n_exp):
        km.fill(name, e * slice_bytes, slice_bytes)  # warm the page cache: time the copy alone
        ta = time.perf_counter()
        km.fill(name, e * slice_bytes, slice_bytes)
        reads.append(time.perf_counter() - ta)
        src = np.array(raw[info[name] + e * slice_bytes: info[name] + (e + 1) * slice_bytes])
        repacks.append(repack_expert(t_ptr, p.addr + e * slice_bytes, slice_bytes, src))
    km.fill(name)  # the kernel file's bytes again (the repack wrote the same ones)
    return {"expert_bytes": slice_bytes, "read_into_rows_us": float(np.median(reads) * 1e6),
            "repack_us": float(np.median(repacks) * 1e6), "experts": int(n_exp)}


def run_arm(arm: str, stock: str, kernel: str) -> dict:
    from mbolt.runtime.arm import own_bytes
    from mbolt.runtime.binding import lib, quiet, set_fields

    L = lib()
    quiet(L)
    L.llama_backend_init()
    rec: dict = {"arm": arm}
    t0, c0 = time.perf_counter(), time.process_time()
    km = None
    if arm == "kernel":
        from mbolt.runtime.kernel_load import load_kernel_model

        km = load_kernel_model(kernel)
        rec["anon_after_load_mb"] = own_bytes(("RssAnon:",)) >> 20
        f0, fc = time.perf_counter(), time.process_time()
        rec["fill_mb"] = km.fill_all() >> 20
        rec["fill_s"], rec["fill_cpu_s"] = time.perf_counter() - f0, time.process_time() - fc
        model = km.model
    else:
        mp = L.llama_model_default_params()
        set_fields(mp, n_gpu_layers=0)
        if arm == "mapped":
            set_fields(mp, load_mode=L.LLAMA_LOAD_MODE_MMAP, use_extra_bufts=False)
        model = L.llama_model_load_from_file(stock.encode(), mp)
    rec["load_s"], rec["load_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    logits, rec["prompt_tok_s"], rec["decode_tok_s"], rec["cpu_s_per_token"] = _measure(stock, model)
    rec["anon_mb"] = own_bytes(("RssAnon:",)) >> 20
    if km is not None:
        rec["per_expert"] = _expert_costs(km, stock)
    out = Path(f"/tmp/probe_kernel_layout.{arm}.npy")
    np.save(out, logits)
    rec["logits"] = str(out)
    return rec


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--arm":
        print(json.dumps(run_arm(*sys.argv[2:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stock")
    ap.add_argument("kernel")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    import llama_cpp

    print("llama.cpp:", llama_cpp.llama_print_system_info().decode().strip())
    rows = []
    for r in range(a.rounds):
        for arm in ("mapped", "repacked", "kernel"):
            p = subprocess.run([sys.executable, __file__, "--arm", arm, a.stock, a.kernel], capture_output=True,
                               text=True)
            if p.returncode != 0:
                print(f"error: the {arm} arm failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
                return 2
            rec = json.loads(p.stdout.strip().splitlines()[-1])
            rec["round"] = r
            rows.append(rec)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}))
        same = np.array_equal(np.load("/tmp/probe_kernel_layout.kernel.npy"),
                              np.load("/tmp/probe_kernel_layout.repacked.npy"))
        print(f"round {r}: kernel logits {'identical to' if same else 'DIFFERENT from'} the repacked load's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
