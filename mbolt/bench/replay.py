"""Cache-policy replay: one loop, interchangeable policies (nuthatch's Replay/CachePolicy shape).

`replay(trace, policy)` walks the tokens in order and each token's MoE layers in order; every
policy answers `step(layer, experts) -> hits` with the one cache rule of `mbolt.core.lru` (a hit
is an expert resident as of the previous token: what the planner's evaluator and the streaming
store count, so `--cache-slots` means one thing everywhere). A miss is an expert that must be
read from disk. `per_access=True` counts as nuthatch did instead: every access checks and
updates the cache, so an expert can be evicted between two accesses of one token; it is kept to
reproduce nuthatch's reference table (`mbolt cache --nuthatch-lines`).

Policies (budget = expert slots per layer; the OS policy pools the same total):
- `LruPolicy`        per-layer LRU, starts empty.
- `LearnedPinPolicy` per layer, the `pin` hottest experts of a training split are resident from
                     the start (always hit; their preload is a one-off start-up cost) and the
                     remaining `budget - pin` slots are a per-layer LRU. pin = ceil(share*budget).
- `OsPolicy`         one global LRU over (layer, expert) with budget * n_moe_layers slots: what a
                     page cache does when nothing is layer-aware.
- `BeladyPolicy`     the clairvoyant optimum for the same per-layer slots (evict the slot whose
                     next use is farthest). Its cache starts filled with the first `budget`
                     distinct experts, i.e. the initial fill is free, as it is for learned-pin's
                     pinned set: so it is an upper bound for every policy with `budget` slots per
                     layer, whatever their start state. `scope="global"` bounds the OS policy.
- `LayerCachePolicy` per-layer caches of any class with SlotLru's interface (`mbolt.core.cache_policy`:
                     crf = LRFU, lfu, lru-2, arc, 2q), each starting empty: `compare_policies`.
- `OptPolicy`        Belady's MIN under the one cache rule: the fewest misses any per-layer cache
                     of `budget` slots can have when, like LRU, it starts empty and admits every
                     expert a token selects (evicting the cached expert used again farthest ahead,
                     never one the token selected). The bound beside LRU and the store's cache;
                     `belady` above is looser (free initial fill, and it may decline to admit).

How nuthatch counted (per access; chen3feng/nuthatch src/cache: cache_policy.cc Replay, trace_sweep.cc,
learned_pin_policy.cc): every record of the trace in file order, no warm-up, hit rate =
hits / accesses; pin = (3*budget + 3) // 4 (= ceil(0.75 * budget)); pin set from a usage histogram
of the same trace (in-sample); OS capacity budget * n_layers. `nuthatch_lines_trace` rebuilds
their record sequence from the text export (one pseudo-token per line) to reproduce their table.
Ties in the histogram: lowest expert id first (nuthatch's order is unordered_map's; in-sample
on granite it makes no difference at the printed precision).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core import cache_policy as cp
from mbolt.core.lru import SlotLru
from mbolt.core.trace import DECODE, Trace, select_phase, split_trace

# per-layer policies `compare_policies` replays beside the LRU and MIN (`mbolt cache --policies`)
LAYER_POLICIES = {
    "crf": lambda slots, E, lam: cp.CrfCache(slots, E, lam),
    "lfu": lambda slots, E, lam: cp.CrfCache(slots, E, 0.0),
    "lru-2": lambda slots, E, lam: cp.Lru2Cache(slots, E),
    "arc": lambda slots, E, lam: cp.ArcCache(slots, E),
    "2q": lambda slots, E, lam: cp.TwoQCache(slots, E),
}
COMPARED = ("lru", *LAYER_POLICIES, "opt")


# ---- the access sequence ----


def accesses(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The flat (layer, expert) access sequence replay walks: token-major, layer, rank order."""
    ex = np.asarray(trace.experts)
    n, L, k = ex.shape
    layer = np.broadcast_to(np.arange(L, dtype=np.int32)[None, :, None], ex.shape).reshape(-1)
    flat = ex.reshape(-1).astype(np.int32)
    keep = flat >= 0
    return layer[keep], flat[keep]


def usage_histogram(trace: Trace) -> np.ndarray:
    """Per layer, how often each expert was selected: int64 [n_layers, n_experts]."""
    L, E = trace.n_layers, trace.n_experts
    ly, ex = accesses(trace)
    h = np.zeros(L * E, dtype=np.int64)
    np.add.at(h, ly.astype(np.int64) * E + ex, 1)
    return h.reshape(L, E)


def pin_count(budget: int, share: float) -> int:
    """Pinned slots out of `budget`: ceil(share * budget), at least 1 when budget > 0."""
    if budget <= 0:
        return 0
    return max(1, min(budget, math.ceil(share * budget - 1e-9)))


# ---- policies ----


class CachePolicy:
    """`step(layer, experts)`: one token at one layer, hits against the cache as it stood (the
    one rule, `mbolt.core.lru`); `access(layer, expert)`: one access, nuthatch's counting."""

    name = "policy"

    def start(self, layers: np.ndarray, experts: np.ndarray) -> None:  # noqa: B027
        """Called once before the loop with the whole access sequence (only Belady looks)."""

    def step(self, layer: int, experts: list[int]) -> list[bool]:
        raise NotImplementedError

    def access(self, layer: int, expert: int) -> bool:
        raise NotImplementedError


class LruPolicy(CachePolicy):
    name = "lru"

    def __init__(self, n_layers: int, slots: int):
        self.layers = [SlotLru(slots) for _ in range(n_layers)]

    def step(self, layer, experts):
        return self.layers[layer].step(experts)[0]

    def access(self, layer, expert):
        return self.layers[layer].touch(expert)


class LayerCachePolicy(CachePolicy):
    """One cache per layer, made by `make()` (any class with SlotLru's step)."""

    def __init__(self, name: str, n_layers: int, make):
        self.name = name
        self.layers = [make() for _ in range(n_layers)]

    def step(self, layer, experts):
        return self.layers[layer].step(experts)[0]


class LearnedPinPolicy(CachePolicy):
    name = "learned-pin"

    def __init__(self, usage: np.ndarray, budget: int, share: float = 0.75):
        self.pin = pin_count(budget, share)
        self.lru_slots = budget - self.pin
        # Hottest first; ties -> lowest expert id (stable sort on -count).
        order = np.argsort(-usage, axis=1, kind="stable")
        self.pinned = [set(order[l, : self.pin].tolist()) for l in range(usage.shape[0])]
        self.layers = [SlotLru(self.lru_slots) for _ in range(usage.shape[0])]

    def step(self, layer, experts):
        pinned, lru = self.pinned[layer], self.layers[layer]
        rest = [e for e in experts if e not in pinned]
        hits = dict(zip(rest, lru.step(rest)[0]))
        return [e in pinned or hits[e] for e in experts]

    def access(self, layer, expert):
        return expert in self.pinned[layer] or self.layers[layer].touch(expert)


class OsPolicy(CachePolicy):
    name = "os"

    def __init__(self, capacity: int):
        self.lru = SlotLru(capacity)

    def step(self, layer, experts):
        return self.lru.step([(layer, e) for e in experts])[0]

    def access(self, layer, expert):
        return self.lru.touch((layer, expert))


def next_uses(layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """For each access of the flat sequence (`accesses`), the index of the next access to the
    same (layer, expert); len(sequence) when there is none."""
    n = len(layers)
    keys = layers.astype(np.int64) * (1 << 20) + experts
    out = np.full(n, n, dtype=np.int64)
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = int(keys[i])
        out[i] = last.get(k, n)
        last[k] = i
    return out


class BeladyPolicy(CachePolicy):
    """Clairvoyant optimum with a free initial fill (see the module docstring): after each step
    the cache keeps, of what it held and what the token asked for, the `slots` keys needed
    soonest (a newcomer needed later than all of them is not admitted)."""

    name = "belady"

    def __init__(self, n_layers: int, slots: int, scope: str = "layer"):
        if scope not in ("layer", "global"):
            raise ValueError(scope)
        self.n_layers, self.slots, self.scope = n_layers, slots, scope

    def start(self, layers, experts):
        self._next = next_uses(layers, experts)
        self._i = 0
        n_caches = self.n_layers if self.scope == "layer" else 1
        self._cache = [dict() for _ in range(n_caches)]  # key -> next use
        self._filled = [0] * n_caches  # distinct keys admitted for free

    def step(self, layer, experts):
        slot = layer if self.scope == "layer" else 0
        c = self._cache[slot]
        hits = []
        for e in experts:
            key = e if self.scope == "layer" else (layer, e)
            nxt = int(self._next[self._i])
            self._i += 1
            hit = key in c
            if not hit and self.slots > 0 and self._filled[slot] < self.slots:
                self._filled[slot] += 1  # the initial fill: resident from the start
                hit = True
            hits.append(hit)
            c[key] = nxt
        while len(c) > self.slots:
            del c[max(c, key=c.__getitem__)]
        return hits

    def access(self, layer, expert):
        return self.step(layer, [expert])[0]


class OptPolicy(CachePolicy):
    """Belady's MIN under the one cache rule (module docstring): the fewest misses a cache of
    `slots` experts per layer can have on this routing. Starts empty; after each token the cache
    holds the token's experts (the `slots` needed soonest when the token selected more, as LRU
    keeps its last `slots`) and, in the room left, the experts it held that are needed soonest.
    Evicting the one used again farthest ahead is optimal here as in Belady's proof (exchange:
    keeping a sooner-needed expert instead never costs a miss); tests check it against a
    search over every eviction choice. Needs the future: `replay` hands it the whole trace.

    `prefilled`: the cache starts full, not empty, holding each layer's `slots` experts needed
    soonest (the best start any cache could have: a decode after a prompt pass that filled it).
    Then no cache that starts in any state misses less (tests: against the search over every
    start and every eviction choice)."""

    name = "opt"

    def __init__(self, n_layers: int, slots: int, prefilled: bool = False):
        self.n_layers, self.slots, self.prefilled = n_layers, max(int(slots), 0), bool(prefilled)

    def start(self, layers, experts):
        self._next = next_uses(layers, experts)
        self._i = 0
        self._cache: list[dict] = [dict() for _ in range(self.n_layers)]  # expert -> index of its next use
        self.misses = np.zeros(self.n_layers, dtype=np.int64)  # per layer: a layer's bytes may differ
        if self.prefilled:
            for i, (lay, e) in enumerate(zip(layers.tolist(), experts.tolist())):
                c = self._cache[lay]
                if len(c) < self.slots and e not in c:
                    c[e] = i  # its first use is its next use from the start

    def step(self, layer, experts):
        c = self._cache[layer]
        hits = [e in c for e in experts]
        self.misses[layer] += len(hits) - sum(hits)
        want: dict = {}
        for e in experts:  # a repeated id keeps its later access's next use
            want[e] = int(self._next[self._i])
            self._i += 1
        if self.slots == 0:
            return hits
        for e in want:
            c.pop(e, None)
        if len(want) >= self.slots:
            c.clear()
            c.update((e, want[e]) for e in heapq.nsmallest(self.slots, want, key=want.__getitem__))
        else:
            over = len(c) + len(want) - self.slots
            if over > 0:
                for e in heapq.nlargest(over, c, key=c.__getitem__):
                    del c[e]
            c.update(want)
        return hits

    def access(self, layer, expert):
        return self.step(layer, [expert])[0]


# ---- the loop ----


@dataclass
class ReplayStats:
    accesses: int = 0
    hits: int = 0
    layer_misses: np.ndarray | None = None  # int64 [n_layers] (token-by-token replay only)

    def bytes_missed(self, expert_bytes: np.ndarray) -> int:
        """The bytes read: each layer's misses times its expert's size."""
        return int(np.dot(self.layer_misses, np.asarray(expert_bytes, np.int64)))

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def replay(trace: Trace, policy: CachePolicy, per_access: bool = False) -> ReplayStats:
    """Feed `trace` to `policy` token by token, layer by layer (`step`: the one cache rule), or
    access by access (`per_access`: nuthatch's counting); count hits. The one replay loop."""
    layers, experts = accesses(trace)
    policy.start(layers, experts)
    hits = 0
    if per_access:
        acc = policy.access
        for lay, e in zip(layers.tolist(), experts.tolist()):
            hits += acc(lay, e)
        return ReplayStats(len(layers), hits)
    missed = np.zeros(trace.n_layers, np.int64)
    for row in np.asarray(trace.experts).tolist():
        for lay, ids in enumerate(row):
            ids = [e for e in ids if e >= 0]
            if ids:
                h = sum(policy.step(lay, ids))
                hits += h
                missed[lay] += len(ids) - h
    return ReplayStats(len(layers), hits, missed)


# ---- the sweep `mbolt cache` runs ----


@dataclass
class CacheSweep:
    budgets: list[int]
    rows: list[dict]  # per budget: {budget, pin, learned-pin, lru, os, belady, opt, belady_global}
    mode: str  # "in-sample" | "held-out"
    train_tokens: int
    test_tokens: int
    pin_share: float
    phase: str
    notes: list[str] = field(default_factory=list)
    counting: str = "per token (the one cache rule)"

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "phase": self.phase, "pin_share": self.pin_share, "counting": self.counting,
            "train_tokens": self.train_tokens, "test_tokens": self.test_tokens,
            "rows": self.rows, "notes": self.notes,
        }


def cache_sweep(trace: Trace, budgets=(4, 8, 16), *, in_sample: bool = False,
                pin_share: float = 0.75, train_share: float = 0.5, phase: str = "decode",
                per_access: bool = False) -> CacheSweep:
    """Hit rate of every policy at every per-layer budget.

    Held-out (default): the pin set comes from the first `train_share` of the tokens and every
    policy is measured on the rest. `in_sample`: pin set and measurement on the same tokens.
    `per_access`: nuthatch's counting (see `replay`).
    """
    trace = select_phase(trace, phase)
    if in_sample:
        train = test = trace
    else:
        train, test, _ = split_trace(trace, train_frac=train_share, phase="all")
        if test is None:
            raise MboltError(f"--train-frac {train_share:g} holds out no tokens (use --in-sample)")
    usage = usage_histogram(train)
    n_moe = max(1, len(trace.moe_layers()))
    L = trace.n_layers
    rows = []
    for b in budgets:
        b = int(b)
        if b <= 0:
            raise MboltError(f"budget must be positive, got {b}")
        pin = LearnedPinPolicy(usage, b, pin_share)
        row = {"budget": b, "pin": pin.pin, "lru_slots": pin.lru_slots}
        for pol in (pin, LruPolicy(L, b), OsPolicy(b * n_moe), BeladyPolicy(L, b), OptPolicy(L, b)):
            st = replay(test, pol, per_access)
            row[pol.name] = st.hit_rate
            row["accesses"] = st.accesses
        row["belady_global"] = replay(test, BeladyPolicy(L, b * n_moe, scope="global"), per_access).hit_rate
        rows.append(row)
    return CacheSweep([int(b) for b in budgets], rows, "in-sample" if in_sample else "held-out",
                      train.n_tokens, test.n_tokens, pin_share, phase, list(trace.notes),
                      "per access (nuthatch)" if per_access else "per token (the one cache rule)")


def compare_policies(trace: Trace, budgets, policies=COMPARED, *, lam: float = cp.DEFAULT_LAM,
                     expert_bytes: np.ndarray | None = None) -> list[dict]:
    """Per budget, every policy of `policies` (names of COMPARED) replayed from an empty cache
    over `trace` (its tokens as given: select the phase first): hit rate, misses, bytes when
    `expert_bytes` (per layer) is given, and misses / MIN's at that budget."""
    unknown = [p for p in policies if p not in COMPARED]
    if unknown:
        raise MboltError(f"unknown cache policy {unknown[0]!r} (choose from {', '.join(COMPARED)})")
    L, E = trace.n_layers, trace.n_experts
    rows = []
    for b in budgets:
        b = int(b)
        if b <= 0:
            raise MboltError(f"budget must be positive, got {b}")
        row = {"budget": b}
        for name in dict.fromkeys((*policies, "opt")):
            if name == "lru":
                pol = LruPolicy(L, b)
            elif name == "opt":
                pol = OptPolicy(L, b)
            else:
                make = LAYER_POLICIES[name]
                pol = LayerCachePolicy(name, L, lambda: make(b, E, lam))
            st = replay(trace, pol)
            row[name] = {"hit_rate": st.hit_rate, "misses": st.misses}
            if expert_bytes is not None:
                row[name]["bytes"] = st.bytes_missed(expert_bytes)
            row["accesses"] = st.accesses
        for name in policies:
            row[name]["vs_min"] = row[name]["misses"] / max(row["opt"]["misses"], 1)
        rows.append(row)
    return rows


def nuthatch_lines_trace(path: str | Path) -> Trace:
    """nuthatch's own reading of its text export: every line `layer e0 .. ek` is one record.

    Replaying this reproduces `trace_replay --text` exactly, including the 93 prompt lines that
    the export bug corrupted (DESIGN.md); use the shared importer for real analyses.
    """
    from mbolt.trace.formats.nuthatch import nuthatch_text_rows

    path = Path(path)
    from mbolt.core.checks import check_cells

    try:
        text = path.read_bytes().decode("ascii")
    except OSError as e:
        raise MboltError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise MboltError(f"{path}: not a nuthatch text trace (non-ASCII byte at {e.start})") from None
    rows, _ = nuthatch_text_rows(text, str(path))
    if not rows:
        raise MboltError(f"{path}: no records")
    L = max(r[0] for r in rows) + 1
    E = max(max(r[1:]) for r in rows) + 1
    k = max(len(r) - 1 for r in rows)
    check_cells(f"{path}: lines x layers x k", (len(rows), L, k))
    ex = np.full((len(rows), L, k), -1, dtype=np.int16)
    for t, r in enumerate(rows):
        ex[t, r[0], : len(r) - 1] = r[1:]
    n = len(rows)
    return Trace(L, E, k, ex, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32),
                 np.arange(n, dtype=np.int32),
                 notes=[f"{path.name}: nuthatch line records (one pseudo-token per line)"])
