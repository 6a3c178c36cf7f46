"""A warm measurement on a bare llama.cpp context: one prompt pass, then one token per
llama_decode, the last logits of each kept (the exploratory probes' loop: scripts/probe_*.py)."""

from __future__ import annotations

import ctypes
import time

import numpy as np


def prompt_then_steps(L, ctx, ids: list[int], n_prompt: int) -> tuple[np.ndarray, float, float]:
    """Decode `ids[:n_prompt]` in one pass, then the rest one token at a time on `ctx` (a context of
    llama-cpp-python's low-level API whose batch holds n_prompt tokens). Returns the logits after the
    prompt and after each step, the prompt's seconds and the steps' seconds."""
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(L.llama_get_model(ctx)))

    def decode(chunk: list[int]) -> np.ndarray:
        arr = (ctypes.c_int32 * len(chunk))(*chunk)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(chunk))) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()

    t0 = time.perf_counter()
    out = [decode(ids[:n_prompt])]
    t1 = time.perf_counter()
    out += [decode([t]) for t in ids[n_prompt:]]
    return np.stack(out), t1 - t0, time.perf_counter() - t1


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
