"""What the exploratory probes (scripts/probe_*.py) share: an expert repacked into llama.cpp's
rows through libggml (their decoding is the runtime's driver, `Driver.decode`)."""

from __future__ import annotations

import ctypes
import time

import numpy as np


def repack_expert(t_ptr: int, addr: int, slice_bytes: int, src: np.ndarray) -> float:
    """llama.cpp repacking one expert's stock bytes `src` into its rows at `addr`, through libggml's
    ggml_backend_tensor_set on a copy of the expert tensor `t_ptr` narrowed to that expert (the
    repack buffer repacks what it is given). Returns the seconds it took (the source already in
    memory: the repack alone)."""
    from mbolt.runtime.binding import GgmlTensor, ggml_library

    base = ggml_library()
    base.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    view = ctypes.create_string_buffer(512)
    ctypes.memmove(view, t_ptr, 400)  # the whole ggml_tensor, its extra (the repack traits) included
    v = GgmlTensor.from_buffer(view)
    v.ne[2], v.nb[3], v.data = 1, slice_bytes, addr
    src = np.ascontiguousarray(src)
    t0 = time.perf_counter()
    base.ggml_backend_tensor_set(ctypes.addressof(view), src.ctypes.data, 0, slice_bytes)
    return time.perf_counter() - t0
