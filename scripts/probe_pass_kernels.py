"""Exploratory probe (issue 54; not pre-registered, no results file): can a kernel-layout file's
experts be computed by llama.cpp's kernels for the stock layout, for one pass?

A native build prompts faster on its kernels for the stock layout than on its repacked ones (at
full depth the mapped runtime's 2,000-token prompt took 55 s where the kernel layout's took 87 s,
docs/results.md), and decodes faster on the repacked ones. llama.cpp's CPU backend picks a matrix
product's kernel from its weight's buffer and `extra` (the repack traits) at compute time. So a pass
could point each expert tensor at its stock bytes (core.repack.unrepack of what the file holds) in a
plain CPU buffer with no traits, and point it back after.

The probe writes a small Q4_K_M model and its kernel layout, loads the kernel layout filled
(runtime.kernel_load), and compares the logits of a 16-token pass and 8 decode steps:
  1. as loaded: llama.cpp's repacked load of the stock file, bit for bit (as tests/test_kernel_layout.py);
  2. every repacked expert tensor pointed at its un-repacked bytes in the token embedding's buffer
     (a plain CPU buffer), `extra` cleared: llama.cpp's mapped load of the stock file, bit for bit?
  3. pointed back: the repacked load's again?

    python scripts/probe_pass_kernels.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IDS = [3 + (7 * i) % 200 for i in range(24)]


def logits(stock: Path, model) -> np.ndarray:
    """A 16-token pass, then 8 one-token steps, on the runtime's driver (plain llama.cpp over
    `model`, the stock file's map describing it): the logits of each."""
    from mbolt.runtime.driver import open_driver

    with open_driver(str(stock), reads=False, evict=False, repacked=True, llama_model=model, n_ctx=64,
                     n_ubatch=16, n_threads=2) as d:
        return np.stack([lg for _, lg in d.decode(IDS[:16], len(IDS) - 16, fed=IDS[16:])])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where the small model is written (default: a temporary folder)")
    a = ap.parse_args(argv)

    from mbolt.core.repack import layout_of, this_build, unrepack
    from mbolt.rewrite.kernel import write_kernel
    from mbolt.runtime.binding import GgmlTensor, lib
    from mbolt.runtime.kernel_load import load_kernel_model
    from mbolt.synth.config import SynthConfig
    from mbolt.synth.synth import write_synth

    class TensorExtra(ctypes.Structure):  # ggml_tensor's prefix, then `extra` (after name)
        _fields_ = GgmlTensor._fields_ + [("extra", ctypes.c_void_p)]

    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or Path(tmp)
        cfg = SynthConfig(n_layers=2, n_experts=32, n_used=4, hidden=1024, expert_ff=512, n_heads=8, n_kv_heads=2,
                          head_dim=128, expert_type="Q4_K_M", dense_type="F16", fast_random=True, expert_gain=16.0)
        stock = write_synth(d / "m.gguf", cfg)
        kl = d / "m.kl.gguf"
        write_kernel(stock, kl, this_build())
        L = lib()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = False
        m = L.llama_model_load_from_file(str(stock).encode(), mp)
        mapped = logits(stock, m)
        L.llama_model_free(m)
        m = L.llama_model_load_from_file(str(stock).encode(), L.llama_model_default_params())
        repacked = logits(stock, m)
        L.llama_model_free(m)

        km = load_kernel_model(kl)
        try:
            km.fill_all()
            as_loaded = logits(stock, km.model)
            plain_buffer = TensorExtra.from_address(km.places["token_embd.weight"].tensor).buffer
            build, held, saved = this_build(), [], []
            for t in km.kernel.header.tensors:
                r = layout_of(t.name, tuple(t.ne), t.type, build)
                if "_exps." not in t.name or r is None:
                    continue
                p = km.places[t.name]
                x = TensorExtra.from_address(p.tensor)
                buf = np.empty(p.nbytes + 64, np.uint8)
                off = (-buf.ctypes.data) % 64
                buf[off:off + p.nbytes] = unrepack(np.frombuffer(ctypes.string_at(p.addr, p.nbytes), np.uint8), r, t.ne[0])
                held.append(buf)
                saved.append((x, x.data, x.buffer, x.extra))
                x.data, x.buffer, x.extra = buf.ctypes.data + off, plain_buffer, None
            swapped = logits(stock, km.model)
            for x, data, buffer, extra in saved:
                x.data, x.buffer, x.extra = data, buffer, extra
            back = logits(stock, km.model)
        finally:
            km.close()
    print(f"llama.cpp's two loads of the stock file differ by up to {np.abs(mapped - repacked).max():.4g} in a logit")
    print(f"1. the kernel layout as loaded = the repacked load, bit for bit: {np.array_equal(as_loaded, repacked)}")
    print(f"2. {len(saved)} expert tensors pointed at their stock bytes in a plain buffer = the mapped load, "
          f"bit for bit: {np.array_equal(swapped, mapped)}")
    print(f"3. pointed back = the repacked load again, bit for bit: {np.array_equal(back, repacked)}")
    return 0 if np.array_equal(as_loaded, repacked) and np.array_equal(swapped, mapped) and np.array_equal(back, repacked) else 1


if __name__ == "__main__":
    sys.exit(main())
