"""`mbolt trace-stats`: what a routing trace looks like, per layer (rendered by
report.layout_tables.trace_stats_renderables).

* tokens (prefill / decode), sequences, domain tags;
* heat entropy per layer: H = -sum p_e log2 p_e over the share p_e of routed slots that went to
  expert e, in bits and normalised by log2(E) (1 = perfectly even heat, 0 = one expert);
* lift of co-activated pairs: lift(i, j) = P(i, j) / (P(i) P(j)), with P over the tokens routed
  at that layer; percentiles 50/90/99 over the pairs seen together at least 5 times (the same
  cut as the original mbolt's co-activation files);
* consecutive-token overlap: mean |S_t ∩ S_t+1| / k between adjacent decode tokens of the same
  sequence (how much an expert cache could reuse from one token to the next).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mbolt.layout.coact import Coact, coactivation
from mbolt.core.trace import DECODE, PREFILL, Trace

MIN_PAIR_COUNT = 5
LIFT_PERCENTILES = (50, 90, 99)


def layer_stats(co: Coact, layer: int, experts: np.ndarray, k: int, next_mask: np.ndarray) -> dict:
    """Stats of one layer from its co-activation counts (`co`, the planner's statistics) and its
    expert ids [n, k] (-1 = not recorded); next_mask [n] marks tokens whose successor (row t+1)
    is the next decode token of the same sequence."""
    n = int(co.n_tokens[layer])
    out = {"tokens": n, "entropy_bits": None, "entropy_norm": None, "pairs": 0,
           **{f"lift_p{q}": None for q in LIFT_PERCENTILES}, "overlap": None,
           "overlap_pairs": 0}
    if n == 0:
        return out
    E = co.n_experts
    heat = co.heat[layer]
    p = heat / heat.sum()
    nz = p[p > 0]
    h = float(-(nz * np.log2(nz)).sum())
    out["entropy_bits"] = h
    out["entropy_norm"] = float(h / np.log2(E)) if E > 1 else 1.0

    # pairs of experts selected together by at least MIN_PAIR_COUNT tokens, and their lift
    iu, ju = np.triu_indices(E, 1)
    sel = co.counts[layer][iu, ju] >= MIN_PAIR_COUNT
    out["pairs"] = int(sel.sum())
    if sel.any():
        lift = co.lift(layer)[iu[sel], ju[sel]]
        for q in LIFT_PERCENTILES:
            out[f"lift_p{q}"] = float(np.percentile(lift, q))

    # consecutive-token overlap (rows of the full trace, so index before filtering)
    t = np.flatnonzero(next_mask[: len(experts) - 1] if len(experts) else next_mask[:0])
    if len(t):
        a, b = experts[t], experts[t + 1]
        both = (a >= 0).any(axis=1) & (b >= 0).any(axis=1)
        a, b = a[both], b[both]
        if len(a):
            inter = ((a[:, :, None] == b[:, None, :]) & (a[:, :, None] >= 0)).sum(axis=(1, 2))
            out["overlap"] = float(inter.mean() / k)
            out["overlap_pairs"] = int(len(a))
    return out


def trace_stats(trace: Trace | str | os.PathLike, fmt: str = "auto") -> dict:
    """Stats of a `Trace`, or of a file in any format the importers read."""
    source = None
    if not isinstance(trace, Trace):
        from mbolt.trace.formats import detect_format, load_trace

        source = Path(trace)
        fmt = detect_format(source) if fmt == "auto" else fmt
        trace = load_trace(source, fmt)
    tr = trace
    n = tr.n_tokens
    seq_ids, seq_counts = np.unique(tr.seq, return_counts=True)
    domains: dict[str, int] = {}
    for s in seq_ids.tolist():
        tag = tr.domains.get(int(s))
        if tag is not None:
            domains[tag] = domains.get(tag, 0) + 1
    # row t -> t+1 is a consecutive decode step when both are decode, same sequence, next pos
    nxt = np.zeros(n, bool)
    if n > 1:
        nxt[:-1] = ((tr.phase[:-1] == DECODE) & (tr.phase[1:] == DECODE)
                    & (tr.seq[:-1] == tr.seq[1:]) & (tr.pos[1:] == tr.pos[:-1] + 1))
    layers = []
    co = coactivation(tr) if n else None
    for layer in tr.moe_layers().tolist():
        st = layer_stats(co, layer, tr.experts[:, layer, :], tr.k, nxt)
        layers.append({"layer": int(layer), **st})

    def mean_of(key):
        vals = [x[key] for x in layers if x[key] is not None]
        return float(np.mean(vals)) if vals else None

    return {
        "source": str(source) if source else None,
        "format": fmt if source else None,
        "n_layers": tr.n_layers,
        "n_experts": tr.n_experts,
        "k": tr.k,
        "fingerprint": tr.fingerprint,
        "tokens": {"total": n, "prefill": int((tr.phase == PREFILL).sum()),
                   "decode": int((tr.phase == DECODE).sum())},
        "sequences": int(len(seq_ids)),
        "tokens_per_sequence": {"min": int(seq_counts.min()) if n else 0,
                                "median": float(np.median(seq_counts)) if n else 0.0,
                                "max": int(seq_counts.max()) if n else 0},
        "domains": domains,
        "weights": tr.weights is not None,
        "moe_layers": len(layers),
        "summary": {
            "entropy_norm_mean": mean_of("entropy_norm"),
            **{f"lift_p{q}_mean": mean_of(f"lift_p{q}") for q in LIFT_PERCENTILES},
            "overlap_mean": mean_of("overlap"),
        },
        "layers": layers,
        "notes": list(tr.notes),
    }
