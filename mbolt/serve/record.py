"""The routing of served traffic, as an .mbtrace that `mbolt plan` takes like any trace.

The recorder watches the driver's steps (runtime.driver: `begin`, every selection through
`on_topk`, `end`): the eval callback's rows are positions in the file, mapped to original experts
through the route map. A step is one graph: a prompt pass of one slot (one row per token; the last
MoE layer routes only the tokens whose logits are wanted), with a decode row of every replying
slot after its tokens when replies are under way, or a decode step (one row per replying slot);
the scheduler names the requests of the rows and how many of the last are decode rows (`rows`).
A token's sequence in the trace is its slot's request. Tokens are kept in memory up to `max_tokens` (the rest is not recorded),
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
        self._next_pos: dict[int, int] = {}
        self._step: dict[int, np.ndarray] = {}
        self._rows: list[int] = []
        self._decode_rows = 0  # the last rows of a prompt pass that are decode rows
        self._decode = False
        self._lock = threading.Lock()

    def rows(self, requests: list[int], decode_rows: int = 0) -> None:
        """The requests the rows of the next step belong to, and how many of the last rows of a
        prompt pass are replies' decode rows (the scheduler, before each step)."""
        self._rows, self._decode_rows = list(requests), int(decode_rows)

    def begin(self, phase, n_rows: int) -> None:
        from mbolt.runtime.driver import Phase

        self._decode = phase is Phase.DECODE
        self._step = {}

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        if layer < self.perm.shape[0]:
            self._step[layer] = self.perm[layer][np.asarray(rows, np.int64)].astype(np.int16)

    def end(self) -> None:
        step, self._step = self._step, {}
        n = max((r.shape[0] for r in step.values()), default=0)
        if n == 0 or self.n_tokens >= self.max_tokens:
            return
        n_keep = min(n, self.max_tokens - self.n_tokens)
        ex = np.full((n, self.mm.n_layers, self.mm.n_used), -1, np.int16)
        for layer, r in step.items():
            m, k = r.shape
            ex[n - m:, layer, :min(k, self.mm.n_used)] = r[:, :self.mm.n_used]  # the last rows are the last tokens
        reqs = self._rows if len(self._rows) == n else [self._rows[0] if self._rows else 0] * n
        pos = np.empty(n, np.int32)
        for i, q in enumerate(reqs):
            pos[i] = self._next_pos.get(q, 0)
            self._next_pos[q] = pos[i] + 1
        with self._lock:
            self._experts.append(ex[:n_keep])
            phase = np.full(n, DECODE if self._decode else PREFILL, np.uint8)
            phase[n - min(self._decode_rows, n):] = DECODE
            self._phase.append(phase[:n_keep])
            self._seq.append(np.asarray(reqs[:n_keep], np.int32))
            self._pos.append(pos[:n_keep])
            self.n_tokens += n_keep

    def begin_request(self) -> int:
        """A new request: its number (its sequence in the trace)."""
        self._request += 1
        return self._request

    def end_request(self) -> None:
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
