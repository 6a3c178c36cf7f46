"""The hot path of a cached expert (issue 35): a decode layer whose experts are all cached is
answered by the C filter (runtime.native), which stamps the LRU's arrays (core.lru.ArrayLru)
itself. Checked here: ArrayLru keeps SlotLru's rule (hits, victims, order) on random traces; the C
filter answers cached layers, and a run with it gives the same tokens, hits, misses and LRU state
as the same run with every selection handled in Python (the filter absent, as without a C
compiler); a batched step's union is counted once."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from conftest import EXPERT_GAIN, needs_llama
from mbolt.core.lru import ArrayLru, SlotLru
from mbolt.synth.synth import SynthConfig, write_synth


def test_array_lru_keeps_slot_lrus_rule():
    rng = random.Random(3)
    for trial in range(300):
        E = rng.randint(2, 48)
        slots = rng.randint(0, E)
        a = SlotLru(slots)
        b = ArrayLru(slots, np.zeros(E, np.uint8), np.zeros(E, np.int64), np.zeros(1, np.int64))
        pins = set(rng.sample(range(E), rng.randint(0, max(0, slots - 1)))) if rng.random() < 0.3 else set()
        a.pinned, b.pinned = set(pins), set(pins)
        for t in range(60):
            keys = rng.sample(range(E), rng.randint(1, min(E, 12)))
            assert a.step(keys) == b.step(keys), (trial, t)
            assert list(a.order) == b.order and len(a) == len(b)
            if rng.random() < 0.05:
                k = rng.randrange(E)
                a.discard(k)
                b.discard(k)


TOY = SynthConfig(arch="qwen3moe", n_layers=4, n_experts=16, n_used=4, hidden=64, expert_ff=64, n_heads=4,
                  n_kv_heads=2, head_dim=16, expert_type="F32", dense_type="F32", seed=3, expert_gain=EXPERT_GAIN)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = tmp_path_factory.mktemp("hot") / "toy.gguf"
    write_synth(path, TOY)
    return path


def _run(path, text_ids, **kw):
    from mbolt.runtime.driver import open_driver

    with open_driver(path, reads=True, qd=2, asynchronous=True, n_ctx=256, **kw) as d:
        d.make_cold()
        runs = [d.generate([text_ids], 24, forced=16) for _ in range(2)]
        lru = {layer: d.arm.store.cached(layer) for layer in sorted(d.arm.moe_layers)}
        return runs, lru, d.arm.fast_layers, d.runner.native_filter


@needs_llama
def test_cached_layers_are_answered_in_c_with_pythons_results(toy, monkeypatch):
    from mbolt.runtime import native

    ids = list(range(40, 120))
    fast_runs, fast_lru, fast_layers, native_on = _run(toy, ids, budget=2 << 30)
    assert native_on  # CI has a C compiler (it builds llama.cpp)
    assert fast_layers > 0  # cached layers never reached Python
    # the second pass over the same text: every expert it needs is cached (the budget holds the model)
    assert fast_runs[1].misses == 0 and fast_runs[1].hits == 24 * 4 * 4
    monkeypatch.setattr(native, "_LIB", None)  # no filter: every selection handled in Python
    slow_runs, slow_lru, slow_layers, native_off = _run(toy, ids, budget=2 << 30)
    assert not native_off and slow_layers == 0
    for f, s in zip(fast_runs, slow_runs):
        assert f.generated == s.generated
        assert (f.hits, f.misses, f.reads, f.bytes) == (s.hits, s.misses, s.reads, s.bytes)
    assert fast_lru == slow_lru  # the C stamps leave the LRU as Python's admit does


@needs_llama
def test_a_batched_step_reads_the_union_once(toy):
    """Four sequences decoded in one step: the layer's union is read and counted once (a cached
    expert serves them all), and each sequence gets the tokens it gets alone."""
    from mbolt.runtime.driver import open_driver

    prompts = [[40 + 7 * i + j for j in range(12)] for i in range(4)]
    alone = []
    with open_driver(toy, reads=True, budget=2 << 30, n_ctx=128, n_seq=1, f32_kv=True) as d:
        d.make_cold()
        for p in prompts:
            d.forget()
            logits, _, _ = d.prompt(p)
            out = [int(np.argmax(logits))]
            for _ in range(5):
                out.append(int(np.argmax(d.step([(0, out[-1])])[0])))
            alone.append(out)
    with open_driver(toy, reads=True, budget=2 << 30, n_ctx=128, n_seq=4, f32_kv=True) as d:
        d.make_cold()
        outs = []
        for s, p in enumerate(prompts):
            logits, _, _ = d.prompt(p, seq=s)
            outs.append([int(np.argmax(logits))])
        c0 = d.arm.store.counters.experts
        for _ in range(5):
            logits = d.step([(s, outs[s][-1]) for s in range(4)])
            for s in range(4):
                outs[s].append(int(np.argmax(logits[s])))
        per_layer_step = (d.arm.store.counters.experts - c0) / (5 * len(d.arm.moe_layers))
    assert outs == alone  # F32 weights and KV cache: batching changes no greedy token here
    assert d.mm.n_used <= per_layer_step <= 4 * d.mm.n_used  # a union: at most every row's k, at least one row's



@needs_llama
def test_generate_decodes_prompts_together_as_it_does_alone(toy):
    """generate(parallel=4): four teacher-forced prompts, one sequence each, every decode step one
    row of each in one llama_decode (what `mbolt ab` arms with parallel=4 measure): the same
    predictions as one prompt after another, and every row counted as a decode token."""
    from mbolt.core.errors import MboltError
    from mbolt.bench.ab import run_ab
    from mbolt.bench.arms import parse_arm
    from mbolt.runtime.driver import open_driver

    prompts = [[40 + 7 * i + 3 * j for j in range(28)] for i in range(4)]
    runs, steps = {}, {1: [], 4: []}
    for n in (1, 4):
        with open_driver(toy, reads=True, budget=2 << 30, n_ctx=128, n_seq=n, f32_kv=True) as d:
            d.make_cold()
            runs[n] = d.generate(prompts, 12, forced=16, parallel=n, on_token=lambda i, t: steps[n].append(t))
            with pytest.raises(MboltError, match="multiple of"):
                d.generate(prompts[:3], 4, forced=16, parallel=max(n, 2))
    assert runs[4].generated == runs[1].generated  # F32 weights and KV cache: batching changes no prediction
    assert [len(g) for g in runs[4].generated] == [12] * 4
    assert runs[4].decode_tokens == runs[1].decode_tokens == 48
    assert (len(steps[1]), len(steps[4])) == (48, 12)  # one llama_decode per step: 4 rows in each
    assert runs[4].prompt_tokens == runs[1].prompt_tokens == 64
    with pytest.raises(MboltError, match="parallel=4 .* multiple of it \\(now 2\\)"):
        run_ab([parse_arm(f"{toy}:parallel=4,async", 0)], mode="decode", engine="llama.cpp", prompts=prompts[:2],
               rounds=1, forced=16, n_new=4)

def _run_small_cache(path, text_ids, slots: int, **kw):
    """Two teacher-forced runs through a cache of `slots` experts per layer (under a budget, so
    victims leave memory at once), every cached expert's pages taken from the page cache between
    them (as the kernel's reclaim would); what each run counted, the LRU, and which experts'
    pages are resident at the end."""
    from mbolt.runtime.driver import open_driver

    with open_driver(path, reads=True, qd=2, asynchronous=True, n_ctx=256, budget=2 << 30, **kw) as d:
        d.make_cold()
        b = d.arm.budget
        b.decode_slots = b.prefill_slots = slots
        d.arm._resize_cache(slots)
        first = d.generate([text_ids], 24, forced=16)
        for layer in d.arm.moe_layers:
            d.pages.drop(d.pages.expert_spans_of(layer, d.arm.store.cached(layer)))
        second = d.generate([text_ids[8:]], 24, forced=16)
        lru = {layer: d.arm.store.cached(layer) for layer in sorted(d.arm.moe_layers)}
        resident = {layer: [e for e in range(d.mm.n_experts) if d.pages.expert_resident(layer, e)]
                    for layer in sorted(d.arm.moe_layers)}
        return [first, second], lru, resident, d.arm.native_layers, d.arm.reclaimed, d.arm.drop_behind_s


@needs_llama
def test_layers_with_misses_are_answered_in_c_with_pythons_results(toy):
    """Under a budget the C filter also reads a decode layer's misses, evicts and drops (runtime.
    native's with_misses): the same tokens, hits, misses, merged reads, bytes, reclaimed experts
    and LRU as Python's path, and the same pages left resident: those of the cached experts only."""
    ids = list(range(30, 130))
    c_runs, c_lru, c_res, c_layers, c_reclaimed, _ = _run_small_cache(toy, ids, 6)
    py_runs, py_lru, py_res, py_layers, py_reclaimed, _ = _run_small_cache(toy, ids, 6, native_misses=False)
    assert c_layers > 0 and py_layers == 0
    assert c_runs[0].misses > 24 * 4  # the cache of 6 of 16 missed in most steps
    for c, p in zip(c_runs, py_runs):
        assert c.generated == p.generated
        assert (c.hits, c.misses, c.reads, c.bytes, c.useful_bytes) == (p.hits, p.misses, p.reads, p.bytes,
                                                                          p.useful_bytes)
    assert c_reclaimed == py_reclaimed > 0  # the dropped cached experts were found and read again
    assert c_lru == py_lru
    assert all(len(v) == 6 for v in c_lru.values())
    assert c_res == py_res == {layer: sorted(v) for layer, v in c_lru.items()}  # victims left memory


def _task_names() -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return names


@needs_llama
def test_victims_dropped_behind_the_layer_leave_what_dropping_at_once_leaves(toy):
    """With the victims dropped by the filter's thread while llama.cpp computes (the default), the
    tokens, counts, LRU and resident pages after each run are those of dropping them at once on
    the path to the matmuls; the thread did the drops (its kernel time is counted), and it is gone
    when the driver closes."""
    ids = list(range(30, 130))
    b_runs, b_lru, b_res, b_layers, b_reclaimed, b_drop_s = _run_small_cache(toy, ids, 6)
    assert "mbolt-drops" not in _task_names()
    n_runs, n_lru, n_res, n_layers, n_reclaimed, n_drop_s = _run_small_cache(toy, ids, 6, drop_behind=False)
    assert b_layers == n_layers > 0
    assert b_drop_s > 0 and n_drop_s == 0
    for b, n in zip(b_runs, n_runs):
        assert b.generated == n.generated
        assert (b.hits, b.misses, b.reads, b.bytes) == (n.hits, n.misses, n.reads, n.bytes)
    assert b_reclaimed == n_reclaimed > 0
    assert b_lru == n_lru
    assert b_res == n_res == {layer: sorted(v) for layer, v in b_lru.items()}  # every victim out of memory


@needs_llama
def test_neither_path_asks_mincore_where_the_kernel_hides_residency(toy, monkeypatch):
    """On a file the kernel hides page-cache residency of (not the user's, not writable: mincore
    says every page is resident), neither the C filter nor Python asks it: a cached expert whose
    pages were taken is then not found reclaimed (root here sees the truth, so a path that still
    asked would find them, as the test above does), and both paths give the same tokens and counts."""
    import mbolt.runtime.pages as pages

    monkeypatch.setattr(pages, "residency_visible", lambda path: False)
    ids = list(range(30, 130))
    with pytest.warns(UserWarning, match="hides its page-cache residency"):
        c_runs, c_lru, _, c_layers, c_reclaimed, _ = _run_small_cache(toy, ids, 6)
    with pytest.warns(UserWarning, match="hides its page-cache residency"):
        py_runs, py_lru, _, py_layers, py_reclaimed, _ = _run_small_cache(toy, ids, 6, native_misses=False)
    assert c_layers > 0 and py_layers == 0
    assert c_reclaimed == py_reclaimed == 0
    for c, p in zip(c_runs, py_runs):
        assert c.generated == p.generated
        assert (c.hits, c.misses, c.reads, c.bytes) == (p.hits, p.misses, p.reads, p.bytes)
    assert c_lru == py_lru
