"""The bound beside every figure: Belady's MIN under the one cache rule (replay.OptPolicy) and
the decode tok/s bound (bench.bound), on hand-worked traces, an exhaustive search and the real
granite routing."""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mbolt.bench.bound import decode_bound, miss_bytes_per_token
from mbolt.bench.replay import BeladyPolicy, LruPolicy, OptPolicy, cache_sweep, replay
from _trace_util import make_trace

from mbolt.core.errors import MboltError


def one_layer(tokens, n_experts=6):
    return make_trace([[list(t)] for t in tokens], n_experts=n_experts)


def misses(trace, policy):
    return replay(trace, policy).misses


# ---- by hand ----


def test_opt_one_expert_per_token_by_hand():
    # 2 slots, empty: 0m 1m 0h 2m (evict 1: next at 5, 0's at 4) 0h 1m (evict 2: never again)
    # 3m (evict 1: never again; 0 is needed at 7) 0h -> 5 misses; LRU misses 6
    t = one_layer([[e] for e in [0, 1, 0, 2, 0, 1, 3, 0]])
    assert misses(t, OptPolicy(1, 2)) == 5
    assert misses(t, LruPolicy(1, 2)) == 6


def test_opt_keeps_the_one_needed_soonest_beside_a_tokens_experts():
    # k=2, 3 slots. t0 {0,1} mm; t1 {2,3} mm, one old one stays: 0 (needed at t2) over 1 (t3);
    # t2 {0,2} hh; t3 {1,3}: 1m 3h -> 5 misses. LRU drops 0 at t1 (least recent): 6 misses.
    t = one_layer([[0, 1], [2, 3], [0, 2], [1, 3]])
    assert misses(t, OptPolicy(1, 3)) == 5
    assert misses(t, LruPolicy(1, 3)) == 6


def test_opt_fewer_slots_than_selected_keeps_the_soonest_needed():
    # 1 slot, k=2: t0 {0,1} mm, keeps 1 (needed at t1); t1 {1,2}: 1h 2m, keeps 1 (t2) over 2
    # (never); t2 {0,1}: 0m 1h -> 4 misses. LRU keeps the last requested: 2 then 1 -> 5.
    t = one_layer([[0, 1], [1, 2], [0, 1]])
    assert misses(t, OptPolicy(1, 1)) == 4
    assert misses(t, LruPolicy(1, 1)) == 5


def test_opt_layers_are_separate_caches():
    # layer 0 repeats expert 0 (1 miss), layer 1 alternates 0/1 in one slot (4 misses)
    t = make_trace([[[0], [0]], [[0], [1]], [[0], [0]], [[0], [1]]], n_layers=2, n_experts=6)
    pol = OptPolicy(2, 1)
    assert misses(t, pol) == 5 and pol.misses.tolist() == [1, 4]


# ---- against every eviction choice ----


def brute_force_misses(tokens: list[list[int]], slots: int, start: frozenset = frozenset()) -> int:
    """The fewest misses of one layer's cache that starts holding `start`, searched over every
    choice the rule allows: after a token the cache holds all its experts plus any subset of the
    others it held, up to `slots` in all; when the token selected more than `slots`, any `slots`
    or fewer of them."""
    tokens = [tuple(dict.fromkeys(t)) for t in tokens]

    @lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(tokens):
            return 0
        req = frozenset(tokens[i])
        cost = len(req - cache)
        if len(req) > slots:
            nexts = [frozenset(c) for n in range(slots + 1) for c in combinations(sorted(req), n)]
        else:
            old = sorted(cache - req)
            room = slots - len(req)
            nexts = [req | frozenset(c) for n in range(min(room, len(old)) + 1) for c in combinations(old, n)]
        return cost + min(best(i + 1, s) for s in nexts)

    return best(0, frozenset(start))


tiny_tokens = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True), min_size=1, max_size=9)


@settings(max_examples=300, deadline=None)
@given(tiny_tokens, st.integers(1, 4))
def test_opt_equals_exhaustive_search(tokens, slots):
    assert misses(one_layer(tokens), OptPolicy(1, slots)) == brute_force_misses(tokens, slots)


def test_prefilled_opt_by_hand():
    # 2 slots holding {0, 1} at the start: 0h 1h 0h 2m (evict 1: next at 5, 0's at 4) 0h 1m
    # (evict 2) 3m (evict 1) 0h -> 3 misses, the empty start's 5 less its first fill of 2
    t = one_layer([[e] for e in [0, 1, 0, 2, 0, 1, 3, 0]])
    assert misses(t, OptPolicy(1, 2, prefilled=True)) == 3
    assert miss_bytes_per_token(t, 2, 1000, prefilled=True) == 375.0
    # more slots than distinct experts: nothing is ever missed
    assert misses(t, OptPolicy(1, 8, prefilled=True)) == 0


@settings(max_examples=200, deadline=None)
@given(tiny_tokens, st.integers(1, 4))
def test_prefilled_opt_equals_the_best_start_of_an_exhaustive_search(tokens, slots):
    """No cache misses less than prefilled MIN, whatever it holds at the start: the search over
    every start of up to `slots` experts (of the 5 the tokens draw from) and every choice after."""
    starts = [frozenset(c) for n in range(slots + 1) for c in combinations(range(5), n)]
    best = min(brute_force_misses(tokens, slots, s) for s in starts)
    assert misses(one_layer(tokens), OptPolicy(1, slots, prefilled=True)) == best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=2, max_size=60),
       st.integers(1, 5))
def test_opt_bounds_lru_and_is_bounded_by_free_fill_belady(layer_tokens, slots):
    """MIN starts empty and must admit: never more misses than LRU, never fewer than `belady`,
    which fills its cache for free and may decline to admit."""
    n = len(layer_tokens) // 2
    t = make_trace([[layer_tokens[i], layer_tokens[n + i]] for i in range(n)], n_layers=2, n_experts=6)
    opt = misses(t, OptPolicy(2, slots))
    assert opt <= misses(t, LruPolicy(2, slots))
    assert opt >= misses(t, BeladyPolicy(2, slots))


# ---- the real routing ----


def test_opt_never_worse_than_lru_on_granite(data_dir):
    from mbolt.core.trace import select_phase
    from mbolt.trace.formats import load_trace

    t = select_phase(load_trace(data_dir / "granite3moe.trace.txt"), "decode")
    assert (t.n_tokens, t.n_layers, t.k) == (64, 24, 8)
    for slots in (2, 4, 8, 12, 16, 24):
        opt, lru = replay(t, OptPolicy(24, slots)), replay(t, LruPolicy(24, slots))
        assert opt.accesses == lru.accesses == 64 * 24 * 8
        if slots == 8:  # N = k: after every token any cache holds exactly its experts, no choice
            assert opt.misses == lru.misses
        else:
            assert opt.misses < lru.misses  # on real routing LRU leaves misses on the table
        # a cold start pays each layer's distinct experts once, and no cache can do better
        distinct = sum(len(set(t.experts[:, l].ravel().tolist())) for l in range(24))
        assert opt.misses >= distinct
    assert replay(t, OptPolicy(24, 32)).misses == distinct  # every expert fits: only cold misses


def test_sweep_lists_opt_beside_the_others(data_dir):
    from mbolt.trace.formats import load_trace

    rows = cache_sweep(load_trace(data_dir / "granite3moe.trace.txt"), [4, 16]).rows
    for r in rows:
        assert r["lru"] <= r["opt"] <= r["belady"]


def test_cache_cli_json_has_opt(data_dir):
    import json

    from typer.testing import CliRunner

    from mbolt.cli import app

    r = CliRunner().invoke(app, ["cache", str(data_dir / "granite3moe.trace.txt"), "--cache-slots", "8", "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["rows"][0]
    assert row["lru"] <= row["opt"] <= row["belady"]


# ---- the decode bound ----


def test_decode_bound_by_hand():
    # 50 ms compute, 64 MB of misses per token: at 1.6 GB/s the reads take 40 ms, hidden behind
    # the compute -> 20 tok/s; on a 125 MB/s cloud volume they take 512 ms -> 1/0.512 tok/s
    fast = decode_bound(0.05, 64e6, 1.6e9)
    assert (fast.limit, fast.io_s, fast.tok_s) == ("compute", pytest.approx(0.04), pytest.approx(20.0))
    cloud = decode_bound(0.05, 64e6, 125e6)
    assert cloud.limit == "io" and cloud.io_s == pytest.approx(0.512) and cloud.tok_s == pytest.approx(1.953125)
    assert cloud.share(1.5) == pytest.approx(0.768)  # mbolt's share: 1.5 tok/s measured
    assert decode_bound(0.0, 1e6, 1e6).tok_s == 1.0  # no compute: the drive alone
    assert decode_bound(0.25, 0.0, 1e6).tok_s == 4.0  # every expert cached: the compute alone


@pytest.mark.parametrize("args, what", [((0.05, 1e6, 0), "bandwidth"), ((-1, 1e6, 1e9), "compute"),
                                        ((0.05, math.nan, 1e9), "miss bytes"), ((0, 0, 1e9), "both 0")])
def test_decode_bound_refuses(args, what):
    with pytest.raises(MboltError, match=what):
        decode_bound(*args)


def test_miss_bytes_per_token_by_hand():
    # the hand trace above: 5 misses in 8 tokens with 2 slots; one expert is 1000 bytes
    t = one_layer([[e] for e in [0, 1, 0, 2, 0, 1, 3, 0]])
    assert miss_bytes_per_token(t, 2, 1000) == 625.0
    # two layers of different sizes (mixed quantization types): layer 1 misses 4 of 4
    t2 = make_trace([[[0], [0]], [[0], [1]], [[0], [0]], [[0], [1]]], n_layers=2, n_experts=6)
    assert miss_bytes_per_token(t2, 1, [100, 10]) == (1 * 100 + 4 * 10) / 4
    with pytest.raises(MboltError, match="one per layer"):
        miss_bytes_per_token(t2, 1, [1, 2, 3])
