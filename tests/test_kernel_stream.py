"""The streaming runtime over a kernel-layout file (runtime.kernel_stream, issue 54): experts read
straight into llama.cpp's repacked buffers at each layer's selection, evicted by giving their pages
back.

Checked against llama.cpp itself: its own default load of the stock file (the weights repacked by
llama.cpp) gives the same logits, bit for bit, as the kernel-layout file streamed through a cache
of k slots (every expert read and dropped again and again). The bytes read are checked against the
tensor sizes gguf-py reports, and what stays resident against mincore.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import needs_llama
from mbolt.synth.config import SynthConfig
from mbolt.synth.synth import write_synth

pytestmark = needs_llama

# experts of several pages each (a 1024 x 512 Q4_K matrix: 288 KiB), so eviction gives pages back
CFG = SynthConfig(n_layers=2, n_experts=32, n_used=4, hidden=1024, expert_ff=512, n_heads=8, n_kv_heads=2,
                  head_dim=128, expert_type="Q4_K_M", dense_type="Q4_K_M", fast_random=True, expert_gain=16.0)
IDS = [3 + (7 * i) % 200 for i in range(48)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from mbolt.rewrite.kernel import write_kernel
    from mbolt.runtime.binding import lib
    from mbolt.runtime.kernel_load import this_build

    d = tmp_path_factory.mktemp("kstream")
    stock = write_synth(d / "m.gguf", CFG)
    kl = d / "m.kl.gguf"
    write_kernel(stock, kl, this_build(lib()))
    return stock, kl


def _run(path, prompt: int = 24, **options):
    """Logits of a prompt and of the teacher-forced steps after it, and the arm's counters."""
    from mbolt.runtime.driver import open_driver

    with open_driver(path, n_ubatch=512, n_ctx=256, **options) as d:
        d.make_cold()
        out = [d.prompt(IDS[:prompt])[0]]
        for t in IDS[prompt:]:
            out += d.step([(0, t)])
        arm = d.arm
        info = {"slots": arm.cache_slots, "resident": arm.pages.resident() if hasattr(arm, "rows") else None,
                "native_layers": getattr(arm, "native_layers", None),
                "behind": getattr(arm, "behind_layers", None),
                "counters": getattr(arm.store, "counters", None), "repacking": arm.repacking}
    return np.stack(out), info


def _expert_bytes(path, layer: int) -> int:
    """One expert's bytes in a layer, from gguf-py: each routed tensor's size over its experts."""
    r = GGUFReader(path)
    return sum(int(t.n_bytes) // CFG.n_experts for t in r.tensors if t.name.startswith(f"blk.{layer}.ffn_")
               and t.name.endswith("_exps.weight"))


def _read_exactly_the_misses(path, c) -> None:
    """The bytes read are m0 experts of layer 0 and m1 of layer 1 (the Q4_K_M mix types their down
    projections differently), m0 + m1 the misses: each miss read its own bytes once, nothing else."""
    b0, b1 = _expert_bytes(path, 0), _expert_bytes(path, 1)
    assert b0 != b1
    m0, rest = divmod(c.bytes - c.misses * b1, b0 - b1)
    assert rest == 0 and 0 < m0 < c.misses, (c.bytes, c.misses, b0, b1)


def test_a_streamed_kernel_file_computes_llama_cpps_own_repacked_logits(files):
    stock, kl = files
    want, ref = _run(stock, reads=False, evict=False, repacked=True)  # llama.cpp's default load
    got, info = _run(kl, reads=True, cache_slots=CFG.n_used, paged=False)  # rows; k slots: every step reads and evicts
    assert ref["repacking"].startswith("on") and info["repacking"].startswith("stored")
    assert np.isfinite(want).all() and want.std() > 0
    assert np.array_equal(got, want)  # bit for bit: the same bytes in the same kernels
    assert info["behind"] > 0  # up and down rows read while the gate and up matmuls computed
    inline, info_inline = _run(kl, reads=True, cache_slots=CFG.n_used, paged=False, read_behind=False)
    assert np.array_equal(inline, want) and info_inline["behind"] == 0
    c = info["counters"]
    steps = len(IDS) - 24
    assert c.misses > steps * CFG.n_layers  # experts came and went
    _read_exactly_the_misses(stock, c)
    # what stays: about the k slots of every layer (mincore), not the experts read
    assert CFG.n_used / CFG.n_experts - 0.02 <= info["resident"] <= CFG.n_used / CFG.n_experts + 0.02, (info, c)


def test_a_paged_kernel_file_computes_the_same_logits_and_gives_pages_back(files):
    # paged: the experts are pages of the kernel-layout file's map (llama.cpp's tensors point there),
    # read by WILLNEED and faults; an eviction gives the page cache's copy back too
    from mbolt.core.pagecache import resident_pages

    stock, kl = files
    want, _ = _run(stock, reads=False, evict=False, repacked=True)
    got, info = _run(kl, reads=True, cache_slots=CFG.n_used)  # paged, the default
    assert np.array_equal(got, want)
    assert info["native_layers"] > 0  # decode layers with misses answered by the C filter
    py, info_py = _run(kl, reads=True, cache_slots=CFG.n_used, native_misses=False)  # the pymisses arm
    assert np.array_equal(py, want) and info_py["native_layers"] == 0
    assert info_py["counters"].misses == info["counters"].misses and info_py["counters"].bytes == info["counters"].bytes  # one cache rule
    c = info["counters"]
    assert c.misses > (len(IDS) - 24) * CFG.n_layers
    _read_exactly_the_misses(stock, c)  # asked of the page cache: the misses' bytes, nothing else
    assert CFG.n_used / CFG.n_experts - 0.02 <= info["resident"] <= CFG.n_used / CFG.n_experts + 0.02, (info, c)
    # the file's expert pages in the page cache (mincore on the file, not the map): the k slots' only
    r = GGUFReader(kl)
    res = resident_pages(kl)
    pages = [res[t.data_offset // mmap.PAGESIZE:(t.data_offset + int(t.n_bytes)) // mmap.PAGESIZE]
             for t in r.tensors if t.name.endswith("_exps.weight")]
    share = sum(int(p.sum()) for p in pages) / sum(p.size for p in pages)
    assert share <= CFG.n_used / CFG.n_experts + 0.02, share


def test_every_expert_cached_reads_each_once(files):
    stock, kl = files
    got, info = _run(kl, reads=True)  # no budget, no slots: the cache holds every expert
    c = info["counters"]
    assert info["slots"] == CFG.n_experts
    _read_exactly_the_misses(stock, c)
    assert c.misses <= CFG.n_experts * CFG.n_layers
    want, _ = _run(stock, reads=False, evict=False, repacked=True)
    assert np.array_equal(got, want)


def test_a_prompt_pass_larger_than_the_cache_keeps_what_it_computes_with(files):
    # 48 tokens select nearly every expert of a layer: the union outgrows a cache of 4, and the
    # victims the layer still uses are given back only after it
    stock, kl = files
    want, _ = _run(stock, prompt=40, reads=False, evict=False, repacked=True)
    got, info = _run(kl, prompt=40, reads=True, cache_slots=CFG.n_used, paged=False)  # rows: zeros if dropped early
    assert np.array_equal(got, want)
    assert info["resident"] <= CFG.n_used / CFG.n_experts + 0.02


def test_evicted_rows_leave_memory_and_shared_pages_stay(files):
    from mbolt.runtime.driver import open_driver

    _, kl = files
    with open_driver(kl, reads=True, cache_slots=CFG.n_used, n_ctx=256, paged=False) as d:
        d.make_cold()
        arm = d.arm
        assert arm.pages.resident() < 0.01  # nothing of the experts held after make_cold
        d.prompt(IDS[:8])
        layer = min(arm.moe_layers)
        held = np.flatnonzero(arm.lru_cached[layer]).tolist()
        assert len(held) == CFG.n_used
        # every cached expert's bytes are there (the file's bytes, read independently)
        r = GGUFReader(kl)
        gate = next(t for t in r.tensors if t.name == f"blk.{layer}.ffn_gate_exps.weight")
        data = np.asarray(gate.data).reshape(-1).view(np.uint8)
        s = data.size // CFG.n_experts
        addr = arm.km.places[gate.name].addr
        pos = arm.rows.pos[layer]
        for e in held:
            p = int(pos[e])
            assert ctypes.string_at(addr + p * s, s) == data[p * s:(p + 1) * s].tobytes()
        # an expert not cached reads as zeros in its whole pages (given back)
        gone = next(e for e in range(CFG.n_experts) if e not in held)
        p = int(pos[gone])
        page = mmap.PAGESIZE
        a = -(-(addr + p * s) // page) * page
        assert not ctypes.string_at(a, page).strip(b"\0")


def _mbolt(*args):
    return subprocess.run([sys.executable, "-m", "mbolt", *map(str, args)], capture_output=True, text=True)


def test_the_commands_stream_a_kernel_file_and_refuse_it_plain(files):
    stock, kl = files
    r = _mbolt("generate", kl, "hello world", "-n", "6", "--engine", "llama.cpp", "--stream", "--ram", "2G", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["repacking"].startswith("stored") and res["misses"] > 0 and len(res["ids"]) == 6
    ref = _mbolt("generate", stock, "hello world", "-n", "6", "--engine", "llama.cpp", "--stream", "--ram", "2G",
                 "--json")
    assert ref.returncode == 0, ref.stderr
    assert json.loads(ref.stdout)["prompt_ids"] == res["prompt_ids"]
    plain = _mbolt("generate", kl, "hello", "-n", "2", "--engine", "llama.cpp")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert str(kl.name) in plain.stderr and "--stream" in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    tiny = _mbolt("generate", kl, "hello", "-n", "2", "--engine", "llama.cpp", "--stream", "--ram", "8M")
    assert tiny.returncode == 2 and "Traceback" not in tiny.stderr and "cannot hold" in tiny.stderr


def test_tokens_are_compared_within_their_kernels():
    from mbolt.bench.ab_llama import check_same_tokens, tokens_agreement
    from mbolt.bench.arms import RoundResult
    from mbolt.core.errors import MboltError

    def rr(arm, gen, kernels):
        return RoundResult(arm, 0, 0, 0.0, 0.0, True, False, 4, 1.0, 0.0, 0.1, 0, 0, 0, None, 0, 0, 0, "",
                           generated=[gen], kernels=kernels)

    mixed = [rr("plain", [1, 2, 3, 4], "mapped"), rr("kernel", [1, 2, 9, 4], "repacked"),
             rr("repacked", [1, 2, 9, 4], "repacked")]
    check_same_tokens(mixed)  # a near tie the other way across kernels is not a different model
    assert tokens_agreement(mixed) == 0.75
    with pytest.raises(MboltError, match="other tokens"):
        check_same_tokens(mixed + [rr("kernel (A/A)", [1, 2, 3, 4], "repacked")])


def test_a_prompt_pass_reads_ahead_from_the_selection_or_the_layers_start(files, monkeypatch):
    """Under a budget a prompt pass that selects nearly every expert reads a layer ahead: at the
    selection before it where the budget holds two layers' passes, else from the layer's own start
    (attn_norm-N), once the layer before is done with its experts (the plan a budget one layer short
    of two gives: planned here with the read-ahead taken out). Either way, paged or in rows, the
    logits are llama.cpp's own repacked load's, bit for bit. (In rows, the experts read ahead and
    not selected once gave back a page they share with a selected neighbour: wrong logits.)"""
    import dataclasses

    import mbolt.runtime.budget as budget
    from mbolt.runtime.budget import pass_bytes
    from mbolt.runtime.driver import open_driver

    real_plan = budget.plan_budget
    stock, kl = files
    want, _ = _run(stock, prompt=40, reads=False, evict=False, repacked=True)
    for one_layer in (False, True):
        def plan(*a, **kw):
            p = real_plan(*a, **kw)
            if not one_layer:
                return p
            return dataclasses.replace(p, prefetch=False, prefill_reserve=max(pass_bytes(a[1], p.n_ubatch), p.step_reserve))

        monkeypatch.setattr(budget, "plan_budget", plan)
        for paged in (True, False):
            with open_driver(kl, n_ubatch=512, n_ctx=256, reads=True, budget=1 << 40, paged=paged) as d:
                assert d.arm.plan.prefetch != one_layer
                d.make_cold()
                d.arm._resize(CFG.n_used)  # k slots: the pass's union is read, not cached
                out = [d.prompt(IDS[:40])[0]]
                for t in IDS[40:]:
                    out += d.step([(0, t)])
                p = d.arm.prompt
                # 40 rows x k >= 2E: the first layer from its start (the last computes the last row alone:
                # never read ahead)
                assert p.from_start == (1 if one_layer else 0), p
                assert p.misses >= CFG.n_experts // 2 and p.hits == 0, p
            assert np.array_equal(np.stack(out), want), (one_layer, paged)


def test_experts_read_ahead_and_not_selected_leave_the_page_cache(tmp_path):
    """Paged, under a budget of k slots: a 40-token pass reads each next layer ahead (WILLNEED)
    and gives back what the layer does not select, some of it while its reads are still in flight
    (the page cache keeps a page under I/O). After the pass no page of an expert the cache does not
    hold is left in the page cache (mincore on the file). Before the fix the middle layers of this
    4-layer file kept 1-3 experts beyond their 4 in every run; at 48 layers, 1.4 GB beyond the budget."""
    from mbolt.core.pagecache import resident_pages
    from mbolt.rewrite.kernel import write_kernel
    from mbolt.runtime.binding import lib
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.kernel_load import this_build

    from dataclasses import replace

    stock = write_synth(tmp_path / "m.gguf", replace(CFG, n_layers=4))
    kl = tmp_path / "m.kl.gguf"
    write_kernel(stock, kl, this_build(lib()))
    r = GGUFReader(kl)
    page = mmap.PAGESIZE
    for _ in range(3):
        with open_driver(kl, n_ubatch=512, n_ctx=256, reads=True, budget=1 << 40) as d:
            d.make_cold()
            arm = d.arm
            arm.budget.prefill_slots = arm.budget.decode_slots = CFG.n_used
            arm._resize(CFG.n_used)
            d.prompt(IDS[:40])
            assert arm.plan.prefetch and arm.prompt.misses > 2 * CFG.n_experts
            res = resident_pages(kl)
            for layer in range(4):
                held = np.flatnonzero(arm.lru_cached[layer])
                assert len(held) == CFG.n_used
                allowed = np.zeros(res.size, bool)
                for t in r.tensors:
                    if t.name.startswith(f"blk.{layer}.") and t.name.endswith("_exps.weight"):
                        s = int(t.n_bytes) // CFG.n_experts
                        ends = (t.data_offset // page, -(-(t.data_offset + int(t.n_bytes)) // page) - 1)
                        allowed[list(ends)] = True  # shared with the tensors beside it
                        for p in arm.rows.pos[layer][held]:
                            a = t.data_offset + int(p) * s
                            allowed[a // page: -(-(a + s) // page)] = True
                        stray = res[t.data_offset // page: ends[1] + 1] & ~allowed[t.data_offset // page: ends[1] + 1]
                        assert not stray.any(), (layer, t.name, int(stray.sum()))
