"""Greedy generation with the reference engine (what `mbolt generate` runs)."""

from __future__ import annotations

import os
import time

import numpy as np

from mbolt.engine.model import Model, load_model
from mbolt.engine.tokenizer import Tokenizer
from mbolt.core.errors import MboltError


def generate(model: Model | str | os.PathLike, prompt: str, n_tokens: int = 32, *,
             stop_at_eos: bool = True, on_token=None) -> dict:
    """Greedy decode `n_tokens` after `prompt`; returns ids, text and timings.

    on_token(i, token_id) is called after every generated token (for progress bars).
    """
    if n_tokens < 0:
        raise MboltError(f"-n must be >= 0, got {n_tokens}")
    m = model if isinstance(model, Model) else load_model(model)
    tok = Tokenizer.from_header(m.header)
    prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        raise MboltError("the prompt is empty (no tokens)")
    cache = m.new_cache()
    t0 = time.perf_counter()
    logits = m.forward(prompt_ids, cache)
    t1 = time.perf_counter()
    out: list[int] = []
    for i in range(n_tokens):
        nxt = int(np.argmax(logits))
        out.append(nxt)
        if on_token is not None:
            on_token(i, nxt)
        if (stop_at_eos and nxt == tok.eos) or i == n_tokens - 1:
            break
        logits = m.forward([nxt], cache)
    t2 = time.perf_counter()
    decode_steps = max(len(out) - 1, 0)  # forwards after the prefill
    return {
        "prompt_ids": prompt_ids,
        "ids": out,
        "text": tok.decode(out),
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tokens_per_s": len(prompt_ids) / (t1 - t0) if t1 > t0 else 0.0,
        "decode_tokens_per_s": decode_steps / (t2 - t1) if decode_steps and t2 > t1 else 0.0,
    }
