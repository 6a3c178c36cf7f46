"""Expert caches beyond the LRU, under the one cache rule of `mbolt.core.lru` (a token's experts
that were cached as of the previous token are hits; then all of them are admitted and the
least valuable others leave; a token never evicts an expert it needs itself; k > N keeps the
token's N most valuable, where the LRU keeps the last N requested). Each class has SlotLru's interface (admit, step, __contains__, __len__,
discard, clear, slots, order, pinned), so a layer's store can swap one in. Keys are expert ids
0..n_experts-1.

`CrfCache` is the one the runtime can run (chosen by replay on real traces, `mbolt cache`,
results/cache_real.json). Its state is two numbers per expert, cached or not, updated by a rule
C applies as easily as Python. A layer counts its tokens (`clock`, one tick per `admit`), and
when expert e is used at token `now`:

    crf[e] = crf[e] * 2**(-lam * (now - stamp[e])) + 1;  stamp[e] = now

The victim is the cached unpinned expert, not in this token, with the lowest decayed count
`crf[e] * 2**(-lam * (now - stamp[e]))` (LRFU's combined recency and frequency: every use
counts 1, halving every 1/lam tokens). Ties go to the older stamp, then the lower id. lam -> 0
is LFU over the whole run, a large lam is the LRU.

Why it survives drift where pinning the hottest and pure LFU fail: both rank experts by how
often they were used at any time in the past, so an expert that was hot in an earlier part of
the text (or of the training split) holds its slot long after the routing has moved on (LFU:
forever; a pin: until it is re-learned). Here an old use weighs 2**(-lam * age): at lam = 1/64
a count of 10 gathered earlier falls below one fresh use after log2(10) * 64 = 213 tokens and
below an expert used every 4 tokens far sooner, so a topic change clears the old hot set out,
while within a topic an expert used every few tokens outranks one used once. On the real
single-turn traces (128 decode tokens) there is little drift to survive: there crf and LFU are
within 2% of each other and both miss 8-12% less than the LRU (results/cache_real.json).

`Lru2Cache` (LRU-K at K=2), `ArcCache` (ARC) and `TwoQCache` (2Q) are the families it was
chosen against. ARC and 2Q keep ordered lists and ghost lists rather than a score per expert:
they are replayed, not meant for the runtime.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mbolt.core.lru import FlagArrayCache

DEFAULT_LAM = 1 / 64  # the best on all three real traces together (scripts/bench_cache.py, lam_on_all_traces)


class ScoredCache(FlagArrayCache):
    """One layer's cache whose victims are the cached experts with the lowest score. State is
    per expert (arrays of n_experts), so it is kept for experts that have left too (`clear`
    empties the cache, what was learned about the experts stays)."""

    __slots__ = ("slots", "pinned", "cached", "stamp", "clock", "_n")

    def __init__(self, slots: int, n_experts: int, pinned=()):
        self.slots = max(int(slots), 0)
        self.pinned = set(pinned)
        self.cached = np.zeros(n_experts, bool)
        self.stamp = np.full(n_experts, -1, np.int64)  # token of last use, -1 = never
        self.clock = 0  # tokens this layer has seen
        self._n = 0

    def use(self, key: int, now: int) -> None:
        """The per-access rule (what C would do on a hit)."""
        self.stamp[key] = now

    def scores(self, keys: np.ndarray, now: int) -> np.ndarray:
        return self.stamp[keys].astype(np.float64)

    def ranked(self, keys) -> list[int]:
        """`keys` least valuable first: lowest score, then older stamp, then lower id."""
        keys = np.asarray(list(keys), np.int64)
        if not len(keys):
            return []
        sc = self.scores(keys, self.clock)
        return keys[np.lexsort((keys, self.stamp[keys], sc))].tolist()

    @property
    def order(self) -> list[int]:
        """The cached experts, least valuable first (the next victims)."""
        return self.ranked(np.flatnonzero(self.cached))

    def use_token(self, keys) -> list[int]:
        """One more token on the clock, each of its experts used once (`use`); returns them in
        the token's order, once each."""
        self.clock += 1
        want = list(dict.fromkeys(int(k) for k in keys))
        for key in want:
            self.use(key, self.clock)
        return want

    def admit(self, keys) -> list:
        """Use `keys` as one token; returns the experts that left, first victim first."""
        if self.slots <= 0:
            return []
        want = self.use_token(keys)
        for key in want:
            if not self.cached[key]:
                self.cached[key] = True
                self._n += 1
        over = self._n - self.slots
        if over <= 0:
            return []
        mine = set(want)
        others = [k for k in self.order if k not in mine and k not in self.pinned]
        # when the token alone overfills the cache, its own least valuable experts go too
        gone = (others + self.ranked(k for k in want if k not in self.pinned))[:over]
        for key in gone:
            self.cached[key] = False
        self._n -= len(gone)
        return gone


class CrfCache(ScoredCache):
    """LRFU: the decayed count of uses (module docstring). `lam` = 0 is LFU."""

    __slots__ = ("lam", "crf")

    def __init__(self, slots: int, n_experts: int, lam: float = DEFAULT_LAM, pinned=()):
        super().__init__(slots, n_experts, pinned)
        if not lam >= 0:
            raise ValueError(f"lam must be >= 0, got {lam}")
        self.lam = float(lam)
        self.crf = np.zeros(n_experts, np.float64)

    def use(self, key, now):
        self.crf[key] = self.crf[key] * 2.0 ** (-self.lam * (now - self.stamp[key])) + 1.0
        self.stamp[key] = now

    def scores(self, keys, now):
        # the log of the decayed count: the same order, and no underflow after long absences
        with np.errstate(divide="ignore"):
            return np.log2(self.crf[keys]) - self.lam * (now - self.stamp[keys])


class Lru2Cache(ScoredCache):
    """LRU-K at K=2: the victim is the expert whose second-to-last use is oldest (never used
    twice: oldest of all; ties by the last use)."""

    __slots__ = ("prev",)

    def __init__(self, slots: int, n_experts: int, pinned=()):
        super().__init__(slots, n_experts, pinned)
        self.prev = np.full(n_experts, -1, np.int64)

    def use(self, key, now):
        self.prev[key] = self.stamp[key]
        self.stamp[key] = now

    def scores(self, keys, now):
        return self.prev[keys].astype(np.float64)


class _ListCache:
    """ARC's and 2Q's shared frame: admission through `_use`, eviction through `_victim`,
    never an expert of the current token (unless the token alone overfills the cache)."""

    def __init__(self, slots: int, n_experts: int = 0, pinned=()):
        self.slots = max(int(slots), 0)
        self.pinned = set(pinned)

    def __contains__(self, key) -> bool:
        return any(key in part for part in self._resident())

    def __len__(self) -> int:
        return sum(len(part) for part in self._resident())

    @property
    def order(self) -> list:
        return [k for part in self._resident() for k in part]

    def step(self, keys) -> tuple[list[bool], list]:
        hits = [k in self for k in keys]
        return hits, self.admit(keys)

    def admit(self, keys) -> list:
        if self.slots <= 0:
            return []
        want = list(dict.fromkeys(keys))
        for key in want:
            self._use(key)
        gone = []
        protect = set(want) | self.pinned
        while len(self) > self.slots:
            victim = self._victim(protect)
            if victim is None:  # only the token's own experts left
                victim = self._drop_own_earliest(want)
                if victim is None:
                    break
            gone.append(victim)
        return gone

    def _drop_own_earliest(self, want: list):
        """The token alone overfills the cache: drop its earliest cached unpinned expert and return
        it (None when every one left is pinned)."""
        victim = next((k for k in want if k in self and k not in self.pinned), None)
        if victim is not None:
            self._drop(victim)
        return victim

    def discard(self, key) -> None:
        for part in self._resident():
            part.pop(key, None)

    def clear(self) -> None:
        for part in self._resident():
            part.clear()


def _first(od: OrderedDict, protect):
    return next((k for k in od if k not in protect), None)


class ArcCache(_ListCache):
    """ARC (Megiddo and Modha): T1 seen once lately, T2 seen at least twice, ghosts B1 and B2 of
    what each evicted; the target size p of T1 follows the ghost hits."""

    def __init__(self, slots: int, n_experts: int = 0, pinned=()):
        super().__init__(slots, n_experts, pinned)
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
        self.p = 0.0
        self._ghost_hit_b2 = False

    def _resident(self):
        return (self.t1, self.t2)

    def _use(self, key):
        c = self.slots
        self._ghost_hit_b2 = False
        if key in self.t1 or key in self.t2:
            self.t1.pop(key, None)
            self.t2.pop(key, None)
            self.t2[key] = None
            return
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            del self.b2[key]
            self._ghost_hit_b2 = True
            self.t2[key] = None
        else:
            if len(self.t1) + len(self.b1) >= c and self.b1:
                self.b1.popitem(last=False)
            elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
                self.b2.popitem(last=False)
            self.t1[key] = None

    def _victim(self, protect):
        from_t1 = self.t1 and (len(self.t1) > self.p or (self._ghost_hit_b2 and len(self.t1) == self.p))
        for src, ghost in (((self.t1, self.b1), (self.t2, self.b2)) if from_t1 else
                           ((self.t2, self.b2), (self.t1, self.b1))):
            victim = _first(src, protect)
            if victim is not None:
                del src[victim]
                ghost[victim] = None
                return victim
        return None

    def _drop(self, key):
        for part, ghost in ((self.t1, self.b1), (self.t2, self.b2)):
            if key in part:
                del part[key]
                ghost[key] = None


class TwoQCache(_ListCache):
    """2Q (Johnson and Shasha, full version): newcomers enter a FIFO A1in (a quarter of the
    slots); what leaves it is remembered in a ghost FIFO A1out (half the slots); only an expert
    seen again while remembered enters the LRU Am."""

    def __init__(self, slots: int, n_experts: int = 0, pinned=()):
        super().__init__(slots, n_experts, pinned)
        self.k_in = max(1, self.slots // 4)
        self.k_out = max(1, self.slots // 2)
        self.a1in, self.a1out, self.am = OrderedDict(), OrderedDict(), OrderedDict()

    def _resident(self):
        return (self.a1in, self.am)

    def _use(self, key):
        if key in self.am:
            self.am.move_to_end(key)
        elif key in self.a1in:
            pass
        elif key in self.a1out:
            del self.a1out[key]
            self.am[key] = None
        else:
            self.a1in[key] = None

    def _victim(self, protect):
        order = (self.a1in, self.am) if len(self.a1in) > self.k_in else (self.am, self.a1in)
        for src in order:
            victim = _first(src, protect)
            if victim is not None:
                del src[victim]
                if src is self.a1in:
                    self.a1out[victim] = None
                    while len(self.a1out) > self.k_out:
                        self.a1out.popitem(last=False)
                return victim
        return None

    def _drop(self, key):
        self.a1in.pop(key, None)
        self.am.pop(key, None)
