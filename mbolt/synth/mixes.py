"""Tensor types of synthetic files: llama.cpp's Q4_K_M mix, and the fallback of a block type that
does not fit a tensor's rows, as llama-quantize assigns them (src/llama-quant.cpp of the build CI
uses, llama_tensor_get_type_impl and its fallback).

`Q4_K_M` is accepted as an expert type (--type, --down-type, --layer-types) and as a dense type
(--dense-type); `--type Q4_K_M --dense-type Q4_K_M --fast-random` writes a file typed as
llama-quantize types a Q4_K_M (for a model whose expert count is not 8):

* every matrix llama-quantize quantizes is Q4_K, except:
* attn_v-like tensors (attn_v, attn_qkv, attn_kv_b): Q6_K in the layers use_more_bits picks
  (counted over the layers that have one: every layer of the families synth writes, none in
  deepseek2's split MLA);
* every ffn_down (dense ffn_down, ffn_down_exps, ffn_down_shexp): Q6_K in the layers
  use_more_bits picks (about half: the first and last eighth, then every third layer);
* output.weight: Q6_K (Q8_0 when its rows are not a multiple of 256).
use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division).
Rows that are not a multiple of 256 fall back as llama-quantize does: Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, and to F16 when not a multiple of 32 either.

What synth keeps as it writes it (as a real Q4_K_M does except the first): token_embd stays F32
(the planted routing lives in it; llama-quantize makes it Q4_K), routers (ffn_gate_inp), norms and
biases F32, and the attention --context / --routing-like compute stays F16 (exact values; gguf-py
has no K-quant quantizer). The K-quants themselves are random valid blocks (--fast-random), as
the experts' are (gguf/blocks.py).
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MIXES = ("Q4_K_M",)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}
ENCODABLE = ("F32", "F16", "Q8_0")  # dense types computed matrices can be written in exactly enough


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fitted(qtype: str, ne0: int) -> str:
    """`qtype`, or llama-quantize's fallback when rows of ne0 values are not whole blocks of it."""
    if ne0 % GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0] == 0:
        return qtype
    fb = FALLBACK.get(qtype, qtype)
    return fb if ne0 % GGML_QUANT_SIZES[GGMLQuantizationType[fb]][0] == 0 else "F16"


def mix_type(mix: str, name: str, ne0: int, n_layers: int, n_experts: int) -> str:
    """The type llama-quantize gives tensor `name` (rows of ne0 values) in `mix` (see module doc)."""
    assert mix == "Q4_K_M", mix
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    if name == "output.weight":
        return "Q6_K" if ne0 % 256 == 0 else "Q8_0"
    qtype = "Q4_K"
    attn_v_like = any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))
    if attn_v_like:
        qtype = "Q8_0" if n_experts == 8 else ("Q6_K" if use_more_bits(layer, n_layers) else "Q4_K")
    elif "attn_k.weight" in name and n_experts == 8:
        qtype = "Q8_0"
    elif "attn_output.weight" in name and n_experts == 8:
        qtype = "Q5_K"
    elif "ffn_down" in name and use_more_bits(layer, n_layers):
        qtype = "Q6_K"
    return fitted(qtype, ne0)


def dense_type(cfg, name: str, ne0: int) -> str:
    """The type of dense matrix `name` of a SynthConfig: its dense type (a mix resolved per
    tensor), fallen back when its rows are not whole blocks."""
    if cfg.dense_type in MIXES:
        return mix_type(cfg.dense_type, name, ne0, cfg.n_layers, cfg.n_experts)
    return fitted(cfg.dense_type, ne0) if cfg.dense_type not in ("F32", "F16") else cfg.dense_type


def computed_type(cfg) -> str:
    """The type of matrices synth computes (context attention): exact enough to plant routing."""
    return cfg.dense_type if cfg.dense_type in ENCODABLE else "F16"
