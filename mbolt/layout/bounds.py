"""Upper bounds on the adjacency any expert order can achieve, hence lower bounds on reads.

With gap-free merging a token at a layer costs (selected) - (adjacent selected pairs) reads per
region, so for any order the summed adjacency `sum_p C[perm[p], perm[p+1]]` is at most:

- `top2_bound`: half the sum over experts of their two heaviest edges (each expert has at most
  two neighbours in a path). Quick and loose.
- `lp_bound`: the max-weight fractional 2-matching LP (x_ij in [0, 1], every expert's x sum <= 2,
  total <= E - 1 edges), solved with scipy's HiGHS. Tighter; every path is a feasible point.
- `subtour_bound`: the same LP with subtour cuts added on the support's components. Tightest.

`reads_lower_bound` turns an adjacency bound into reads/token for a layout (gap 0, no cache).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from mbolt.core.errors import MboltError


def top2_bound(C: np.ndarray) -> float:
    C = np.asarray(C, dtype=np.float64).copy()
    np.fill_diagonal(C, 0.0)
    E = C.shape[0]
    if E < 2:
        return 0.0
    top = -np.partition(-C, 1, axis=1)[:, :2] if E > 2 else C[:, ::-1][:, :1]
    return float(top.sum() / 2.0)


def _edges(C: np.ndarray):
    """The positive-weight pairs i < j of C as LP columns: (E, i, j, weight, expert x edge
    incidence matrix), or None when there is no edge to place."""
    C = np.asarray(C, dtype=np.float64)
    E = C.shape[0]
    if E < 2:
        return None
    iu, ju = np.triu_indices(E, 1)
    w = C[iu, ju]
    keep = w > 0
    iu, ju, w = iu[keep], ju[keep], w[keep]
    m = len(w)
    if m == 0:
        return None
    cols = np.arange(m)
    deg = sp.csr_matrix((np.ones(2 * m), (np.concatenate([iu, ju]), np.concatenate([cols, cols]))), shape=(E, m))
    return E, iu, ju, w, deg


def lp_bound(C: np.ndarray) -> float:
    """Max-weight fractional 2-matching (with at most E-1 edges) over positive-weight pairs."""
    edges = _edges(C)
    if edges is None:
        return 0.0
    E, iu, ju, w, deg = edges
    m = len(w)
    A = sp.vstack([deg, sp.csr_matrix(np.ones((1, m)))]).tocsr()
    b = np.concatenate([np.full(E, 2.0), [E - 1.0]])
    res = linprog(-w, A_ub=A, b_ub=b, bounds=(0, 1), method="highs")
    if res.status != 0:
        raise MboltError(f"2-matching LP failed: {res.message}")
    return float(-res.fun)


def subtour_bound(C: np.ndarray, max_rounds: int = 30) -> float:
    """The 2-matching LP plus subtour cuts: for every connected component S of the current
    solution's support (S not all experts), a path has at most |S| - 1 edges inside S.
    Re-solved until no component violates its cut (or `max_rounds`). Tighter than `lp_bound`
    wherever the LP closes groups of experts into cycles (planted cliques)."""
    from scipy.sparse.csgraph import connected_components

    edges = _edges(C)
    if edges is None:
        return 0.0
    E, iu, ju, w, deg = edges
    m = len(w)
    rows = [deg, sp.csr_matrix(np.ones((1, m)))]
    b = [np.full(E, 2.0), np.array([E - 1.0])]
    best = np.inf
    for _ in range(max_rounds):
        res = linprog(-w, A_ub=sp.vstack(rows).tocsr(), b_ub=np.concatenate(b), bounds=(0, 1), method="highs")
        if res.status != 0:
            raise MboltError(f"subtour LP failed: {res.message}")
        best = min(best, float(-res.fun))
        x = res.x
        sup = x > 1e-7
        g = sp.csr_matrix((np.ones(int(sup.sum())), (iu[sup], ju[sup])), shape=(E, E))
        n_comp, lab = connected_components(g, directed=False)
        cuts, rhs = [], []
        for c in range(n_comp):
            inS = lab == c
            size = int(inS.sum())
            if size < 2 or size == E:
                continue
            inside = inS[iu] & inS[ju]
            if x[inside].sum() > size - 1 + 1e-6:
                cuts.append(inside.astype(np.float64))
                rhs.append(size - 1.0)
        if not cuts:
            break
        rows.append(sp.csr_matrix(np.vstack(cuts)))
        b.append(np.array(rhs))
    return best


def adjacency_bounds(counts: np.ndarray, layers=None, kind: str = "lp") -> np.ndarray:
    """Per-layer adjacency bounds of one `kind` (top2, lp, subtour) for a [L, E, E] count stack."""
    fn = {"top2": top2_bound, "lp": lp_bound, "subtour": subtour_bound}.get(kind)
    if fn is None:
        raise MboltError(f"unknown bound {kind!r} (top2, lp, subtour)")
    L = counts.shape[0]
    out = np.zeros(L)
    for l in (range(L) if layers is None else layers):
        out[l] = fn(counts[l])
    return out


def reads_lower_bound(selected_per_layer: np.ndarray, adjacency: np.ndarray, n_tokens: int, n_regions: int) -> float:
    """Lower bound on reads/token (gap 0, no cache): per layer (selections - adjacency) per region."""
    return float(n_regions * (np.asarray(selected_per_layer).sum() - np.asarray(adjacency).sum()) / max(n_tokens, 1))
