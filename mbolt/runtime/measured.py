"""What the driver's measured loop (runtime.driver, `Driver.generate`) records: `StreamRun`, and the
decode routing llama.cpp computed in it (positions) as a Trace of ORIGINAL expert ids
(`routing_trace`, `record_routing`: what the predictor and `ab`'s held-out checks read); `TopkRows`,
the watcher that keeps every selection (the tracer's and llama.cpp parity's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from mbolt.core.moe_map import MoeMap


@dataclass
class StreamRun:
    """What one generation measured (prefill = the prompt, decode = the generated tokens)."""

    generated: list[list[int]]  # per prompt
    prefill_s: float = 0.0  # time to first token, summed over prompts
    decode_s: float = 0.0  # llama_decode wall time of the decode steps (dropping pages after them excluded)
    decode_tokens: int = 0
    io_s: float = 0.0  # decode: wall time of the explicit reads
    reads: int = 0  # decode: merged reads (plain: major faults)
    ops: int = 0
    bytes: int = 0
    useful_bytes: int = 0
    hits: int = 0
    misses: int = 0
    major_faults: int = 0
    device_bytes: int | None = None  # decode: /proc/self/io read_bytes delta
    prompt_tokens: int = 0
    prompt_passes: int = 0  # passes over the experts (prompts and follow-ups): ceil(tokens / n_ubatch) each
    prompt_bytes: int = 0  # read by the pass reader
    prompt_read_s: float = 0.0  # time with a pass read outstanding
    prompt_device_bytes: int | None = None
    prompt_major_faults: int = 0
    followup_s: float = 0.0  # a session's follow-up turn: time to its first token, summed over prompts
    followup_tokens: int = 0
    followup_bytes: int = 0  # read by the pass reader during the follow-up turns
    routing: list[dict] = field(default_factory=list)  # per decode step: {layer: positions}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("routing")
        return d


class TopkRows:
    """A driver's watcher (open_driver(watchers=...)): the top-k rows (positions) of every MoE layer
    in the llama_decodes since the last `take`, every row of a prompt's passes included."""

    def __init__(self):
        self.rows: dict[int, list[np.ndarray]] = {}

    def begin(self, phase, n_rows: int) -> None:
        pass

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        self.rows.setdefault(layer, []).append(rows)

    def end(self) -> None:
        pass

    def take(self) -> dict[int, np.ndarray]:
        """layer -> int32 [n_rows, k] in token order, and start afresh."""
        out = {li: np.concatenate(blocks) for li, blocks in self.rows.items()}
        self.rows = {}
        return out


def routing_trace(runs: list[StreamRun], mm: MoeMap):
    """The decode routing llama.cpp computed, as a Trace of ORIGINAL expert ids (for the predictor)."""
    from mbolt.core.trace import DECODE, Trace

    steps = [s for r in runs for s in r.routing]
    k = mm.n_used
    ex = np.full((len(steps), mm.n_layers, k), -1, np.int16)
    perm = mm.route_map.perm
    for t, st in enumerate(steps):
        for layer, pos in st.items():
            if layer < mm.n_layers:
                p = np.asarray(pos[:k], np.int64)
                ex[t, layer, : p.size] = perm[layer][p]
    n = len(steps)
    return Trace(n_layers=mm.n_layers, n_experts=mm.n_experts, k=k, experts=ex,
                 phase=np.full(n, DECODE, np.uint8), seq=np.zeros(n, np.int32), pos=np.arange(n, dtype=np.int32),
                 fingerprint=mm.source_fingerprint)


def record_routing(path, prompts: list[list[int]], n_new: int, mm: MoeMap | None = None, forced: int = 0):
    """Generate once warm (no reads, no eviction) with the callback recording the decode routing;
    returns it as a Trace (original ids). Deterministic (greedy or teacher-forced): every arm routes
    the same."""
    from mbolt.runtime.driver import open_driver

    with open_driver(path, reads=False, evict=False, record=True, mm=mm) as s:
        return routing_trace([s.generate(prompts, n_new, forced=forced)], s.mm)
