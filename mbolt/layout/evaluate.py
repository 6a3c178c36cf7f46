"""THE evaluator: reads and bytes per token of an expert order, scored the way it will be read.

For every token and MoE layer, the selected experts (minus LRU cache hits) become byte ranges in
the layer's regions and go through `mbolt.core.ranges.merge_ranges_batched`, the same
function the predictor and the streaming store use, so a plan is scored exactly as read.

Layouts:
- `reorder`: one region per weight role (gate, up, down: separate tensors, far apart); expert e
  occupies [pos[e] * slice, (pos[e]+1) * slice) in each; a token's ranges merge per tensor.
- `packed`: one region per layer, each expert's gate|up|down contiguous (slice = their sum).

Cache (`cache_slots` N > 0): the one slot cache rule (`mbolt.core.lru`): a per-layer LRU of N
experts; an expert selected by a token is a hit if it is among the N most recently used experts
of that layer as of the previous token (every selected expert, hit or miss, becomes most
recently used, in rank order). Hits need no read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.lru import SlotLru
from mbolt.core.ranges import merge_ranges_batched
from mbolt.core.routemap import inverse_perm
from mbolt.core.trace import Trace

LAYOUTS = ("reorder", "packed")

# Slice bytes per role of real models' expert tensors (ggml block sizes: IQ3_XXS 98 B / 256
# weights, Q8_0 34 B / 32, F16 2 B). Name -> (roles, bytes per role).
PRESETS: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    # Qwen3-30B-A3B: hidden 2048, expert ff 768; IQ3_XXS (the published mbolt run)
    "qwen3-30b-a3b-iq3_xxs": (("gate", "up", "down"), (602112, 602112, 602112)),
    # Qwen3-Next-80B-A3B: hidden 2048, expert ff 512; IQ3_XXS
    "qwen3-next-80b-a3b-iq3_xxs": (("gate", "up", "down"), (401408, 401408, 401408)),
    # granite3-moe 1b-a400m: hidden 1024, expert ff 512; Q8_0
    "granite3-moe-1b-q8_0": (("gate", "up", "down"), (557056, 557056, 557056)),
    # a unit geometry: 1 MiB per role (reads do not depend on slice size when gap = 0)
    "unit": (("gate", "up", "down"), (1 << 20, 1 << 20, 1 << 20)),
}


@dataclass(frozen=True)
class Geometry:
    layout: str  # "reorder" | "packed"
    slice_bytes: tuple[int, ...]  # per role, in file order (the first MoE layer's)
    roles: tuple[str, ...] = ("gate", "up", "down")
    # (layer, slice bytes per role) for every MoE layer of a file whose layers differ (a Q4_K_M
    # file keeps some down projections in Q6_K; "UD" quants mix types per layer); () = uniform
    per_layer: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise MboltError(f"unknown layout {self.layout!r} (reorder, packed)")
        if not self.slice_bytes or any(int(s) <= 0 for s in self.slice_bytes):
            raise MboltError(f"geometry: slice sizes must be positive, got {self.slice_bytes}")

    @property
    def regions(self) -> tuple[int, ...]:
        """Slice size of each region a token's experts are read from."""
        if self.layout == "packed":
            return (int(sum(self.slice_bytes)),)
        return tuple(int(s) for s in self.slice_bytes)

    @property
    def expert_bytes(self) -> int:
        return int(sum(self.slice_bytes))

    def for_layer(self, layer: int) -> "Geometry":
        """The geometry of one layer (itself where the file is uniform)."""
        for l, sizes in self.per_layer:
            if l == layer:
                return Geometry(self.layout, sizes, self.roles)
        return self if not self.per_layer else Geometry(self.layout, self.slice_bytes, self.roles)

    def far_weights(self, gap: int, far_credit: float = 1.0, max_d: int = 8) -> tuple[float, ...]:
        """Objective weights for pairs at distance d = 2, 3, ...: the share of regions in which
        the (d-1) slices between them fit in the merge gap, times `far_credit` (a pair at d > 1
        only saves a read when the experts between are not selected themselves)."""
        out = []
        for d in range(2, max_d + 2):
            share = float(np.mean([(d - 1) * s <= gap for s in self.regions]))
            if share == 0:
                break
            out.append(far_credit * share)
        return tuple(out)

    def to_dict(self) -> dict:
        d = {"layout": self.layout, "slice_bytes": list(self.slice_bytes), "roles": list(self.roles)}
        if self.per_layer:
            d["per_layer"] = {str(l): list(sizes) for l, sizes in self.per_layer}
        return d


def geometry_preset(name: str, layout: str = "reorder") -> Geometry:
    if name not in PRESETS:
        raise MboltError(f"unknown geometry preset {name!r} (choose from {', '.join(PRESETS)})")
    roles, sizes = PRESETS[name]
    return Geometry(layout, sizes, roles)


def geometry_from_model(moemap, layout: str = "reorder") -> Geometry:
    """Slice sizes per role from a GGUF's MoE map, per MoE layer where the layers differ (roles
    in file order)."""
    layers = [l for l in moemap.layers if not l.dense and l.weights]
    if not layers:
        raise MboltError(f"{moemap.path}: no routed expert weight tensors")
    sizes = {l.index: tuple(int(t.slice_bytes) for t in l.weights) for l in layers}
    first = sizes[layers[0].index]
    roles = tuple(t.role for t in layers[0].weights)
    per_layer = tuple(sorted(sizes.items())) if len(set(sizes.values())) > 1 else ()
    return Geometry(layout, first, roles, per_layer)


def lru_hits(sets: np.ndarray, n_experts: int, slots: int) -> np.ndarray:
    """[N, L, k] expert ids -> bool [N, L, k] hits of the one slot cache (`mbolt.core.lru`): one
    `SlotLru` per layer stepped token by token, as the store and the replay step theirs."""
    N, L, k = sets.shape
    hits = np.zeros(sets.shape, bool)
    if slots <= 0 or N == 0:
        return hits
    caches = [SlotLru(slots) for _ in range(L)]
    for t, row in enumerate(np.asarray(sets).tolist()):
        for layer, ids in enumerate(row):
            at = [i for i, e in enumerate(ids) if e >= 0]  # recorded ranks (-1: not recorded)
            if at:
                hits[t, layer, at] = caches[layer].step([ids[i] for i in at])[0]
    return hits


def evaluate(trace: Trace, perm: np.ndarray, geometry: Geometry, gap: int = 0, cache_slots: int = 0,
             per_layer: bool = False, hits: np.ndarray | None = None) -> dict:
    """Reads and bytes per token of `trace` under expert order `perm` [n_layers, E].

    Returns reads_per_token, bytes_per_token (bytes actually read, holes read through included),
    useful_bytes_per_token, runs_per_token_layer (gap-free runs of adjacent positions per token and
    MoE layer, cache ignored: the geometry-free adjacency metric), hit_rate, n_tokens.
    """
    perm = np.asarray(perm)
    if perm.shape != (trace.n_layers, trace.n_experts):
        raise MboltError(
            f"plan covers {perm.shape[0]} layers x {perm.shape[1]} experts, trace has "
            f"{trace.n_layers} x {trace.n_experts}"
        )
    N = trace.n_tokens
    if N == 0:
        raise MboltError("evaluate: no tokens to evaluate")
    E = trace.n_experts
    pos = inverse_perm(perm).astype(np.int64)
    if cache_slots <= 0:
        hits = None
    elif hits is None:  # hits depend on the tokens, not the order: callers scoring many orders pass them
        hits = lru_hits(trace.experts, E, cache_slots)
    reads = np.zeros(trace.n_layers)
    nbytes = np.zeros(trace.n_layers)
    useful = np.zeros(trace.n_layers)
    runs = 0.0
    n_token_layers = 0
    n_sel = 0
    n_hit = 0
    for layer in trace.moe_layers():
        sets = trace.experts[:, layer, :].astype(np.int64)
        valid = sets >= 0
        p = np.where(valid, pos[layer][np.where(valid, sets, 0)], 0)
        # adjacency runs (unit slices, no gap, no cache)
        _, _, r, _ = merge_ranges_batched(p, p + 1, 0, valid)
        has = valid.any(axis=1)
        runs += float(r[has].sum())
        n_token_layers += int(has.sum())
        want = valid if hits is None else valid & ~hits[:, layer, :]
        n_sel += int(valid.sum())
        n_hit += int((valid & ~want).sum())
        memo: dict[int, tuple[float, float]] = {}
        for s in geometry.for_layer(layer).regions:
            if s not in memo:
                _, _, rr, bb = merge_ranges_batched(p * s, p * s + s, gap, want)
                memo[s] = (float(rr.sum()), float(bb.sum()))
            reads[layer] += memo[s][0]
            nbytes[layer] += memo[s][1]
            useful[layer] += float(want.sum()) * s
    out = {
        "reads_per_token": float(reads.sum() / N),
        "bytes_per_token": float(nbytes.sum() / N),
        "useful_bytes_per_token": float(useful.sum() / N),
        "runs_per_token_layer": runs / max(n_token_layers, 1),
        "hit_rate": n_hit / max(n_sel, 1),
        "misses_per_token": (n_sel - n_hit) / N,
        "n_tokens": N,
        "layout": geometry.layout,
        "gap": int(gap),
        "cache_slots": int(cache_slots),
    }
    if per_layer:
        out["reads_per_layer"] = (reads / N).tolist()
    return out
