"""mbolt reorder: permutation of every expert-indexed tensor, packed layout, route map, safety.

Expected values come from gguf-py's GGUFReader and numpy on the source file, never from
mbolt.rewrite itself.
"""

from __future__ import annotations

import warnings
import hashlib
import json
import os
import re

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from mbolt.core.errors import MboltError
from mbolt.synth.synth import SynthConfig, write_synth
from mbolt.rewrite.reorder import reorder, reorder_file
from mbolt.core.routemap import expert_ranges, read_route_map, read_sidecar, sidecar_path
from mbolt.core.moe_map import moe_map

# suffixes that must move with the expert (checked by name here, independently of moe_map)
EXPERT_INDEXED = re.compile(r"^blk\.(\d+)\.(ffn_(gate|up|down|gate_up)_exps\.(weight|bias)|ffn_gate_inp\.(weight|bias)|exp_probs_b\.bias)$")


def random_perm(n_layers, n_experts, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n_experts) for _ in range(n_layers)]).astype(np.int32)


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def tensors(path) -> dict[str, np.ndarray]:
    r = GGUFReader(path)
    return {t.name: np.array(t.data) for t in r.tensors}


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """qwen3moe with exp_probs_b, per-expert biases and a leading dense layer (F16 experts)."""
    p = tmp_path_factory.mktemp("rw") / "biased.gguf"
    write_synth(p, SynthConfig(arch="qwen3moe", n_layers=4, n_experts=8, n_used=2, probs_bias=True,
                               expert_bias=True, dense_layers=1, expert_type="F16", seed=3))
    return p


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    p = tmp_path_factory.mktemp("rw") / "q8.gguf"
    write_synth(p, SynthConfig(arch="mixtral", n_layers=3, n_experts=8, n_used=2, expert_type="Q8_0", seed=5))
    return p


@pytest.mark.parametrize("layout", ["reorder", "packed"])
def test_every_expert_indexed_tensor_permuted(biased, tmp_path, layout):
    perm = random_perm(4, 8, seed=1)
    out = tmp_path / "out.gguf"
    reorder(biased, out, perm, layout=layout, method="test")
    src = tensors(biased)
    dst = tensors(out)
    moved = 0
    for name, a in src.items():
        m = EXPERT_INDEXED.match(name)
        if layout == "packed" and re.search(r"_exps\.weight$", name):
            assert name not in dst  # lives inside blk.N.ffn_exps_packed
            continue
        b = dst[name]
        if m and int(m.group(1)) > 0:  # layer 0 is dense: nothing expert-indexed there
            p = perm[int(m.group(1))]
            np.testing.assert_array_equal(b, a[p])  # position q holds original expert p[q]
            moved += 1
        else:
            np.testing.assert_array_equal(b, a)
    # 3 MoE layers x (router, probs_bias, 3 biases [+ 3 weights in reorder layout])
    assert moved == 3 * (5 + (3 if layout == "reorder" else 0))
    # the probs bias really moved (the test would be vacuous if the synth bias were constant)
    assert not np.array_equal(dst["blk.1.exp_probs_b.bias"], src["blk.1.exp_probs_b.bias"])


@pytest.mark.parametrize("layout", ["reorder", "packed"])
def test_expert_ranges_locate_original_experts(biased, tmp_path, layout):
    perm = random_perm(4, 8, seed=2)
    out = tmp_path / "out.gguf"
    reorder(biased, out, perm, layout=layout)
    src = tensors(biased)
    m = moe_map(out)
    raw = open(out, "rb").read()
    stock = moe_map(biased)
    for layer in m.moe_layers:
        r = expert_ranges(m, layer)
        names = [w.name for w in layer.weights]
        assert names == [w.name for w in stock.layers[layer.index].weights]
        assert r.shape == (8, len(names), 2) and r.dtype == np.int64
        for e in range(8):
            for j, name in enumerate(names):
                start, size = r[e, j]
                want = src[name][e].tobytes()  # original expert e, straight from the source file
                assert raw[start:start + size] == want, (name, e)
    # stock file: expert_ranges is plain offset arithmetic
    st = expert_ranges(stock, 1)
    w = stock.layers[1].weights[0]
    assert st[3, 0, 0] == w.data_offset + 3 * w.slice_bytes
    assert read_route_map(stock).layout == "stock"


def test_packed_layout_blob(biased, tmp_path):
    out = tmp_path / "p.gguf"
    perm = random_perm(4, 8, seed=4)
    reorder(biased, out, perm, layout="packed")
    r = GGUFReader(out)
    names = [t.name for t in r.tensors]
    for li in (1, 2, 3):
        assert f"blk.{li}.ffn_exps_packed" in names
        assert f"blk.{li}.ffn_gate_exps.weight" not in names
    assert "blk.0.ffn_exps_packed" not in names  # dense layer
    src = tensors(biased)
    blob = next(t for t in r.tensors if t.name == "blk.2.ffn_exps_packed")
    data = np.array(blob.data).view(np.uint8).reshape(8, -1)
    # slot p = gate|up|down of original expert perm[2, p], adjacent
    for p in range(8):
        e = perm[2, p]
        want = b"".join(src[f"blk.2.ffn_{k}_exps.weight"][e].tobytes() for k in ("gate", "up", "down"))
        assert data[p, :len(want)].tobytes() == want
    assert blob.data_offset % 4096 == 0
    rm = read_route_map(moe_map(out))
    assert rm.layout == "packed" and np.array_equal(rm.perm[1:], perm[1:])


def test_route_map_metadata_and_sidecar(biased, tmp_path):
    perm = random_perm(4, 8, seed=5)
    heat = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = tmp_path / "o.gguf"
    res = reorder(biased, out, perm, heat=heat, method="tsp")
    r = GGUFReader(out)
    f = {k: r.fields[k] for k in r.fields if k.startswith("mbolt.")}
    val = lambda k: f[k].contents()  # noqa: E731
    assert val("mbolt.layout") == "reorder" and val("mbolt.plan.method") == "tsp"
    assert val("mbolt.n_layers") == 4 and val("mbolt.n_experts") == 8
    want = perm.copy()
    want[0] = np.arange(8)  # dense layer: identity
    assert np.array_equal(np.array(val("mbolt.perm")).reshape(4, 8), want)
    assert np.allclose(np.array(val("mbolt.heat")).reshape(4, 8), heat)
    assert val("mbolt.source.fingerprint") == moe_map(biased).fingerprint
    assert int(r.fields["general.alignment"].contents()) == 4096
    for t in r.tensors:
        assert t.data_offset % 4096 == 0, t.name
    side = json.loads(sidecar_path(out).read_text())
    assert side["perm"] == want.tolist() and side["layout"] == "reorder"
    assert np.array_equal(read_sidecar(sidecar_path(out)).perm, want)
    assert res.sidecar == str(sidecar_path(out))
    # every other key/value survives with its type
    a, b = GGUFReader(biased), r
    for k, fa in a.fields.items():
        if k.startswith("GGUF.") or k == "general.alignment":
            continue
        fb = b.fields[k]
        assert fa.types == fb.types, k
        ca, cb = fa.contents(), fb.contents()
        assert (np.array_equal(ca, cb) if isinstance(ca, list) else ca == cb), k


def test_rereorder_composes_and_identity_restores_stock(q8, tmp_path):
    """Plans name ORIGINAL expert ids: the plan that undoes P on a reordered file is the identity
    (the rewriter maps through the file's route map); reordering twice equals reordering once."""
    p, q = random_perm(3, 8, seed=6), random_perm(3, 8, seed=7)
    b, c, d, d2 = (tmp_path / f"{x}.gguf" for x in "bcdD")
    reorder(q8, b, p)
    reorder(b, c, None)  # identity plan on the reordered file
    src, back = tensors(q8), tensors(c)
    assert back.keys() == src.keys()
    for name in src:
        assert back[name].tobytes() == src[name].tobytes(), name
    assert read_route_map(moe_map(c)).is_identity
    assert read_route_map(moe_map(c)).source_fingerprint == moe_map(q8).fingerprint
    reorder(b, d, q)
    reorder(q8, d2, q)
    x, y = tensors(d), tensors(d2)
    for name in x:
        assert x[name].tobytes() == y[name].tobytes(), name
    # packed -> reorder also goes back through the route map
    pk, rb = tmp_path / "pk.gguf", tmp_path / "rb.gguf"
    reorder(q8, pk, p, layout="packed")
    reorder(pk, rb, None, layout="reorder")
    back = tensors(rb)
    for name in src:
        assert back[name].tobytes() == src[name].tobytes(), name


def test_refuses_same_file_and_existing_output(q8, tmp_path):
    before = sha(q8)
    with pytest.raises(MboltError, match="is an input"):
        reorder(q8, q8, None)
    link = tmp_path / "hard.gguf"
    os.link(q8, link)
    with pytest.raises(MboltError, match="is an input"):
        reorder(q8, link, None, force=True)
    out = tmp_path / "o.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(MboltError, match="exists"):
        reorder(q8, out, None)
    # --force replaces only a previous mbolt output, never another kind of file
    with pytest.raises(MboltError, match="not a previous rewritten model"):
        reorder(q8, out, None, force=True)
    assert out.read_bytes() == b"keep me"
    out.unlink()
    reorder(q8, out, None)
    reorder(q8, out, None, force=True)
    assert out.stat().st_size > 1000
    assert sha(q8) == before


def test_plan_with_wrong_shape(q8, tmp_path):
    from mbolt.core.plan import Plan, save_plan

    with pytest.raises(MboltError, match="9 experts per layer, the model has 8"):
        reorder(q8, tmp_path / "o.gguf", random_perm(3, 9))
    bad = random_perm(3, 8)
    bad[1, 0] = bad[1, 1]
    with pytest.raises(MboltError, match="layer 1 is not a permutation"):
        reorder(q8, tmp_path / "o.gguf", bad)
    plan = tmp_path / "plan.json"
    save_plan(plan, Plan("tsp", 3, 16, random_perm(3, 16), np.ones((3, 16))))
    with pytest.raises(MboltError, match="plan.json: plan is for 3 layers x 16 experts, .*q8.gguf has 3 x 8"):
        reorder_file(q8, tmp_path / "o.gguf", plan=plan)
    assert not (tmp_path / "o.gguf").exists()
    with pytest.raises(MboltError, match="exactly one of"):
        reorder_file(q8, tmp_path / "o.gguf", plan=plan, identity=True)


def test_plan_file_heat_is_stored_per_position(q8, tmp_path):
    from mbolt.core.plan import Plan, save_plan

    perm = random_perm(3, 8, seed=9)
    heat = np.tile(np.arange(8, dtype=np.float64) * 10, (3, 1))  # heat of ORIGINAL expert e = 10 e
    plan = tmp_path / "plan.json"
    save_plan(plan, Plan("tsp", 3, 8, perm, heat))
    out = tmp_path / "o.gguf"
    reorder_file(q8, out, plan=plan)
    rm = read_route_map(moe_map(out))
    assert np.array_equal(rm.perm, perm)
    assert np.allclose(rm.heat, perm * 10.0)


def _unknown_model(path):
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 8), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((4, 8), dtype=np.float32))
    for k in ("gate", "up"):
        w.add_tensor(f"blk.0.ffn_{k}_exps.weight", rng.standard_normal((4, 6, 8), dtype=np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight", rng.standard_normal((4, 8, 6), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.scale", rng.standard_normal((4,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_expert_indexed_tensor_refused(tmp_path):
    src = tmp_path / "u.gguf"
    _unknown_model(src)
    with pytest.raises(MboltError, match=r"blk\.0\.ffn_gate_exps\.scale"):
        reorder(src, tmp_path / "o.gguf", None)
    assert not (tmp_path / "o.gguf").exists()


def test_not_enough_space(q8, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    du = namedtuple("du", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: du(10**9, 10**9, 1000))
    with pytest.raises(MboltError, match="free"):
        reorder(q8, tmp_path / "o.gguf", None)
    assert list(tmp_path.iterdir()) == []


def test_cli_reorder_json(q8, tmp_path):
    from typer.testing import CliRunner

    from mbolt.cli import app

    out = tmp_path / "o.gguf"
    res = CliRunner().invoke(app, ["reorder", str(q8), str(out), "--identity", "--layout", "packed", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["layout"] == "packed" and d["identity"] and d["bytes_written"] == out.stat().st_size
    res = CliRunner().invoke(app, ["reorder", str(q8), str(out), "--identity"])
    assert res.exit_code == 2 and "exists" in res.output


def test_trace_plans_inline(q8, tmp_path):
    from mbolt.layout.plan import make_plan
    from mbolt.core.mbtrace import read_trace, write_trace
    from mbolt.core.trace import DECODE, Trace

    rng = np.random.default_rng(0)
    n = 300
    experts = np.stack([[rng.choice(8, 2, replace=False) for _ in range(3)] for _ in range(n)]).astype(np.int16)
    tr = Trace(3, 8, 2, experts, np.full(n, DECODE, np.uint8), np.repeat(np.arange(3), 100).astype(np.int32),
               np.tile(np.arange(100), 3).astype(np.int32), fingerprint=moe_map(q8).fingerprint)
    path = tmp_path / "run.mbtrace"
    write_trace(path, tr)
    out = tmp_path / "o.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trace's fingerprint is this model's: no warning
        reorder_file(q8, out, trace=path)
    want = make_plan(read_trace(path))
    rm = read_route_map(moe_map(out))
    assert np.array_equal(rm.perm, want.perm) and rm.method == want.method


def test_alignment_notes_when_slices_are_small(tmp_path):
    src = tmp_path / "s.gguf"
    # Q4_0 slices of 64 x 32 -> 1152 B: not a multiple of 4 KiB; a packed slot of 3456 B would
    # need 640 B (18.5%) of padding for 4 KiB, so it is only padded to 512 B (3584 B).
    write_synth(src, SynthConfig(arch="qwen3moe", n_layers=2, n_experts=8, n_used=2, hidden=64, expert_ff=32,
                                 expert_type="Q4_0"))
    r = reorder(src, tmp_path / "r.gguf", None)
    assert any("slices not 4 KiB aligned" in n and "1152 B" in n for n in r.alignment), r.alignment
    p = reorder(src, tmp_path / "p.gguf", None, layout="packed")
    assert any("NOT 4 KiB aligned" in n and "512 B aligned" in n for n in p.alignment), p.alignment
    blob = next(t for t in GGUFReader(tmp_path / "p.gguf").tensors if t.name == "blk.1.ffn_exps_packed")
    assert blob.n_bytes == 8 * 3584


def test_buffered_fallback_when_kernel_copy_refused(q8, tmp_path, monkeypatch):
    import errno

    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    perm = random_perm(3, 8, seed=8)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    ra = reorder(q8, a, perm)
    assert ra.copy_mode == "buffered" and calls
    monkeypatch.undo()
    rb = reorder(q8, b, perm)
    assert rb.copy_mode == "copy_file_range"
    assert a.read_bytes() == b.read_bytes()
