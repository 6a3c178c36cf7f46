"""mbolt verify: bit-identity through the route map, damage named by tensor/layer/expert, parity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mbolt.core.errors import MboltError
from gguf import GGUFReader

from conftest import needs_llama
from mbolt.core.header import read_header
from mbolt.synth.config import tiny
from mbolt.synth.synth import SYNTH_ARCHS, SynthConfig, write_synth
from mbolt.rewrite.reorder import reorder
from mbolt.rewrite.verify import verify


def random_perm(n_layers, n_experts, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n_experts) for _ in range(n_layers)]).astype(np.int32)


def small(arch: str, seed: int = 11, **kw) -> SynthConfig:
    return tiny(arch, n_layers=3, dense_layers=0, seed=seed, **kw)


ENGINE_ARCHS = ["glm4moe", "mixtral", "olmoe", "qwen2moe", "qwen3moe"]  # the reference engine's families


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A biased qwen3moe and its reorder/packed rewrites with a known perm."""
    d = tmp_path_factory.mktemp("verify")
    src = d / "src.gguf"
    write_synth(src, small("qwen3moe", probs_bias=True, expert_bias=True, expert_type="Q8_0"))
    perm = random_perm(3, 8, seed=4)
    out = {}
    for layout in ("reorder", "packed"):
        out[layout] = d / f"{layout}.gguf"
        reorder(src, out[layout], perm, layout=layout)
    return src, out, perm


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
@pytest.mark.parametrize("layout", ["reorder", "packed"])
def test_every_arch_survives_reorder_and_verify(tmp_path, arch, layout):
    src = tmp_path / "src.gguf"
    write_synth(src, small(arch))
    out = tmp_path / "out.gguf"
    reorder(src, out, random_perm(3, 8, seed=1), layout=layout)
    rep = verify(src, out, parity=True, n_tokens=2, prompts=["hello world", "def f(x): return x"])
    assert rep.ok, [c for c in rep.checks if not c.ok]
    names = [c.name for c in rep.checks]
    assert names == ["header", "route map", "sidecar", "metadata", "tensors", "data", "padding", "routing"]
    assert rep.parity["decisions"] > 0 and rep.parity["identical"] == rep.parity["decisions"]
    assert rep.bytes_compared > 0.9 * sum(t.nbytes for t in read_header(src).tensors)


def test_biased_model_parity_both_layouts(files):
    src, out, _ = files
    for layout in ("reorder", "packed"):
        rep = verify(src, out[layout], parity=True, n_tokens=2, prompts=["The quick brown fox"])
        assert rep.ok, [c for c in rep.checks if not c.ok]


@pytest.mark.parametrize("reader", ["mmap", "pread"])
@pytest.mark.parametrize("layout", ["reorder", "packed"])
def test_flipped_byte_in_expert_slice_is_named(files, tmp_path, layout, reader):
    src, out, perm = files
    bad = copy(out[layout], tmp_path / "bad.gguf")
    layer, position = 2, 5
    r = GGUFReader(bad)
    if layout == "reorder":
        t = next(t for t in r.tensors if t.name == f"blk.{layer}.ffn_up_exps.weight")
        slice_bytes = t.n_bytes // 8
        at = t.data_offset + position * slice_bytes + 17
    else:  # slot = gate|up|down of one expert; the up slice starts after gate's
        t = next(t for t in r.tensors if t.name == f"blk.{layer}.ffn_exps_packed")
        g = next(x for x in GGUFReader(src).tensors if x.name == f"blk.{layer}.ffn_gate_exps.weight")
        slot = t.n_bytes // 8
        at = t.data_offset + position * slot + g.n_bytes // 8 + 17
    flip(bad, at)
    rep = verify(src, bad, reader=reader)
    assert not rep.ok and rep.n_mismatches == 1
    m = rep.mismatches[0]
    assert (m.tensor, m.layer, m.position, m.expert, m.offset) == (
        f"blk.{layer}.ffn_up_exps.weight", layer, position, int(perm[layer, position]), 17)
    assert f"layer {layer}, expert {perm[layer, position]} at position {position}" in str(m)


def test_flipped_byte_in_router_and_plain_tensor(files, tmp_path):
    src, out, perm = files
    bad = copy(out["reorder"], tmp_path / "bad.gguf")
    r = GGUFReader(bad)
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    router = next(t for t in r.tensors if t.name == "blk.1.ffn_gate_inp.weight")
    flip(bad, emb.data_offset + 100)
    flip(bad, router.data_offset + 3 * (router.n_bytes // 8))  # first byte of position 3's row
    rep = verify(src, bad, reader="pread")
    got = {(m.tensor, m.layer, m.position, m.expert, m.offset) for m in rep.mismatches}
    assert got == {("token_embd.weight", -1, -1, -1, 100), ("blk.1.ffn_gate_inp.weight", 1, 3, int(perm[1, 3]), 0)}


def test_truncated_output(files, tmp_path):
    src, out, _ = files
    data = out["reorder"].read_bytes()
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(data[:len(data) - 5000])
    rep = verify(src, bad)
    assert not rep.ok
    assert rep.checks[0].name == "header" and rep.checks[0].ok is False
    assert "ends past the end of the file" in rep.checks[0].detail


def test_metadata_change_is_named(files, tmp_path):
    src, out, _ = files
    bad = copy(out["reorder"], tmp_path / "meta.gguf")
    kv = read_header(bad).kv["qwen3moe.rope.freq_base"]
    flip(bad, kv.span[1] - 1)  # last byte of the float value
    rep = verify(src, bad)
    meta = next(c for c in rep.checks if c.name == "metadata")
    assert meta.ok is False and "qwen3moe.rope.freq_base differs" in meta.detail
    assert not rep.ok


def test_wrong_source_and_stock_output(files, tmp_path):
    src, out, _ = files
    other = tmp_path / "other.gguf"
    write_synth(other, small("qwen3moe", seed=12, probs_bias=True, expert_bias=True, expert_type="Q8_0"))
    with pytest.raises(MboltError, match="not a rewrite of .*made from a file with fingerprint"):
        verify(other, out["reorder"])
    with pytest.raises(MboltError, match="has no route map"):
        verify(src, src)  # a stock "output"


def test_cli_exit_codes(files, tmp_path):
    from typer.testing import CliRunner

    from mbolt.cli import app

    src, out, perm = files
    run = CliRunner().invoke
    res = run(app, ["verify", str(src), str(out["packed"]), "--json", "--new-tokens", "1", "--n-prompts", "1"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["ok"] and d["layout"] == "packed" and d["parity"]["identical"] == d["parity"]["decisions"] > 0
    bad = copy(out["reorder"], tmp_path / "bad.gguf")
    t = next(t for t in GGUFReader(bad).tensors if t.name == "blk.0.ffn_down_exps.weight")
    flip(bad, t.data_offset + t.n_bytes - 1)  # last byte of the last position
    res = run(app, ["verify", str(src), str(bad), "--no-parity"])
    assert res.exit_code == 1
    assert "blk.0.ffn_down_exps.weight" in res.output and "NOT identical" in res.output
    res = run(app, ["verify", str(tmp_path / "missing.gguf"), str(bad)])
    assert res.exit_code == 2


@needs_llama
@pytest.mark.parametrize("arch", sorted(SYNTH_ARCHS))
def test_llama_cpp_loads_reorder_output(tmp_path, arch):
    src = tmp_path / "src.gguf"
    write_synth(src, small(arch))
    out = tmp_path / "out.gguf"
    reorder(src, out, random_perm(3, 8, seed=2))
    rep = verify(src, out, llama=True, n_tokens=4, prompts=["The quick brown fox", "1 2 3 5 8"])
    assert rep.ok, [c for c in rep.checks if not c.ok]
    ll = rep.llama
    assert ll["tokens_identical"] == ll["tokens"] > 0
    assert ll["max_logit_diff"] <= ll["tolerance"]
    assert ll["routing_share"] == 1.0 and ll["routing_decisions"] > 0


def test_packed_slot_padding_must_be_zero(tmp_path):
    src = tmp_path / "s.gguf"
    # Q4_0 64 x 32 slices of 1152 B: 3456 B per expert, padded to 3584 B slots (2 layers x 8 x 128 B)
    write_synth(src, SynthConfig(arch="qwen3moe", n_layers=2, n_experts=8, n_used=2, hidden=64, expert_ff=32,
                                 expert_type="Q4_0"))
    out = tmp_path / "p.gguf"
    reorder(src, out, random_perm(2, 8, seed=3), layout="packed")
    rep = verify(src, out)
    assert rep.ok
    assert "padding bytes zero" in next(c for c in rep.checks if c.name == "padding").detail
    blob = next(t for t in GGUFReader(out).tensors if t.name == "blk.1.ffn_exps_packed")
    flip(out, blob.data_offset + 2 * 3584 + 3456 + 5)
    rep = verify(src, out)
    assert not rep.ok
    m = rep.mismatches[0]
    assert (m.tensor, m.layer, m.position, m.offset) == ("blk.1.ffn_exps_packed (slot padding)", 1, 2, 3461)


@pytest.mark.parametrize("reader", ["mmap", "pread"])
def test_small_chunks_report_each_slice_once(files, tmp_path, monkeypatch, reader):
    import mbolt.rewrite.compare as C

    monkeypatch.setattr(C, "BUF", 512)  # slices span several chunks
    monkeypatch.setattr(C, "RELEASE", 4096)
    src, out, perm = files
    bad = copy(out["reorder"], tmp_path / "bad.gguf")
    t = next(t for t in GGUFReader(bad).tensors if t.name == "blk.1.ffn_gate_exps.weight")
    sb = t.n_bytes // 8
    assert sb > 3 * 512
    for off in (10, 700, sb - 1):  # three bytes of position 4's slice, in different chunks
        flip(bad, t.data_offset + 4 * sb + off)
    flip(bad, t.data_offset + 6 * sb)  # and the first byte of position 6
    rep = verify(src, bad, reader=reader)
    got = [(m.tensor, m.position, m.expert, m.offset) for m in rep.mismatches]
    name = "blk.1.ffn_gate_exps.weight"
    assert got == [(name, 4, int(perm[1, 4]), 10), (name, 6, int(perm[1, 6]), 0)]


def test_stale_sidecar_is_flagged(files, tmp_path):
    src, out, _ = files
    a = copy(out["reorder"], tmp_path / "a.gguf")
    rep = verify(src, a)
    assert next(c for c in rep.checks if c.name == "sidecar").ok is None  # none written for the copy
    side = tmp_path / "a.gguf.mbolt.json"
    side.write_text((out["packed"].parent / "packed.gguf.mbolt.json").read_text())
    rep = verify(src, a)
    c = next(c for c in rep.checks if c.name == "sidecar")
    assert c.ok is False and "stale" in c.detail and not rep.ok
    side.write_text((out["reorder"].parent / "reorder.gguf.mbolt.json").read_text())
    assert verify(src, a).ok


def test_flipped_head_count_kv_in_the_output_is_one_line_naming_the_key(files, tmp_path):
    """Issue 33's reliability defect: a byte of head_count_kv flipped in a rewritten file made
    `mbolt verify` crash with a traceback in its reference parity. Through the command line, as a
    user runs it: exit 2 and one line naming the key (the value no longer fits the attention
    tensors, checked where the model is opened)."""
    import subprocess
    import sys

    src, out, _ = files
    bad = copy(out["reorder"], tmp_path / "kv.gguf")
    kv = read_header(bad).kv["qwen3moe.attention.head_count_kv"]
    assert int(kv.value) == 2
    flip(bad, kv.span[1] - 4)  # the low byte of the little-endian u32 value: 2 -> 66
    assert int(read_header(bad).kv["qwen3moe.attention.head_count_kv"].value) == 66
    r = subprocess.run([sys.executable, "-m", "mbolt", "verify", str(src), str(bad)], capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert "qwen3moe.attention.head_count_kv = 66" in lines[0] and str(bad) in lines[0]
