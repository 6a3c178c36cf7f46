"""`mbolt inspect` on every synth architecture and on broken files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.synth.synth import SynthConfig, write_synth

ARCHS = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "qwen2moe": "qwen2moe"}
runner = CliRunner()


def inspect(*args):
    return runner.invoke(app, ["inspect", *map(str, args)])


def model(tmp_path, arch="qwen3moe", **kw):
    kw.setdefault("n_kv_heads", 4 if arch == "olmoe" else 2)
    return write_synth(tmp_path / f"{arch}.gguf", SynthConfig(arch=arch, **kw))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_inspect_json_every_arch(tmp_path, arch):
    path = model(tmp_path, arch, n_layers=3, n_experts=8, n_used=2, hidden=64, expert_ff=32, expert_type="Q8_0")
    res = inspect(path, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert (d["arch"], d["n_layers"], d["n_experts"], d["n_used"]) == (ARCHS[arch], 3, 8, 2)
    offsets = {t.name: t.data_offset for t in GGUFReader(path).tensors}  # independent reader
    for layer in d["layers"]:
        assert not layer["dense"]
        by_role = {t["role"]: t for t in layer["tensors"]}
        assert set(by_role) == {"router", "gate", "up", "down"}
        for role in ("gate", "up", "down"):
            t = by_role[role]
            assert t["type"] == "Q8_0"
            assert t["slice_bytes"] == 64 * 32 // 32 * 34
            assert t["offset"] == offsets[t["name"]]
        assert by_role["router"]["slice_bytes"] == 64 * 4
        assert layer["expert_bytes"] == 3 * 64 * 32 // 32 * 34
        i = layer["index"]
        expected_shared = {f"blk.{i}.ffn_{p}_shexp.weight" for p in ("gate_inp", "gate", "up", "down")}
        assert set(layer["shared"]) == (expected_shared if arch == "qwen2moe" else set())


def test_inspect_table_and_dense_and_extra_tensors(tmp_path):
    path = model(tmp_path, n_layers=3, dense_layers=1, probs_bias=True, expert_bias=True)
    res = inspect(path)
    assert res.exit_code == 0, res.output
    assert "ffn_gate_exps.weight" in res.stdout and "dense FFN layers (no routed experts): 0" in res.stdout
    d = json.loads(inspect(path, "--json").stdout)
    assert [layer["dense"] for layer in d["layers"]] == [True, False, False]
    roles = {t["role"] for t in d["layers"][2]["tensors"]}
    assert {"probs_bias", "gate_bias", "up_bias", "down_bias"} <= roles


def assert_one_error_line(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error:")
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in res.output


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("this is not a model, just some text that is long enough\n" * 4)
    assert_one_error_line(inspect(p), "notes.txt", "not a GGUF")


def test_tiny_file(tmp_path):
    p = tmp_path / "tiny.gguf"
    p.write_bytes(b"GGUF")
    assert_one_error_line(inspect(p), "tiny.gguf", "not a GGUF")


def test_missing_file(tmp_path):
    assert_one_error_line(inspect(tmp_path / "nope.gguf"), "nope.gguf")


def test_truncated_header(tmp_path):
    path = model(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:3000])  # inside the vocabulary
    assert_one_error_line(inspect(cut), "cut.gguf", "truncated")


def test_truncated_data(tmp_path):
    path = model(tmp_path)
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: len(raw) - 100])  # header intact, last tensor incomplete
    assert_one_error_line(inspect(cut), "cut.gguf", "output.weight", "past the end")


def test_tensor_offset_past_eof(tmp_path):
    path = model(tmp_path)
    raw = bytearray(path.read_bytes())
    name = b"blk.1.ffn_up_exps.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    off_at = at + 4 + 8 * n_dims + 4
    struct.pack_into("<Q", raw, off_at, len(raw) * 4)  # relative offset far beyond the file
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    assert_one_error_line(inspect(bad), "bad.gguf", "blk.1.ffn_up_exps.weight", "past the end")


def test_non_moe_gguf(tmp_path):
    p = tmp_path / "dense.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_error_line(inspect(p), "dense.gguf", "not a MoE model")


@pytest.mark.parametrize("arch, kw, lines", [
    ("glm4moe", {}, ["dense FFN layers (no routed experts): 0", "shared expert (ffn_*_shexp, never permuted) in 3 "
                     "layers, ungated", "exp_probs_b", "expert weights: gate Q8_0, up Q8_0, down Q8_0"]),
    ("deepseek2", {"fused_gate_up": True}, ["fused gate_up (ffn_gate_up_exps) in layers 1-3", "MLA"]),
    ("gpt-oss", {}, ["router bias, per-expert biases", "attention sinks"]),
    ("qwen3next", {}, ["sigmoid-gated (ffn_gate_inp_shexp)", "linear attention (gated delta net, ssm_*) in layers 0, 2"]),
    ("qwen3moe", {"expert_type": "Q4_K", "down_type": "Q6_K", "layer_types": "0:Q5_K", "fast_random": True},
     ["expert weights: gate Q5_K (layer 0) / Q4_K (layers 1-3), up Q5_K (layer 0) / Q4_K (layers 1-3), down Q6_K"]),
])
def test_inspect_shows_family_structure(tmp_path, arch, kw, lines):
    from mbolt.core.moe_map import moe_map
    from mbolt.synth.config import tiny
    from mbolt.report.tables import moe_structure

    kw.setdefault("expert_type", "Q8_0")
    path = write_synth(tmp_path / "m.gguf", tiny(arch, **kw))
    text = "\n".join(moe_structure(moe_map(path)))
    for line in lines:
        assert line in text, text
    res = inspect(path)
    assert res.exit_code == 0, res.output
    shared = [t for t in GGUFReader(path).tensors if "shexp" in t.name]
    if shared:  # shared tensors listed with their own type
        assert "shared" in res.stdout and shared[0].tensor_type.name in res.stdout
