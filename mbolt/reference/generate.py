"""The numpy reference engine's greedy decoding: `greedy_decode` over its `forward` (the loop of the
reference tracer and of `routing_parity`), and `generate` (`mbolt generate --engine reference`) on
top of it. llama.cpp decodes through runtime/driver.py alone (`Driver.decode`, `Driver.generate`,
and the server's turn over the driver's steps)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mbolt.reference.arch import load_model
from mbolt.reference.model import Model
from mbolt.reference.tokenizer import Tokenizer
from mbolt.core.errors import MboltError


@dataclass
class Step:
    index: int  # 0 = the prefill, i = the forward that fed the i-th generated token
    fed: list[int]  # the ids this forward consumed
    out: Any  # what forward returned (logits, or a tuple whose first item is the logits)
    next_token: int  # the greedy choice from these logits: what the next forward feeds


def last_logits(out) -> np.ndarray:
    """The last position's logits of a forward's result (a tuple's first item; last row of 2-D)."""
    logits = np.asarray(out[0] if isinstance(out, tuple) else out)
    return logits[-1] if logits.ndim > 1 else logits


def greedy_decode(forward: Callable[[list[int]], Any], prompt_ids: list[int], n_new: int, *,
                  eos: int | None = None) -> Iterator[Step]:
    """Prefill `prompt_ids`, then feed back the argmax `n_new` times; yields a Step after every
    forward (1 + n_new of them, fewer when the greedy token is `eos`: it is not fed).

    forward(ids) runs ids after everything fed so far (the caller owns the cache/context) and
    returns the last token's logits, or a tuple whose first item is them (the rest, e.g. routing,
    rides along in Step.out). Stop early by breaking out of the loop."""
    fed = list(prompt_ids)
    for i in range(n_new + 1):
        out = forward(fed)
        nxt = int(np.argmax(last_logits(out)))
        yield Step(i, fed, out, nxt)
        if i == n_new or (eos is not None and nxt == eos):
            return
        fed = [nxt]


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
    t1 = None
    out: list[int] = []
    # n_tokens greedy tokens take n_tokens - 1 forwards after the prefill: the last one is not fed
    steps = greedy_decode(lambda ids: m.forward(ids, cache), prompt_ids, max(n_tokens - 1, 0),
                          eos=tok.eos if stop_at_eos else None)
    for st in steps:
        if t1 is None:
            t1 = time.perf_counter()
        if len(out) == n_tokens:
            break
        out.append(st.next_token)
        if on_token is not None:
            on_token(len(out) - 1, st.next_token)
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
