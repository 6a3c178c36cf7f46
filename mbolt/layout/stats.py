"""`mbolt trace-stats`: what a routing trace looks like, per layer (rendered by
report.layout_tables.trace_stats_renderables).

* tokens (prefill / decode), sequences, domain tags;
* heat entropy per layer: H = -sum p_e log2 p_e over the share p_e of routed slots that went to
  expert e, in bits and normalised by log2(E) (1 = perfectly even heat, 0 = one expert);
* lift of co-activated pairs: lift(i, j) = P(i, j) / (P(i) P(j)), with P over the tokens routed
  at that layer; percentiles 50/90/99 over the pairs seen together at least 5 times;
* consecutive-token overlap: mean |S_t ∩ S_t+1| / k between adjacent tokens of the same
  sequence and phase (the prompt's tokens, or the generated ones): how much an expert cache could
  reuse from one token to the next;
* the profile's cut (core/routing_stats.py), to put a trace beside a co-activation profile: the
  hottest 10% share, lift percentiles of the pairs a profile keeps (count >= 5, lift >= 1.5, top
  2,000 by count), and the overlap against chance (k / E) and against the heat overlap (two
  distinct tokens drawn from the layer's own heat: what heat alone gives). Means over layers
  leave out layers routed for fewer than half the tokens of the busiest (llama.cpp routes the
  last layer of a prompt for its last token only).

`profile_stats` gives the same cut for a co-activation profile (no overlap: a profile has no token
order), and `routing_target` turns either into what `synth --routing-like` plants.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.routing_stats import LIFT_PERCENTILES, cut_lifts, cut_summary
from mbolt.core.trace import DECODE, PREFILL, Trace, select_phase
from mbolt.layout.coact import Coact, coactivation

MIN_PAIR_COUNT = 5
CUT_KEYS = ("entropy_norm", "top10_share", "cut_lift_p50", "cut_lift_p90", "cut_lift_p99", "cut_pairs",
            "overlap", "overlap_vs_chance", "overlap_vs_heat")


def layer_stats(co: Coact, layer: int, experts: np.ndarray, k: int, next_mask: np.ndarray) -> dict:
    """Stats of one layer from its co-activation counts (`co`, the planner's statistics) and its
    expert ids [n, k] (-1 = not recorded); next_mask [n] marks tokens whose successor (row t+1)
    is the next decode token of the same sequence."""
    n = int(co.n_tokens[layer])
    E = co.n_experts
    out = {"tokens": n, "entropy_bits": None, "entropy_norm": None, "pairs": 0,
           **{f"lift_p{q}": None for q in LIFT_PERCENTILES}, "overlap": None,
           "overlap_pairs": 0, "chance": k / E, "top10_share": None, "cut_pairs": 0,
           **{f"cut_lift_p{q}": None for q in LIFT_PERCENTILES}, "heat_overlap": None,
           "overlap_vs_chance": None, "overlap_vs_heat": None}
    if n == 0:
        return out
    heat = co.heat[layer]
    p = heat / heat.sum()
    nz = p[p > 0]
    h = float(-(nz * np.log2(nz)).sum())
    out["entropy_bits"] = h
    out.update(cut_summary(heat, cut_lifts(co.counts[layer], heat, n), n, k))
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
            out["overlap_vs_chance"] = out["overlap"] / (k / E)
            if out["heat_overlap"]:
                out["overlap_vs_heat"] = out["overlap"] / out["heat_overlap"]
    return out


def trace_stats(trace: Trace | str | os.PathLike, fmt: str = "auto", phase: str = "all") -> dict:
    """Stats of a `Trace`, or of a file in any format the importers read, over the tokens of
    `phase` (decode, prefill or all)."""
    source = None
    if not isinstance(trace, Trace):
        from mbolt.trace.formats import detect_format, load_trace

        source = Path(trace)
        fmt = detect_format(source) if fmt == "auto" else fmt
        trace = load_trace(source, fmt)
    tr = trace if phase == "all" else select_phase(trace, phase, str(source or "trace"))
    n = tr.n_tokens
    seq_ids, seq_counts = np.unique(tr.seq, return_counts=True)
    domains: dict[str, int] = {}
    for s in seq_ids.tolist():
        tag = tr.domains.get(int(s))
        if tag is not None:
            domains[tag] = domains.get(tag, 0) + 1
    # row t -> t+1 is a consecutive step: same sequence and phase, next position
    nxt = np.zeros(n, bool)
    if n > 1:
        nxt[:-1] = ((tr.phase[:-1] == tr.phase[1:]) & (tr.seq[:-1] == tr.seq[1:]) & (tr.pos[1:] == tr.pos[:-1] + 1))
    layers = []
    co = coactivation(tr) if n else None
    for layer in tr.moe_layers().tolist():
        st = layer_stats(co, layer, tr.experts[:, layer, :], tr.k, nxt)
        layers.append({"layer": int(layer), **st})

    def mean_of(key, rows=layers):
        vals = [x[key] for x in rows if x[key] is not None]
        return float(np.mean(vals)) if vals else None

    busiest = max((x["tokens"] for x in layers), default=0)
    full = [x for x in layers if x["tokens"] * 2 >= busiest]

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
        "phase": phase,
        "profile_cut": {"layers": len(full), "left_out": [x["layer"] for x in layers if x not in full],
                        **{key: mean_of(key, full) for key in CUT_KEYS}},
        "layers": layers,
        "notes": list(tr.notes),
    }


def profile_stats(profile) -> dict:
    """The profile cut of a co-activation profile (a path or a layout.profile.Profile): the
    means over its layers of the same statistics trace_stats reports in "profile_cut"."""
    from mbolt.layout.profile import Profile, load_profile

    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    rows = []
    for l in prof.layers().tolist():
        lifts = prof.pairs[l][:, 3] if len(prof.pairs[l]) else np.zeros(0)
        st = cut_summary(prof.heat[l], lifts, prof.n_tokens, prof.k)
        rows.append({"layer": l, **st, "overlap": None, "overlap_vs_chance": None, "overlap_vs_heat": None})

    def mean_of(key):
        vals = [x[key] for x in rows if x[key] is not None]
        return float(np.mean(vals)) if vals else None

    return {"source": prof.path, "model": prof.model, "n_layers": prof.n_layers, "n_experts": prof.n_experts,
            "k": prof.k, "tokens": prof.n_tokens, "chance": prof.k / prof.n_experts,
            "profile_cut": {"layers": len(rows), "left_out": [], **{key: mean_of(key) for key in CUT_KEYS}},
            "layers": rows}


def is_profile(path: str | os.PathLike) -> bool:
    """A co-activation profile (JSON) rather than a trace: by its first non-blank byte."""
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return head[:1] == b"{"


def routing_target(path: str | os.PathLike, fmt: str = "auto"):
    """What `synth --routing-like` plants, from a co-activation profile or from any trace (its
    heat, its pairs in the profile's cut, and its own consecutive overlap / heat overlap)."""
    from mbolt.synth.routing_like import OVERLAP_VS_HEAT, RoutingTarget
    from mbolt.layout.profile import load_profile, strong_pairs

    path = Path(path)
    if is_profile(path):
        p = load_profile(path)
        return RoutingTarget(path.name, p.n_experts, p.k, p.n_tokens, p.heat, p.pairs)
    from mbolt.trace.formats import load_trace

    tr = load_trace(path, fmt)
    co = coactivation(tr)
    n = int(co.n_tokens.max())
    keep = co.n_tokens * 2 >= n  # as the means above: not llama.cpp's output-token-only last layer
    heat = np.where(keep[:, None], co.heat, 0.0)
    pairs = [np.asarray(strong_pairs(co.counts[l], co.heat[l], int(co.n_tokens[l])) or np.zeros((0, 4)), float)
             if keep[l] else np.zeros((0, 4)) for l in range(tr.n_layers)]
    if not keep.any() or not np.isfinite(heat).all():
        raise MboltError(f"{path}: no routed tokens")
    ratio = trace_stats(tr)["profile_cut"]["overlap_vs_heat"]
    # the profile's n_tokens scales heat into rates: use the busiest layer's count
    return RoutingTarget(path.name, tr.n_experts, tr.k, n, heat, pairs, ratio or OVERLAP_VS_HEAT)
