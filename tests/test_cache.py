"""Cache-policy replay against tiny traces worked out by hand, and nuthatch's granite table."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mbolt.bench.replay import (
    BeladyPolicy, LearnedPinPolicy, LruPolicy, OsPolicy, cache_sweep, nuthatch_lines_trace,
    pin_count, replay, split_trace, usage_histogram,
)
from _trace_util import make_trace

from mbolt.core.errors import MboltError


SEQ = [0, 1, 0, 2, 0, 1, 3, 0]  # one layer, one expert per token


def seq_trace():
    return make_trace([[[e]] for e in SEQ])


def test_lru_by_hand():
    # 2 slots: 0m 1m 0h 2m(evict 1) 0h 1m(evict 2) 3m(evict 0) 0m -> 2 hits
    st_ = replay(seq_trace(), LruPolicy(1, 2))
    assert (st_.accesses, st_.hits) == (8, 2)


def test_belady_by_hand():
    # 2 slots, free initial fill {0, 1}: 0h 1h 0h 2(never again: bypass)m 0h 1h 3m 0h -> 6 hits
    assert replay(seq_trace(), BeladyPolicy(1, 2)).hits == 6


def test_learned_pin_by_hand():
    t = seq_trace()
    u = usage_histogram(t)
    assert u.tolist() == [[4, 2, 1, 1]]
    pol = LearnedPinPolicy(u, budget=2, share=0.5)  # pin {0}, one LRU slot
    assert pol.pinned == [{0}] and pol.lru_slots == 1
    # 0h 1m 0h 2m 0h 1m 3m 0h -> 4 hits
    assert replay(t, pol).hits == 4


def test_pin_ties_lowest_id_first():
    u = np.array([[3, 5, 5, 1, 5]])
    assert LearnedPinPolicy(u, budget=2, share=1.0).pinned == [{1, 2}]


def test_pin_count_matches_nuthatch_rounding():
    # nuthatch: pin = (3*budget + 3) // 4 for budget > 1, 1 for budget 1
    for b in range(1, 40):
        assert pin_count(b, 0.75) == ((3 * b + 3) // 4 if b > 1 else 1)


def test_os_global_lru_by_hand():
    t = make_trace([[[0], [0]], [[1], [0]], [[0], [0]]], n_layers=2)
    # accesses (0,0) (1,0) (0,1) (1,0) (0,0) (1,0), 2 global slots:
    # m m m(evict (0,0)) h m(evict (0,1)) h -> 2 hits
    assert replay(t, OsPolicy(2)).hits == 2


def test_skips_unrecorded_layers():
    t = make_trace([[[0, 1], []], [[], [2]]], n_layers=2)
    assert replay(t, LruPolicy(2, 4)).accesses == 3


def test_held_out_split_uses_leading_tokens():
    t = make_trace([[[0]], [[0]], [[1]], [[1]]])
    train, test, _ = split_trace(t, train_frac=0.5, phase="all")
    assert train.experts[:, 0, 0].tolist() == [0, 0] and test.experts[:, 0, 0].tolist() == [1, 1]
    sw = cache_sweep(t, [1], pin_share=1.0, phase="all")
    # pin {0} from the training half, held-out accesses are 1, 1: no LRU slot -> 0 hits
    assert sw.rows[0]["learned-pin"] == 0.0
    sw = cache_sweep(t, [1], pin_share=1.0, phase="all", in_sample=True)
    assert sw.rows[0]["learned-pin"] == 0.5  # pin {0} (tie -> lowest id): hits on the two 0s


def test_bad_budget_and_split():
    with pytest.raises(MboltError):
        cache_sweep(seq_trace(), [0], phase="all")
    with pytest.raises(MboltError, match="no tokens"):
        cache_sweep(make_trace([[[0]]]).select(np.zeros(1, bool)), [1], phase="all")
    with pytest.raises(MboltError, match="too few"):
        cache_sweep(make_trace([[[0]], [[1]]]), [1], phase="all")


tok_st = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(tok_st, min_size=2, max_size=2), st.integers(1, 4), st.floats(0.0, 1.0))
def test_belady_bounds_every_policy(layers, budget, share):
    n = min(len(x) for x in layers)
    t = make_trace([[layers[0][i], layers[1][i]] for i in range(n)], n_layers=2, n_experts=6)
    u = usage_histogram(t)
    best = replay(t, BeladyPolicy(2, budget)).hits
    for pol in (LruPolicy(2, budget), LearnedPinPolicy(u, budget, share)):
        assert replay(t, pol).hits <= best
    assert replay(t, OsPolicy(2 * budget)).hits <= replay(t, BeladyPolicy(2, 2 * budget, scope="global")).hits


def _clean_decode(data_dir):
    """The 64 clean decode tokens of the granite export (lines 93..), built here independently."""
    rows = [list(map(int, s.split())) for s in (data_dir / "granite3moe.trace.txt").read_text().splitlines()]
    rows = rows[93:]
    assert len(rows) == 64 * 24
    return make_trace([[rows[i * 24 + l][1:] for l in range(24)] for i in range(64)], n_layers=24, n_experts=32)


def test_granite_reproduces_nuthatch(data_dir):
    t = nuthatch_lines_trace(data_dir / "granite3moe.trace.txt")
    assert t.n_tokens == 1629
    r4 = cache_sweep(t, [4], in_sample=True, phase="all", per_access=True).rows[0]
    assert round(100 * r4["learned-pin"], 1) == 22.4
    assert round(100 * r4["lru"], 1) == 4.7
    assert round(100 * r4["os"], 1) == 0.0
    held = cache_sweep(_clean_decode(data_dir), [4, 16], per_access=True).rows
    assert [round(100 * held[0][p], 1) for p in ("learned-pin", "lru")] == [20.0, 4.8]
    assert [round(100 * held[1][p], 1) for p in ("learned-pin", "lru")] == [69.6, 64.2]
    for r in held:
        assert r["belady"] >= r["learned-pin"]


def test_granite_held_out_through_the_importer(data_dir):
    from mbolt.trace.formats import load_trace

    t = load_trace(data_dir / "granite3moe.trace.txt")
    rows = cache_sweep(t, [4, 16], phase="decode", per_access=True).rows
    assert [round(100 * rows[0][p], 1) for p in ("learned-pin", "lru", "os")] == [20.0, 4.8, 0.0]
    assert [round(100 * rows[1][p], 1) for p in ("learned-pin", "lru")] == [69.6, 64.2]


def test_cache_cli_json(data_dir):
    import json

    from typer.testing import CliRunner

    from mbolt.cli import app

    r = CliRunner().invoke(app, ["cache", str(data_dir / "granite3moe.trace.txt"), "--nuthatch-lines",
                                 "--in-sample", "--cache-slots", "4", "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["rows"][0]
    assert round(100 * row["learned-pin"], 1) == 22.4 and round(100 * row["lru"], 1) == 4.7
    r = CliRunner().invoke(app, ["cache", str(data_dir / "granite3moe.trace.txt"), "--cache-slots", "x"])
    assert r.exit_code == 2


def _naive_token_lru(experts: np.ndarray, slots: int) -> int:
    """Hits of the one cache rule, written out plainly: a layer's list, most recent last; a
    token's experts are hits if in the list before the token; then each moves to the end."""
    hits = 0
    for layer in range(experts.shape[1]):
        cache: list[int] = []
        for row in experts[:, layer]:
            ids = [int(e) for e in row if e >= 0]
            hits += sum(e in cache for e in ids)
            for e in ids:
                if e in cache:
                    cache.remove(e)
                cache.append(e)
            del cache[:max(0, len(cache) - slots)]
    return hits


def test_one_cache_rule_in_evaluator_replay_and_store(data_dir, tmp_path):
    """`--cache-slots N` means one thing: the evaluator (plan, predict), the replay (`mbolt
    cache`) and the streaming store count the same hits on the real granite routing, equal to a
    plain LRU written here; nuthatch's per-access counting differs when N < k."""
    from mbolt.runtime.store import ExpertStore
    from mbolt.synth.synth import SynthConfig, write_synth
    from mbolt.layout.evaluate import lru_hits

    tr = _clean_decode(data_dir)
    model = write_synth(tmp_path / "g.gguf", SynthConfig(n_layers=24, n_experts=32, n_used=8, hidden=32,
                                                         expert_ff=16, seed=1))
    for slots in (4, 8, 16):
        want = _naive_token_lru(tr.experts, slots)
        assert int(lru_hits(tr.experts, 32, slots).sum()) == want
        assert replay(tr, LruPolicy(24, slots)).hits == want
        with ExpertStore(model, cache_slots=slots, drop_pages=False) as s:
            for t in range(tr.n_tokens):
                for l in range(24):
                    s.read(l, tr.experts[t, l])
            assert s.snapshot().hits == want
    assert replay(tr, LruPolicy(24, 4), per_access=True).hits != _naive_token_lru(tr.experts, 4)
