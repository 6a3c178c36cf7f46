"""One cache rule, two bindings (issue 56): the expert slot cache's rule is written once, in C
(`mbolt_lru_admit`, core/lru.c). ArrayLru calls it through ctypes; its pure-Python body is the
fallback where no C compiler exists; the runtime's filter library (runtime/native.c, compiled with
lru.c) exports the same function. Every trace here is replayed through the C binding, the Python
fallback and SlotLru (the hashable-key form the replay uses), and every hit and every victim
compared: BigMoeOnEdge's real Qwen3-30B-A3B routing (mbolt/data/bigmoeonedge/qwen.route.csv) and
synthetic traces (random, pins, slots changed by a resize, 0 slots, slots >= experts, steps that
bring more experts than the slots). A hand-worked trace pins the rule itself down."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import IN_CI

from mbolt.core import lru
from mbolt.core.lru import ArrayLru, SlotLru, by_last_use

needs_cc = pytest.mark.skipif(lru.c_admit() is None and not IN_CI,
                              reason="no C compiler: ArrayLru runs its Python fallback (required in CI)")

BINDINGS = ("c", "python")


def _array_lru(E: int, slots: int, binding: str) -> ArrayLru:
    return ArrayLru(slots, np.zeros(E, np.uint8), np.zeros(E, np.int64), np.zeros(1, np.int64), binding=binding)


class Replay:
    """The same events sent to one cache of each binding and a SlotLru; what each answered kept,
    step by step: ("step", hits, victims), ("resize", victims), ("discard",)."""

    def __init__(self, E: int, slots: int):
        self.caches = {b: _array_lru(E, slots, b) for b in BINDINGS}
        self.caches["slot"] = SlotLru(slots)
        self.log = {name: [] for name in self.caches}

    def step(self, keys) -> None:
        for name, c in self.caches.items():
            hits, gone = c.step(list(keys))
            self.log[name].append(("step", hits, list(gone)))

    def resize(self, slots: int) -> None:
        """What ExpertStore.resize does: the new slots, then an empty admit evicts the excess."""
        for name, c in self.caches.items():
            c.slots = slots
            self.log[name].append(("resize", list(c.admit(()))))

    def pin(self, keys) -> None:
        for c in self.caches.values():
            c.pinned = set(keys)

    def discard(self, key) -> None:
        for name, c in self.caches.items():
            c.discard(key)
            self.log[name].append(("discard",))

    def check(self) -> tuple[int, int, int]:
        """Every binding answered as C did, and holds the same keys in the same order; returns
        (hits, misses, victims) of C's answers."""
        want = self.log["c"]
        for name in ("python", "slot"):
            got = self.log[name]
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g == w, (name, i, g, w)
            assert list(self.caches[name].order) == self.caches["c"].order
            assert len(self.caches[name]) == len(self.caches["c"])
        hits = sum(sum(e[1]) for e in want if e[0] == "step")
        misses = sum(len(e[1]) - sum(e[1]) for e in want if e[0] == "step")
        victims = sum(len(e[-1]) for e in want if e[0] in ("step", "resize"))
        return hits, misses, victims


@needs_cc
def test_a_hand_worked_trace():
    """The rule, worked out by hand: 3 slots; a step's hits are what was cached before it; its
    keys become most recently used in order; the least recently used unpinned leave, a step's
    own keys too when it brings more than the slots."""
    for binding in BINDINGS:
        c = _array_lru(8, 3, binding)
        assert c.binding == binding
        assert c.step([0, 1, 2]) == ([False, False, False], [])
        assert c.step([3]) == ([False], [0])  # order now 1 2 3
        assert c.step([1, 4]) == ([True, False], [2])  # 3 1 4
        assert c.step([5, 6, 7, 3]) == ([False, False, False, True], [1, 4, 5])  # k > slots: the last 3 stay
        assert c.order == [6, 7, 3]
        c.pinned = {7}
        assert c.step([0, 1, 2]) == ([False, False, False], [6, 3, 0])  # 7 pinned: 1 2 and 7 stay
        assert sorted(c.order) == [1, 2, 7] and len(c) == 3
        c.slots = 1
        assert c.admit(()) == [1, 2]  # a resize: the pin stays
        c.pinned = {0, 1}
        assert c.step([0, 1]) == ([False, False], [7])  # pins beyond the slots: the cache is over by one
        assert c.order == [0, 1]
        c.slots = 0
        assert c.step([2, 3]) == ([False, False], []) and c.order == [0, 1]  # no cache: nothing changes
        with pytest.raises(IndexError):
            c.admit([8])
        with pytest.raises(IndexError):
            c.admit([-1])


@needs_cc
@pytest.mark.parametrize("slots", [6, 16, 27, 51])
def test_real_qwen3_routing_gives_every_binding_the_same_hits_and_victims(data_dir, slots):
    """BigMoeOnEdge's Qwen3-30B-A3B trace (48 layers x 128 experts, top-6; the prompt and 128
    decode tokens of one chat turn): each layer's cache from cold, the prompt as one step (the
    union by last use, as a prompt pass admits it), then token by token."""
    from mbolt.core.trace import PREFILL, select_phase
    from mbolt.trace.formats import load_trace

    trace = load_trace(data_dir / "bigmoeonedge" / "qwen.route.csv")
    prompt = trace.phase == PREFILL
    assert 0 < prompt.sum() < trace.n_tokens
    decode = select_phase(trace, "decode")
    assert decode.n_tokens == 128
    total = np.zeros(3, np.int64)
    rates = []
    for layer in range(trace.n_layers):
        r = Replay(trace.n_experts, slots)
        union = by_last_use(trace.experts[prompt, layer])
        r.step(union.tolist())
        first = len(r.log["c"])
        for row in decode.experts[:, layer]:
            r.step([int(e) for e in row if e >= 0])
        total += r.check()
        # decode hit rate from a cold cache, as mbolt/data/README.md records it for this file
        cold = Replay(trace.n_experts, slots)
        for row in decode.experts[:, layer]:
            cold.step([int(e) for e in row])
        h, m, _ = cold.check()
        rates.append(h / (h + m))
        assert len(r.log["c"]) == first + 128
    hits, misses, victims = total
    assert hits > 0 and misses > 0
    assert victims > 48 * 10  # the cache was full and evicted all along: every victim compared
    recorded = {16: 0.609, 27: 0.756, 51: 0.897}  # mbolt/data/README.md (means over the 48 layers)
    if slots in recorded:
        assert np.mean(rates) == pytest.approx(recorded[slots], abs=2e-3)


@needs_cc
def test_random_traces_with_pins_resizes_and_discards():
    rng = random.Random(56)
    totals = np.zeros(3, np.int64)
    pinned_victims = 0
    for trial in range(400):
        E = rng.randint(1, 64)
        slots = rng.choice([0, 1, rng.randint(0, E), E, E + rng.randint(1, 4)])
        r = Replay(E, slots)
        pins: set[int] = set()
        if rng.random() < 0.4:  # at times more pins than slots: the cache is over by that much
            pins = set(rng.sample(range(E), rng.randint(0, min(E, slots + 2))))
            r.pin(pins)
        for t in range(60):
            k = rng.randint(0, min(E, 12) + 2)
            keys = [rng.randrange(E) for _ in range(k)]  # repeats too: a key counts at its last use
            r.step(keys)
            if rng.random() < 0.08:
                r.resize(rng.choice([0, 1, rng.randint(0, E), E + 1]))
            if rng.random() < 0.05:
                r.discard(rng.randrange(E))
        totals += r.check()
        pinned_victims += sum(v in pins for e in r.log["c"] if e[0] != "discard" for v in e[-1])
    hits, misses, victims = totals
    assert hits > 1000 and misses > 1000 and victims > 1000
    assert pinned_victims == 0  # a pinned key never left


@needs_cc
def test_zero_slots_and_slots_beyond_the_experts():
    rng = random.Random(7)
    E = 32
    trace = [[rng.randrange(E) for _ in range(rng.randint(1, 8))] for _ in range(200)]
    for slots, want_victims in ((0, 0), (E, 0), (E + 5, 0), (E - 1, None)):
        r = Replay(E, slots)
        for keys in trace:
            r.step(keys)
        hits, misses, victims = r.check()
        if slots == 0:
            assert hits == 0 and len(r.caches["c"]) == 0  # no cache: every use a miss
        if want_victims is not None:
            assert victims == 0
        else:
            assert victims > 0


@needs_cc
def test_the_filter_library_exports_the_same_rule(monkeypatch):
    """The runtime's filter library (runtime/native.c with core/lru.c) holds mbolt_lru_admit too:
    ArrayLru bound to it answers a random trace as the Python fallback does."""
    from mbolt.runtime import native

    lib = native._library()
    assert lib is not None
    monkeypatch.setattr(lru, "_ADMIT", lru.bind_admit(lib))
    rng = random.Random(9)
    E, slots = 48, 10
    a, b = _array_lru(E, slots, "c"), _array_lru(E, slots, "python")
    assert a._admit_c is lru._ADMIT
    victims = 0
    for t in range(500):
        keys = rng.sample(range(E), rng.randint(1, 8))
        ga, gb = a.step(keys), b.step(keys)
        assert ga == gb, t
        victims += len(ga[1])
    assert victims > 100 and a.order == b.order
