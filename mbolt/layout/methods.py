"""Ordering methods: one interface, `order(coact, heat, method, **opts) -> perm`.

`coact` is one layer's co-activation count matrix C [E, E] (zero diagonal), `heat` its per-expert
selection counts; the result `perm[p]` is the original expert id stored at position p.

- `stock`: identity (the file as it is).
- `heat`: hottest expert first.
- `heat-tsp`: `tsp` on the co-activation expected from heat alone (C_ij = h_i h_j / N, as if
  experts were picked independently): the best an order can get from the heat effect. It
  places hot experts next to each other (hottest in the middle), which beats plain `heat`;
  the null control: without co-activation structure `tsp` should not beat it.
- `mbolt-chain`: the original mbolt algorithm: greedy modularity communities on P(i,j),
  clusters in heat order, a greedy nearest-neighbour chain inside each cluster from its hottest
  expert; junctions between clusters are not optimised.
- `tsp` (ours): with gap-free merging a token at a layer costs k - (adjacent selected pairs)
  reads per tensor, so the order maximising the summed C over adjacent positions (a max-weight
  Hamiltonian path) minimises expected reads. Greedy-edge construction, then vectorised 2-opt
  and Or-opt on the path, then (up to 256 experts, where it is cheap) iterated local search
  with double-bridge kicks; deterministic for a given `seed`. Gap-aware (`far=[w2, w3, ...]`): a pair at distance d>1 is worth
  w_d of an adjacent pair (the reader merges across the slices between them); refined with
  vectorised swap moves on that windowed objective.
"""

from __future__ import annotations

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.layout.coact import modularity_communities, order_groups

METHODS = ("stock", "heat", "heat-tsp", "mbolt-chain", "tsp")


def order(coact: np.ndarray, heat: np.ndarray, method: str = "tsp", **opts) -> np.ndarray:
    """The expert order of one layer by `method`; returns int32 perm (a permutation of 0..E-1)."""
    C = np.asarray(coact, dtype=np.float64)
    heat = np.asarray(heat, dtype=np.float64)
    if C.ndim != 2 or C.shape[0] != C.shape[1] or heat.shape != (C.shape[0],):
        raise MboltError(f"order: co-activation {C.shape} and heat {heat.shape} do not match")
    fn = _METHODS.get(method)
    if fn is None:
        raise MboltError(f"unknown ordering method {method!r} (choose from {', '.join(METHODS)})")
    C = C.copy()
    np.fill_diagonal(C, 0.0)
    perm = np.asarray(fn(C, heat, **opts), dtype=np.int32)
    assert np.array_equal(np.sort(perm), np.arange(len(heat))), f"{method} returned a non-permutation"
    return perm


def path_weight(C: np.ndarray, perm: np.ndarray, far: tuple[float, ...] = ()) -> float:
    """Summed co-activation over adjacent positions (+ far[d-2] x pairs at distance d)."""
    perm = np.asarray(perm)
    total = float(C[perm[:-1], perm[1:]].sum())
    for d, w in enumerate(far, start=2):
        if w and len(perm) > d:
            total += w * float(C[perm[:-d], perm[d:]].sum())
    return total


# ---------------------------------------------------------------- simple methods


def heat_order(heat: np.ndarray) -> np.ndarray:
    """Hottest expert first, ties by lower id: the order that needs no co-activation."""
    return np.lexsort((np.arange(len(heat)), -np.asarray(heat)))


def _stock(C, heat, **_):
    return np.arange(len(heat))


def _heat(C, heat, **_):
    return heat_order(heat)


def _heat_tsp(C, heat, **opts):
    n = max(heat.sum(), 1.0)
    indep = np.outer(heat, heat) / n
    np.fill_diagonal(indep, 0.0)
    return _tsp(indep, heat, **opts)


def _mbolt_chain(C, heat, *, clusters: list[list[int]] | None = None, **_):
    if clusters is None:
        clusters = _modularity_clusters(C, heat)
    out: list[int] = []
    for cl in clusters:
        rest = sorted(cl, key=lambda e: (-heat[e], e))
        cur = rest.pop(0)
        out.append(cur)
        while rest:
            w = C[cur, rest]
            # nearest neighbour by co-activation; ties go to the hotter expert (rest is heat-sorted)
            cur = rest.pop(int(np.argmax(w)))
            out.append(cur)
    return np.array(out)


def _modularity_clusters(C, heat) -> list[list[int]]:
    # weights scaled by the hottest expert's count, as the original mbolt did
    return order_groups(modularity_communities(C / max(heat.max(), 1.0), heat), heat)


# ---------------------------------------------------------------- tsp


def _tsp(C, heat, *, far: tuple[float, ...] = (), max_rounds: int = 200, neighbours: int = 12,
         kicks: int | None = None, seed: int = 0, time_limit: float | None = None, **_):
    E = len(heat)
    if E <= 2:
        return np.arange(E)
    path = greedy_edge_path(C, heat, neighbours=neighbours)
    path = local_search(C, path, max_rounds=max_rounds)
    if kicks is None:  # iterated local search: a fixed (deterministic) budget where kicks are cheap
        kicks = max(8, 3000 // E) if E <= 256 else 0
    if kicks > 0:
        path = iterated_local_search(C, path, kicks=kicks, seed=seed, time_limit=time_limit)
    far = tuple(float(w) for w in far)
    if any(far):
        path = swap_refine(C, path, (1.0,) + far, max_rounds=max_rounds)
    return path


def greedy_edge_path(C: np.ndarray, heat: np.ndarray, neighbours: int = 12) -> np.ndarray:
    """Greedy edge matching on each expert's strongest candidate edges, fragments joined greedily."""
    E = len(heat)
    m = min(neighbours, E - 1)
    nb = np.argpartition(-C, m, axis=1)[:, : m + 1] if m + 1 < E else np.tile(np.arange(E), (E, 1))
    i = np.repeat(np.arange(E), nb.shape[1])
    j = nb.ravel()
    keep = (i < j) | ((i > j) & ~np.isin(i * E + j, j * E + i))
    i, j = np.minimum(i[keep], j[keep]), np.maximum(i[keep], j[keep])
    key = np.unique(i * E + j)
    i, j = key // E, key % E
    w = C[i, j]
    pos = w > 0
    i, j, w = i[pos], j[pos], w[pos]
    o = np.lexsort((i, j, -w))
    deg = np.zeros(E, np.int8)
    parent = list(range(E))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    adj = [[] for _ in range(E)]
    n_edges = 0
    for a, b in zip(i[o].tolist(), j[o].tolist()):
        if deg[a] >= 2 or deg[b] >= 2:
            continue
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        parent[ra] = rb
        deg[a] += 1
        deg[b] += 1
        adj[a].append(b)
        adj[b].append(a)
        n_edges += 1
        if n_edges == E - 1:
            break
    # Walk the fragments (paths) from their ends.
    frags: list[list[int]] = []
    seen = np.zeros(E, bool)
    for s in range(E):
        if seen[s] or deg[s] == 2:
            continue
        frag, prev, cur = [], -1, s
        while cur != -1:
            frag.append(cur)
            seen[cur] = True
            nxt = [x for x in adj[cur] if x != prev]
            prev, cur = cur, (nxt[0] if nxt else -1)
        frags.append(frag)
    # Join fragments: repeatedly attach the fragment whose end is best tied to the current tail.
    frags.sort(key=lambda f: (-heat[f].sum(), f[0]))
    path = list(frags.pop(0))
    if heat[path[-1]] > heat[path[0]]:
        path.reverse()
    while frags:
        heads = np.array([f[0] for f in frags])
        tails = np.array([f[-1] for f in frags])
        wh, wt = C[path[-1], heads], C[path[-1], tails]
        b = int(np.argmax(np.maximum(wh, wt)))
        f = frags.pop(b)
        path.extend(f if wh[b] >= wt[b] else f[::-1])
    return np.array(path)


def local_search(C: np.ndarray, path: np.ndarray, max_rounds: int = 200, eps: float = 1e-9) -> np.ndarray:
    """2-opt and Or-opt (segments of 1-3, either direction) on a path, batched and vectorised.

    The path is closed with a dummy node (weight 0 to everyone) kept at position 0, so a cycle
    move on the closed tour is a path move (including changing the path's ends).
    """
    E = len(path)
    W = np.zeros((E + 1, E + 1))
    W[:E, :E] = C
    t = np.concatenate([[E], path]).astype(np.int64)
    n = E + 1
    for _ in range(max_rounds):
        moved = False
        # ---- 2-opt: reverse t[i+1..j]
        a, b = t, np.roll(t, -1)
        eab = W[a, b]
        d = W[np.ix_(a, a)] + W[np.ix_(b, b)] - eab[:, None] - eab[None, :]
        d = np.triu(d, 2)
        d[0, n - 1] = 0.0
        cand = np.argwhere(d > eps)
        if len(cand):
            gains = d[cand[:, 0], cand[:, 1]]
            used = np.zeros(n + 1, bool)
            for (i, j) in cand[np.argsort(-gains)[:256]]:
                if used[i : j + 2].any():
                    continue
                used[i : j + 2] = True
                t[i + 1 : j + 1] = t[i + 1 : j + 1][::-1].copy()
                moved = True
        # ---- Or-opt: move segment t[i..i+s-1] between t[j] and t[j+1], maybe reversed
        best_keys = np.arange(n, dtype=np.float64)
        any_or = False
        used = np.zeros(n, bool)
        nxt = np.roll(t, -1)
        ej = W[t, nxt]  # edge j: (t[j], t[j+1])
        for s in (1, 2, 3):
            if n - 1 < s + 2:
                break
            i = np.arange(1, n - s + 1)  # segment start positions (dummy at 0 never moves)
            p, s0, sl = t[i - 1], t[i], t[i + s - 1]
            nx = t[(i + s) % n]
            rem = W[p, s0] + W[sl, nx] - W[p, nx]
            fwd = W[t[None, :], s0[:, None]] + W[sl[:, None], nxt[None, :]] - ej[None, :]
            rev = W[t[None, :], sl[:, None]] + W[s0[:, None], nxt[None, :]] - ej[None, :]
            gain = np.maximum(fwd, rev) - rem[:, None]
            jj = np.arange(n)[None, :]
            bad = (jj >= (i[:, None] - 1)) & (jj <= (i[:, None] + s - 1))
            gain[bad] = -np.inf
            cand = np.argwhere(gain > eps)
            if not len(cand):
                continue
            g = gain[cand[:, 0], cand[:, 1]]
            for r, j in cand[np.argsort(-g)[:128]]:
                i0 = int(i[r])
                aff = np.r_[np.arange(i0 - 1, i0 + s + 1) % n, j, (j + 1) % n]
                if used[aff].any():
                    continue
                used[aff] = True
                seg = np.arange(i0, i0 + s)
                step = 0.5 / (s + 1)
                ks = j + step * np.arange(1, s + 1)
                if rev[r, j] > fwd[r, j]:
                    ks = ks[::-1]
                best_keys[seg] = ks
                any_or = True
        if any_or:
            t = t[np.argsort(best_keys, kind="stable")]
            z = int(np.flatnonzero(t == E)[0])
            t = np.roll(t, -z)
            moved = True
        if not moved:
            break
    return t[1:]


def iterated_local_search(C: np.ndarray, path: np.ndarray, *, kicks: int = 50, seed: int = 0,
                          time_limit: float | None = None) -> np.ndarray:
    """Double-bridge kicks (path A B C D -> A C B D) followed by local search; keep improvements.
    `time_limit` (seconds) stops early; without it the result depends only on the seed."""
    import time

    rng = np.random.default_rng(seed)
    best = np.asarray(path)
    best_w = path_weight(C, best)
    n = len(best)
    if n < 4:
        return best
    t_end = time.perf_counter() + (np.inf if time_limit is None else time_limit)
    for _ in range(kicks):
        if time.perf_counter() > t_end:
            break
        a, b, c = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
        cand = np.concatenate([best[:a], best[b:c], best[a:b], best[c:]])
        cand = local_search(C, cand)
        w = path_weight(C, cand)
        if w > best_w + 1e-9:
            best, best_w = cand, w
    return best


def swap_refine(C: np.ndarray, path: np.ndarray, w: tuple[float, ...], max_rounds: int = 200, eps: float = 1e-9) -> np.ndarray:
    """Batched best-improvement swaps on the windowed objective sum_d w[d-1] * C over distance d."""
    x = np.asarray(path, dtype=np.int64).copy()
    n = len(x)
    D = len(w)
    w = np.asarray(w, dtype=np.float64)
    dist = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    wmat = np.where((dist >= 1) & (dist <= D), w[np.clip(dist - 1, 0, D - 1)], 0.0)
    for _ in range(max_rounds):
        Wx = C[np.ix_(x, x)]  # Wx[p, q] = C[x_p, x_q]
        # G[p, e] = sum over window neighbours q of p: w(|p-q|) C[e, x_q]; Gx[p, q] = G[p, x_q]
        Gx = wmat @ Wx  # (wmat @ Wx)[p, q] = sum_r wmat[p, r] C[x_r, x_q]
        g = np.diag(Gx).copy()
        delta = Gx + Gx.T - g[:, None] - g[None, :] + 2.0 * wmat * Wx
        delta = np.triu(delta, 1)
        cand = np.argwhere(delta > eps)
        if not len(cand):
            break
        gains = delta[cand[:, 0], cand[:, 1]]
        used = np.zeros(n + 2 * D + 2, bool)
        moved = False
        for a, b in cand[np.argsort(-gains)[:256]]:
            ra = slice(a, a + 2 * D + 1)  # window [a-D, a+D] shifted by D
            rb = slice(b, b + 2 * D + 1)
            if used[ra].any() or used[rb].any():
                continue
            used[ra] = True
            used[rb] = True
            x[a], x[b] = x[b], x[a]
            moved = True
        if not moved:
            break
    return x


_METHODS = {"stock": _stock, "heat": _heat, "heat-tsp": _heat_tsp, "mbolt-chain": _mbolt_chain, "tsp": _tsp}
