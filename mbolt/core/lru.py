"""The one expert cache rule: a layer's slots, least recently used out.

`--cache-slots N` means the same everywhere (the planner's evaluator, `predict`, the streaming
store, `mbolt cache`): a layer keeps N experts. A token's (a call's) experts that were resident
as of the previous token are hits; then every requested expert becomes most recently used, in
request (rank) order, and the least recently used unpinned experts beyond N leave. So a token
never evicts an expert it needs itself, and k > N keeps the last N requested.

`touch` is the per-access variant nuthatch's replay counts (each access checks and updates the
cache, so an expert can leave between two accesses of one token); only the reproduction of its
reference table uses it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class SlotLru:
    """One layer's slot cache. Keys are expert ids (any hashable: the OS policy keys by
    (layer, expert)). Pinned keys, once admitted, never leave."""

    __slots__ = ("slots", "order", "pinned")

    def __init__(self, slots: int, pinned=()):
        self.slots = max(int(slots), 0)
        self.order: OrderedDict = OrderedDict()  # least recently used first
        self.pinned = set(pinned)

    def __contains__(self, key) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)

    def admit(self, keys) -> list:
        """Make `keys` most recently used in order; returns the keys that left (LRU first). A
        union of pinned keys larger than the slots stays: the cache is over by that much."""
        if self.slots <= 0:
            return []
        order = self.order
        for key in keys:
            order[key] = None
            order.move_to_end(key)
        gone = []
        while len(order) > self.slots:
            victim = next((k for k in order if k not in self.pinned), None)
            if victim is None:
                break
            del order[victim]
            gone.append(victim)
        return gone

    def step(self, keys) -> tuple[list[bool], list]:
        """One token: hits against the cache as it stood, then `admit`. Returns (hits, gone)."""
        hits = [key in self.order for key in keys]
        return hits, self.admit(keys)

    def touch(self, key) -> bool:
        """One access, nuthatch's counting: hit, then admit this key alone."""
        hit = key in self.order
        self.admit((key,))
        return hit

    def discard(self, key) -> None:
        self.order.pop(key, None)

    def clear(self) -> None:
        self.order.clear()


class ArrayLru:
    """One layer's slot cache under the same rule as SlotLru, its state in arrays that C code can
    update: `cached[e]` (uint8) and `stamp[e]` (int64, last use) for integer keys 0..E-1, and a
    shared `clock`. A use stamps `++clock`, so admitting keys in order leaves them most recently
    used in that order, exactly as SlotLru moves them to the end; eviction takes the smallest
    stamps among the unpinned. The runtime's C filter (runtime.native) answers a decode step's
    layer whose experts are all cached by stamping them itself, without Python: its hits then
    reorder this cache as `admit` would have (tests/test_runtime_hotpath.py holds the two classes to
    the same hits and victims). The count of cached keys lives in `count` (an int64 array of one
    element) because the C filter also admits misses and evicts under this rule (runtime.native)."""

    __slots__ = ("slots", "cached", "stamp", "clock", "pinned", "count")

    def __init__(self, slots: int, cached, stamp, clock, pinned=(), count=None):
        self.slots = max(int(slots), 0)
        self.cached, self.stamp, self.clock = cached, stamp, clock
        self.pinned = set(pinned)
        self.count = np.zeros(1, np.int64) if count is None else count
        self.count[0] = int(cached.sum())

    @property
    def _n(self) -> int:
        return int(self.count[0])

    @_n.setter
    def _n(self, n: int) -> None:
        self.count[0] = n

    def __contains__(self, key) -> bool:
        return bool(self.cached[key])

    def __len__(self) -> int:
        return self._n

    @property
    def order(self) -> list[int]:
        """The cached keys, least recently used first."""
        import numpy as np

        keys = np.flatnonzero(self.cached)
        return keys[np.argsort(self.stamp[keys], kind="stable")].tolist()

    def admit(self, keys) -> list:
        """Make `keys` most recently used in order; returns the keys that left (LRU first)."""
        if self.slots <= 0:
            return []
        cached, stamp, clock = self.cached, self.stamp, self.clock
        for key in keys:
            clock[0] += 1
            stamp[key] = clock[0]
            if not cached[key]:
                cached[key] = 1
                self._n += 1
        if self._n <= self.slots:
            return []
        gone = [k for k in self.order if k not in self.pinned][: self._n - self.slots]
        for k in gone:
            cached[k] = 0
        self._n -= len(gone)
        return gone

    def step(self, keys) -> tuple[list[bool], list]:
        hits = [bool(self.cached[key]) for key in keys]
        return hits, self.admit(keys)

    def discard(self, key) -> None:
        if self.cached[key]:
            self.cached[key] = 0
            self._n -= 1

    def clear(self) -> None:
        self.cached[:] = 0
        self._n = 0


def by_last_use(positions: np.ndarray) -> np.ndarray:
    """Unique positions of a step's rows, ordered by their last use (the last token's experts last:
    the LRU then keeps what the next token most likely needs)."""
    flat = positions.reshape(-1)
    flat = flat[flat >= 0]
    if flat.size == 0:
        return flat.astype(np.int64)
    u, first_in_reversed = np.unique(flat[::-1], return_index=True)
    return u[np.argsort(-first_in_reversed, kind="stable")].astype(np.int64)
