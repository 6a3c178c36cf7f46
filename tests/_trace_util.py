"""Tiny hand-written routing traces for the cache-replay and bound tests."""

from __future__ import annotations

import numpy as np

from mbolt.core.trace import DECODE, Trace


def make_trace(per_token, n_layers=1, n_experts=4):
    """per_token: list of tokens, each a list (one per layer) of expert lists."""
    k = max(1, max(len(x) for tok in per_token for x in tok))
    ex = np.full((len(per_token), n_layers, k), -1, np.int16)
    for t, tok in enumerate(per_token):
        for l, es in enumerate(tok):
            ex[t, l, : len(es)] = es
    n = len(per_token)
    return Trace(n_layers, n_experts, k, ex, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32),
                 np.arange(n, dtype=np.int32))
