"""Every MoE family llama.cpp ships, fused gate_up, K- and I-quants: synth -> llama.cpp -> rewrite.

Bit-exactness is checked with gguf-py's GGUFReader on both files (never mbolt's own reader):
position q of every expert-indexed tensor of the output holds the source's expert perm[q], and a
packed slot holds the source's slices of that expert back to back, zero padded.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.synth.config import FUSED_GATE_UP_ARCHS, K_I_TYPES, tiny
from mbolt.synth.synth import synth_tensors, write_synth
from mbolt.rewrite.reorder import reorder

from conftest import needs_llama

NEW_FAMILIES = ["glm4moe", "deepseek2", "gpt-oss", "qwen3next"]
EXPERT_INDEXED = re.compile(r"^blk\.(\d+)\.(ffn_(gate|up|down|gate_up)_exps\.(weight|bias)|"
                            r"ffn_gate_inp\.(weight|bias)|exp_probs_b\.bias)$")
PAGE = 4096


def perm_for(path, seed=0) -> np.ndarray:
    """A random perm of every MoE layer, identity on dense layers (read with gguf-py)."""
    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_layers = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    n_exp = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    moe = {int(m.group(1)) for t in r.tensors if (m := re.match(r"blk\.(\d+)\.ffn_gate_inp\.weight$", t.name))}
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n_exp) if i in moe else np.arange(n_exp) for i in range(n_layers)]).astype(np.int32)


def check_bit_exact(src, out, perm, layout) -> int:
    """Compare every tensor of `out` with `src` through `perm`; returns the packed layers seen."""
    a = {t.name: t for t in GGUFReader(src).tensors}
    b = {t.name: t for t in GGUFReader(out).tensors}
    weights: dict[int, list] = {}
    for name, t in a.items():
        m = EXPERT_INDEXED.match(name)
        if layout == "packed" and name.endswith("_exps.weight"):
            assert name not in b
            weights.setdefault(int(m.group(1)), []).append(t)
            continue
        if m:
            np.testing.assert_array_equal(np.array(b[name].data), np.array(t.data)[perm[int(m.group(1))]], err_msg=name)
        else:
            np.testing.assert_array_equal(np.array(b[name].data), np.array(t.data), err_msg=name)
    for layer, ws in weights.items():
        ws.sort(key=lambda t: t.data_offset)  # packed order: the source's file order
        blob = b[f"blk.{layer}.ffn_exps_packed"]
        slots = np.array(blob.data).view(np.uint8).reshape(len(perm[layer]), -1)  # I8 blob
        raw = [np.array(t.data).view(np.uint8).reshape(len(perm[layer]), -1) for t in ws]
        for q, e in enumerate(perm[layer]):
            want = np.concatenate([r[e] for r in raw])
            np.testing.assert_array_equal(slots[q, :len(want)], want, err_msg=f"layer {layer} slot {q}")
            assert not slots[q, len(want):].any()
    return len(weights)


# ---- each family: tensor set, llama.cpp pipeline ----

def test_family_tensor_sets():
    names = {a: {n for n, _, _ in synth_tensors(tiny(a))} for a in NEW_FAMILIES}
    glm, ds, oss, q3n = (names[a] for a in NEW_FAMILIES)
    # GLM: dense layer 0, exp_probs_b, ungated shared expert, q/k/v biases, post-attention norm
    assert "blk.0.ffn_gate.weight" in glm and "blk.0.ffn_gate_exps.weight" not in glm
    assert {"blk.1.exp_probs_b.bias", "blk.1.ffn_up_shexp.weight", "blk.1.attn_q.bias",
            "blk.1.post_attention_norm.weight"} <= glm
    assert "blk.1.ffn_gate_inp_shexp.weight" not in glm
    # DeepSeek: MLA tensors, no plain q/k/v
    assert {"blk.1.attn_q_a.weight", "blk.1.attn_q_b.weight", "blk.1.attn_kv_a_mqa.weight", "blk.1.attn_k_b.weight",
            "blk.1.attn_v_b.weight", "blk.1.attn_kv_a_norm.weight", "blk.1.exp_probs_b.bias"} <= ds
    assert "blk.1.attn_k.weight" not in ds
    # gpt-oss: router bias, expert biases, sinks, attention output bias
    assert {"blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias", "blk.0.ffn_down_exps.bias",
            "blk.0.attn_sinks.weight", "blk.0.attn_output.bias"} <= oss
    # Qwen3-Next: linear attention on layers 0 and 2, gated full attention on 1 and 3
    assert {"blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_ba.weight", "blk.0.attn_gate.weight"} <= q3n
    assert "blk.1.ssm_a" not in q3n and "blk.1.attn_q_norm.weight" in q3n
    assert "blk.1.ffn_gate_inp_shexp.weight" in q3n


def run(args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


@needs_llama
@pytest.mark.parametrize("arch, fused", [(a, False) for a in NEW_FAMILIES] + [(a, True) for a in FUSED_GATE_UP_ARCHS])
def test_family_pipeline_in_llama_cpp(tmp_path, arch, fused):
    """synth -> trace --engine llama.cpp -> plan -> reorder -> verify --llama: same greedy tokens,
    every routing decision maps through the route map."""
    src, trace, plan, out = (tmp_path / n for n in ("m.gguf", "t.mbtrace", "plan.json", "out.gguf"))
    args = ["synth", src, "--arch", arch, "--layers", 4] + (["--fused-gate-up"] if fused else [])
    if arch in ("glm4moe", "deepseek2"):
        args += ["--dense-layers", 1]
    if arch == "gpt-oss":  # as gpt-oss ships: MXFP4 experts
        args += ["--type", "MXFP4"]
    run(args)
    run(["trace", src, "-o", trace, "--engine", "llama.cpp", "-n", 4, "--n-prompts", 3])
    run(["plan", trace, "-o", plan, "--model", src, "--method", "heat"])
    run(["reorder", src, out, "--plan", plan])
    res = run(["verify", src, out, "--llama", "--n-prompts", 2, "-n", 4, "--json"])
    rep = json.loads(res.output)
    ll = rep["llama"]
    assert ll["tokens_identical"] == ll["tokens"] > 0
    assert ll["routing_decisions"] > 0 and ll["routing_share"] == 1.0
    checks = {c["name"]: c for c in rep["checks"]}
    assert checks["data"]["ok"] and checks["llama.cpp"]["ok"]
    if fused:
        assert any(t.name == "blk.3.ffn_gate_up_exps.weight" for t in GGUFReader(out).tensors)


# ---- fused gate_up and every expert type: reorder and packed, bit-exact ----

@pytest.mark.parametrize("layout", ["reorder", "packed"])
@pytest.mark.parametrize("arch", FUSED_GATE_UP_ARCHS)
def test_fused_gate_up_rewrites_bit_exact(tmp_path, arch, layout):
    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    write_synth(src, tiny(arch, fused_gate_up=True, expert_type="Q8_0"))
    names = {t.name for t in GGUFReader(src).tensors}
    assert "blk.1.ffn_gate_up_exps.weight" in names and "blk.1.ffn_gate_exps.weight" not in names
    perm = perm_for(src, seed=4)
    reorder(src, out, perm, layout=layout)
    packed = check_bit_exact(src, out, perm, layout)
    assert packed == (0 if layout == "reorder" else (3 if arch == "deepseek2" else 4))


TYPE_CASES = [dict(expert_type=t) for t in K_I_TYPES] + [
    dict(expert_type="Q4_K", down_type="Q6_K"),  # Q4_K_M's expert mix
    dict(expert_type="IQ2_XXS", down_type="Q4_K", layer_types="0:Q3_K"),  # per-layer mix
]


@pytest.mark.parametrize("layout", ["reorder", "packed"])
@pytest.mark.parametrize("case", TYPE_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_type_rewrites_bit_exact(tmp_path, case, layout):
    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    write_synth(src, tiny("qwen3moe", n_layers=2, hidden=256, expert_ff=256, fast_random=True, dense_type="F16", **case))
    types = {t.name: t.tensor_type.name for t in GGUFReader(src).tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == case["expert_type"]
    assert types["blk.1.ffn_down_exps.weight"] == case.get("down_type", case["expert_type"])
    if "layer_types" in case:
        assert types["blk.0.ffn_gate_exps.weight"] == "Q3_K"
    perm = perm_for(src, seed=1)
    res = reorder(src, out, perm, layout=layout)
    check_bit_exact(src, out, perm, layout)
    if layout == "packed":  # slots padded to 4 KiB even when the projections differ in size
        for t in GGUFReader(out).tensors:
            if t.name.endswith("ffn_exps_packed"):
                slot = int(t.shape[0])
                assert slot % PAGE == 0 and t.data_offset % PAGE == 0
        assert any("every expert slot 4 KiB aligned" in n for n in res.alignment)


def test_reorder_says_where_packed_slots_cannot_align(tmp_path):
    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    # Q4_0 64 x 32: 3 x 1152 B = 3456 B per expert; 4 KiB slots would cost 18 % (> 1/8): 512 B slots
    write_synth(src, tiny("qwen3moe", n_layers=2, expert_type="Q4_0"))
    res = reorder(src, out, perm_for(src), layout="packed")
    assert any("NOT 4 KiB aligned" in n and "512 B aligned" in n for n in res.alignment), res.alignment


def test_synth_cli_says_what_llama_cpp_would_refuse(tmp_path):
    res = CliRunner().invoke(app, ["synth", str(tmp_path / "f.gguf"), "--arch", "glm4moe", "--fused-gate-up"])
    assert res.exit_code == 0 and "glm4moe loader refuses ffn_gate_up_exps" in res.output
    res = CliRunner().invoke(app, ["synth", str(tmp_path / "m.gguf"), "--arch", "qwen3next", "--layers", 3])
    assert res.exit_code == 2 and "no full-attention layer" in res.output
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("arch, etype", [("qwen3moe", "F32"), ("glm4moe", "Q8_0"), ("qwen3moe", "Q4_1")])
def test_fused_file_is_the_same_model(tmp_path, arch, etype):
    """A fused file holds the unfused file's gate and up rows (gguf-py), and the reference engine
    gives bit-identical logits and the same routing on both (its gate_up path)."""
    import warnings

    from mbolt.reference import load_model

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_synth(a, tiny(arch, expert_type=etype, seed=7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # llama.cpp refuses fused files of these families
        write_synth(b, tiny(arch, expert_type=etype, seed=7, fused_gate_up=True))
    ta = {t.name: np.array(t.data) for t in GGUFReader(a).tensors}
    tb = {t.name: np.array(t.data) for t in GGUFReader(b).tensors}
    for i in range(1 if arch == "glm4moe" else 0, 4):
        g, u = ta[f"blk.{i}.ffn_gate_exps.weight"], ta[f"blk.{i}.ffn_up_exps.weight"]
        np.testing.assert_array_equal(tb[f"blk.{i}.ffn_gate_up_exps.weight"], np.concatenate([g, u], axis=1))
    ma, mb = load_model(a), load_model(b)
    ids = [104, 101, 108, 108, 111, 32, 116, 104, 101, 256]
    la, lb = ma.forward(ids, all_logits=True), mb.forward(ids, all_logits=True)
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))
    for ra, rb in zip(ma.last_routing, mb.last_routing):
        assert (ra is None and rb is None) or np.array_equal(ra.experts, rb.experts)
    assert any(layer.role("gate_up") for layer in mb.map.layers)
    ma.close()
    mb.close()


@needs_llama
def test_fused_and_unfused_agree_in_llama_cpp(tmp_path):
    """deepseek2 fused vs unfused (same bytes): llama.cpp gives the same greedy tokens and routing."""
    from mbolt.runtime.runner import LlamaRunner

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_synth(a, tiny("deepseek2", seed=7))
    write_synth(b, tiny("deepseek2", seed=7, fused_gate_up=True))
    with LlamaRunner(a) as ra, LlamaRunner(b) as rb:
        ids = ra.tokenize("The quick brown fox")
        la, lb = ra.eval(ids), rb.eval(ids)
        for _ in range(4):
            np.testing.assert_allclose(la, lb, atol=1e-4 + 1e-4 * float(np.abs(la).max()))
            ka, kb = ra.topk(), rb.topk()
            assert sorted(ka) == sorted(kb) and all(np.array_equal(np.sort(ka[i], 1), np.sort(kb[i], 1)) for i in ka)
            ta, tb = int(np.argmax(la)), int(np.argmax(lb))
            assert ta == tb
            la, lb = ra.eval([ta]), rb.eval([tb])


def test_k_quant_needs_fast_random():
    from mbolt.core.errors import MboltError

    with pytest.raises(MboltError, match="needs --fast-random"):
        tiny("glm4moe", expert_type="Q4_K").validate()


@needs_llama
@pytest.mark.parametrize("case", TYPE_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_type_runs_in_llama_cpp(tmp_path, case):
    """llama.cpp loads each type and gives the same greedy tokens and routing after a reorder."""
    from mbolt.rewrite.parity import llama_parity

    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    write_synth(src, tiny("glm4moe", n_layers=3, fast_random=True, dense_type="F16", **case))
    reorder(src, out, perm_for(src, seed=2))
    res = llama_parity(src, out, prompts=["The quick brown fox"], n_tokens=3)
    assert res["ok"], res["detail"]
    assert res["tokens"] == 4 and res["routing_decisions"] > 0


@needs_llama
@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_planted_groups_survive_each_family(tmp_path, arch):
    """llama.cpp's own routing on each family picks experts of one planted group together (far
    above chance), through sigmoid routers with exp_probs_b, MLA and linear attention alike."""
    from mbolt.runtime.runner import LlamaRunner

    cfg = tiny(arch, n_experts=16, n_used=2, n_groups=4, hidden=128, head_dim=32)
    path = write_synth(tmp_path / "m.gguf", cfg)
    f = GGUFReader(path).fields["mbolt.synth.groups"]
    groups = np.array([f.parts[i][0] for i in f.data]).reshape(cfg.n_layers, 16)
    same = total = 0
    with LlamaRunner(path) as r:
        r.eval(r.tokenize("The quick brown fox jumps over the lazy dog while the theater in a tin plays on"))
        for li, top in r.topk().items():
            g = groups[li][top]
            same += int((g[:, 0] == g[:, 1]).sum())
            total += len(g)
    assert total > 0 and same / total > 0.6, same / total  # chance: 1/4


@pytest.mark.parametrize("layout", ["reorder", "packed"])
def test_fused_rewrite_keeps_reference_parity(tmp_path, layout):
    """A fused file rewritten (packed: gate_up|down per slot) still routes and computes the same
    in the reference engine: verify's routing parity and bit-identity both pass."""
    import warnings

    from mbolt.rewrite.verify import verify

    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_synth(src, tiny("glm4moe", fused_gate_up=True, expert_type="Q8_0", seed=2))
    reorder(src, out, perm_for(src, seed=3), layout=layout)
    rep = verify(src, out, parity=True, n_tokens=2, prompts=["hello world"])
    assert rep.ok, [c for c in rep.checks if not c.ok]
    assert rep.parity["decisions"] > 0 and rep.parity["identical"] == rep.parity["decisions"]
