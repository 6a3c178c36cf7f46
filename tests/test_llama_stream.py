"""llama.cpp as the streaming engine (runtime.driver, bench.ab_llama): explicit expert reads
from the eval callback, cold expert pages after every step, the A/B through run_ab.

The model has planted co-activation groups; the reordered file comes from a plan built on a
llama.cpp trace of training prompts (the demo's pipeline), so fewer reads per token on it is a
property of the layout, not of the code under test. Residency is checked with the kernel's own
reports: mincore (page cache) through pagecache.resident_pages and /proc/self/pagemap (the
mapping); no wall-clock assertions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import EXPERT_GAIN, needs_llama
from mbolt.core.errors import MboltError
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama

PROMPTS = [[104, 101, 108, 108, 111, 32, 116, 104], [200, 201, 65, 66, 10, 33]]


# 64 KiB F32 slices, 4 planted groups
MODEL = SynthConfig(arch="qwen3moe", n_layers=4, n_experts=32, n_used=4, hidden=128, expert_ff=128, n_heads=4,
                    n_kv_heads=2, head_dim=32, expert_type="F32", seed=0, structure="planted",
                    expert_gain=EXPERT_GAIN)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """stock, reorder(tsp) from a llama.cpp trace of training prompts, and packed (refused)."""
    from mbolt.core.mbtrace import read_trace
    from mbolt.core.plan import save_plan
    from mbolt.demo import _as_prompt, demo_prompts
    from mbolt.layout.evaluate import geometry_from_model
    from mbolt.layout.plan import make_plan
    from mbolt.core.moe_map import moe_map
    from mbolt.rewrite.reorder import reorder_file
    from mbolt.trace.tracer import trace_prompts

    d = tmp_path_factory.mktemp("llama_stream")
    stock = d / "model.gguf"
    write_synth(stock, MODEL)
    trace_prompts(stock, [_as_prompt(p) for p in demo_prompts(12)], d / "train.mbtrace", max_new_tokens=8,
                  engine="llama.cpp")
    mm = moe_map(stock)
    plan = make_plan(read_trace(d / "train.mbtrace"), "tsp", train_frac=1.0, phase="all",
                     geometry=geometry_from_model(mm, "reorder"))
    save_plan(d / "plan.json", plan)
    reordered = d / "model.reorder-tsp.gguf"
    reorder_file(stock, reordered, plan=d / "plan.json", layout="reorder", force=True)
    packed = d / "model.packed.gguf"
    reorder_file(stock, packed, identity=True, layout="packed", force=True)
    return {"stock": stock, "reorder": reordered, "packed": packed}


def _page_share(path, spans, resident):
    from mbolt.core.pagecache import PAGE

    keep = np.zeros(resident.size, bool)
    for a, b in spans:
        keep[a // PAGE: b // PAGE] = True
    return float(resident[keep].mean())


def test_eviction_after_a_token_leaves_experts_cold_and_dense_resident(files):
    from mbolt.runtime.driver import open_driver
    from mbolt.core.pagecache import resident_pages
    from mbolt.core.moe_map import moe_map
    from gguf import GGUFReader

    path = str(files["stock"])
    mm = moe_map(path)
    with open_driver(path, reads=True) as s:
        pages = s.pages
        # the load (MAP_POPULATE) made every page resident and mapped
        assert pages.mapped() == 1.0
        s.make_cold()
        run = s.generate([PROMPTS[0]], 3)
        res = resident_pages(path)
        # the kernel's view over the expert tensors as gguf-py sees them (not from ExpertPages)
        spans = [(-(-int(t.data_offset) // 4096) * 4096, (int(t.data_offset) + int(t.n_bytes)) // 4096 * 4096)
                 for t in GGUFReader(path).tensors if "_exps." in t.name]
        assert len(spans) == 3 * len(mm.moe_layers)
        assert _page_share(path, spans, res) == 0.0
        assert pages.mapped() == 0.0  # not in llama.cpp's page tables either
        assert pages.resident(pages.dense_spans) == 1.0 and pages.mapped(pages.dense_spans) == 1.0
        # and the step really read experts: k experts x 3 tensors per MoE layer per token at most
        assert 0 < run.reads <= 3 * len(mm.moe_layers) * mm.n_used * 3
        assert run.major_faults == 0  # llama.cpp found every page it touched resident: the reads covered them
        assert run.useful_bytes == run.misses * sum(w.slice_bytes for w in mm.moe_layers[0].weights)


def test_split_set_streams_cold_with_the_same_tokens(files, tmp_path):
    """A set cut by gguf-py's own splitter streams like the one file: the same greedy tokens, and
    after every token no page of any shard's expert tensors resident (each shard's tensors as
    gguf-py reads them, the kernel's mincore), the dense pages resident, no page fault."""
    from gguf import GGUFReader

    from _split_util import split_with_gguf_py
    from mbolt.runtime.driver import open_driver
    from mbolt.core.pagecache import resident_pages

    shards = split_with_gguf_py(files["stock"], tmp_path / "set.gguf", max_tensors=12)
    assert len(shards) >= 3
    with open_driver(str(files["stock"]), reads=True) as s:
        s.make_cold()
        want = s.generate([PROMPTS[0]], 4)
    with open_driver(str(shards[1]), reads=True) as s:  # any shard names the set
        assert len(s.pages.files) == len(shards)
        s.make_cold()
        run = s.generate([PROMPTS[0]], 4)
        assert run.generated == want.generated
        # the same experts read (reads may differ: slices adjacent across a shard boundary never merge)
        assert run.useful_bytes == want.useful_bytes > 0 and run.reads > 0 and run.major_faults == 0
        experts = dense = 0
        for p in shards:
            res = resident_pages(str(p))
            exps = [(-(-int(t.data_offset) // 4096) * 4096, (int(t.data_offset) + int(t.n_bytes)) // 4096 * 4096)
                    for t in GGUFReader(str(p)).tensors if "_exps." in t.name]
            if exps:
                experts += 1
                assert _page_share(str(p), exps, res) == 0.0, p
            dense += bool(s.pages.files[shards.index(p)].dense_spans)
        assert experts >= 2 and dense >= 1  # the experts really are spread over shards
        assert s.pages.resident() == 0.0 and s.pages.mapped() == 0.0
        assert s.pages.resident(s.pages.dense_spans) == 1.0


def test_slot_budget_keeps_cached_experts_resident(files):
    from mbolt.runtime.driver import open_driver

    path = str(files["stock"])
    with open_driver(path, reads=True, cache_slots=8) as s:
        s.make_cold()
        run = s.generate([PROMPTS[0]], 4)
        # the slot cache serves hits, and exactly its experts stay resident
        assert run.hits > 0
        cached = {layer.index: s.arm.store.cached(layer.index) for layer in s.mm.moe_layers}
        kept = [sp for layer, slots in cached.items() for sp in s.pages.expert_spans_of(layer, slots)]
        assert s.pages.resident(kept) == 1.0
        # each expert's own pages (a page two experts share stays while either may be needed)
        gone = [sp for layer, slots in cached.items() for e in sorted(set(range(32)) - set(slots))
                for sp in s.pages.expert_spans_of(layer, [e])]
        assert s.pages.resident(gone) == 0.0
    with pytest.raises(MboltError, match="below the 4 experts"):
        open_driver(path, reads=True, cache_slots=2)


def test_ab_decode_llama_three_arms(files, tmp_path):
    """CI's short A/B: stock os, stock+reads, reorder+reads (+ A/A), a few rounds and tokens."""
    from mbolt.bench.ab import run_ab, write_result
    from mbolt.bench.arms import parse_arm

    arms = [parse_arm(f"{files['stock']}:name=stock-os,os", 0), parse_arm(f"{files['stock']}:name=stock", 1),
            parse_arm(f"{files['reorder']}:name=reorder-tsp", 2)]
    res = run_ab(arms, mode="decode", rounds=2, prompts=PROMPTS, n_new=4, engine="llama.cpp", name="t")
    d = json.loads(write_result(tmp_path / "t.json", res).read_text())
    assert d["engine"] == "llama.cpp" and d["cold"] is True
    assert len(d["rounds"]) == 2 * 4
    gen = {json.dumps(r["generated"]) for r in d["rounds"]}
    assert len(gen) == 1 and len(json.loads(gen.pop())[0]) == 4  # same tokens in every arm-round
    for r in d["rounds"]:
        assert r["resident_after"] <= 0.01 and r["cold_proven"] and not r["rejected"]
    s = {x["arm"]: x for x in d["summary"]}
    assert s["reorder-tsp"]["reads_per_token"] < s["stock"]["reads_per_token"]
    assert s["stock"]["read_share_s"] > 0 and s["stock-os"]["read_share_s"] is None
    # the os arm reads through page faults: the device saw it
    assert s["stock-os"]["device_bytes_per_token"] > 0
    assert all(x["tokens_identical"] for x in d["summary"])


def test_ab_refuses_disagreeing_tokens():
    from mbolt.bench.arms import RoundResult
    from mbolt.bench.ab_llama import check_same_tokens

    def rr(arm, gen):
        return RoundResult(arm, 0, 0, 0, 0, True, False, 2, 1.0, 0.1, 0.1, 1, 1, 1, 1, 0, 1, 0, generated=gen)

    check_same_tokens([rr("a", [[1, 2]]), rr("b", [[1, 2]])])
    with pytest.raises(MboltError, match="arm b .*token 1"):
        check_same_tokens([rr("a", [[1, 2]]), rr("b", [[1, 3]])])


def test_packed_and_direct_refused_in_one_line(files):
    from mbolt.bench.ab import run_ab
    from mbolt.bench.arms import parse_arm

    with pytest.raises(MboltError, match="packed layout: llama.cpp cannot load it"):
        run_ab([parse_arm(str(files["packed"]), 0)], mode="decode", prompts=PROMPTS, engine="llama.cpp", aa=False)
    with pytest.raises(MboltError, match="O_DIRECT"):
        run_ab([parse_arm(f"{files['stock']}:direct", 0)], mode="decode", prompts=PROMPTS, engine="llama.cpp",
               aa=False)
    with pytest.raises(MboltError, match="no slot cache"):
        run_ab([parse_arm(f"{files['stock']}:os,cache=8", 0)], mode="decode", prompts=PROMPTS, engine="llama.cpp",
               aa=False)
    with pytest.raises(MboltError, match="--decode"):
        run_ab([parse_arm(str(files["stock"]), 0)], mode="replay", trace=object(), engine="llama.cpp", aa=False)


def test_prediction_counts_what_llama_read(files, tmp_path):
    """predict_llama counts reads on the routing llama.cpp computed; with no slot cache every step
    reads exactly the step's experts, so the prediction's reads/token are the measured ones (up to
    the boundary case of test_ab's equivalent test: a tensor's last slice touching the next
    tensor's first, merged by the store, not by the per-tensor evaluator)."""
    from test_ab import fake_probe

    from mbolt.bench.ab import run_ab

    from mbolt.bench.arms import parse_arm
    from mbolt.runtime.measured import record_routing
    from mbolt.bench.predict import predict_llama

    arms = [parse_arm(f"{files['stock']}:name=stock", 0), parse_arm(f"{files['reorder']}:name=reorder-tsp", 1)]
    res = run_ab(arms, mode="decode", rounds=1, prompts=PROMPTS, n_new=3, engine="llama.cpp", aa=False)
    tr = record_routing(files["stock"], PROMPTS, 3)
    assert tr.n_tokens == 2 * 3 and (tr.experts[:, 0] >= 0).all()
    rows = predict_llama(res, tr, fake_probe(tmp_path))
    assert [r["arm"] for r in rows] == ["stock", "reorder-tsp"]
    for r in rows:
        assert r["pred_reads_per_token"] == pytest.approx(r["meas_reads_per_token"], rel=0.05)
        assert r["s"] == res.summary[0]["read_share_s"]
    assert rows[1]["pred_reads_per_token"] < rows[0]["pred_reads_per_token"]
    assert rows[0]["pred_speedup"] == pytest.approx(1.0)


def test_cli_generate_stream_and_ab(files, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mbolt.cli import app

    r = CliRunner().invoke(app, ["generate", str(files["stock"]), "hello there", "-n", "3", "--engine", "llama.cpp",
                                 "--stream", "--cache-slots", "4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["stream"] and len(d["ids"]) == 3 and d["reads_per_token"] > 0 and d["decode_tokens_per_s"] > 0
    r = CliRunner().invoke(app, ["generate", str(files["packed"]), "hi", "--engine", "llama.cpp", "--stream"])
    assert r.exit_code == 2 and "packed layout" in r.output and "Traceback" not in r.output
    monkeypatch.chdir(tmp_path)  # no results/probe.json here: no prediction asked for
    r = CliRunner().invoke(app, ["ab", f"{files['stock']}:os,name=os", f"{files['reorder']}:name=reorder",
                                 "--decode", "--engine", "llama.cpp", "--rounds", "1", "-n", "2", "--no-aa",
                                 "--out-dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["engine"] == "llama.cpp" and d["cold"] and (tmp_path / "ab.json").exists()


def test_predict_takes_s_from_a_llama_ab_result(tmp_path):
    from mbolt.bench.predict import measured_s

    p = tmp_path / "ab.json"
    p.write_text(json.dumps({"engine": "llama.cpp", "summary": [{"arm": "os", "read_share_s": None},
                                                                 {"arm": "stock", "read_share_s": 0.62}]}))
    assert measured_s(p) == 0.62
    p.write_text(json.dumps({"engine": "reference", "summary": [{"arm": "stock"}]}))
    with pytest.raises(MboltError, match="no arm with a measured read share"):
        measured_s(p)


def test_an_error_in_the_callback_reaches_the_caller(files):
    """An exception cannot cross llama.cpp's C frames: the runner stops the graph and raises it."""
    from mbolt.runtime.runner import LlamaRunner

    seen = []

    def boom(layer, rows):
        seen.append((layer, rows.shape))
        raise MboltError("stop at layer %d" % layer)

    with LlamaRunner(files["stock"], capture=False, on_topk=boom, load_mode="mmap") as r:
        with pytest.raises(MboltError, match="stop at layer 0"):
            r.eval(PROMPTS[0])
    assert seen[0] == (0, (len(PROMPTS[0]), 4))  # one row of k=4 positions per prompt token


def test_cold_start_keeps_every_dense_page_and_no_expert_page(files):
    """make_cold after llama.cpp's load (which reads the whole file into large folios): no expert
    page stays resident, every page holding a dense byte does (norms of 512 B included), so a
    streamed prefill faults nothing in."""
    import resource

    from mbolt.runtime.driver import open_driver

    with open_driver(str(files["stock"]), reads=True, cache_slots=8) as s:
        s.make_cold()
        assert s.pages.resident() == 0.0
        assert s.pages.resident(s.pages.dense_tensors) == 1.0
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        s.runner.reset()
        s.runner.eval(list(PROMPTS[0]))
        assert resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0 == 0


def test_quantized_experts_are_read_from_the_mapping(tmp_path):
    """Q4_0 experts: llama.cpp's CPU backend repacks such weights into its own buffers unless told
    not to; streaming loads without extra buffer types, so the os arm's matmuls fault the mapped
    expert pages in (a warm copy in anonymous memory would make every arm read for nothing)."""
    from mbolt.runtime.driver import open_driver

    path = write_synth(tmp_path / "q4.gguf", SynthConfig(arch="qwen3moe", n_layers=2, n_experts=16, n_used=4,
                                                         hidden=128, expert_ff=128, n_heads=4, n_kv_heads=2,
                                                         head_dim=32, expert_type="Q4_0", seed=1))
    with open_driver(str(path), reads=False) as s:
        s.make_cold()
        run = s.generate([PROMPTS[0]], 3)
        assert run.major_faults > 0 and s.pages.resident() == 0.0


def test_another_map_of_the_model_file_is_not_the_engines(files):
    """gguf-py's reader maps the model file too. The runtime advises, locks and drops llama.cpp's
    maps only: with a reader's map open, a second model in the same process loads, prompts and
    decodes (it failed with madvise EINVAL: the first had locked the dense pages of the reader's
    map as well), and the reader's bytes are still the file's."""
    from gguf import GGUFReader

    from mbolt.runtime.driver import open_driver

    stock = files["stock"]
    r = GGUFReader(stock)
    t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    want = open(stock, "rb").read()[t.data_offset:t.data_offset + int(t.n_bytes)]
    outs = []
    for _ in range(2):
        with open_driver(stock, n_ctx=256, reads=True, budget=1 << 40) as d:
            d.make_cold()
            outs.append([d.prompt(PROMPTS[0])[0]] + d.step([(0, 7)]))
            assert np.asarray(t.data).tobytes() == want
    assert np.array_equal(np.stack(outs[0]), np.stack(outs[1]))
