"""Reference engine without llama.cpp: dequantization, permutation invariance, expert access,
tokenizer round trips and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from _engine_util import permuted_copy, random_perm
from mbolt.reference import load_model
from mbolt.reference.quant import dequantize, round_activations
from mbolt.reference.source import MmapExpertSource
from mbolt.reference.tokenizer import Tokenizer, pre_split
from mbolt.core.errors import MboltError
from mbolt.core.header import read_header
from mbolt.synth.synth import SynthConfig, write_synth

TOKENS = [104, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101, 33, 256, 257, 65, 66]


def _synth(tmp_path, name="m.gguf", **kw):
    return write_synth(tmp_path / name, SynthConfig(**{"seed": 7, **kw}))


@pytest.mark.parametrize("qt", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"])
def test_dequantize_matches_gguf_py(qt):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    raw = gq.quantize(x, T[qt]) if qt not in ("F16",) else x.astype(np.float16).view(np.uint8)
    expect = gq.dequantize(raw, T[qt]).reshape(4, 64)
    got = dequantize(raw, T[qt], (4, 64), "t")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expect)


def test_unsupported_type_names_the_tensor():
    with pytest.raises(MboltError, match="blk.3.ffn_down_exps.weight.*IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (256,), "blk.3.ffn_down_exps.weight")


def test_q8_activation_rounding_is_blockwise_int8():
    x = np.linspace(-3, 5, 64, dtype=np.float32)[None]
    y = round_activations(x, T.Q4_0)
    for b in range(2):
        blk, qb = x[0, 32 * b: 32 * b + 32], y[0, 32 * b: 32 * b + 32]
        d = np.float32(np.float16(np.abs(blk).max() / 127))
        q = qb / d
        np.testing.assert_allclose(q, np.round(q), atol=1e-3)  # integer multiples of the fp16 scale
        assert np.abs(q).max() <= 127.01
    np.testing.assert_allclose(y, x, atol=5 / 127)


@pytest.mark.parametrize("kw", [
    dict(arch="qwen3moe", expert_type="F32"),
    dict(arch="qwen3moe", expert_type="Q4_0", probs_bias=True, expert_bias=True),
    dict(arch="qwen2moe", expert_type="Q8_0", n_experts=16, n_used=4),
    dict(arch="mixtral", expert_type="F16", dense_layers=1),
    dict(arch="olmoe", expert_type="Q4_0", n_kv_heads=4),
])
def test_permuted_file_gives_bit_identical_logits_and_mapped_routing(tmp_path, kw):
    src = _synth(tmp_path, **kw)
    base = load_model(src)
    ref = base.forward(TOKENS, all_logits=True)
    ref_routing = [None if r is None else r.experts.copy() for r in base.last_routing]
    perm = random_perm(base.n_layers, base.hp.n_experts, seed=11)
    assert not (perm == np.arange(base.hp.n_experts)).all()
    permuted_copy(src, tmp_path / "file.gguf", perm, router=True)
    permuted_copy(src, tmp_path / "map.gguf", perm, router=False)
    for path, route in ((tmp_path / "file.gguf", "file"), (tmp_path / "map.gguf", "map")):
        m = load_model(path, route=route)
        got = m.forward(TOKENS, all_logits=True)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), route
        for li, r in enumerate(m.last_routing):
            if ref_routing[li] is None:
                assert r is None
            else:
                np.testing.assert_array_equal(r.experts, ref_routing[li])
    # reading a router-permuted file as if the router were untouched must change the answer
    wrong = load_model(tmp_path / "file.gguf", route="map").forward(TOKENS, all_logits=True)
    assert np.abs(wrong - ref).max() > 1e-3


class CountingSource:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def fetch(self, layer, ids):
        self.calls.append((layer, list(ids)))
        return self.inner.fetch(layer, ids)


def test_experts_come_only_through_the_source(tmp_path):
    src = _synth(tmp_path, n_experts=16, n_used=3)
    plain = load_model(src)
    src_obj = CountingSource(MmapExpertSource(plain.map))
    m = load_model(src, expert_source=src_obj)
    cache = m.new_cache()
    m.forward(TOKENS[:5], cache)
    m.forward([TOKENS[5]], cache)
    # decode step: one fetch per MoE layer, exactly the routed original ids
    last = src_obj.calls[-m.n_layers:]
    for li, ids in last:
        assert sorted(ids) == sorted(set(m.last_routing[li].experts[0].tolist()))
        assert len(ids) == 3

    class Broken:
        def fetch(self, layer, ids):
            return {e: {role: np.zeros_like(v) for role, v in d.items()}
                    for e, d in src_obj.inner.fetch(layer, ids).items()}

    z = load_model(src, expert_source=Broken()).forward(TOKENS[:5])
    assert np.abs(z - plain.forward(TOKENS[:5])).max() > 1e-4


def test_routing_weights_normalised_for_qwen3_not_olmoe(tmp_path):
    q = load_model(_synth(tmp_path, "q.gguf", arch="qwen3moe"))
    q.forward(TOKENS)
    np.testing.assert_allclose(q.last_routing[0].weights.sum(1), 1.0, rtol=1e-6)
    o = load_model(_synth(tmp_path, "o.gguf", arch="olmoe", n_kv_heads=4))
    o.forward(TOKENS)
    assert (o.last_routing[0].weights.sum(1) < 0.999).all()


def test_incremental_decode_equals_one_batch(tmp_path):
    m = load_model(_synth(tmp_path, expert_type="Q8_0"))
    full = m.forward(TOKENS, all_logits=True)
    cache = m.new_cache()
    m.forward(TOKENS[:9], cache)
    steps = [m.forward([t], cache) for t in TOKENS[9:]]
    np.testing.assert_allclose(np.stack(steps), full[9:], atol=2e-5)


def test_unsupported_arch_lists_supported(tmp_path):
    src = _synth(tmp_path)
    data = bytearray(src.read_bytes())
    i = data.index(b"qwen3moe")
    data[i:i + 8] = b"qwen9moe"  # same length: header stays valid
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(MboltError, match="qwen9moe.*supported: .*mixtral.*olmoe.*qwen2moe.*qwen3moe"):
        load_model(bad)


def test_gpt2_pretokenizer_pieces():
    assert pre_split("Hello world!  It's\n\nok", "gpt2") == ["Hello", " world", "!", " ", " It", "'s", "\n", "\n", "ok"]
    assert pre_split("a  ", "gpt2") == ["a", "  "]
    assert pre_split("x 12345\n\n  y", "llama3") == ["x", " ", "123", "45", "\n\n", " ", " y"]
    assert pre_split("x 12345", "qwen2") == ["x", " ", "1", "2", "3", "4", "5"]


def test_tokenizer_round_trip_and_merges(tmp_path):
    tok = Tokenizer.from_header(read_header(_synth(tmp_path)))
    ids = tok.encode("the tin")
    # synth merges: "Ġ t", "h e", "i n", "Ġ a" -> "the" = t,he ; " tin" = Ġt,in
    assert [tok.tokens[i] for i in ids] == ["t", "he", "Ġt", "in"]
    for text in ["héllo wörld 😀", "  a\n\tb  ", ""]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("layout", ["reorder", "packed"])
def test_files_written_by_mbolt_reorder_give_bit_identical_logits(tmp_path, layout):
    from mbolt.rewrite.reorder import reorder

    src = _synth(tmp_path, expert_type="Q4_0", n_experts=16, n_used=4, probs_bias=True, expert_bias=True)
    base = load_model(src)
    ref = base.forward(TOKENS, all_logits=True)
    perm = random_perm(base.n_layers, 16, seed=3)
    out = tmp_path / f"{layout}.gguf"
    reorder(src, out, perm, layout=layout)
    m = load_model(out)
    assert m.routes.layout == layout
    got = m.forward(TOKENS, all_logits=True)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    for a, b in zip(base.last_routing, m.last_routing):
        np.testing.assert_array_equal(a.experts, b.experts)
