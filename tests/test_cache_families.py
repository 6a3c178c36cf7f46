"""The cache families of `mbolt.bench.cache_families` (scripts/bench_cache_families.py): the bypass
bound against a search over every keep/bypass choice, the two bounds on real routing, and what
every family promises (at most `slots` experts; a token never evicts an expert it selected) on
random routing."""

from __future__ import annotations

import random
from functools import cache
from itertools import combinations

import pytest
from _trace_util import make_trace

from mbolt.bench import cache_families as cf
from mbolt.bench.replay import LayerCachePolicy, OptPolicy, replay


def random_tokens(rng: random.Random, n_tokens: int, n_experts: int, k_max: int) -> list[list[int]]:
    return [rng.sample(range(n_experts), rng.randint(1, k_max)) for _ in range(n_tokens)]


def fewest_misses_with_bypass(tokens: list[list[int]], slots: int) -> int:
    """One layer's fewest misses when, after each token, the cache may hold any subset of what it
    held and what the token selected, up to `slots`: every keep, evict and bypass choice."""
    tokens = [frozenset(t) for t in tokens]

    @cache
    def best(i: int, held: frozenset) -> int:
        if i == len(tokens):
            return 0
        pool = sorted(held | tokens[i])
        return len(tokens[i] - held) + min(
            best(i + 1, frozenset(kept)) for n in range(min(slots, len(pool)) + 1) for kept in combinations(pool, n))

    return best(0, frozenset())


def test_bypass_min_equals_exhaustive_search():
    rng = random.Random(0)
    for _ in range(150):
        slots = rng.randint(1, 4)
        a, b = (random_tokens(rng, rng.randint(1, 8), 5, 3) for _ in range(2))
        n = min(len(a), len(b))
        pol = cf.BypassOptPolicy(2, slots)
        st = replay(make_trace([[a[i], b[i]] for i in range(n)], n_layers=2, n_experts=5), pol)
        want = [fewest_misses_with_bypass(a[:n], slots), fewest_misses_with_bypass(b[:n], slots)]
        assert pol.misses.tolist() == want and st.misses == sum(want)


def test_bypass_min_at_most_forced_min_on_real_routing(data_dir):
    from mbolt.core.trace import select_phase
    from mbolt.trace.formats import load_trace

    t = select_phase(load_trace(data_dir / "bigmoeonedge" / "qwen.route.csv"), "decode")
    assert (t.n_tokens, t.n_layers, t.n_experts) == (128, 48, 128)
    for slots in (16, 27, 51):
        forced, bypass = OptPolicy(t.n_layers, slots), cf.BypassOptPolicy(t.n_layers, slots)
        f, b = replay(t, forced).misses, replay(t, bypass).misses
        assert (bypass.misses <= forced.misses).all() and b < f


FAMILIES = {
    "s3-fifo": lambda s, E: cf.S3FifoCache(s, E, small=0.2, threshold=1),
    "s3-fifo-thr2": lambda s, E: cf.S3FifoCache(s, E, small=0.35, threshold=2),
    "lirs": lambda s, E: cf.LirsCache(s, E, hir=0.2),
    "lirs-hir1%": lambda s, E: cf.LirsCache(s, E, hir=0.01),
    "irr": lambda s, E: cf.IrrCache(s, E, alpha=0.5),
    "stale": lambda s, E: cf.StaleCache(s, E, alpha=0.5),
    "hyperbolic": lambda s, E: cf.HyperbolicCache(s, E, reset=True),
    "hyperbolic-noreset": lambda s, E: cf.HyperbolicCache(s, E, reset=False),
    "lfu-bypass": lambda s, E: cf.LfuBypassCache(s, E, lam=0.0, tie_admit=False),
    "lrfu-bypass-tie": lambda s, E: cf.LfuBypassCache(s, E, lam=1 / 8, tie_admit=True),
    "tinylfu": lambda s, E: cf.TinyLfuCache(s, E, lam=0.0, window=0.0, main_victim="lru"),
    "w-tinylfu-lfu": lambda s, E: cf.TinyLfuCache(s, E, lam=1 / 16, window=0.2, main_victim="lfu"),
    "w-tinylfu-half": lambda s, E: cf.TinyLfuCache(s, E, lam=0.0, window=0.5, main_victim="lru"),
}
BYPASS = (cf.LfuBypassCache, cf.TinyLfuCache)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_slots_and_the_tokens_own_experts(name):
    """Checked from outside, by asking which experts are cached before and after every token."""
    rng = random.Random(name)
    E = 12
    for _ in range(40):
        slots = rng.randint(1, 7)
        cache = FAMILIES[name](slots, E)
        for token in random_tokens(rng, 40, E, 5):
            before = {e for e in range(E) if e in cache}
            hits, gone = cache.step(token)
            after = {e for e in range(E) if e in cache}
            dropped = set(getattr(cache, "bypassed", ()))  # the token's experts dropped after use
            assert hits == [e in before for e in token]
            assert len(after) <= slots and len(cache) == len(after)
            assert dropped <= set(token) and not dropped & after and not dropped & set(gone)
            assert set(gone) == (before | set(token)) - after - dropped
            if isinstance(cache, BYPASS) or len(token) <= slots:
                assert set(token) - dropped <= after
            else:  # the token alone overfills the cache: it holds `slots` of the token's experts
                assert after <= set(token) and len(after) == slots
            if not isinstance(cache, BYPASS):
                assert not dropped


@pytest.mark.parametrize("name", list(FAMILIES))
def test_no_family_beats_its_bound(name):
    rng = random.Random(name)
    for _ in range(10):
        slots, E = rng.randint(1, 6), 10
        a, b = (random_tokens(rng, 40, E, 4) for _ in range(2))
        t = make_trace([[x, y] for x, y in zip(a, b)], n_layers=2, n_experts=E)
        pol = LayerCachePolicy(name, 2, lambda: FAMILIES[name](slots, E))  # noqa: B023 (called at once)
        misses = replay(t, pol).misses
        bypassed = sum(getattr(c, "nbypass", 0) for c in pol.layers)
        assert misses >= replay(t, cf.BypassOptPolicy(2, slots)).misses
        if not bypassed:
            assert misses >= replay(t, OptPolicy(2, slots)).misses
