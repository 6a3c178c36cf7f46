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
