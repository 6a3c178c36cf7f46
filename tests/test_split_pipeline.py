"""A split set written by gguf-py's splitter through the whole pipeline: trace (both engines),
plan, reorder (both layouts, as a set), verify, and llama.cpp on the input and output sets;
traces from several machines (trace --shard, trace-merge, plan on several traces)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from _split_util import split_with_gguf_py
from conftest import EXPERT_GAIN, needs_llama
from mbolt.cli import app
from mbolt.core.errors import MboltError
from mbolt.core.mbtrace import read_trace, write_trace
from mbolt.core.plan import load_plan
from mbolt.core.trace import merge_traces
from mbolt.synth.synth import SynthConfig, write_synth

runner = CliRunner()
PROMPTS = [{"prompt": "the tin", "source": "dolly/qa"}, {"prompt": "def f(x):", "source": "code"},
           {"prompt": "once upon a", "source": "dolly/story"}, {"prompt": "import os", "source": "code"},
           {"prompt": "a b c", "source": "misc"}]


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res


def ok(*args):
    res = cli(*args)
    assert res.exit_code == 0, res.output
    return res


# llama.cpp: no dense qwen3moe layers
MODEL = SynthConfig(arch="qwen3moe", n_layers=4, n_experts=8, n_used=2, expert_type="Q8_0", seed=5,
                    expert_gain=EXPERT_GAIN)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe")
    src = write_synth(d / "m.gguf", MODEL)
    shards = split_with_gguf_py(src, d / "set.gguf", max_tensors=16)
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return d, src, shards, prompts


def test_reference_trace_of_a_set_is_the_trace_of_the_file(setup):
    d, src, shards, prompts = setup
    ok("trace", src, "-p", prompts, "-o", d / "file.mbtrace", "-n", "3")
    ok("trace", shards[1], "-p", prompts, "-o", d / "set.mbtrace", "-n", "3")  # any shard
    a, b = read_trace(d / "file.mbtrace"), read_trace(d / "set.mbtrace")
    assert a.n_tokens == b.n_tokens > 0
    np.testing.assert_array_equal(a.experts, b.experts)
    assert (b.experts[:, 1:] >= 0).all()


def test_trace_shards_merge_into_the_whole_trace(setup):
    d, src, shards, prompts = setup
    whole = d / "whole.mbtrace"
    ok("trace", shards[0], "-p", prompts, "-o", whole, "-n", "2")
    parts = []
    for i in (1, 2):
        p = d / f"part{i}.mbtrace"
        ok("trace", shards[0], "-p", prompts, "-o", p, "-n", "2", "--shard", f"{i}/2")
        parts.append(p)
    t1, t2 = read_trace(parts[0]), read_trace(parts[1])
    assert sorted(set(t1.seq.tolist())) == [0, 2, 4] and sorted(set(t2.seq.tolist())) == [1, 3]
    merged = d / "all.mbtrace"
    ok("trace-merge", parts[0], parts[1], "-o", merged)
    m, w = read_trace(merged), read_trace(whole)
    assert m.n_tokens == w.n_tokens
    assert len(set(m.seq.tolist())) == 5
    # every whole-trace sequence appears once in the merge, with its domain and routing
    for s in set(w.seq.tolist()):
        rows = w.experts[w.seq == s]
        match = [t for t in set(m.seq.tolist()) if np.array_equal(m.experts[m.seq == t], rows)]
        assert len(match) >= 1
        assert m.domains[match[0]] == w.domains[s]
    # plan on several traces equals plan on their merge
    ok("plan", parts[0], parts[1], "--model", shards[2], "-o", d / "p2.json", "--method", "heat")
    ok("plan", merged, "--model", shards[2], "-o", d / "p1.json", "--method", "heat")
    assert np.array_equal(load_plan(d / "p2.json").perm, load_plan(d / "p1.json").perm)
    # refusals: other geometry, other model, an input as output
    other = write_synth(d / "o.gguf", SynthConfig(arch="qwen3moe", n_layers=3, n_experts=8, n_used=2, seed=6))
    ok("trace", other, "-p", prompts, "-o", d / "o.mbtrace", "-n", "1", "--n-prompts", "1")
    res = cli("trace-merge", parts[0], d / "o.mbtrace", "-o", d / "bad.mbtrace")
    assert res.exit_code == 2 and "not the same model" in res.output
    res = cli("trace-merge", parts[0], parts[1], "-o", parts[0], "--force")
    assert res.exit_code == 2 and "is an input" in res.output
    res = cli("trace", shards[0], "-p", prompts, "-o", d / "x.mbtrace", "--shard", "3/2")
    assert res.exit_code == 2 and "--shard" in res.output


def test_merge_refuses_another_fingerprint(setup):
    d, src, shards, prompts = setup
    for i in (1, 2):
        ok("trace", shards[0], "-p", prompts, "-o", d / f"f{i}.mbtrace", "-n", "1", "--shard", f"{i}/2")
    t, u = read_trace(d / "f1.mbtrace"), read_trace(d / "f2.mbtrace")
    assert t.fingerprint == u.fingerprint != ""
    u.fingerprint = "0" * 32
    with pytest.raises(MboltError, match="b: recorded on model 000000000000, a on"):
        merge_traces([t, u], ["a", "b"])
    write_trace(d / "fp.mbtrace", u)
    res = cli("trace-merge", d / "f1.mbtrace", d / "fp.mbtrace", "-o", d / "fpm.mbtrace")
    assert res.exit_code == 2 and "not the same model" in res.output
    assert not (d / "fpm.mbtrace").exists()


@needs_llama
def test_llama_pipeline_on_a_set(setup):
    from mbolt.runtime.runner import LlamaRunner

    d, src, shards, prompts = setup
    trace = d / "llama.mbtrace"
    ok("trace", shards[2], "--engine", "llama.cpp", "-p", prompts, "-o", trace, "-n", "4", "--threads", "1")
    assert read_trace(trace).n_tokens > 0
    ok("plan", trace, "--model", shards[0], "-o", d / "plan.json", "--train-frac", "1")
    outs = {}
    for layout in ("reorder", "packed"):
        res = ok("reorder", shards[1], d / f"o-{layout}.gguf", "--plan", d / "plan.json", "--layout", layout, "--json")
        r = json.loads(res.output)
        assert len(r["files"]) == len(shards) == 4
        outs[layout] = r["files"]
        ok("verify", shards[0], r["files"][1], "--no-parity")
    ok("verify", shards[0], outs["reorder"][0], "--llama", "--no-parity", "--n-prompts", "2", "-n", "4")

    def greedy(path, ids, n=6):
        with LlamaRunner(path, n_ctx=64, capture=False, n_threads=1) as r:
            out, step = [], ids
            for _ in range(n):
                t = int(np.argmax(r.eval(step)))
                out.append(t)
                step = [t]
            return out

    for ids in ([1, 2, 3, 4], [7, 9, 11]):
        want = greedy(shards[0], ids)
        assert greedy(outs["reorder"][0], ids) == want
        assert greedy(outs["reorder"][2], ids) == want  # any shard: the runner opens the set
    # the plan moved experts: the output set is not a byte copy of the input set
    assert not (load_plan(d / "plan.json").perm == np.arange(8)).all()


@needs_llama
def test_llama_streaming_a_set_gives_the_one_files_tokens(setup):
    """`generate --engine llama.cpp --stream` on a shard of the set: the same greedy tokens as the
    one file, experts read explicitly (reads per token > 0) from every shard."""
    d, src, shards, prompts = setup
    out = {}
    for name, path in (("file", src), ("set", shards[0])):
        r = cli("generate", path, "hello there", "--engine", "llama.cpp", "--stream", "-n", "4", "--json")
        assert r.exit_code == 0, r.output
        out[name] = json.loads(r.output)
    assert out["set"]["ids"] == out["file"]["ids"] and len(out["set"]["ids"]) == 4
    assert out["set"]["reads_per_token"] > 0 and out["set"]["misses"] == out["file"]["misses"] > 0
    assert "Traceback" not in r.output
