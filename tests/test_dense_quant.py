"""Q4_K_M-like files: K-quant dense matrices and llama-quantize's Q4_K_M type mix (gguf/mixes.py).
gguf-py reads every tensor with the type llama.cpp's rule gives it, llama.cpp loads and generates,
and a reorder of the file verifies bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from mbolt.core.errors import MboltError
from mbolt.synth.mixes import use_more_bits
from mbolt.synth.synth import SynthConfig, synth_tensors, write_synth
from mbolt.rewrite.reorder import reorder
from mbolt.rewrite.verify import verify

from conftest import needs_llama

L, E = 8, 16
# llama-quantize's use_more_bits for 8 layers: i < 1, i >= 7, (i - 1) % 3 == 2
MORE_BITS = {0, 3, 6, 7}


def q4km(**kw) -> SynthConfig:
    geo = dict(arch="qwen3moe", n_layers=L, n_experts=E, n_used=2, hidden=256, expert_ff=256, n_heads=4, n_kv_heads=2,
               head_dim=64, expert_type="Q4_K_M", dense_type="Q4_K_M", fast_random=True, seed=3)
    geo.update(kw)
    return SynthConfig(**geo)


def expected(name: str, n_experts: int = E) -> str:
    """The Q4_K_M rule written out by hand for these shapes (every row a multiple of 256)."""
    if name == "output.weight":
        return "Q6_K"
    if not name.endswith(".weight") or "norm" in name or "ffn_gate_inp" in name or name == "token_embd.weight":
        return "F32"
    layer = int(name.split(".")[1])
    kind = name.split(".")[2]
    if n_experts == 8 and kind in ("attn_v", "attn_k"):
        return "Q8_0"
    if n_experts == 8 and kind == "attn_output":
        return "Q5_K"
    if kind in ("attn_v", "ffn_down_exps"):
        return "Q6_K" if layer in MORE_BITS else "Q4_K"
    return "Q4_K"


def test_use_more_bits_is_llama_quantizes():
    assert {i for i in range(8) if use_more_bits(i, 8)} == MORE_BITS
    # 48 layers (Qwen3-30B-A3B): the first and last 6, then every third from layer 8
    assert [i for i in range(48) if use_more_bits(i, 48)] == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29,
                                                             32, 35, 38, 41, 42, 43, 44, 45, 46, 47]


@pytest.mark.parametrize("n_experts", [E, 8])
def test_every_tensor_has_the_rules_type(tmp_path, n_experts):
    """Read back with gguf-py: the Q4_K_M rule per tensor, including the 8-expert exceptions
    (attn_v and attn_k Q8_0, attn_output Q5_K) llama-quantize makes for Mixtral-like models."""
    p = write_synth(tmp_path / "m.gguf", q4km(n_experts=n_experts))
    r = GGUFReader(str(p))
    got = {t.name: t.tensor_type.name for t in r.tensors}
    assert got == {name: expected(name, n_experts) for name in got}
    assert int(r.fields["general.file_type"].contents()) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert {"Q4_K", "Q6_K"} <= set(got.values())


def test_rows_not_whole_blocks_fall_back_as_llama_quantize_does():
    """Rows of 96 and 64: Q4_K -> Q5_0, Q6_K -> Q8_0 (output: Q8_0); rows of 80, not even a multiple
    of 32: F16."""
    types = {n: t for n, _, t in synth_tensors(q4km(hidden=96, n_heads=2, head_dim=48, expert_ff=64, n_layers=2))}
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["output.weight"] == "Q8_0"
    assert types["blk.1.attn_v.weight"] == "Q8_0"  # layer 1 of 2 is a more-bits layer, layer 0 is not
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.1.ffn_down_exps.weight"] == "Q8_0"
    types = {n: t for n, _, t in synth_tensors(q4km(hidden=80, n_heads=2, head_dim=40, expert_ff=80, n_layers=2))}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_gate_exps.weight"] == "F16"


def test_uniform_k_quant_dense_type_and_computed_attention():
    types = {n: t for n, _, t in synth_tensors(q4km(dense_type="Q6_K", expert_type="Q4_K"))}
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "Q6_K"
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K"
    # --context computes its attention matrices: they stay F16 (gguf-py has no K-quant quantizer)
    types = {n: t for n, _, t in synth_tensors(q4km(context=1.0))}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_output.weight"] == "F16"


def test_k_quant_dense_needs_fast_random():
    with pytest.raises(MboltError, match="needs --fast-random"):
        q4km(fast_random=False, expert_type="Q8_0").validate()
    with pytest.raises(MboltError, match="dense type must be one of"):
        q4km(dense_type="IQ2_XS").validate()


def test_reorder_verifies_bit_exact(tmp_path):
    src = write_synth(tmp_path / "m.gguf", q4km())
    perm = np.stack([np.random.default_rng(i).permutation(E) for i in range(L)]).astype(np.int32)
    for layout in ("reorder", "packed"):
        out = tmp_path / f"{layout}.gguf"
        reorder(src, out, perm, layout=layout)
        rep = verify(src, out)
        assert rep.ok, [c for c in rep.checks if not c.ok]
        names = [c.name for c in rep.checks]
        assert names == ["header", "route map", "sidecar", "metadata", "tensors", "data", "padding"]


@needs_llama
def test_llama_cpp_loads_and_generates_it_and_its_reorder(tmp_path):
    """Greedy tokens of the file and of its reorder (llama.cpp reads the route map's permuted
    routers): the same tokens, every token finite."""
    from llama_cpp import Llama

    src = write_synth(tmp_path / "m.gguf", q4km())
    out = tmp_path / "r.gguf"
    reorder(src, out, np.stack([np.random.default_rng(i).permutation(E) for i in range(L)]).astype(np.int32))
    texts = []
    for p in (src, out):
        llm = Llama(model_path=str(p), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
        res = llm("The quick brown fox", max_tokens=8, temperature=0)
        assert np.isfinite(np.array(llm.scores[:llm.n_tokens])).all()
        texts.append(res["choices"][0]["text"])
        assert res["choices"][0]["finish_reason"] == "length"
        llm.close()
    assert texts[0] == texts[1]
