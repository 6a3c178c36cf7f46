"""The in-memory trace: which experts every token routed to, at every layer.

This dataclass is the contract between the tracer/importers (which produce it) and the
planner, predictor and cache replay (which consume it). The on-disk `.mbtrace` format lives in
`mbolt/trace/format.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PREFILL = 0
DECODE = 1


@dataclass
class Trace:
    n_layers: int  # layers in the model (MoE or not); dense layers are all -1
    n_experts: int
    k: int  # experts used per token
    experts: np.ndarray  # int16 [N, n_layers, k], rank order; -1 where not recorded / dense
    phase: np.ndarray  # uint8 [N]: PREFILL or DECODE
    seq: np.ndarray  # int32 [N]: sequence (prompt) id
    pos: np.ndarray  # int32 [N]: token position within its sequence
    weights: np.ndarray | None = None  # float32 [N, n_layers, k] routing weights, optional
    domains: dict[int, str] = field(default_factory=dict)  # seq id -> domain tag
    fingerprint: str = ""  # source model fingerprint (hex), "" when unknown (imports)
    notes: list[str] = field(default_factory=list)  # what importers dropped or flagged

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    def select(self, mask: np.ndarray) -> "Trace":
        """The sub-trace of the tokens where `mask` is true (same header)."""
        return Trace(
            self.n_layers, self.n_experts, self.k, self.experts[mask], self.phase[mask],
            self.seq[mask], self.pos[mask],
            None if self.weights is None else self.weights[mask],
            dict(self.domains), self.fingerprint, list(self.notes),
        )

    def moe_layers(self) -> np.ndarray:
        """Indices of layers where at least one token has a recorded routing."""
        return np.flatnonzero((self.experts >= 0).any(axis=(0, 2)))
