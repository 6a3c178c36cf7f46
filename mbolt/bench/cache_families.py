"""Expert-cache families beyond `mbolt.core.cache_policy`, replayed against Belady's MIN on the
real routing traces by `scripts/bench_cache_families.py` (results/cache_families.json). Replay
only: nothing here is wired into the runtime. They were tried because the best of
`cache_policy`'s families (LRFU, LFU, LRU-2, ARC, 2Q) still misses 1.53x (Qwen3-30B-A3B) and 1.44x
(Gemma-4-26B-A4B) as often as MIN at 27 slots (results/cache_real.json); the literature's other
answers are admission filters, small-queue and ghost schemes, inter-reference recency,
overdue-ness and hyperbolic decay. None reaches 1.4x MIN there either, even with its parameters
chosen in hindsight (the results file).

Two kinds:

- Forced admission, the one cache rule of `mbolt.core.lru` (after a token every expert it
  selected is cached, unless the token alone selects more than `slots`; a token never evicts an
  expert it selected): `S3FifoCache`, `LirsCache` (ordered lists, on `_ListCache` as ARC and 2Q
  are), `IrrCache`, `StaleCache`, `HyperbolicCache` (a score per expert, on `ScoredCache`). Their
  bound is `OptPolicy` (MIN, forced).
- Admission / bypass: a missed expert is read and used for the token anyway, but may be dropped
  right after instead of evicting a cached one: `LfuBypassCache`, `TinyLfuCache`. Each lists the
  token's experts it did not keep in `bypassed` (after the last `admit`) and counts them in
  `nbypass`. One that bypassed does not obey the one cache rule, so its honest bound is
  `BypassOptPolicy` (MIN that may bypass; <= OptPolicy's).

The interface is `_ListCache`'s or `ScoredCache`'s (step, admit, __contains__, __len__, slots);
keys are expert ids 0..n_experts-1; a hit is an expert cached as of the previous token.

What C would keep per expert per layer, were one of them worth porting:

| class | per expert | per layer |
|---|---|---|
| LfuBypassCache | decayed count, stamp | clock |
| TinyLfuCache | decayed count, stamp, last use, region (window/main/none) | clock, access count |
| S3FifoCache | queue (S/M/none) and place in it, 2-bit count, ghost stamp | ghost counter |
| LirsCache | LIR flag, place in the stack, place in Q | - |
| IrrCache, StaleCache | last use, EWMA inter-reference gap | clock (Stale: mean gap) |
| HyperbolicCache | use count, start token | clock |
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from mbolt.bench.replay import OptPolicy
from mbolt.core.cache_policy import CrfCache, ScoredCache, _first, _ListCache

# ---- forced admission, ordered lists ----


class S3FifoCache(_ListCache):
    """S3-FIFO (Yang et al., SOSP'23): newcomers enter a small FIFO S (`small` of the slots)
    unless the ghost FIFO remembers them (as many entries as M's slots: an entry is live while
    fewer than that many were ghosted after it), then they enter the main FIFO M. Evicting from
    S: its head moves to M (count cleared) if hit at least `threshold` times while in S, else it
    leaves and is ghosted. Evicting from M: 2-bit CLOCK (a head with count > 0 goes to the back
    with count - 1). Evict from S while it holds at least its share, else from M. The token's
    own experts are passed over (not moved, not decremented)."""

    def __init__(self, slots: int, n_experts: int = 0, small: float = 0.1, threshold: int = 1):
        super().__init__(slots, n_experts)
        self.s_target = max(1, round(small * self.slots))
        self.ghost_size = max(1, self.slots - self.s_target)
        self.threshold = int(threshold)
        self.S, self.M = OrderedDict(), OrderedDict()  # head (next out) first
        self.freq: dict[int, int] = {}
        self.ghosted: dict[int, int] = {}  # expert -> number of its last ghosting
        self.n_ghosted = 0

    def _resident(self):
        return (self.S, self.M)

    def _use(self, key):
        if key in self:
            self.freq[key] = min(self.freq[key] + 1, 3)
            return
        g = self.ghosted.pop(key, None)
        (self.M if g is not None and self.n_ghosted - g < self.ghost_size else self.S)[key] = None
        self.freq[key] = 0

    def _victim(self, protect):
        v = self._evict_s(protect) if len(self.S) >= self.s_target else None
        if v is None:
            v = self._evict_m(protect)
        return self._evict_s(protect) if v is None else v

    def _evict_s(self, protect):
        while (t := _first(self.S, protect)) is not None:
            del self.S[t]
            if self.freq[t] >= self.threshold:
                self.M[t] = None
                self.freq[t] = 0
                continue
            self.n_ghosted += 1
            self.ghosted[t] = self.n_ghosted
            return t
        return None

    def _evict_m(self, protect):
        while (t := _first(self.M, protect)) is not None:
            if not self.freq[t]:
                del self.M[t]
                return t
            self.freq[t] -= 1
            self.M.move_to_end(t)
        return None

    def _drop(self, key):
        self.discard(key)


class LirsCache(_ListCache):
    """LIRS (Jiang and Zhang, SIGMETRICS'02): experts with a small inter-reference recency are
    LIR (kept), the rest HIR; `hir` of the slots (at least 1) hold resident HIR experts in a FIFO
    Q. The stack holds experts by last use; pruning keeps a LIR at its bottom. A resident HIR
    expert hit while in the stack becomes LIR and the bottom LIR goes to Q. A miss evicts Q's
    head (passing over the token's experts; when Q has none, the bottom-most LIR not in the
    token), then becomes LIR if it is still in the stack (a non-resident HIR), else resident HIR.
    LIRS decides on each miss as it comes, so `admit` is its own, not `_ListCache`'s."""

    def __init__(self, slots: int, n_experts: int = 0, hir: float = 0.1):
        super().__init__(slots, n_experts)
        self.h = min(self.slots, max(1, round(hir * self.slots)))
        self.n_lir_max = self.slots - self.h
        self.lir: dict[int, None] = {}  # resident LIR experts
        self.Q = OrderedDict()  # resident HIR experts, head first
        self.stack = OrderedDict()  # bottom (oldest use) first

    def _resident(self):
        return (self.Q, self.lir)

    def _push(self, key):
        self.stack.pop(key, None)
        self.stack[key] = None

    def _prune(self):
        while self.stack and next(iter(self.stack)) not in self.lir:
            self.stack.popitem(last=False)

    def _demote_bottom(self):
        b = next(k for k in self.stack if k in self.lir)
        del self.lir[b], self.stack[b]
        self.Q[b] = None
        self._prune()

    def _evict(self, protect):
        v = _first(self.Q, protect)
        if v is not None:
            del self.Q[v]  # stays in the stack (a non-resident HIR) if it was there
            return v
        v = next((k for k in self.stack if k in self.lir and k not in protect), None)
        if v is not None:
            self._drop(v)
        return v

    def _drop(self, key):
        if key in self.lir:
            del self.lir[key], self.stack[key]
        self.Q.pop(key, None)
        self._prune()

    discard = _drop

    def admit(self, keys) -> list:
        if self.slots <= 0:
            return []
        want = list(dict.fromkeys(keys))
        protect = set(want) | self.pinned
        gone = []
        for x in want:
            if x in self.lir:
                self._push(x)
                self._prune()
            elif x in self.Q:
                if x in self.stack:
                    del self.Q[x]
                    self.lir[x] = None
                    self._push(x)
                    self._demote_bottom()
                else:
                    self._push(x)
                    self.Q.move_to_end(x)
            else:
                if len(self) >= self.slots:
                    v = self._evict(protect)
                    if v is not None:
                        gone.append(v)
                in_stack = x in self.stack
                self._push(x)
                if len(self.lir) < self.n_lir_max:
                    self.lir[x] = None
                elif in_stack:  # a non-resident HIR seen again soon enough: swaps with the bottom LIR
                    self.lir[x] = None
                    self._demote_bottom()
                else:
                    self.Q[x] = None
        while len(self) > self.slots and (v := self._drop_own_earliest(want)) is not None:
            gone.append(v)
        return gone


# ---- forced admission, scored (ScoredCache: lowest score leaves) ----


class IrrCache(ScoredCache):
    """LIRS's inter-reference recency as a score: the victim is the expert with the largest
    max(idle, gap), idle = tokens since its last use, gap = EWMA (weight `alpha` on the newest) of
    its gaps between uses (alpha 1: the last gap, LIRS's IRR in tokens); an expert used only once
    has gap infinity (LIRS: HIR), so it goes first, oldest first."""

    __slots__ = ("alpha", "gap")

    def __init__(self, slots: int, n_experts: int, alpha: float = 1.0):
        super().__init__(slots, n_experts)
        self.alpha = float(alpha)
        self.gap = np.full(n_experts, np.inf)

    def use(self, key, now):
        if self.stamp[key] >= 0:
            g = float(now - self.stamp[key])
            self.gap[key] = g if np.isinf(self.gap[key]) else self.alpha * g + (1 - self.alpha) * self.gap[key]
        self.stamp[key] = now

    def scores(self, keys, now):
        return -np.maximum((now - self.stamp[keys]).astype(np.float64), self.gap[keys])


class StaleCache(ScoredCache):
    """Least stale: the victim is the most overdue expert, the largest idle / gap (idle = tokens
    since its last use, gap = EWMA of its gaps between uses, weight `alpha` on the newest; an
    expert used once is given the layer's mean observed gap, 1 before any). Keeps the experts
    whose usual rhythm says they are due; no parameter is fitted beyond alpha."""

    __slots__ = ("alpha", "gap", "gn", "gsum")

    def __init__(self, slots: int, n_experts: int, alpha: float = 0.5):
        super().__init__(slots, n_experts)
        self.alpha = float(alpha)
        self.gap = np.full(n_experts, np.nan)
        self.gsum, self.gn = 0.0, 0

    def use(self, key, now):
        if self.stamp[key] >= 0:
            g = float(now - self.stamp[key])
            self.gsum += g
            self.gn += 1
            self.gap[key] = g if np.isnan(self.gap[key]) else self.alpha * g + (1 - self.alpha) * self.gap[key]
        self.stamp[key] = now

    def scores(self, keys, now):
        prior = self.gsum / self.gn if self.gn else 1.0
        gap = np.where(np.isnan(self.gap[keys]), prior, self.gap[keys])
        return -(now - self.stamp[keys]).astype(np.float64) / np.maximum(gap, 1e-9)


class HyperbolicCache(ScoredCache):
    """Hyperbolic caching (Blankstein et al., ATC'17): the victim has the lowest uses / tokens
    since it started counting (`reset`: since it last entered the cache, the paper's rule; else
    since first seen). Ties: older last use."""

    __slots__ = ("count", "reset", "start")

    def __init__(self, slots: int, n_experts: int, reset: bool = True):
        super().__init__(slots, n_experts)
        self.reset = bool(reset)
        self.count = np.zeros(n_experts, np.float64)
        self.start = np.full(n_experts, -1, np.int64)

    def use(self, key, now):
        if self.start[key] < 0 or (self.reset and not self.cached[key]):
            self.start[key] = now
            self.count[key] = 0.0
        self.count[key] += 1.0
        self.stamp[key] = now

    def scores(self, keys, now):
        return self.count[keys] / (now - self.start[keys] + 1).astype(np.float64)


# ---- admission / bypass ----


class LfuBypassCache(CrfCache):
    """LRFU/LFU with bypass (CrfCache's decayed count; lam 0: LFU): a missed expert enters only
    if the cache has room or its count beats the lowest-count cached expert not in this token,
    which then leaves (`tie_admit`: a tie enters too); otherwise it is used and dropped.
    Newcomers are tried most valuable first (ties: the token's order)."""

    __slots__ = ("bypassed", "nbypass", "tie_admit")

    def __init__(self, slots: int, n_experts: int, lam: float = 0.0, tie_admit: bool = False):
        super().__init__(slots, n_experts, lam)
        self.tie_admit = bool(tie_admit)
        self.bypassed: list[int] = []
        self.nbypass = 0

    def admit(self, keys) -> list:
        self.bypassed = []
        if self.slots <= 0:
            return []
        want = self.use_token(keys)
        value = self.scores(np.arange(len(self.cached)), self.clock).tolist()
        new = sorted((k for k in want if not self.cached[k]), key=lambda k: -value[k])  # ties: token order
        mine = set(want) | self.pinned
        others = None  # the cached experts not in this token, least valuable first
        gone = []
        for k in new:
            if self._n >= self.slots:
                if others is None:
                    others = self.ranked(c for c in np.flatnonzero(self.cached).tolist() if c not in mine)
                vk, vv = value[k], value[others[0]] if others else np.inf
                if not (vk > vv or (self.tie_admit and vk == vv)):
                    self.bypassed.append(k)
                    continue
                v = others.pop(0)
                self.cached[v] = False
                self._n -= 1
                gone.append(v)
            self.cached[k] = True
            self._n += 1
        self.nbypass += len(self.bypassed)
        return gone


class TinyLfuCache(_ListCache):
    """W-TinyLFU (Einziger, Friedman and Manes, 2017): a window LRU of `round(window * slots)`
    slots takes every newcomer; what falls out of it (its least recent) competes with the main
    cache's victim (`main_victim` "lru": its least recent; "lfu": its lowest count) and stays
    only if its count is strictly higher; the loser leaves. Counts are CrfCache's decayed uses
    (2^-lam per token), exact per expert instead of the paper's sketch (128 experts fit). An
    expert keeps its last use as its place in the LRU orders, in the window and in main alike.
    A loser selected by this token (possible only when the window holds fewer than the token's
    experts that pass through it; window 0 is plain TinyLFU admission in front of the main
    cache) is dropped after use: a bypass, though it may have been a hit."""

    def __init__(self, slots: int, n_experts: int, lam: float = 0.0, window: float = 0.2,
                 main_victim: str = "lru"):
        super().__init__(slots, n_experts)
        if main_victim not in ("lru", "lfu"):
            raise ValueError(main_victim)
        self.main_victim = main_victim
        self.w = min(self.slots, max(0, round(window * self.slots)))
        self.m = self.slots - self.w
        self.counts = CrfCache(0, n_experts, lam)  # used for its counts only
        self.last = [0] * n_experts  # access number of the last use: the LRU order
        self.clock = self.seq = 0
        self.win: dict[int, None] = {}
        self.main: dict[int, None] = {}
        self.bypassed: list[int] = []
        self.nbypass = 0

    def _resident(self):
        return (self.win, self.main)

    def __contains__(self, key) -> bool:
        return key in self.win or key in self.main

    def admit(self, keys) -> list:
        self.bypassed = []
        if self.slots <= 0:
            return []
        self.clock += 1
        now = self.clock
        want = list(dict.fromkeys(keys))
        for k in want:
            self.seq += 1
            self.counts.use(k, now)
            self.last[k] = self.seq
            if k not in self:
                self.win[k] = None
        mine = set(want)
        gone = []
        if len(self.win) > self.w:
            value = self.counts.scores(np.arange(len(self.last)), now).tolist()
        while len(self.win) > self.w:
            c = min(self.win, key=self.last.__getitem__)
            del self.win[c]
            if len(self.main) < self.m or c in self.pinned:
                self.main[c] = None
                continue
            cands = [v for v in self.main if v not in mine and v not in self.pinned]
            if self.main_victim == "lru":
                v = min(cands, key=self.last.__getitem__, default=None)
            else:
                v = min(cands, key=lambda x: (value[x], self.last[x]), default=None)
            if v is not None and value[c] > value[v]:
                del self.main[v]
                gone.append(v)
                self.main[c] = None
            else:
                (self.bypassed if c in mine else gone).append(c)
        self.nbypass += len(self.bypassed)
        return gone


# ---- the bypass bound ----


class BypassOptPolicy(OptPolicy):
    """Belady's MIN that may bypass, starting empty: a token's experts not cached before it are
    misses; then, of the cached experts and the token's, the `slots` needed soonest stay (a
    newcomer needed later than all of them is used and dropped). Keeping the soonest needed is
    optimal when any subset may be kept (Belady's exchange argument; the tests check it against a
    search over every keep/bypass choice). The fewest misses any per-layer cache of `slots`
    experts can have when it may decline to keep what it read: <= OptPolicy's, which must keep
    every token's experts, and unlike `BeladyPolicy` it pays for its initial fill."""

    name = "opt-bypass"

    def step(self, layer, experts):
        c = self._cache[layer]
        hits = [e in c for e in experts]
        self.misses[layer] += len(hits) - sum(hits)
        for e in experts:
            c[e] = int(self._next[self._i])  # a repeated id keeps its later access's next use
            self._i += 1
        if len(c) > self.slots:
            keep = heapq.nsmallest(self.slots, c.items(), key=lambda kv: kv[1])
            c.clear()
            c.update(keep)
        return hits
