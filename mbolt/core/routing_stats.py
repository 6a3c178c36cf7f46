"""Routing statistics in the cut of the original mbolt's co-activation profiles, one definition for
the stages that compare routing with a profile (`trace-stats`, `synth --routing-like`).

A profile (`coactivation_*.json`) keeps, per layer, the heat of every expert and only the pairs
seen together at least PAIR_MIN_COUNT times with lift >= PAIR_MIN_LIFT, the PAIR_TOP largest
counts (lift = P(ij) / (P(i) P(j))). Lift percentiles over all pairs seen 5 times and over the
profile's pairs are different numbers: comparing a trace with a profile needs the same cut.

Per layer, from heat (selections of each expert over n routed tokens) and pair counts:
* heat entropy / max: -sum p log2 p / log2 E over the share p of the selections;
* hottest 10% share: share of the selections that went to the ceil(E / 10) hottest experts;
* cut lifts: the lifts of the pairs that survive the profile's cut;
* heat overlap: the expected |S_t & S_u| / k of two distinct tokens drawn from the same heat,
  sum c_e (c_e - 1) / (n (n - 1) k); a consecutive overlap above it is reuse beyond heat.
"""

from __future__ import annotations

import math

import numpy as np

PAIR_MIN_COUNT = 5
PAIR_MIN_LIFT = 1.5
PAIR_TOP = 2000
TOP_SHARE = 0.10
LIFT_PERCENTILES = (50, 90, 99)


def entropy_norm(heat: np.ndarray) -> float | None:
    heat = np.asarray(heat, dtype=np.float64)
    if heat.sum() <= 0:
        return None
    p = heat[heat > 0] / heat.sum()
    return float(-(p * np.log2(p)).sum() / math.log2(len(heat))) if len(heat) > 1 else 1.0


def top_share(heat: np.ndarray, frac: float = TOP_SHARE) -> float | None:
    heat = np.asarray(heat, dtype=np.float64)
    if heat.sum() <= 0:
        return None
    n = max(1, math.ceil(frac * len(heat)))
    return float(np.sort(heat)[::-1][:n].sum() / heat.sum())


def heat_overlap(heat: np.ndarray, n_tokens: int, k: int) -> float | None:
    """Expected overlap (share of k) of two distinct tokens drawn from the same selections."""
    if n_tokens < 2:
        return None
    c = np.asarray(heat, dtype=np.float64)
    return float((c * (c - 1)).sum() / (n_tokens * (n_tokens - 1) * k))


def set_counts(sets: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(heat [E], upper-triangle pair counts [E, E]) of token expert sets [n, k] (distinct ids >= 0)."""
    sets = np.sort(np.asarray(sets, dtype=np.int64), axis=1)
    E = n_experts
    heat = np.bincount(sets.ravel(), minlength=E).astype(np.float64)
    ri, rj = np.triu_indices(sets.shape[1], 1)
    c = np.bincount((sets[:, ri] * E + sets[:, rj]).ravel(), minlength=E * E)
    return heat, c.reshape(E, E).astype(np.float64)


def cut_lifts(counts: np.ndarray, heat: np.ndarray, n_tokens: int) -> np.ndarray:
    """Lifts of the pairs a profile would keep: count >= 5, lift >= 1.5, the 2,000 largest counts
    (ties: lower i, then lower j). `counts` [E, E] with each pair's count at [i, j], i < j."""
    E = len(heat)
    iu, ju = np.triu_indices(E, 1)
    c = np.asarray(counts)[iu, ju]
    hh = heat[iu] * heat[ju]
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = np.where(hh > 0, c * n_tokens / hh, 0.0)
    keep = np.flatnonzero((c >= PAIR_MIN_COUNT) & (lift >= PAIR_MIN_LIFT))
    keep = keep[np.lexsort((ju[keep], iu[keep], -c[keep]))][:PAIR_TOP]
    return lift[keep]


def cut_summary(heat: np.ndarray, lifts: np.ndarray, n_tokens: int, k: int) -> dict:
    """One layer's statistics in the profile's cut (see module doc); lifts: that layer's cut lifts."""
    out = {"entropy_norm": entropy_norm(heat), "top10_share": top_share(heat), "cut_pairs": int(len(lifts)),
           "heat_overlap": heat_overlap(heat, n_tokens, k)}
    for q in LIFT_PERCENTILES:
        out[f"cut_lift_p{q}"] = float(np.percentile(lifts, q)) if len(lifts) else None
    return out
