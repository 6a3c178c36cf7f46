"""Real tokenizers on every llama.cpp path (issue 20).

The vocabularies are llama.cpp's own `models/ggml-vocab-*.gguf` with the token ids its tokenizer
test expects (`.inp` texts, `.out` ids), taken from the llama-cpp-python 0.3.36 source by
`python scripts/fetch_test_vocabs.py` (README's test command runs it): Llama 2's SentencePiece
(as Mixtral's), and the byte-level BPE of Qwen2, Llama 3, DeepSeek LLM and GPT-2, each with its
pre-tokenizer. A synthetic model that borrows a vocabulary (`synth --vocab`) then goes through
`trace`, `generate --stream`, `ab --forced --ram` and `verify --llama` in llama.cpp.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import IN_CI, needs_llama
from mbolt.cli import app
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama

VOCAB_DIR = Path(os.environ.get("MBOLT_TEST_VOCABS", Path(__file__).parent / ".vocabs"))
VOCABS = ("llama-spm", "qwen2", "llama-bpe", "deepseek-llm", "gpt-2")


def vocab(name: str) -> Path:
    p = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not p.exists():
        if IN_CI:
            pytest.fail(f"{p} missing: README's test command runs scripts/fetch_test_vocabs.py first")
        pytest.skip(f"{p} missing (python scripts/fetch_test_vocabs.py)")
    return p


def expected(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 cases: texts split by its separator, one line of ids each."""
    p = vocab(name)
    texts = Path(f"{p}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = Path(f"{p}.out").read_text(encoding="utf-8").split("\n")
    texts[-1] = texts[-1].rstrip("\n") if texts[-1].endswith("\n") else texts[-1]
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids)]


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("name", VOCABS)
def test_llama_tokenizer_gives_llama_cpps_expected_ids(name):
    """The tokenizer every llama.cpp path of mbolt uses, against llama.cpp's own expected ids."""
    from mbolt.runtime.runner import LlamaRunner

    cases = expected(name)
    assert len(cases) > 20
    with LlamaRunner(vocab(name), vocab_only=True) as r:
        got = [r.tokenize(text, add_special=False) for text, _ in cases]
    assert got == [ids for _, ids in cases]


@pytest.fixture(scope="module", params=VOCABS)
def model(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(f"vocab-{name}")
    path = write_synth(d / "m.gguf", SynthConfig(arch="qwen3moe", n_layers=2, n_experts=8, n_used=2, hidden=32,
                                                 expert_ff=32, n_heads=2, n_kv_heads=1, head_dim=16,
                                                 dense_type="F16", seed=7, vocab=str(vocab(name))))
    return name, path


def test_every_llama_path_runs_on_the_real_vocabulary(model, tmp_path):
    name, path = model
    from mbolt.core.header import read_header

    h = read_header(path)
    assert h.get("tokenizer.ggml.model") == read_header(vocab(name)).get("tokenizer.ggml.model")
    r = cli("trace", path, "--engine", "llama.cpp", "-n", "3", "--n-prompts", "2", "-o", tmp_path / "t.mbtrace")
    assert r.exit_code == 0, r.output
    plain = cli("generate", path, "The capital of France is", "--engine", "llama.cpp", "-n", "4", "--json")
    stream = cli("generate", path, "The capital of France is", "--engine", "llama.cpp", "-n", "4", "--stream",
                 "--json")
    assert plain.exit_code == 0 and stream.exit_code == 0, plain.output + stream.output
    a, b = json.loads(plain.output), json.loads(stream.output)
    assert a["ids"] == b["ids"] and a["prompt_ids"] == b["prompt_ids"] and len(a["ids"]) == 4
    r = cli("ab", f"{path}:os,name=plain", f"{path}:name=mbolt,async", "--decode", "--engine", "llama.cpp",
            "--forced", "-n", "3", "--rounds", "1", "--no-aa", "--out-dir", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {row["arm"] for row in d["summary"]} == {"plain", "mbolt"}
    r = cli("reorder", path, tmp_path / "r.gguf", "--identity")
    assert r.exit_code == 0, r.output
    r = cli("verify", path, tmp_path / "r.gguf", "--llama", "--no-parity", "-n", "2")
    assert r.exit_code == 0, r.output


def test_the_reference_engine_names_the_way_for_sentencepiece(tmp_path):
    p = write_synth(tmp_path / "spm.gguf", SynthConfig(arch="qwen3moe", n_layers=2, n_experts=8, n_used=2, hidden=32,
                                                       expert_ff=32, n_heads=2, n_kv_heads=1, head_dim=16,
                                                       vocab=str(vocab("llama-spm"))))
    r = cli("trace", p, "-n", "2", "--n-prompts", "1", "-o", tmp_path / "t.mbtrace")
    assert r.exit_code == 2 and "use --engine llama.cpp" in r.output.replace("\n", " ")
