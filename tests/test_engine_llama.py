"""Reference engine vs llama.cpp (llama-cpp-python) on synthetic models of every architecture.

Tolerances on logits, as (max |diff|, mean |diff|) over all positions (logits are O(5) here):
  F32 experts: (2e-5, 2e-6). Plain float32 arithmetic on both sides; what is left is the
    summation order (SIMD lanes vs BLAS). A float32 dot product of n terms is off by at most
    n * 2^-24 * sum|x_i w_i| whatever the order: n = 64..128 here and sum|x_i w_i| = O(1) gives
    <= 8e-6 per matmul, a few matmuls deep: 2e-5. Measured max <= 1.5e-6.
  BF16 experts: (2e-3, 2e-6). ggml converts the activations to BF16 before its BF16 dot
    products, and the engine does the same; the rest is F32's summation order. An activation
    that sits on a BF16 rounding boundary flips by one BF16 step (2^-8 of its value) when the
    two sides' float32 results differ in the last bit, exactly as a Q8_0 activation flips by
    one int8 step (1/127 of its block's maximum, the coarser of the two): so BF16 takes the
    quantized types' max bound. Measured: max 1.5e-6 on one AMD EPYC, 2.5e-5 on another (one
    flip, AVX-512 numpy kernels), mean 4.3e-7 on both: the mean bound keeps discriminating.
  F16 experts: (1e-4, 2e-6): measured max 1.4e-5 in prefill (ggml's batched F16 path).
  Q8_0, Q4_0, Q5_0, MXFP4, Q4_1, Q5_1 experts: (2e-3, 2e-5). ggml's CPU matmul quantizes the
    activations (Q8_0 for the first four, Q8_1 for Q4_1/Q5_1, whose fp16 block sum multiplies
    the weight minimum); the engine does the same (quant.round_activations, q8_1_correction).
    Measured: Q8_0/Q4_1 max ~1.4e-6, Q4_0 max 1.3e-4 / mean 2.1e-6. The Q4_0 maxima are single
    activations sitting on a Q8 rounding boundary: a 1e-7 difference in the gate/up output
    (float32 BLAS vs ggml's integer block dots) flips one int8 step, which moves that expert's
    output by ~1e-4 (traced to one row of one expert). Without the activation rounding: max
    1.8-2.9e-3, mean 3.6-4.8e-4, so the mean bound separates "mimicked" from "not" by >15x.
    How many activations land on a boundary depends on the SIMD kernel llama.cpp was built with:
    against a GGML_NATIVE build (AVX-512 paths) Q4_1 measured max 5.3e-4 / mean 5.5e-6, against
    the GGML_NATIVE=OFF build CI makes, 1.4e-6. The max bound is therefore the K-quants' 2e-3
    (a handful of flips), and the mean bound, which flips barely move, does the discriminating.
  Q2_K..Q6_K experts: (2e-3, 5e-5) (synth cannot quantize K-quants, so the test writes random
    valid blocks). Activations are Q8_K on ggml's side and in the engine. Measured: Q3_K/Q6_K
    max 1.9e-6, Q4_K/Q5_K max 7e-5, Q2_K max 8.8e-4 / mean 1.4e-5 (boundary flips again, with
    Q2_K's coarser steps); without the activation rounding: max 7e-3..1e-1, mean >= 1.4e-3.
  glm4moe (sigmoid router + exp_probs_b, shared expert, a dense layer, partial rotary): the type's
    bounds above. Its sigmoid adds one float32 exp per expert (numpy's and ggml's expf may differ
    by 1 ulp): a 6e-8 relative change of a combine weight, far below the matmul terms. Measured
    F32/Q8_0/Q4_0 max 1.4e-6, mean 1.3e-7.
llama.cpp runs with an F32 KV cache and flash attention off (its default F16 cache rounds K/V).
"""

from __future__ import annotations

import numpy as np
import pytest

from _engine_util import permuted_copy, random_perm, with_expert_type
from conftest import needs_llama
from mbolt.reference import load_model
from mbolt.reference.tokenizer import Tokenizer
from mbolt.core.header import read_header
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama

PROMPT = [104, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101, 33, 256, 257, 65, 66, 10, 200]
TOL = {"F32": (2e-5, 2e-6), "BF16": (2e-3, 2e-6), "F16": (1e-4, 2e-6), "Q8_0": (2e-3, 2e-5),
       "Q4_0": (2e-3, 2e-5), "Q5_0": (2e-3, 2e-5), "MXFP4": (2e-3, 2e-5), "Q4_1": (2e-3, 2e-5),
       "Q5_1": (2e-3, 2e-5)}
ARCH_KW = {"qwen3moe": {}, "olmoe": {"n_kv_heads": 4}, "mixtral": {}, "qwen2moe": {},
           "glm4moe": {"dense_layers": 1, "rope_dim": 8}}
CASES = [(a, t) for a in ARCH_KW for t in ("F32", "Q8_0", "Q4_0")] + [
    ("qwen3moe", t) for t in ("F16", "BF16", "Q5_0", "MXFP4", "Q4_1", "Q5_1")]


def _runner(path):
    from mbolt.runtime.runner import LlamaRunner

    return LlamaRunner(path, n_ctx=128, n_threads=1)


def _check_routing(engine_routing, llama_topk, where):
    for li, theirs in llama_topk.items():
        mine = engine_routing[li].experts[-theirs.shape[0]:]
        assert mine.shape == theirs.shape, where
        np.testing.assert_array_equal(np.sort(mine, 1), np.sort(theirs, 1), err_msg=f"{where} layer {li}")
        assert (mine == theirs).all(axis=1).mean() >= 0.95, f"{where} layer {li}: rank order differs"


@pytest.mark.parametrize("arch,etype", CASES)
def test_logits_routing_and_greedy_match_llama_cpp(tmp_path, arch, etype):
    max_tol, mean_tol = TOL[etype]
    path = write_synth(tmp_path / "m.gguf", SynthConfig(arch=arch, expert_type=etype, seed=3, **ARCH_KW[arch]))
    m = load_model(path)
    with _runner(path) as r:
        cache = m.new_cache()
        mine = m.forward(PROMPT, cache, all_logits=True)
        theirs = r.eval(PROMPT, all_logits=True)
        diff = np.abs(mine - theirs)
        assert diff.max() <= max_tol and diff.mean() <= mean_tol, (diff.max(), diff.mean())
        topk = r.topk()
        assert sorted(topk) == [layer.index for layer in m.map.moe_layers]
        _check_routing(m.last_routing, topk, "prefill")
        a, b = int(np.argmax(mine[-1])), int(np.argmax(theirs[-1]))
        gen_m, gen_l, worst, total = [], [], 0.0, 0.0
        for step in range(32):
            gen_m.append(a)
            gen_l.append(b)
            lm, ll = m.forward([a], cache), r.eval([b])
            worst = max(worst, float(np.abs(lm - ll).max()))
            total += float(np.abs(lm - ll).mean()) / 32
            if a == b:
                _check_routing(m.last_routing, r.topk(), f"decode step {step}")
            a, b = int(np.argmax(lm)), int(np.argmax(ll))
        assert gen_m == gen_l
        assert worst <= max_tol and total <= mean_tol, (worst, total)
        assert len(set(gen_m)) > 1  # the model is not degenerate


def test_llama_cpp_on_permuted_file_routes_to_permuted_positions(tmp_path):
    src = write_synth(tmp_path / "m.gguf", SynthConfig(arch="qwen3moe", n_experts=16, n_used=4, seed=5))
    perm = random_perm(4, 16, seed=2)
    permuted_copy(src, tmp_path / "p.gguf", perm, router=True)
    with _runner(src) as r:
        r.eval(PROMPT, all_logits=True)
        ref = r.topk()
    with _runner(tmp_path / "p.gguf") as r:
        r.eval(PROMPT, all_logits=True)
        got = r.topk()
    m = load_model(tmp_path / "p.gguf")
    m.forward(PROMPT, all_logits=True)
    for li in ref:
        np.testing.assert_array_equal(np.sort(perm[li][got[li]], 1), np.sort(ref[li], 1))
        np.testing.assert_array_equal(np.sort(m.last_routing[li].experts, 1), np.sort(ref[li], 1))


def test_tokenizer_matches_llama_cpp(tmp_path):
    path = write_synth(tmp_path / "m.gguf", SynthConfig(seed=1))
    tok = Tokenizer.from_header(read_header(path))
    texts = ["the theater in a tin", "Hello world!  It's   a test\n\nwith\ttabs and 1234 numbers",
             "  leading", "trailing   ", "héllo wörld 日本語 😀", "a\n b\r\n  c", "don't YOU'LL we've",
             "   \n\n   x", "'''s"]
    with _runner(path) as r:
        for t in texts:
            assert tok.encode(t) == r.tokenize(t), t


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_experts_match_llama_cpp(tmp_path, qtype):
    src = write_synth(tmp_path / "m.gguf", SynthConfig(seed=3, hidden=256, expert_ff=256, n_heads=4,
                                                       n_kv_heads=2, head_dim=32))
    path = tmp_path / f"{qtype}.gguf"
    with_expert_type(src, path, qtype)
    m = load_model(path)
    assert {t.type for layer in m.map.moe_layers for t in layer.weights} == {qtype}
    with _runner(path) as r:
        mine = m.forward(PROMPT, all_logits=True)
        theirs = r.eval(PROMPT, all_logits=True)
        diff = np.abs(mine - theirs)
        assert diff.max() <= 2e-3 and diff.mean() <= 5e-5, (diff.max(), diff.mean())
        _check_routing(m.last_routing, r.topk(), qtype)


def test_native_name_filter_gives_the_python_callbacks_routing(tmp_path, monkeypatch):
    """The C filter in front of the eval callback (runtime/native.py) passes on exactly
    the ffn_moe_topk nodes: the routing equals the pure-Python callback's, layer by layer."""
    from mbolt.runtime import native

    path = write_synth(tmp_path / "m.gguf", SynthConfig(arch="qwen3moe", n_experts=16, n_used=4, seed=6))
    with _runner(path) as r:
        assert r.native_filter  # CI has a C compiler (it builds llama.cpp)
        r.eval(PROMPT)
        fast = r.topk()
    monkeypatch.setattr(native, "_LIB", None)  # as without a compiler
    with _runner(path) as r:
        assert not r.native_filter
        r.eval(PROMPT)
        slow = r.topk()
    assert sorted(fast) == sorted(slow) == list(range(4))
    for layer in fast:
        np.testing.assert_array_equal(fast[layer], slow[layer])
