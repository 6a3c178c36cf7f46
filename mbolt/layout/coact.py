"""Co-activation statistics of a trace: per layer, how often each pair of experts routes together.

`C[l, i, j]` counts the tokens whose top-k at layer l contains both i and j (diagonal = heat:
tokens that selected i). Everything the planner needs (orders, bounds, groups) is a function of
these counts, computed with one matrix product per layer over a one-hot token x expert matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.mbtrace import validate_experts
from mbolt.core.trace import Trace


@dataclass
class Coact:
    counts: np.ndarray  # float64 [n_layers, E, E], zero diagonal
    heat: np.ndarray  # float64 [n_layers, E]: tokens that selected each expert
    n_tokens: np.ndarray  # int64 [n_layers]: tokens with a recorded routing at that layer
    layers: np.ndarray  # MoE layer indices (layers with any recorded routing)

    @property
    def n_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.counts.shape[1])

    def prob(self, layer: int) -> np.ndarray:
        """P(i and j both selected) at one layer."""
        return self.counts[layer] / max(int(self.n_tokens[layer]), 1)

    def lift(self, layer: int) -> np.ndarray:
        """P(ij) / (P(i) P(j)); 0 where an expert was never selected."""
        n = max(int(self.n_tokens[layer]), 1)
        p = self.heat[layer] / n
        denom = np.outer(p, p)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(denom > 0, self.prob(layer) / denom, 0.0)
        np.fill_diagonal(out, 0.0)
        return out


def check_ids(trace: Trace) -> None:
    if trace.n_tokens == 0:
        raise MboltError("trace has no tokens")
    validate_experts("trace", trace.experts, trace.n_experts, unique=False)


def coactivation(trace: Trace) -> Coact:
    """Per-layer co-activation counts and heat of every expert over all tokens of `trace`.

    Counted from each token's pairs of selected experts (O(N k^2) per layer, not O(N E^2)); an
    id repeated within one token and layer counts once, as a set."""
    check_ids(trace)
    L, E, k = trace.n_layers, trace.n_experts, trace.experts.shape[2]
    counts = np.zeros((L, E, E))
    heat = np.zeros((L, E))
    n_tok = np.zeros(L, dtype=np.int64)
    ri, rj = np.triu_indices(k, 1)
    for layer in range(L):
        sets = trace.experts[:, layer, :]
        rows = (sets >= 0).any(axis=1)
        if not rows.any():
            continue
        ex = np.sort(sets[rows].astype(np.int64), axis=1)
        ex[:, 1:][ex[:, 1:] == ex[:, :-1]] = -1  # repeats within a token: keep one
        heat[layer] = np.bincount(ex[ex >= 0], minlength=E)
        a, b = ex[:, ri].ravel(), ex[:, rj].ravel()  # sorted rows: a < b wherever both are ids
        ok = (a >= 0) & (b >= 0)
        c = np.bincount(a[ok] * E + b[ok], minlength=E * E).reshape(E, E).astype(np.float64)
        counts[layer] = c + c.T
        n_tok[layer] = int(rows.sum())
    return Coact(counts, heat, n_tok, np.flatnonzero(n_tok > 0))


def modularity_communities(weights: np.ndarray, heat: np.ndarray) -> list[list[int]]:
    """networkx greedy modularity communities of the graph over the experts with heat > 0, with
    edge weights weights[i, j] (i < j); every selected expert alone when there is no edge."""
    import networkx as nx
    from networkx.algorithms.community import greedy_modularity_communities

    active = [int(i) for i in np.flatnonzero(heat > 0)]
    g = nx.Graph()
    g.add_nodes_from(active)
    iu, ju = np.nonzero(np.triu(weights, 1))
    g.add_weighted_edges_from((int(i), int(j), float(weights[i, j])) for i, j in zip(iu, ju))
    if not g.number_of_edges():
        return [[i] for i in active]
    return [list(c) for c in greedy_modularity_communities(g, weight="weight")]


def order_groups(comms: list[list[int]], heat: np.ndarray) -> list[list[int]]:
    """Hottest group first (ties: lowest id), hottest expert first within a group; experts in no
    group follow as singletons."""
    comms = [sorted(c, key=lambda e: (-heat[e], e)) for c in comms]
    comms.sort(key=lambda c: (-heat[c].sum(), min(c)))
    seen = {e for c in comms for e in c}
    return comms + [[e] for e in range(len(heat)) if e not in seen]


def groups(coact: Coact, layer: int, *, method: str = "modularity", seed: int = 0) -> list[list[int]]:
    """Groups of co-activated experts at one layer, ordered by `order_groups`.

    "modularity": networkx greedy modularity communities on the P(i,j) graph (what the original
    mbolt used); "spectral": scikit-learn spectral clustering on the lift-weighted affinity.
    Experts never selected form singleton groups at the end.
    """
    heat = coact.heat[layer]
    active = np.flatnonzero(heat > 0)
    if method == "modularity":
        comms = modularity_communities(coact.prob(layer), heat)
    elif method == "spectral":
        from sklearn.cluster import SpectralClustering

        A = np.maximum(coact.lift(layer) - 1.0, 0.0)[np.ix_(active, active)]
        n_clusters = max(2, min(len(active) // 8, 64))
        if len(active) < 4 or not A.any():
            comms = [[int(i)] for i in active]
        else:
            lab = SpectralClustering(n_clusters, affinity="precomputed", random_state=seed).fit_predict(A + 1e-9)
            comms = [[int(active[i]) for i in np.flatnonzero(lab == c)] for c in np.unique(lab)]
    else:
        raise MboltError(f"unknown grouping method {method!r} (modularity, spectral)")
    return order_groups(comms, heat)
