"""llama.cpp under a real memory limit: `ab --ram --forced`, the runtime's budget, tracing a
model larger than its limit (issue 19).

The model (about 170 MB: 6 layers x 64 Q4_0 experts of 144 KiB slices) is larger than the
limits used here, so plain llama.cpp must fault experts in and mbolt's runtime must evict. What
is checked comes from the kernel (the group's peak charge and OOM kills, major faults) and from
llama.cpp itself (its greedy predictions through the high-level API, independent of mbolt).
These tests run in CI, as root on a machine with memory cgroups.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import EXPERT_GAIN, needs_llama
from mbolt.core.errors import MboltError
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama

# 6 layers x 64 Q4_0 experts of 144 KiB slices
MODEL = SynthConfig(arch="qwen3moe", n_layers=6, n_experts=64, n_used=4, hidden=1024, expert_ff=256, n_heads=4,
                    n_kv_heads=2, head_dim=32, dense_ff=256, expert_type="Q4_0", fast_random=True,
                    structure="planted", seed=3, expert_gain=EXPERT_GAIN)
LIMIT = 130 << 20  # below the model's size, above what the engine itself takes (~35 MB) plus dense and margin
N_NEW = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mbolt.core.moe_map import moe_map
    from mbolt.rewrite.reorder import reorder_file

    d = tmp_path_factory.mktemp("memlimit")
    stock = d / "model.gguf"
    write_synth(stock, MODEL)
    # a permuted file: every expert elsewhere (a reversed order), so its reads and faults differ
    from mbolt.core.plan import Plan, save_plan

    E = 64
    plan = save_plan(d / "plan.json", Plan("manual", 6, E, np.tile(np.arange(E)[::-1], (6, 1)).astype(np.int32),
                                           np.zeros((6, E))))
    reordered = d / "model.reorder.gguf"
    reorder_file(stock, reordered, plan=plan, layout="reorder", force=True)
    assert stock.stat().st_size > LIMIT
    return {"stock": stock, "reorder": reordered, "mm": moe_map(stock)}


def _llama_predictions(path, prompts, forced, n_new, n_ctx=256, followup=0):
    """llama.cpp's own greedy prediction at each teacher-forced step, through llama-cpp-python's
    high-level API (file mapped, default KV cache, flash attention on as in every mbolt context: off,
    the last bits differ and a near-tie can flip): the oracle mbolt's arms must match. `followup`:
    then the next tokens as one more turn, and its prediction."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, flash_attn=True, use_mmap=True, verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    out = []
    try:
        for ids in prompts:
            llm.reset()
            llm.eval(list(ids[:forced]))
            preds = []
            for i in range(n_new):
                preds.append(int(np.argmax(last_logits())))
                llm.eval([int(ids[forced + i])])
            if followup:
                llm.eval([int(t) for t in ids[forced + n_new: forced + n_new + followup]])
                preds.append(int(np.argmax(last_logits())))
            out.append(preds)
    finally:
        llm.close()
    return out


def test_ab_under_a_real_limit(model, tmp_path):
    """`mbolt ab --ram --forced`: every arm-round a process in a cgroup of LIMIT bytes; plain faults
    experts in, mbolt's runtime takes no major fault at all (dense weights locked, every selected
    expert read before llama.cpp touches it); every arm predicts the tokens llama.cpp predicts."""
    from typer.testing import CliRunner

    from mbolt.cli import app
    from mbolt.core.memlimit import readahead_kb

    r = CliRunner().invoke(app, ["ab", f"{model['stock']}:os,name=plain", f"{model['stock']}:name=mbolt,qd=2",
                                 f"{model['reorder']}:name=mbolt-reorder", "--decode", "--engine", "llama.cpp",
                                 "--ram", str(LIMIT), "--forced", "-n", str(N_NEW), "--rounds", "1", "--no-aa",
                                 "--out-dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    env = d["environment"]
    assert env["memory_limit_bytes"] == LIMIT and env["teacher_forced"] == 8
    assert env["readahead_kb"] == str(readahead_kb(model["stock"]))
    rounds = {x["arm"]: x for x in d["rounds"]}
    for x in rounds.values():
        assert x["peak_bytes"] is not None and 0 < x["peak_bytes"] <= LIMIT
        assert x["tokens"] == 2 * N_NEW and not x["rejected"]
    assert rounds["plain"]["major_faults"] > 0  # the limit is real: experts come back through faults
    # the runtime reads every selected expert before llama.cpp touches it: no expert faults. A
    # group this tight can still reclaim a code page of the process's own libraries (2 faults
    # were seen once, with the whole suite running beside it); plain faults in every expert it misses
    for arm in ("mbolt", "mbolt-reorder"):
        assert rounds[arm]["major_faults"] <= 4 < rounds["plain"]["major_faults"], (arm, rounds[arm]["major_faults"])
    assert rounds["mbolt"]["reads"] > 0 and rounds["plain"]["hits"] == 0
    assert all(row["decode_tokens_per_s"] > 0 for row in d["summary"])
    assert "expert slots/layer" in rounds["mbolt"]["note"]
    gen = rounds["plain"]["generated"]
    assert rounds["mbolt"]["generated"] == gen and rounds["mbolt-reorder"]["generated"] == gen
    from mbolt.bench.ab import load_prompt_ids

    prompts = load_prompt_ids(str(model["stock"]), None, 2, engine="llama.cpp", forced=8, n_new=N_NEW)
    assert gen == _llama_predictions(model["stock"], prompts, 8, N_NEW)


def test_ram_needs_llama_engine_and_a_size(model, tmp_path):
    from typer.testing import CliRunner

    from mbolt.cli import app

    r = CliRunner().invoke(app, ["ab", str(model["stock"]), "--decode", "--ram", "1G", "--out-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--engine llama.cpp" in r.output
    r = CliRunner().invoke(app, ["ab", str(model["stock"]), "--decode", "--engine", "llama.cpp", "--ram", "lots",
                                 "--out-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--ram: 'lots' is not a size" in r.output


def test_the_runtime_takes_2048_token_passes_by_default(model):
    """With no -ub the streaming runtime of one sequence evaluates a prompt in 2048-token passes
    (each pass reads the layer's selected experts once: results/ubatch_q72.json); plain llama.cpp
    and batched sequences keep llama.cpp's 512. A 1,500-token prompt is one pass instead of three,
    and greedy decoding after it gives the same tokens."""
    from mbolt.runtime.driver import open_driver

    mm = model["mm"]
    ids = [65 + (i * 7) % 180 for i in range(1500)]
    runs = {}
    for ub in (None, 512):
        with open_driver(str(model["stock"]), budget=1 << 40, qd=2, mm=mm, n_ubatch=ub) as s:
            assert s.n_ubatch == (ub or 2048)
            runs[ub] = s.generate([ids], 4)
    assert (runs[None].prompt_passes, runs[512].prompt_passes) == (1, 3)
    assert runs[None].generated == runs[512].generated
    with open_driver(str(model["stock"]), reads=False, evict=False, mm=mm) as s:
        assert s.n_ubatch == 512
    with open_driver(str(model["stock"]), budget=1 << 40, qd=2, mm=mm, n_seq=2) as s:
        assert s.n_ubatch == 512


def test_budget_sizes_the_cache_and_refuses_too_small(model):
    """Outside a cgroup the runtime counts its own memory (dense weights, anonymous memory, the
    compute buffer its first prompt will touch, its read buffers): a budget of that plus the margin,
    a prompt pass's reserve (this layer's union and the next layer read ahead) and 20 slots' worth
    gives about 20 slots during a prompt; a decode step reads only k experts per layer, so the
    cache then also takes the rest of the pass's reserve."""
    from mbolt.runtime.budget import BUDGET_MARGIN, expert_bytes_all_layers, layer_bytes, step_bytes
    from mbolt.runtime.streamer import own_bytes
    from mbolt.runtime.driver import open_driver

    mm = model["mm"]
    per_slot = expert_bytes_all_layers(mm)
    assert per_slot == sum(w.slice_bytes for w in mm.moe_layers[0].weights) * len(mm.moe_layers)
    layer = sum(w.slice_bytes for w in mm.moe_layers[0].weights) * mm.n_experts
    assert layer_bytes(mm) == layer
    with open_driver(str(model["stock"]), budget=1 << 40, qd=2, mm=mm, n_ubatch=512) as s:
        assert s.n_ubatch == 512 and s.arm.plan.prefetch  # a pass selects the whole layer: two layers reserved
        assert s.arm.plan.prefill_reserve == 2 * layer
        dense = sum(b - a for a, b in s.pages.dense_tensors)
        s.budget.limit = (own_bytes() + dense + BUDGET_MARGIN + s.arm.memory.compute_bytes + 2 * layer
                    + 20 * per_slot)
        s.make_cold()
        assert 15 <= s.prefill_slots <= 21  # the pages held round dense tensors up to whole pages
        # the pass's reserve less a step's k experts, and the compute buffer less a decode step's
        # part of it (given back after each prompt)
        extra = (2 * layer - step_bytes(mm) + s.arm.memory.compute_bytes - s.arm.plan.decode_compute_bytes) // per_slot
        assert s.decode_slots in (min(64, s.prefill_slots + extra), min(64, s.prefill_slots + extra + 1))
        assert s.cache_slots == s.decode_slots > s.prefill_slots
        s.generate([list(range(65, 65 + 16))], 8, forced=8)  # a prompt pass, then decode steps
        assert s.arm.store.cache_slots == s.decode_slots
        before = {l.index: s.arm.store.cached(l.index) for l in mm.moe_layers}
        s.arm._resize_cache(s.prefill_slots)  # what the next prompt does first: shrink, victims gone
        assert any(len(old) > s.prefill_slots for old in before.values())  # the shrink had work to do
        for layer_i, old in before.items():
            now = s.arm.store.cached(layer_i)
            assert len(now) <= s.prefill_slots and now == old[len(old) - len(now):]  # the most recent stay
            gone = [e for e in old if e not in now]
            if gone:
                assert s.pages.resident(s.pages.expert_spans_of(layer_i, gone)) == 0.0
        assert s.locked_bytes >= dense and s.copied_bytes == 0  # root: everything locked
        assert s.pages.resident(s.pages.dense_tensors) == 1.0
    with pytest.raises(MboltError, match=r"a budget of 8 MiB cannot hold the dense weights .* the KV cache of a "
                                         r"4096-token context .*no context fits: give a larger --ram"):
        open_driver(str(model["stock"]), budget=8 << 20, mm=mm)


def _resident_bytes(base: int, size: int) -> int:
    """Bytes of [base, base + size) in memory (mincore: the kernel's answer for anonymous pages)."""
    import ctypes

    from mbolt.core.pagecache import PAGE, libc

    a, b = -(-base // PAGE) * PAGE, (base + size) // PAGE * PAGE
    vec = (ctypes.c_ubyte * ((b - a) // PAGE))()
    assert libc().mincore(ctypes.c_void_p(a), b - a, vec) == 0
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) * PAGE


class _ComputeResidency:
    """A watcher: after every llama_decode, how much of llama.cpp's compute buffer is in memory."""

    def __init__(self, advise_huge=False):
        self.driver, self.after, self.advise_huge = None, [], advise_huge

    def begin(self, phase, n_rows):
        self.phase = phase

    def on_topk(self, layer, rows):
        # the first pass's first layer: the buffer exists, most of it not yet touched. Advising it
        # MADV_HUGEPAGE is what numpy leaves on a heap range it freed and malloc hands to llama.cpp
        # (numpy advises every array of 4 MiB or more): the pass then faults 2 MiB pages
        if self.advise_huge:
            import ctypes

            from mbolt.core.pagecache import libc
            from mbolt.runtime.binding import buffer_span

            base, size = buffer_span(self.driver.runner.tap.buffer)
            a, b = -(-base // (2 << 20)) * (2 << 20), (base + size) // (2 << 20) * (2 << 20)
            assert b > a  # a kernel without THP refuses the advice (EINVAL): nothing to reproduce there
            libc().madvise(ctypes.c_void_p(a), b - a, 14)  # MADV_HUGEPAGE
            self.advise_huge = False

    def end(self):
        from mbolt.runtime.binding import buffer_span

        self.after.append((self.phase.name, _resident_bytes(*buffer_span(self.driver.runner.tap.buffer))))


def test_the_compute_buffer_is_given_back_after_a_prompt(model, monkeypatch):
    """A 512-token prompt pass fills llama.cpp's compute buffer (its graph is the one the buffer
    was sized for); after the prompt the runtime gives the buffer's pages back, and each decode
    step touches only its own graph's part (at most what the plan counts for it), so the budget
    gives the rest of the buffer to decode's expert slots. Residency is the kernel's (mincore on the
    buffer libggml names); the greedy tokens are those of the same run with the buffer kept, and
    those of llama.cpp's own API."""
    from mbolt.runtime.binding import buffer_span
    from mbolt.runtime.budget import BUDGET_MARGIN, expert_bytes_all_layers, layer_bytes
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.streamer import own_bytes

    mm = model["mm"]
    per_slot = expert_bytes_all_layers(mm)
    ids = [65 + (i * 7) % 180 for i in range(512 + N_NEW)]

    def run(watcher=None, give_back=True):
        with open_driver(str(model["stock"]), budget=1 << 40, qd=2, mm=mm, asynchronous=True, n_ubatch=512,
                         watchers=[watcher] if watcher else (), give_back_compute=give_back) as s:
            if watcher:
                watcher.driver = s
            assert s.n_ubatch == 512
            dense = sum(b - a for a, b in s.pages.dense_tensors)  # room for a pass and 16 slots (of 64)
            s.budget.limit = (own_bytes() + dense + BUDGET_MARGIN + s.arm.memory.compute_bytes + 2 * layer_bytes(mm)
                              + 16 * per_slot)
            s.make_cold()
            before = (s.prefill_slots, s.decode_slots)
            out = s.generate([ids], N_NEW, forced=512)
            return dict(tokens=out.generated, releases=s.arm.compute_releases, plan=s.arm.plan, memory=s.arm.memory,
                        prefill=before[0], decode=before[1], decode_after=s.decode_slots,
                        size=buffer_span(s.runner.tap.buffer)[1])

    w = _ComputeResidency(advise_huge=True)
    r = run(w)
    mem, plan = r["memory"], r["plan"]
    assert r["size"] == pytest.approx(mem.compute_bytes, abs=16 << 10)  # the buffer llama.cpp logged
    assert 0 < plan.decode_compute_bytes < mem.compute_bytes // 4
    assert r["releases"] == 1 and r["decode_after"] == r["decode"]
    assert [p for p, _ in w.after] == ["PROMPT"] + ["DECODE"] * N_NEW
    assert w.after[0][1] >= mem.compute_bytes // 2  # the pass's graph used the buffer it was sized for
    for _, resident in w.after[1:]:
        assert resident <= plan.decode_compute_bytes  # a decode step: its own part only
    # kept resident, the buffer is decode's too: decode holds that many slots fewer beyond the prompt's
    kept = run(give_back=False)
    assert kept["releases"] == 0
    freed = (mem.compute_bytes - plan.decode_compute_bytes) / per_slot
    gained = (r["decode"] - r["prefill"]) - (kept["decode"] - kept["prefill"])
    assert freed - 2 <= gained <= freed + 2 and gained >= 1  # four slot counts, each rounded down
    assert r["tokens"] == kept["tokens"] == _llama_predictions(model["stock"], [ids], 512, N_NEW, n_ctx=1024)
    # a buffer the runtime cannot give back (not the one llama.cpp logged): decode gives up the
    # slots it had counted on, once the prompt is done
    import mbolt.runtime.memory as memory

    monkeypatch.setattr(memory, "give_back", lambda buffer, compute_bytes: False)  # runtime.arm.BudgetedArm's
    failed = run()
    assert failed["releases"] == 0
    assert failed["decode_after"] == max(failed["prefill"], failed["decode"] - math.ceil(freed))


def test_a_budget_that_holds_every_expert_keeps_them_through_prompts(model):
    """A budget that holds every expert (but not every expert and a prompt pass's reserve on top)
    caches them all, in prompts too: the experts a first conversation read stay cached and resident
    through a second prompt. Before, the pass's reserve shrank the cache (121 of 128 slots on the
    48-layer model) and the next decode steps read the dropped experts back from the drive."""
    from mbolt.runtime.budget import expert_bytes_all_layers, layer_bytes, margin
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.streamer import own_bytes

    mm = model["mm"]
    per_slot = expert_bytes_all_layers(mm)
    with open_driver(str(model["stock"]), budget=1 << 40, qd=2, mm=mm, asynchronous=True) as s:
        assert s.arm.plan.prefill_reserve >= layer_bytes(mm) > 4 * per_slot  # the reserve is worth several slots
        dense = sum(b - a for a, b in s.pages.dense_tensors)
        # room for every expert and half a pass's reserve: enough for all, not for all and the reserve
        need = own_bytes() + dense + s.arm.memory.compute_bytes + mm.n_experts * per_slot + s.arm.plan.prefill_reserve // 2
        limit = need
        while limit - margin(limit) < need:
            limit = need + margin(limit)
        s.budget.limit = limit
        s.make_cold()
        assert s.prefill_slots == s.decode_slots == s.cache_slots == mm.n_experts
        # no pass will be laid over: no slot taken at load (it would not fit beside every expert)
        assert s.arm.overlay is None or s.arm.overlay.held_bytes == 0
        s.generate([list(range(65, 65 + 24))], 8, forced=16)
        first = {l.index: s.arm.store.cached(l.index) for l in mm.moe_layers}
        assert any(len(v) > mm.n_used for v in first.values())
        # what the prompt read ahead for a layer that did not select it stays cached and resident
        # (dropped, decode read it back from the drive: 7 MB a token at 48 layers, the file in memory)
        assert s.arm.prompt.prefetched_unused > 0
        ahead = [layer for layer, v in first.items() if len(v) == mm.n_experts]
        # read ahead whole: the layers whose predecessor selected at least half its experts (3 of the
        # 6 here; none stayed whole when the unused ones were dropped)
        assert len(ahead) >= 2
        for layer in ahead:
            assert s.pages.resident(s.pages.expert_spans_of(layer, range(mm.n_experts))) == 1.0, layer
        s.generate([list(range(97, 97 + 24))], 8, forced=16)  # another conversation: a prompt pass, steps
        for layer, experts in first.items():
            assert set(experts) <= set(s.arm.store.cached(layer)), layer
            assert s.pages.resident(s.pages.expert_spans_of(layer, experts)) == 1.0, layer


def test_a_layer_without_expert_selection_is_an_error(model):
    from mbolt.runtime.driver import open_driver

    with open_driver(str(model["stock"]), cache_slots=8, mm=model["mm"]) as s:
        s.arm.moe_layers = s.arm.moe_layers | {99}
        s.make_cold()
        with pytest.raises(MboltError, match="no ffn_moe_topk for layer\\(s\\) 99"):
            s.generate([[65, 66, 67, 68]], 2)


def test_trace_a_model_larger_than_its_limit(model, tmp_path):
    """`mbolt trace --engine llama.cpp` inside a cgroup below the model's size: it finishes (the
    weights stay reclaimable file pages), stays under the limit, and records the routing it
    records without a limit."""
    from mbolt.core.mbtrace import read_trace
    from mbolt.core.memlimit import MemoryGroup

    args = ["-m", "mbolt", "trace", str(model["stock"]), "--engine", "llama.cpp", "-n", "4", "--n-prompts", "2"]
    free = subprocess.run([sys.executable, *args, "-o", str(tmp_path / "free.mbtrace")], capture_output=True,
                          text=True, timeout=600)
    assert free.returncode == 0, free.stderr
    from mbolt.core.pagecache import evict

    evict(model["stock"])
    with MemoryGroup(LIMIT - (40 << 20)) as g:
        p = g.popen([sys.executable, *args, "-o", str(tmp_path / "limited.mbtrace")], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=600)
        peak, kills = g.peak(), g.oom_kills()
    assert p.returncode == 0 and kills == 0, err
    assert peak <= LIMIT - (40 << 20) < model["stock"].stat().st_size
    a, b = read_trace(tmp_path / "free.mbtrace"), read_trace(tmp_path / "limited.mbtrace")
    assert a.n_tokens == b.n_tokens > 0 and np.array_equal(a.experts, b.experts)


def test_arm_rounds_under_a_drive_profile(model):
    """An arm-round under a drive profile (bench_memlimit.py drives): the worker throttles its own
    block-I/O group once its model has loaded, and reports what the disk served it during decode
    after the first step, apart from its prompt's reads; the group is gone afterwards."""
    import os

    from mbolt.bench.ab import load_prompt_ids, run_ab
    from mbolt.bench.arms import Arm
    from mbolt.core import blkio

    try:
        kind, root = blkio.io_hierarchy()
        blkio.whole_disk(model["stock"])
    except MboltError as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(e))
    before = {p.name for p in root.iterdir() if p.name.startswith("mbolt-io-")}
    prompts = load_prompt_ids(str(model["stock"]), None, 1, engine="llama.cpp", forced=8, n_new=N_NEW)
    res = run_ab([Arm("plain", str(model["stock"]), mode="os"), Arm("mbolt", str(model["stock"]), io_threads=2)],
                 mode="decode", engine="llama.cpp", rounds=1, prompts=prompts, n_new=N_NEW, ram=LIMIT, forced=8,
                 aa=False, drive="sata")
    assert res.environment["drive"] == "sata"
    for r in res.rounds:
        assert r.drive_decode_tokens == N_NEW - 1  # the steps after the first
        assert 0 <= r.drive_decode_bytes <= r.drive_served_bytes and 0 <= r.drive_decode_reads <= r.drive_served_reads
        assert r.drive_served_bytes > r.drive_decode_bytes  # the prompt read from the disk before decode
    plain = next(r for r in res.rounds if r.arm == "plain")
    assert plain.drive_decode_reads > 0  # experts came back from the disk through faults
    assert {p.name for p in root.iterdir() if p.name.startswith("mbolt-io-")} == before


def test_the_default_slots_are_those_whose_working_sets_the_cache_holds(model):
    """serve's default -np: the most slots (up to 4) whose KV caches take at most an eighth of the
    budget and whose working sets the decode cache holds (results/batch_*.json: 4 interleaved
    conversations on q864 at 40% decoded 0.95x one, 2 gained 1.11x). Over a scan of budgets: more
    memory never gives fewer slots, and where llama.cpp's KV cache of 4 slots takes less than an
    eighth (its own sizes, llama_context) the cache rule still gives fewer on tighter budgets; the
    runtime loaded with the default holds its slots' steps."""
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.memory import simulate
    from mbolt.serve.model import KV_SHARE, auto_parallel

    path, mm = str(model["stock"]), model["mm"]
    assert auto_parallel(path, 256, 512, None) == 1
    assert auto_parallel(path, 256, 512, 1 << 40) == 4
    budgets = [mib << 20 for mib in range(150, 1200, 25)]
    chosen = [auto_parallel(path, 256, 512, b) for b in budgets]
    assert chosen == sorted(chosen) and chosen[-1] == 4, chosen
    kv4 = simulate(path, 256, 256, n_seq=4).kv_bytes
    held_back = [(b, n) for b, n in zip(budgets, chosen) if n < 4 and kv4 * KV_SHARE <= b]
    assert held_back, list(zip(budgets, chosen))  # the cache rule, not the KV rule, keeps these below 4
    b, n = held_back[-1]
    with open_driver(path, budget=b, qd=2, mm=mm, n_ctx=256, n_seq=n) as s:
        s.make_cold()
        assert s.decode_slots >= n * mm.n_used  # at least a step of every slot, cached


def _backing(addr: int) -> str:
    """What backs this address in this process: the mapped file's path, or '' (anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) == 6 else ""
    raise AssertionError(f"{addr:#x} is not mapped")


class _LaidOver:
    """A watcher of the steps: at each prompt pass's expert selection, what backs the first and last
    page of that layer's expert tensors in llama.cpp's mapping (the kernel's /proc/self/maps), and
    whether every byte there is the file's (read apart, by pread)."""

    def __init__(self):
        self.rt, self.phase, self.seen, self.differ = None, None, [], []

    def begin(self, phase, n_rows):
        self.phase = phase

    def end(self):
        pass

    def on_topk(self, layer, rows):
        from mbolt.runtime.runner import Phase

        if self.phase is Phase.PROMPT:
            lo, _, off = self.rt.pages.files[0].maps[0]
            spans = self.rt.pages.expert_spans_of(layer, range(self.rt.mm.n_experts))
            self.seen.append((layer, _backing(lo + spans[0][0] - off), _backing(lo + spans[-1][1] - 1 - off)))
            fd = self.rt.pages.files[0].fd
            for a, b in spans:
                mapped = np.ctypeslib.as_array((ctypes.c_ubyte * (b - a)).from_address(lo + a - off))
                if not np.array_equal(mapped, np.frombuffer(os.pread(fd, b - a, a), np.uint8)):
                    self.differ.append((layer, a))


def test_prompt_passes_laid_over_compute_what_llama_cpp_computes(model, monkeypatch):
    """Where the budget holds two layers and the cache less than half a layer, each layer of a prompt
    pass is laid over with anonymous memory (huge pages) that O_DIRECT fills, and the file is mapped
    back once the layer is done. The predictions are llama.cpp's own on the file (its high-level
    API) through a prompt of two passes, decode steps and a follow-up turn; the kernel shows the
    layer anonymous when its matmuls run and the file mapped again over every expert afterwards;
    the follow-up's logits are bit for bit those of the page cache's way (on this model llama.cpp's
    greedy predictions do not change even with every expert weight zero: the logits do). A
    filesystem that refuses the O_DIRECT reads gets buffered ones into the same memory."""
    import errno

    from mbolt.runtime.budget import BUDGET_MARGIN, expert_bytes_all_layers, layer_bytes
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.prefill import huge_pages, open_direct
    from mbolt.runtime.streamer import own_bytes

    mm, path = model["mm"], str(model["stock"])
    ids = [65 + (i * 7) % 180 for i in range(700)]
    forced, n_new, followup = 600, 6, 40
    want = _llama_predictions(path, [ids], forced, n_new, n_ctx=1024, followup=followup)
    fds = open_direct([path])
    for fd in fds or ():
        os.close(fd)
    available = huge_pages() and fds is not None
    real_preadv = os.preadv
    logits = []
    for overlay, refuse in ((True, False), (True, True), (False, False)):
        w = _LaidOver()
        with open_driver(path, budget=1 << 40, qd=2, mm=mm, n_ubatch=512, n_ctx=1024, asynchronous=True,
                         watchers=[w], overlay=overlay) as s:
            w.rt = s.arm
            assert s.arm.plan.prefetch and (s.arm.overlay is not None) == (available and overlay)
            assert ("laid over: huge pages" in s.arm.describe_budget()) == (available and overlay)  # said to users
            dense = sum(b - a for a, b in s.pages.dense_tensors)
            s.budget.limit = (own_bytes() + dense + BUDGET_MARGIN + s.arm.memory.compute_bytes + 2 * layer_bytes(mm)
                              + 20 * expert_bytes_all_layers(mm))
            s.make_cold()
            assert s.prefill_slots < mm.n_experts // 2
            if refuse and available:
                direct = set(s.arm.overlay.direct)

                def preadv(fd, bufs, off):
                    if fd in direct:
                        raise OSError(errno.EINVAL, "Invalid argument")
                    return real_preadv(fd, bufs, off)

                monkeypatch.setattr(os, "preadv", preadv)
            run = s.generate([ids], n_new, forced=forced, followup=followup)
            monkeypatch.setattr(os, "preadv", real_preadv)
            logits.append(s.runner._logits(-1))  # the follow-up's
            assert run.generated == want
            assert run.prompt_passes == 3  # 600 tokens in two passes of 512, the follow-up in one
            mine = str(model["stock"].resolve())
            if available and overlay:
                layers = len(mm.moe_layers)
                assert all(first == last for _, first, last in w.seen), w.seen  # a layer is laid over whole
                assert not w.differ  # what the matmuls read is the file's bytes
                laid = [layer for layer, first, _ in w.seen if first == ""]
                # every layer of the two passes of the prompt; the follow-up's 40 tokens may leave a
                # layer more than half cached (the cache's way then)
                assert s.arm.overlay.layers_laid == len(laid) >= 2 * layers
                assert (s.arm.overlay.direct is None) == refuse
            for layer in (l.index for l in mm.moe_layers):  # the file under every expert again
                lo, _, off = s.pages.files[0].maps[0]
                for a, b in s.pages.expert_spans_of(layer, range(mm.n_experts)):
                    assert _backing(lo + a - off) == _backing(lo + b - 1 - off) == mine
    assert all(np.array_equal(logits[0], x) for x in logits[1:])


def test_a_budget_of_one_layer_reads_each_layer_from_its_start(model, monkeypatch):
    """Where the budget holds one layer's pass but not two (no read-ahead under the layer before), a
    prompt pass that selects nearly every expert reads each layer from its start (its attention's
    norm, attn_norm-N), once the layer before is done with its experts: laid over (huge pages filled
    by O_DIRECT) where the kernel has them, or asked of the page cache. The plan is what a budget one
    layer short of two gives (planned here with the read-ahead taken out). The predictions are
    llama.cpp's own on the file, through two prompt passes, decode steps and a follow-up turn; both
    ways give the same logits bit for bit; where laid over, the kernel shows each layer anonymous
    when its matmuls run and the file mapped again afterwards."""
    import dataclasses

    import mbolt.runtime.budget as budget
    from mbolt.runtime.budget import BUDGET_MARGIN, expert_bytes_all_layers, layer_bytes, pass_bytes
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.pages import can_move_pages
    from mbolt.runtime.prefill import huge_pages, open_direct
    from mbolt.runtime.streamer import own_bytes

    real_plan = budget.plan_budget

    def one_layer(*a, **kw):
        p = real_plan(*a, **kw)
        return dataclasses.replace(p, prefetch=False, prefill_reserve=max(pass_bytes(a[1], p.n_ubatch), p.step_reserve))

    monkeypatch.setattr(budget, "plan_budget", one_layer)
    mm, path = model["mm"], str(model["stock"])
    ids = [65 + (i * 7) % 180 for i in range(700)]
    forced, n_new, followup = 600, 6, 40
    want = _llama_predictions(path, [ids], forced, n_new, n_ctx=1024, followup=followup)
    layers = len(mm.moe_layers)
    fds = open_direct([path])
    for fd in fds or ():
        os.close(fd)
    available = huge_pages() and fds is not None and can_move_pages()
    logits = []
    for overlay in (True, False):
        w = _LaidOver()
        with open_driver(path, budget=1 << 40, qd=2, mm=mm, n_ubatch=512, n_ctx=1024, asynchronous=True,
                         watchers=[w], overlay=overlay) as s:
            w.rt = s.arm
            assert not s.arm.plan.prefetch and s.arm.plan.prefill_reserve == layer_bytes(mm)
            laying = s.arm.overlay is not None
            assert laying == (overlay and available)  # one slot laid over: the reserve holds one layer
            dense = sum(b - a for a, b in s.pages.dense_tensors)
            s.budget.limit = (own_bytes() + dense + BUDGET_MARGIN + s.arm.memory.compute_bytes + layer_bytes(mm)
                              + 20 * expert_bytes_all_layers(mm))
            s.make_cold()
            assert s.prefill_slots < mm.n_experts // 2
            if laying:  # the first prompt's slot allocated at load, as llama.cpp warms up
                assert s.arm.overlay.held_bytes >= layer_bytes(mm)
            run = s.generate([ids], n_new, forced=forced, followup=followup)
            if laying:  # and freed when the prompt ended: decode's cache has the room
                assert s.arm.overlay.held_bytes == 0
            # the prompt's counts are a part of the totals (serve's decode counts are the difference:
            # they went negative where the laid-over layers were left out of the totals)
            v = s.runtime_view()
            assert v.prompt_misses >= len(mm.moe_layers)
            assert v.misses - v.prompt_misses >= 0 and v.hits - v.prompt_hits >= 0
            assert v.experts - (v.prompt_hits + v.prompt_misses) > 0  # the decode steps'
            logits.append(s.runner._logits(-1))
            assert run.generated == want
            assert run.prompt_passes == 3
            # every layer of the two passes of the prompt (their first layers: 512 and 88 rows x k >= 2E)
            assert s.arm.prompt.from_start >= 2 * layers, s.arm.prompt
            if laying:
                assert not w.differ  # what the matmuls read is the file's bytes
                laid = [layer for layer, first, last in w.seen if first == last == ""]
                assert s.arm.overlay.layers_laid == len(laid) >= 2 * layers
            mine = str(model["stock"].resolve())
            for layer in (l.index for l in mm.moe_layers):  # the file under every expert again
                lo, _, off = s.pages.files[0].maps[0]
                for a, b in s.pages.expert_spans_of(layer, range(mm.n_experts)):
                    assert _backing(lo + a - off) == _backing(lo + b - 1 - off) == mine
    assert np.array_equal(logits[0], logits[1])
