"""Files whose expert types differ per layer (issue 20): the planner's evaluator, `predict` and the
store count the same reads and bytes, and those bytes are the file's own per-layer sizes (read
with gguf-py). Before, every layer was priced at the first MoE layer's slice size."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from mbolt.core.moe_map import moe_map
from mbolt.core.trace import DECODE, Trace
from mbolt.runtime.store import ExpertStore
from mbolt.synth.synth import SynthConfig, write_synth
from mbolt.layout.evaluate import evaluate, geometry_from_model

L, E, K, N = 4, 8, 2, 40


@pytest.fixture(scope="module", params=[dict(expert_type="Q4_0", layer_types="0-1:Q8_0"),
                                        dict(expert_type="Q8_0", down_type="Q4_0", layer_types="3:Q4_0")],
                ids=["q8-first-layers", "q4km-like-down"])
def mixed(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("mixed") / "m.gguf"
    write_synth(p, SynthConfig(arch="qwen3moe", n_layers=L, n_experts=E, n_used=K, hidden=64, expert_ff=64, seed=4,
                               **request.param))
    return p


def _trace(seed: int = 0) -> Trace:
    """Random decode tokens; expert E-1 left out, so no read spans the end of one tensor and the
    start of the next (the store would join those, the per-tensor evaluator does not)."""
    rng = np.random.default_rng(seed)
    ex = np.stack([np.stack([rng.choice(E - 1, K, replace=False) for _ in range(L)]) for _ in range(N)])
    return Trace(L, E, K, ex.astype(np.int16), np.full(N, DECODE, np.uint8), np.zeros(N, np.int32),
                 np.arange(N, dtype=np.int32))


def test_layers_really_differ(mixed):
    """gguf-py's own sizes: one expert's bytes per layer are not all equal (the case under test)."""
    r = GGUFReader(str(mixed))
    per_layer = [sum(int(t.n_bytes) // E for t in r.tensors if t.name.startswith(f"blk.{l}.ffn_")
                     and "_exps." in t.name) for l in range(L)]
    assert len(set(per_layer)) > 1
    geo = geometry_from_model(moe_map(mixed))
    assert [geo.for_layer(l).expert_bytes for l in range(L)] == per_layer


def test_evaluator_predict_and_store_agree(mixed):
    from mbolt.bench.predict import counts

    tr = _trace()
    mm = moe_map(mixed)
    ident = np.tile(np.arange(E), (L, 1))
    ev = evaluate(tr, ident, geometry_from_model(mm, "reorder"))
    pr = counts(tr, ident, mm, "reorder")
    with ExpertStore(mixed, mm=mm, drop_pages=False) as s:
        for t in range(N):
            for l in range(L):
                s.read(l, tr.experts[t, l])
        c = s.snapshot()
    r = GGUFReader(str(mixed))
    slice_of = {(int(t.name.split(".")[1]), t.name.split(".")[2]): int(t.n_bytes) // E
                for t in r.tensors if "_exps." in t.name}
    want = sum(slice_of[(l, role)] * K for l in range(L) for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
               for _ in range(N)) / N
    assert ev["useful_bytes_per_token"] == pytest.approx(want, rel=1e-12)
    assert c.useful_bytes == pytest.approx(want * N, rel=1e-12)
    assert c.reads == pytest.approx(ev["reads_per_token"] * N, rel=1e-12)
    assert c.bytes == pytest.approx(ev["bytes_per_token"] * N, rel=1e-12)
    assert pr["useful_bytes_per_token"] == ev["useful_bytes_per_token"] and pr["reads_per_token"] == ev["reads_per_token"]


def test_touching_tensors_are_read_as_the_evaluator_scores(tmp_path):
    """The tensor-boundary case: the last expert of one tensor and the first of the next, both
    selected, with no padding between the tensors. The store reads them as two reads, as the
    per-tensor evaluator counts them (it used to join them into one)."""
    p = write_synth(tmp_path / "t.gguf", SynthConfig(arch="qwen3moe", n_layers=1, n_experts=E, n_used=K, hidden=64,
                                                      expert_ff=64, expert_type="F32", seed=2))
    mm = moe_map(p)
    ws = mm.moe_layers[0].weights
    ends = [w.data_offset + w.nbytes for w in ws]
    assert any(e == w.data_offset for e, w in zip(ends, ws[1:]))  # some tensors touch
    ex = np.array([[[E - 1, 0]]], np.int16)
    tr = Trace(1, E, K, ex, np.full(1, DECODE, np.uint8), np.zeros(1, np.int32), np.arange(1, dtype=np.int32))
    ev = evaluate(tr, np.arange(E)[None, :], geometry_from_model(mm, "reorder"))
    with ExpertStore(p, mm=mm, drop_pages=False) as s:
        s.read(0, [E - 1, 0])
        assert s.counters.reads == ev["reads_per_token"] == 2 * len(ws)


@pytest.mark.parametrize("slots", [2, 3, 5])
def test_cache_hits_and_reads_agree_with_the_store(mixed, slots):
    """One LRU rule (a hit is an expert resident as of the previous token) in the evaluator and
    the store: the same hits, misses and reads over the same trace."""
    tr = _trace(seed=slots)
    mm = moe_map(mixed)
    ev = evaluate(tr, np.tile(np.arange(E), (L, 1)), geometry_from_model(mm, "reorder"), cache_slots=slots)
    with ExpertStore(mixed, mm=mm, cache_slots=slots, drop_pages=False) as s:
        for t in range(N):
            for l in range(L):
                s.read(l, tr.experts[t, l])
        c = s.snapshot()
    assert c.hits / (c.hits + c.misses) == pytest.approx(ev["hit_rate"], abs=1e-12)
    assert c.misses == pytest.approx(ev["misses_per_token"] * N, abs=1e-9)
    assert c.reads == pytest.approx(ev["reads_per_token"] * N, abs=1e-9)
    assert 0 < c.hits < c.hits + c.misses
