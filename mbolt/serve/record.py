"""The routing of served traffic, as an .mbtrace that `mbolt plan` takes like any trace.

The recorder sees every expert selection llama.cpp computes (the eval callback's rows, positions
in the file, mapped to original experts through the route map). A step is one graph: a prompt
pass (one row per token; the last MoE layer routes only the tokens whose logits are wanted) or a
decode step (one row). Tokens are kept in memory up to `max_tokens` (the rest is not recorded),
and after every request the whole trace is written atomically (temporary file, fsync, rename), so
the file is complete and readable at any moment while the server runs.
"""

from __future__ import annotations

import threading

import numpy as np

from mbolt.core.trace import DECODE, PREFILL, Trace


class RoutingRecorder:
    def __init__(self, path, mm, max_tokens: int = 100_000):
        self.path = path
        self.mm = mm
        self.max_tokens = int(max_tokens)
        self.perm = mm.route_map.perm
        self._experts: list[np.ndarray] = []  # [n, L, k] blocks
        self._phase: list[np.ndarray] = []
        self._seq: list[np.ndarray] = []
        self._pos: list[np.ndarray] = []
        self.n_tokens = 0
        self._request = -1
        self._next_pos = 0
        self._step: dict[int, np.ndarray] = {}
        self._prev_layer = 1 << 30
        self._lock = threading.Lock()

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        if layer >= self.perm.shape[0]:
            return
        if layer <= self._prev_layer and self._step:
            self._close_step()
        self._prev_layer = layer
        self._step[layer] = self.perm[layer][np.asarray(rows, np.int64)].astype(np.int16)

    def _close_step(self) -> None:
        step, self._step = self._step, {}
        n = max(r.shape[0] for r in step.values())
        if n == 0 or self.n_tokens >= self.max_tokens:
            return
        n_keep = min(n, self.max_tokens - self.n_tokens)
        ex = np.full((n, self.mm.n_layers, self.mm.n_used), -1, np.int16)
        for layer, r in step.items():
            m, k = r.shape
            ex[n - m:, layer, :min(k, self.mm.n_used)] = r[:, :self.mm.n_used]  # the last rows are the last tokens
        pos = np.arange(self._next_pos, self._next_pos + n, dtype=np.int32)
        self._next_pos += n
        with self._lock:
            self._experts.append(ex[:n_keep])
            self._phase.append(np.full(n_keep, PREFILL if n > 1 else DECODE, np.uint8))
            self._seq.append(np.full(n_keep, max(self._request, 0), np.int32))
            self._pos.append(pos[:n_keep])
            self.n_tokens += n_keep

    def begin_request(self) -> None:
        self._request += 1
        self._next_pos = 0

    def end_request(self) -> None:
        if self._step:
            self._close_step()
        self._prev_layer = 1 << 30
        self.flush()

    def trace(self) -> Trace:
        with self._lock:
            if self._experts:
                ex, ph = np.concatenate(self._experts), np.concatenate(self._phase)
                seq, pos = np.concatenate(self._seq), np.concatenate(self._pos)
            else:
                ex = np.zeros((0, self.mm.n_layers, self.mm.n_used), np.int16)
                ph, seq, pos = np.zeros(0, np.uint8), np.zeros(0, np.int32), np.zeros(0, np.int32)
        return Trace(self.mm.n_layers, self.mm.n_experts, self.mm.n_used, ex, ph, seq, pos,
                     fingerprint=self.mm.source_fingerprint,
                     notes=["routing of the traffic `mbolt serve` served (original expert ids)"])

    def flush(self) -> None:
        from mbolt.core.mbtrace import write_trace

        write_trace(self.path, self.trace(), force=True)
