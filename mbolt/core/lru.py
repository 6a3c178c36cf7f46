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
