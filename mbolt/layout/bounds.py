"""Upper bounds on the adjacency any expert order can achieve, hence lower bounds on reads.

With gap-free merging a token at a layer costs (selected) - (adjacent selected pairs) reads per
region, so for any order the summed adjacency `sum_p C[perm[p], perm[p+1]]` is at most:

- `top2_bound`: half the sum over experts of their two heaviest edges (each expert has at most
  two neighbours in a path). Quick and loose.
- `lp_bound`: the max-weight fractional 2-matching LP (x_ij in [0, 1], every expert's x sum <= 2,
  total <= E - 1 edges), solved with scipy's HiGHS. Tighter; every path is a feasible point.

`reads_lower_bound` turns an adjacency bound into reads/token for a layout (gap 0, no cache).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from mbolt.errors import MboltError


def top2_bound(C: np.ndarray) -> float:
    C = np.asarray(C, dtype=np.float64).copy()
    np.fill_diagonal(C, 0.0)
    E = C.shape[0]
    if E < 2:
        return 0.0
    top = -np.partition(-C, 1, axis=1)[:, :2] if E > 2 else C[:, ::-1][:, :1]
    return float(top.sum() / 2.0)


def lp_bound(C: np.ndarray) -> float:
    """Max-weight fractional 2-matching (with at most E-1 edges) over positive-weight pairs."""
    C = np.asarray(C, dtype=np.float64)
    E = C.shape[0]
    if E < 2:
        return 0.0
    iu, ju = np.triu_indices(E, 1)
    w = C[iu, ju]
    keep = w > 0
    iu, ju, w = iu[keep], ju[keep], w[keep]
    m = len(w)
    if m == 0:
        return 0.0
    cols = np.arange(m)
    A = sp.csr_matrix(
        (np.ones(2 * m), (np.concatenate([iu, ju]), np.concatenate([cols, cols]))), shape=(E, m)
    )
    A = sp.vstack([A, sp.csr_matrix(np.ones((1, m)))]).tocsr()
    b = np.concatenate([np.full(E, 2.0), [E - 1.0]])
    res = linprog(-w, A_ub=A, b_ub=b, bounds=(0, 1), method="highs")
    if res.status != 0:
        raise MboltError(f"2-matching LP failed: {res.message}")
    return float(-res.fun)


def adjacency_bounds(counts: np.ndarray, layers=None, lp: bool = True) -> dict:
    """Per-layer adjacency bounds for a [L, E, E] count stack (layers: which to compute)."""
    L = counts.shape[0]
    layers = range(L) if layers is None else layers
    top2 = np.zeros(L)
    lpb = np.zeros(L)
    for l in layers:
        top2[l] = top2_bound(counts[l])
        lpb[l] = lp_bound(counts[l]) if lp else top2[l]
    return {"top2": top2, "lp": lpb}


def reads_lower_bound(selected_per_layer: np.ndarray, adjacency: np.ndarray, n_tokens: int, n_regions: int) -> float:
    """Lower bound on reads/token (gap 0, no cache): per layer (selections - adjacency) per region."""
    return float(n_regions * (np.asarray(selected_per_layer).sum() - np.asarray(adjacency).sum()) / max(n_tokens, 1))
