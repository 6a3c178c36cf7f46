"""Hyperparameters against tensor shapes when a model is opened (core.hparams): a metadata value
that disagrees with the tensors is one line naming the key and the tensor, exit 2, in every
command, `verify` included (it was a reshape traceback inside the reference engine)."""

from __future__ import annotations

import struct

import pytest
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.errors import MboltError
from mbolt.core.header import read_header
from mbolt.synth.synth import SYNTH_ARCHS, SynthConfig, write_synth


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from mbolt.rewrite.reorder import reorder_file

    d = tmp_path_factory.mktemp("hparams")
    src = write_synth(d / "m.gguf", SynthConfig(arch="qwen3moe", n_layers=2, n_experts=8, n_used=2, hidden=64,
                                                expert_ff=32, n_heads=4, n_kv_heads=2, head_dim=16, seed=5))
    out = d / "m.reorder.gguf"
    reorder_file(src, out, identity=True, layout="reorder", force=True)
    return src, out


def _set_u32(src, dst, key: str, value: int):
    kv = read_header(src).kv[key]
    raw = bytearray(src.read_bytes())
    assert struct.unpack_from("<I", raw, kv.span[1] - 4)[0] == kv.value  # the value is the entry's last 4 bytes
    struct.pack_into("<I", raw, kv.span[1] - 4, value)
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("key, value, tensor", [
    ("qwen3moe.attention.head_count_kv", 3, "blk.0.attn_k.weight"),
    ("qwen3moe.attention.head_count", 5, "blk.0.attn_q.weight"),
    ("qwen3moe.embedding_length", 65, "token_embd.weight"),
    ("qwen3moe.expert_feed_forward_length", 33, "blk.0.ffn_gate_exps.weight"),
    ("qwen3moe.vocab_size", 300, "token_embd.weight"),
])
def test_a_flipped_hyperparameter_names_key_and_tensor_everywhere(pair, tmp_path, key, value, tensor):
    src, out = pair
    bad = _set_u32(out, tmp_path / "bad.gguf", key, value)
    for args in (["verify", str(src), str(bad), "--no-parity"], ["inspect", str(bad)],
                 ["generate", str(bad), "hi", "-n", "1"]):
        r = CliRunner().invoke(app, args)
        text = r.output.replace("\n", " ")
        assert r.exit_code == 2, (args, r.output)
        assert key in text and tensor in text and "Traceback" not in r.output, (args, r.output)


def test_the_unchanged_files_open(pair):
    from mbolt.core.moe_map import moe_map

    for p in pair:
        assert moe_map(p).n_experts == 8


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_every_family_passes_its_own_checks(arch, tmp_path):
    """The checks follow llama.cpp's tensor forms, so every family synth writes (MLA, gated and
    linear attention, sinks) opens; llama.cpp loading these files is tested in test_families."""
    from mbolt.core.moe_map import moe_map
    from mbolt.synth.config import tiny

    p = write_synth(tmp_path / f"{arch}.gguf", tiny(arch))
    assert moe_map(p).n_experts > 1


def test_hparam_error_is_a_user_error():
    from mbolt.core.hparams import HparamError

    assert issubclass(HparamError, MboltError)


@pytest.mark.parametrize("key", ["qwen3moe.attention.head_count_kv", "qwen3moe.attention.head_count",
                                 "qwen3moe.embedding_length", "qwen3moe.expert_used_count"])
def test_every_bit_of_a_sizing_hparam_flipped_is_a_verdict_never_a_traceback(pair, tmp_path, key):
    """Every one of the 32 bits of the value flipped in the rewritten file: verify (with the
    reference engine's routing parity, which reshapes by these values) ends in exit 1 or 2 and one
    error line, never a traceback."""
    from mbolt.core.header import read_header

    src, out = pair
    value = int(read_header(out).kv[key].value)
    for bit in range(32):
        bad = _set_u32(out, tmp_path / "bad.gguf", key, value ^ (1 << bit))
        r = CliRunner().invoke(app, ["verify", str(src), str(bad)])
        assert r.exit_code in (1, 2) and r.exception is None or isinstance(r.exception, SystemExit), (bit, r.output)
        assert "Traceback" not in r.output, (bit, r.output)
