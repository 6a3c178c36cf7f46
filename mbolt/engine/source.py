"""Where expert bytes come from: the route map of a file and the default (mmap) expert source.

The engine asks for experts by ORIGINAL id only: `source.fetch(layer, ids) -> {id: {role: raw}}`
(raw uint8 slice bytes, roles as in `MoeLayer.weights`). The default source slices an mmap of
the file; `engine/store.py` implements the same `fetch` with explicit, merged reads.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from mbolt.errors import MboltError
from mbolt.gguf.header import GGUFHeader
from mbolt.gguf.moe_map import MoeMap


@dataclass
class Routes:
    """Per-layer perm (perm[l, p] = original id at position p) and its inverse pos."""

    layout: str  # stock | reorder | packed
    perm: np.ndarray  # int32 [n_layers, E]
    pos: np.ndarray  # int32 [n_layers, E]


def read_routes(header: GGUFHeader, n_layers: int, n_experts: int) -> Routes:
    """The route map of a file (identity for a stock file)."""
    try:  # the rewriter's reader, when present, is the authority
        from mbolt.rewrite.routemap import read_route_map
    except ImportError:
        read_route_map = None
    if read_route_map is not None:
        rm = read_route_map(header)
        perm = np.asarray(rm.perm, dtype=np.int32).reshape(n_layers, n_experts)
        layout = rm.layout
    else:
        raw = header.get("mbolt.perm")
        layout = header.get("mbolt.layout", "stock") if raw is not None else "stock"
        if raw is None:
            perm = np.tile(np.arange(n_experts, dtype=np.int32), (n_layers, 1))
        else:
            raw = np.asarray(raw, dtype=np.int32)
            if raw.size != n_layers * n_experts:
                raise MboltError(f"{header.path}: mbolt.perm has {raw.size} entries, expected "
                                 f"{n_layers} layers x {n_experts} experts")
            perm = raw.reshape(n_layers, n_experts)
    expect = np.arange(n_experts)
    for li in range(n_layers):
        if not np.array_equal(np.sort(perm[li]), expect):
            raise MboltError(f"{header.path}: route map of layer {li} is not a permutation of 0..{n_experts - 1}")
    pos = np.empty_like(perm)
    rows = np.arange(n_layers)[:, None]
    pos[rows, perm] = np.arange(n_experts, dtype=np.int32)[None, :]
    return Routes(layout, perm, pos)


class MmapExpertSource:
    """Expert slices straight from an mmap of the file (the page cache decides what is read)."""

    def __init__(self, moemap: MoeMap, routes: Routes):
        self.map = moemap
        self.routes = routes
        with open(moemap.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._ranges: dict[int, np.ndarray] = {}
        try:  # the rewriter's locator knows every layout (stock, reorder, packed)
            from mbolt.rewrite.routemap import expert_ranges
        except ImportError:
            expert_ranges = None
        if expert_ranges is None and routes.layout == "packed":
            raise MboltError(f"{moemap.path}: packed layout needs mbolt.rewrite.routemap")
        self._expert_ranges = expert_ranges

    def ranges(self, layer: int) -> np.ndarray:
        """int64 [E, n_roles, 2] (absolute start, size) by original id, roles in layer.weights order."""
        r = self._ranges.get(layer)
        if r is None:
            if self._expert_ranges is not None:
                r = np.asarray(self._expert_ranges(self.map, layer), dtype=np.int64)
            else:
                ml = self.map.layers[layer]
                pos = self.routes.pos[layer].astype(np.int64)
                r = np.stack([np.stack([t.data_offset + pos * t.slice_bytes,
                                        np.full(len(pos), t.slice_bytes, dtype=np.int64)], axis=-1)
                              for t in ml.weights], axis=1)
            self._ranges[layer] = r
        return r

    def fetch(self, layer: int, expert_ids) -> dict[int, dict[str, np.ndarray]]:
        roles = [t.role for t in self.map.layers[layer].weights]
        r = self.ranges(layer)
        out = {}
        for e in expert_ids:
            e = int(e)
            out[e] = {role: self._buf[int(s): int(s) + int(n)] for role, (s, n) in zip(roles, r[e])}
        return out

    def close(self) -> None:
        self._buf = None
        try:
            self._mm.close()
        except BufferError:  # numpy views still alive; the GC closes it later
            pass
