"""The one expert cache rule: a layer's slots, least recently used out.

`--cache-slots N` means the same everywhere (the planner's evaluator, `predict`, the streaming
store, `mbolt cache`): a layer keeps N experts. A token's (a call's) experts that were resident
as of the previous token are hits; then every requested expert becomes most recently used, in
request (rank) order, and the least recently used unpinned experts beyond N leave. So a token
never evicts an expert it needs itself, and k > N keeps the last N requested.

Where the rule lives: once, in C, `mbolt_lru_admit` in core/lru.c. It has two bindings over the
same arrays: `ArrayLru` here (through ctypes; the store's cache) and the runtime's C filter
(runtime/native.c, compiled with lru.c, which answers decode steps without Python). ArrayLru's
pure-Python body is only the fallback where no C compiler exists. tests/test_lru_bindings.py
replays real and synthetic traces through the C binding, the fallback and SlotLru and compares
every hit and victim.

`SlotLru` is the same rule over any hashable keys (the OS policy keys by (layer, expert)) in an
OrderedDict, kept in Python for the replay and the evaluator, whose loops call it per token and
layer (a ctypes call there would cost more than the rule); the same test holds it to the C rule.
Its `touch` is the per-access variant nuthatch's replay counts (each access checks and updates the
cache, so an expert can leave between two accesses of one token); only the reproduction of its
reference table uses it.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from pathlib import Path

import numpy as np

from mbolt.core.clib import load_c_library

_HERE = Path(__file__).parent
# the rule in C, as text: compiled alone here, and with the runtime's filter (runtime.native)
C_SOURCES = {"lru.h": (_HERE / "lru.h").read_text(), "lru.c": (_HERE / "lru.c").read_text()}

_ADMIT = False  # mbolt_lru_admit through ctypes; False: not tried yet; None: no C compiler


def c_admit():
    """`mbolt_lru_admit` of core/lru.c through ctypes, or None where no C compiler exists. The
    rule is compiled here, in core, rather than looked up in the runtime's library: core imports
    nothing above it, and the store's cache then runs the C rule whether or not the runtime's
    filter was ever built (core.clib compiles both from the same lru.c)."""
    global _ADMIT
    if _ADMIT is False:
        lib = load_c_library("lru", C_SOURCES)
        _ADMIT = None if lib is None else bind_admit(lib)
    return _ADMIT


def bind_admit(lib: ctypes.CDLL):
    """`mbolt_lru_admit` of a library that holds core/lru.c (this module's, or the runtime's)."""
    fn = lib.mbolt_lru_admit
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    # cached, stamp, n_keys, clock, count, slots, pinned, keys, n, victims
    fn.argtypes = [p, p, i64, p, p, i64, p, p, i64, p]
    fn.restype = i64
    return fn


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


class FlagArrayCache:
    """What every cache whose state is a flag per key (`cached[e]`, any numpy array) and a count of
    the set flags (`_n`) answers alike, whatever its victim rule: membership, size, a token's hits,
    dropping one key, emptying (what the rule learned about the keys, e.g. their stamps, stays).
    ArrayLru here and cache_policy's ScoredCache are two; each brings `admit` and `order`."""

    __slots__ = ()

    def __contains__(self, key) -> bool:
        return bool(self.cached[key])

    def __len__(self) -> int:
        return self._n

    def step(self, keys) -> tuple[list[bool], list]:
        """One token: hits against the cache as it stood, then `admit`. Returns (hits, gone)."""
        hits = [bool(self.cached[key]) for key in keys]
        return hits, self.admit(keys)

    def discard(self, key) -> None:
        if self.cached[key]:
            self.cached[key] = 0
            self._n -= 1

    def clear(self) -> None:
        self.cached[:] = 0
        self._n = 0


class ArrayLru(FlagArrayCache):
    """One layer's slot cache under the one rule (core/lru.c), its state in arrays the C code
    updates: `cached[e]` (uint8) and `stamp[e]` (int64, last use) for integer keys 0..E-1, a
    shared `clock` (int64 [1]: a use stamps ++clock, so admitting keys in order leaves them most
    recently used in that order) and `count` (int64 [1], the cached keys), fixed at construction
    (C holds their addresses). The runtime's C filter (runtime/native.c) updates the same arrays
    with the same C function, without Python.

    `binding`: "c" (`mbolt_lru_admit` through ctypes; an error where no C compiler exists),
    "python" (the fallback body), or None: C when it compiles, else Python."""

    __slots__ = ("slots", "cached", "stamp", "clock", "count", "_pinned", "_pin_mask", "_pin_ptr", "_admit_c",
                 "_victims", "_victims_ptr", "_args")

    def __init__(self, slots: int, cached, stamp, clock, pinned=(), count=None, binding: str | None = None):
        self.slots = max(int(slots), 0)
        self.cached, self.stamp, self.clock = cached, stamp, clock
        self.count = np.zeros(1, np.int64) if count is None else count
        self.count[0] = int(cached.sum())
        if binding not in (None, "c", "python"):
            raise ValueError(f"binding: c, python or None, not {binding!r}")
        self._admit_c = None if binding == "python" else c_admit()
        if self._admit_c is not None:
            for name, a, dt in (("cached", cached, np.uint8), ("stamp", stamp, np.int64), ("clock", clock, np.int64),
                                ("count", self.count, np.int64)):
                if a.dtype != dt or not a.flags.c_contiguous:
                    raise ValueError(f"ArrayLru: {name} must be a C-contiguous {np.dtype(dt).name} array")
            if not len(stamp) == len(cached):
                raise ValueError("ArrayLru: cached and stamp must have one entry per key")
            self._victims = np.zeros(len(cached), np.int32)
            # the addresses, once: a ctypes view of an array costs about 2 us, the rule itself less
            self._args = (cached.ctypes.data, stamp.ctypes.data, len(cached), clock.ctypes.data, self.count.ctypes.data)
            self._victims_ptr = self._victims.ctypes.data
        elif binding == "c":
            raise RuntimeError("ArrayLru: the C binding needs a C compiler (cc, gcc or $CC)")
        self.pinned = pinned

    @property
    def binding(self) -> str:
        return "python" if self._admit_c is None else "c"

    @property
    def pinned(self) -> set:
        return self._pinned

    @pinned.setter
    def pinned(self, keys) -> None:
        self._pinned = {int(k) for k in keys}
        self._pin_mask, self._pin_ptr = None, None  # C reads a mask; NULL when nothing is pinned
        if self._pinned:
            self._pin_mask = np.zeros(len(self.cached), np.uint8)
            self._pin_mask[list(self._pinned)] = 1
            self._pin_ptr = self._pin_mask.ctypes.data

    @property
    def _n(self) -> int:
        return int(self.count[0])

    @_n.setter
    def _n(self, n: int) -> None:
        self.count[0] = n

    @property
    def order(self) -> list[int]:
        """The cached keys, least recently used first."""
        keys = np.flatnonzero(self.cached)
        return keys[np.argsort(self.stamp[keys], kind="stable")].tolist()

    def admit(self, keys) -> list:
        """Make `keys` most recently used in order; returns the keys that left (LRU first)."""
        if self._admit_c is None:
            return self._admit_python(keys)
        keys = keys.reshape(-1).tolist() if isinstance(keys, np.ndarray) else list(keys)
        if keys and (min(keys) < 0 or max(keys) >= self._args[2]):  # here: ctypes would wrap a huge one
            raise IndexError(f"a key out of 0..{self._args[2] - 1}: {keys}")
        n = self._admit_c(*self._args, self.slots, self._pin_ptr, (ctypes.c_int64 * len(keys))(*keys), len(keys),
                          self._victims_ptr)
        return self._victims[:n].tolist()

    def _admit_python(self, keys) -> list:
        """The fallback where no C compiler exists: the rule of mbolt_lru_admit (core/lru.c) in Python."""
        E = len(self.cached)
        keys = [int(key) for key in keys]
        if any(not 0 <= key < E for key in keys):
            raise IndexError(f"a key out of 0..{E - 1}: {keys}")
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
        gone = [k for k in self.order if k not in self._pinned][: self._n - self.slots]
        for k in gone:
            cached[k] = 0
        self._n -= len(gone)
        return gone


def by_last_use(positions: np.ndarray) -> np.ndarray:
    """Unique positions of a step's rows, ordered by their last use (the last token's experts last:
    the LRU then keeps what the next token most likely needs)."""
    flat = positions.reshape(-1)
    flat = flat[flat >= 0]
    if flat.size == 0:
        return flat.astype(np.int64)
    u, first_in_reversed = np.unique(flat[::-1], return_index=True)
    return u[np.argsort(-first_in_reversed, kind="stable")].astype(np.int64)
