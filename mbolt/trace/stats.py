"""`mbolt trace-stats`: what a routing trace looks like, per layer.

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
        from mbolt.core.trace_import import detect_format, load_trace

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


def stats_renderables(s: dict) -> list:
    """Rich renderables for `mbolt trace-stats` (a header table, the per-layer table, notes)."""
    from rich import box
    from rich.table import Table

    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    if s["source"]:
        head.add_row("trace", f"{s['source']} ({s['format']})")
    head.add_row("shape", f"{s['n_layers']} layers ({s['moe_layers']} routed) x "
                          f"{s['n_experts']} experts, k={s['k']}"
                          f"{', with routing weights' if s['weights'] else ''}")
    t = s["tokens"]
    head.add_row("tokens", f"{t['total']:,} ({t['prefill']:,} prefill, {t['decode']:,} decode)")
    tps = s["tokens_per_sequence"]
    head.add_row("sequences", f"{s['sequences']:,} (tokens each: min {tps['min']}, median "
                              f"{tps['median']:g}, max {tps['max']})")
    if s["domains"]:
        head.add_row("domains", ", ".join(f"{d}: {c}" for d, c in sorted(s["domains"].items())))
    if s["fingerprint"]:
        head.add_row("model", s["fingerprint"])
    sm = s["summary"]
    head.add_row("mean over layers",
                 f"entropy {f(sm['entropy_norm_mean'])} of max, lift p50/p90/p99 "
                 f"{f(sm['lift_p50_mean'], '{:.2f}')}/{f(sm['lift_p90_mean'], '{:.2f}')}/"
                 f"{f(sm['lift_p99_mean'], '{:.2f}')}, consecutive overlap "
                 f"{f(sm['overlap_mean'])}")

    tab = Table(title="per layer (H: heat entropy; pairs: co-activated >= 5 times; liftNN: "
                      "percentiles of their lift; H norm: H / log2 E; overlap: |S_t & S_t+1| / k, decode)",
                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("layer", "tokens", "H bits", "H norm", "pairs", "lift50", "lift90", "lift99",
                "overlap"):
        tab.add_column(col, justify="right")
    for x in s["layers"]:
        tab.add_row(str(x["layer"]), f"{x['tokens']:,}", f(x["entropy_bits"]),
                    f(x["entropy_norm"]), str(x["pairs"]), f(x["lift_p50"], "{:.2f}"),
                    f(x["lift_p90"], "{:.2f}"), f(x["lift_p99"], "{:.2f}"), f(x["overlap"]))
    out = [head, tab]
    for note in s["notes"]:
        out.append(f"[yellow]note:[/] {note}")
    return out
