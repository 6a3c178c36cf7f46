"""mbolt trace / mbolt generate: prompt files, recorded phases and domains, both backends."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from _engine_util import permuted_copy, random_perm
from conftest import needs_llama
from mbolt.cli import app
from mbolt.reference import load_model
from mbolt.reference.tokenizer import Tokenizer
from mbolt.core.errors import MboltError
from mbolt.core.header import read_header
from mbolt.synth.synth import SynthConfig, write_synth
from mbolt.core.mbtrace import read_trace
from mbolt.core.trace import DECODE, PREFILL
from mbolt.core.prompts import read_prompts
from mbolt.trace.tracer import trace_prompts


@pytest.fixture()
def model(tmp_path):
    return write_synth(tmp_path / "m.gguf", SynthConfig(n_experts=8, n_used=2, seed=4, dense_layers=1))


def _jsonl(tmp_path, rows, name="p.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_trace_records_prefill_decode_domains_and_matches_engine(tmp_path, model):
    prompts = _jsonl(tmp_path, [{"prompt": "the tin", "source": "dolly/qa"}, {"prompt": "def f(x):", "source": "code"}])
    res = trace_prompts(model, prompts, tmp_path / "r.mbtrace", max_new_tokens=3)
    t = read_trace(tmp_path / "r.mbtrace")
    tok = Tokenizer.from_header(read_header(model))
    n0, n1 = len(tok.encode("the tin")), len(tok.encode("def f(x):"))
    assert t.domains == {0: "dolly/qa", 1: "code"}
    assert t.n_tokens == n0 + n1 + 6 == res["prefill_tokens"] + res["decode_tokens"]
    assert (t.phase == PREFILL).sum() == n0 + n1 and (t.phase == DECODE).sum() == 6
    s0 = t.seq == 0
    np.testing.assert_array_equal(t.pos[s0], np.arange(n0 + 3))
    assert (t.experts[:, 0] == -1).all()  # dense layer 0
    assert (t.experts[:, 1:] >= 0).all()
    # the recorded prefill routing is the engine's own
    m = load_model(model)
    m.forward(tok.encode("def f(x):"))
    rows = t.experts[(t.seq == 1) & (t.phase == PREFILL)]
    for li in range(1, m.n_layers):
        np.testing.assert_array_equal(rows[:, li], m.last_routing[li].experts)
    assert t.weights is not None and np.allclose(t.weights[:, 1:].sum(-1), 1.0, atol=1e-5)


def test_trace_of_reordered_file_records_original_ids(tmp_path, model):
    prompts = _jsonl(tmp_path, [{"prompt": "hello there", "source": "x"}])
    trace_prompts(model, prompts, tmp_path / "a.mbtrace", max_new_tokens=4)
    permuted_copy(model, tmp_path / "p.gguf", random_perm(4, 8, seed=9))
    trace_prompts(tmp_path / "p.gguf", prompts, tmp_path / "b.mbtrace", max_new_tokens=4)
    a, b = read_trace(tmp_path / "a.mbtrace"), read_trace(tmp_path / "b.mbtrace")
    np.testing.assert_array_equal(a.experts, b.experts)
    assert a.fingerprint == read_header(model).fingerprint


@pytest.mark.parametrize("content,msg", [
    ('{"prompt": "a"}\n\n{"prompt": "b"}\n', r"p.jsonl:2: empty line"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', r"p.jsonl:2: invalid JSON"),
    ('{"source": "x"}\n', r"p.jsonl:1: missing or empty \"prompt\""),
    ('[1, 2]\n', r"p.jsonl:1: expected a JSON object"),
    ('', r"no prompts"),
])
def test_bad_prompt_files_name_the_line(tmp_path, content, msg):
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    with pytest.raises(MboltError, match=msg):
        read_prompts(p)


def test_missing_prompt_file_and_txt_prompts(tmp_path):
    with pytest.raises(MboltError, match="no such prompt file"):
        read_prompts(tmp_path / "nope.jsonl")
    t = tmp_path / "p.txt"
    t.write_text("first\n\nsecond\n")
    assert [(p.text, p.line) for p in read_prompts(t)] == [("first", 1), ("second", 3)]


def test_cli_trace_on_shared_prompts_and_generate_json(tmp_path, model, data_dir):
    r = CliRunner().invoke(app, ["trace", str(model), "--prompts", str(data_dir / "prompts.jsonl"),
                                 "-o", str(tmp_path / "s.mbtrace"), "--n-prompts", "3", "--new-tokens", "2", "--json"])
    assert r.exit_code == 0, r.output
    t = read_trace(tmp_path / "s.mbtrace")
    assert len(t.domains) == 3 and all("/" in d or d == "codealpaca" for d in t.domains.values())
    r = CliRunner().invoke(app, ["generate", str(model), "the tin", "-n", "5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert len(out["ids"]) == 5 and out["prompt_ids"] == Tokenizer.from_header(read_header(model)).encode("the tin")
    m = load_model(model)
    assert int(np.argmax(m.forward(out["prompt_ids"]))) == out["ids"][0]


def test_cli_errors_are_one_line(tmp_path, model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    r = CliRunner().invoke(app, ["trace", str(model), "--prompts", str(bad), "-o", str(tmp_path / "o.mbtrace")])
    assert r.exit_code == 2 and "bad.jsonl:2" in r.output
    good = tmp_path / "good.txt"
    good.write_text("hello\n")
    r = CliRunner().invoke(app, ["trace", str(model), "--prompts", str(good), "-o", str(tmp_path / "o.mbtrace"),
                                 "--engine", "vllm"])
    assert r.exit_code == 2 and "reference, llama.cpp" in r.output


@needs_llama
def test_llama_backend_trace_agrees_with_reference(tmp_path):
    model = write_synth(tmp_path / "m.gguf", SynthConfig(n_experts=8, n_used=2, seed=4))  # llama.cpp: no dense layers
    prompts = _jsonl(tmp_path, [{"prompt": "the theater in a tin", "source": "a"}, {"prompt": "x = 1", "source": "b"}])
    trace_prompts(model, prompts, tmp_path / "r.mbtrace", max_new_tokens=5)
    trace_prompts(model, prompts, tmp_path / "l.mbtrace", max_new_tokens=5, engine="llama.cpp", threads=1)
    a, b = read_trace(tmp_path / "r.mbtrace"), read_trace(tmp_path / "l.mbtrace")
    assert a.n_tokens == b.n_tokens and b.domains == a.domains
    np.testing.assert_array_equal(a.phase, b.phase)
    last = a.n_layers - 1
    # llama.cpp routes the last layer only for the prompt's output token
    out_tok = (b.phase == PREFILL) & np.r_[b.phase[1:] == DECODE, False]
    assert (b.experts[(b.phase == PREFILL) & ~out_tok, last] == -1).all()
    assert (b.experts[out_tok, last] >= 0).all()
    rec = (b.experts >= 0).all(-1)  # llama.cpp recorded this (token, layer)
    assert rec.mean() > 0.7
    np.testing.assert_array_equal(np.sort(a.experts, -1)[rec], np.sort(b.experts, -1)[rec])


def test_interrupted_trace_leaves_no_output_and_keeps_a_readable_part(tmp_path, model):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\nsecond prompt\nthird one\n")
    out = tmp_path / "run.mbtrace"

    def stop_after_first(done, total, toks, secs):
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(MboltError, match=r"interrupted; the \d+ tokens traced so far are in .*run\.mbtrace\.part"):
        trace_prompts(model, prompts, out, max_new_tokens=2, on_progress=stop_after_first)
    assert not out.exists()
    part = read_trace(tmp_path / "run.mbtrace.part")
    assert set(part.seq.tolist()) == {0} and part.n_tokens > 0


def test_trace_cli_refuses_to_overwrite_without_force(tmp_path, model):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    out = tmp_path / "run.mbtrace"
    out.write_bytes(b"precious")
    res = CliRunner().invoke(app, ["trace", str(model), "-p", str(prompts), "-o", str(out), "--new-tokens", "1"])
    assert res.exit_code == 2 and "use --force" in res.output
    assert out.read_bytes() == b"precious"
    res = CliRunner().invoke(app, ["trace", str(model), "-p", str(prompts), "-o", str(out), "--new-tokens", "1",
                                   "--force"])
    assert res.exit_code == 2 and "not a previous trace" in res.output  # --force replaces only a trace
    assert out.read_bytes() == b"precious"
    out.unlink()
    for force in ([], ["--force"]):  # a first run, then --force over that earlier trace
        res = CliRunner().invoke(app, ["trace", str(model), "-p", str(prompts), "-o", str(out), "--new-tokens", "1",
                                       *force])
        assert res.exit_code == 0, res.output
        assert read_trace(out).n_tokens > 0
