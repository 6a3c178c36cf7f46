"""Where expert bytes come from by default: an mmap of the file.

The engine asks for experts by ORIGINAL id only: `source.fetch(layer, ids) -> {id: {role: raw}}`
(raw uint8 slice bytes, roles as in `MoeLayer.weights`). The default source slices an mmap of
the file; `runtime/store.py` implements the same `fetch` with explicit, merged reads.
"""

from __future__ import annotations


import numpy as np

from mbolt.core.gguf_set import split_vaddr
from mbolt.core.header import MappedFile
from mbolt.core.moe_map import MoeMap
from mbolt.core.routemap import expert_ranges


class MmapExpertSource:
    """Expert slices straight from an mmap of the file (the page cache decides what is read)."""

    def __init__(self, moemap: MoeMap):
        self.map = moemap
        self._files = [MappedFile(p) for p in moemap.paths]  # one map per file (the shards of a split set)
        self._bufs = [f.buf for f in self._files]
        self._ranges: dict[int, np.ndarray] = {}

    def ranges(self, layer: int) -> np.ndarray:
        """int64 [E, n_roles, 2] (virtual start, size) by original id, roles in layer.weights order."""
        r = self._ranges.get(layer)
        if r is None:
            r = self._ranges[layer] = expert_ranges(self.map, layer)
        return r

    def fetch(self, layer: int, expert_ids) -> dict[int, dict[str, np.ndarray]]:
        roles = [t.role for t in self.map.layers[layer].weights]
        r = self.ranges(layer)
        out = {}
        for e in expert_ids:
            e = int(e)
            d = {}
            for role, (v, n) in zip(roles, r[e]):
                f, s = split_vaddr(v)
                d[role] = self._bufs[f][s:s + int(n)]
            out[e] = d
        return out

    def close(self) -> None:
        self._bufs = []
        for f in self._files:
            f.close()
