"""Where expert bytes come from by default: an mmap of the file.

The engine asks for experts by ORIGINAL id only: `source.fetch(layer, ids) -> {id: {role: raw}}`
(raw uint8 slice bytes, roles as in `MoeLayer.weights`). The default source slices an mmap of
the file; `engine/store.py` implements the same `fetch` with explicit, merged reads.
"""

from __future__ import annotations


import numpy as np

from mbolt.core.header import MappedFile
from mbolt.core.moe_map import MoeMap
from mbolt.core.routemap import expert_ranges


class MmapExpertSource:
    """Expert slices straight from an mmap of the file (the page cache decides what is read)."""

    def __init__(self, moemap: MoeMap):
        self.map = moemap
        self._file = MappedFile(moemap.path)
        self._buf = self._file.buf
        self._ranges: dict[int, np.ndarray] = {}

    def ranges(self, layer: int) -> np.ndarray:
        """int64 [E, n_roles, 2] (absolute start, size) by original id, roles in layer.weights order."""
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
            out[e] = {role: self._buf[int(s): int(s) + int(n)] for role, (s, n) in zip(roles, r[e])}
        return out

    def close(self) -> None:
        self._buf = None
        self._file.close()
