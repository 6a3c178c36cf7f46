"""Synthetic MoE GGUF models that llama.cpp loads, with planted co-activation structure.

`write_synth(path, SynthConfig(...))` writes a complete model: byte-level `gpt2` vocabulary,
embeddings, attention, norms, a router per MoE layer and the routed experts, for one of
`SYNTH_ARCHS` (gguf/config.py), each with the tensor set and metadata its llama.cpp loader
requires. The routing is planted (gguf/routing.py) or fitted to a real model's profile
(gguf/routing_like.py); the bytes of each tensor come from gguf/blocks.py, their types from
gguf/config.py and gguf/mixes.py. This module lays out the tensors and writes the file.

Vocabulary: "gpt2" with GPT-2's pre-tokenizer; ids 0..255 are the bytes, then one token per merge of
synth.vocabulary.BYTE_MERGES, then <|bos|> and <|eos|> (not added). Token topics and expert groups
are recorded (`mbolt.synth.token_topic`; `mbolt.synth.groups`: int32 [n_layers*E], -1 dense).

Expert weights: real mode: Gaussian weights (std gain/sqrt(fan_in)) quantized with `gguf.quants.quantize`.
`fast_random=True` writes random but valid blocks instead (the only way for K- and I-quants),
copied from a pool at a per-slice offset so every expert slice has its own bytes; this runs at
memcpy speed, so big files write at disk speed with bounded memory. Router, embeddings and norms
are always real, so the planted routing is there in fast-random files too (expert outputs are
then noise). Mixed types as real files have them: `down_type`, `layer_types` (per layer) and the
Q4_K_M mix (experts and dense matrices, gguf/mixes.py); `fused_gate_up` writes one ffn_gate_up_exps
tensor (gate rows then up rows per expert, as llama.cpp's build_moe_ffn splits it).

Memory: streamed tensor by tensor, in chunks: a few pools of POOL_BYTES plus one chunk, whatever
the model's size. Every byte derives from `seed` and the tensor name: same config, same bytes.
What llama.cpp refuses: `probs_bias`, `expert_bias` and `dense_layers` on qwen3moe, olmoe, mixtral
and qwen2moe (files for mbolt's own tools); glm4moe, deepseek2 and gpt-oss have them natively.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from mbolt.core.atomic import atomic_output
from mbolt.core.errors import warn
from mbolt.core.header import encode_header_start, encode_kv, encode_tensor_info
from mbolt.synth.blocks import Pools, coprime_stride, encode
from mbolt.synth.config import (  # noqa: F401  (re-exported: the public names of synth)
    DENSE_TYPES, EXPERT_TYPES, FILE_TYPE, FUSED_GATE_UP_ARCHS, GGUF_ARCH, K_I_TYPES, PRESETS,
    SHARED_BY_COUNT, SHARED_GATED, SYNTH_ARCHS, SynthConfig, SynthInfo,
)
from mbolt.synth.mixes import computed_type, dense_type
from mbolt.synth.routing import PlantedRouting, rng_for
from mbolt.synth.routing_like import RoutingLike
from mbolt.synth.vocabulary import borrowed_vocabulary, vocabulary

ATTN_OUT_GAIN = 1.0  # attention output scale: larger = more context-dependent routing, weaker groups
GAIN = 0.5  # weight std = GAIN / sqrt(fan_in); output projections also / sqrt(n_layers)
CHUNK_BYTES = 16 << 20  # target size of one generated chunk
SIGMOID, SOFTMAX = 2, 1  # llama_expert_gating_func_type

@dataclass
class _Tensor:
    name: str
    ne: tuple[int, ...]  # GGUF order (ne[0] innermost)
    type: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]  # yields the data (any dtype) in file order
    offset: int = 0

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        return int(np.prod(self.ne, dtype=np.int64)) // block * size


class _Model:
    """Builds the tensor list of a SynthConfig; data are generated lazily, in file order."""

    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        self.H = cfg.hidden
        self.pools = Pools(cfg.seed)
        self.vocab_entries: list[bytes] = []
        if cfg.vocab:
            self.vocab_entries, self.V, self.bos, self.eos = borrowed_vocabulary(cfg.vocab)
        else:
            self.tokens, self.token_types, self.merges, self.bos, self.eos = vocabulary()
            self.V = len(self.tokens)
        self.plant = RoutingLike(cfg, self.V) if cfg.routing_like is not None else PlantedRouting(cfg, self.V)
        self.groups, self.token_topic = self.plant.groups, self.plant.token_topic
        self.tensors: list[_Tensor] = []
        self._build()

    # ---- tensor kinds ----
    def _dense(self, name: str, ne: tuple[int, ...], std: float, qtype: str | None = None) -> None:
        qt = GGMLQuantizationType[qtype or dense_type(self.cfg, name, ne[0])]
        self._add(name, ne, qt, std)

    def _add(self, name: str, ne, qt: GGMLQuantizationType, std: float, experts: int = 1) -> None:
        """A Gaussian (or fast-random) tensor, generated per expert / in row chunks."""
        ne = tuple(int(n) for n in ne)
        units = lambda: self._units(name, ne, qt, std, experts)  # noqa: E731
        self.tensors.append(_Tensor(name, ne, qt, lambda: (c for unit in units() for c in unit)))

    def _units(self, name: str, ne: tuple[int, ...], qt: GGMLQuantizationType, std: float,
               experts: int) -> Iterator[Iterator[np.ndarray]]:
        """The data of tensor `name`, one chunk iterator per expert (consumed in order)."""
        cfg = self.cfg
        rows_per_unit = int(np.prod(ne[1:], dtype=np.int64)) // experts  # rows of ne[0] per expert
        if cfg.fast_random:  # random valid blocks, a different pool window per expert
            blocks_per_unit = ne[0] * rows_per_unit // GGML_QUANT_SIZES[qt][0]
            n_pool = self.pools.n_blocks(qt)
            base = int(rng_for(cfg.seed, "offset", name).integers(0, n_pool))
            stride = coprime_stride(n_pool)
            for e in range(experts):
                yield self.pools.stream(qt, std, base + e * stride, blocks_per_unit)
            return
        rng = rng_for(cfg.seed, name)
        step = max(1, min(rows_per_unit, CHUNK_BYTES // (ne[0] * 4)))

        def unit():
            for r0 in range(0, rows_per_unit, step):
                n = min(step, rows_per_unit - r0)
                x = rng.standard_normal((n, ne[0]), dtype=np.float32) * np.float32(std)
                yield encode(x, qt)

        for _e in range(experts):
            yield unit()

    def _add_fused(self, p: str, ne: tuple[int, ...], qt: GGMLQuantizationType, std: float) -> None:
        """ffn_gate_up_exps: per expert the rows of ffn_gate_exps then those of ffn_up_exps, the
        very bytes the unfused file has (same generators), so fused and unfused files are the same
        model (llama.cpp's build_moe_ffn splits the 2 x ff rows into gate then up)."""
        H, ff, E = ne
        one = (H, ff, E)

        def chunks():
            gate = self._units(p + "ffn_gate_exps.weight", one, qt, std, E)
            up = self._units(p + "ffn_up_exps.weight", one, qt, std, E)
            for g, u in zip(gate, up):
                yield from g
                yield from u

        self.tensors.append(_Tensor(p + "ffn_gate_up_exps.weight", (H, 2 * ff, E), qt, chunks))

    def _matrix(self, name: str, ne: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        """A dense-type matrix computed by `make` (numpy shape = reversed ne)."""
        qt = GGMLQuantizationType[computed_type(self.cfg)]
        self.tensors.append(_Tensor(name, ne, qt, lambda: iter([encode(make().astype(np.float32), qt)])))

    def _zeros(self, name: str, ne: tuple[int, ...]) -> None:
        """An all-zero dense matrix in its dense type: zero bytes are zero values in every type."""
        t = _Tensor(name, ne, GGMLQuantizationType[dense_type(self.cfg, name, ne[0])],
                    lambda: iter([np.zeros(t.nbytes, np.uint8)]))
        self.tensors.append(t)

    def _const(self, name: str, arr, shape: tuple[int, ...] | None = None) -> None:
        """An F32 tensor given as an array, or as a function making it (then `shape` is
        required) so that big ones (routers) exist only while they are written."""
        if callable(arr):
            make = arr
        else:
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            shape, make = arr.shape, (lambda a=arr: a)
        self.tensors.append(_Tensor(name, tuple(reversed(shape)), GGMLQuantizationType.F32,
                                    lambda: iter([np.ascontiguousarray(make(), dtype=np.float32)])))

    def _small(self, name: str, shape: tuple[int, ...], std: float) -> None:
        """A small random F32 tensor (biases, sinks), made when written."""
        self._const(name, lambda: rng_for(self.cfg.seed, name).standard_normal(shape) * std, shape=shape)

    # ---- blocks of a layer ----
    def _attention(self, i: int, p: str) -> None:
        """Plain GQA attention (qwen3moe, olmoe, mixtral, qwen2moe, glm4moe, gpt-oss)."""
        cfg, H = self.cfg, self.H
        q_w, kv_w = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        out_scale = 1.0 / math.sqrt(cfg.n_layers)
        ctx = cfg.context > 0 or cfg.routing_like is not None
        zeros = cfg.typed_zero_attention and isinstance(self.plant, RoutingLike) and self.plant.zero_attention(i)
        if zeros:
            for what, w in (("q", q_w), ("k", kv_w), ("v", kv_w)):
                self._zeros(p + f"attn_{what}.weight", (H, w))
        elif ctx:  # attention that carries the context (routing.py, routing_like.py), built when written
            att = self.plant.attention
            for j, (what, w) in enumerate((("q", q_w), ("k", kv_w), ("v", kv_w))):
                self._matrix(p + f"attn_{what}.weight", (H, w), lambda i=i, j=j: att(i)[j])
        else:
            self._dense(p + "attn_q.weight", (H, q_w), GAIN / math.sqrt(H))
            self._dense(p + "attn_k.weight", (H, kv_w), GAIN / math.sqrt(H))
            self._dense(p + "attn_v.weight", (H, kv_w), GAIN / math.sqrt(H))
        if cfg.arch in ("qwen2moe", "glm4moe", "gpt-oss"):  # q/k/v biases
            for what, w in (("q", q_w), ("k", kv_w), ("v", kv_w)):
                self._small(p + f"attn_{what}.bias", (w,), 0.01)
        if zeros:
            self._zeros(p + "attn_output.weight", (q_w, H))
        elif ctx:
            self._matrix(p + "attn_output.weight", (q_w, H), lambda i=i: att(i)[3])
        else:
            self._dense(p + "attn_output.weight", (q_w, H), GAIN * ATTN_OUT_GAIN * out_scale / math.sqrt(q_w))
        qn = self.plant.context_norm() if ctx else 1.0
        if cfg.arch == "qwen3moe":
            self._const(p + "attn_q_norm.weight", np.full(cfg.head_dim, qn))
            self._const(p + "attn_k_norm.weight", np.full(cfg.head_dim, qn))
        elif cfg.arch == "olmoe":
            self._const(p + "attn_q_norm.weight", np.full(q_w, qn))
            self._const(p + "attn_k_norm.weight", np.full(kv_w, qn))
        elif cfg.arch == "gpt-oss":
            self._small(p + "attn_output.bias", (H,), 0.01)
            self._small(p + "attn_sinks.weight", (cfg.n_heads,), 1.0)

    def _mla(self, p: str) -> None:
        """DeepSeek MLA as llama.cpp's deepseek2 loads it: low-rank q (q_a, norm, q_b), a joint
        kv_a_mqa (kv_lora_rank latent + the shared rotary key part), and the per-head k_b / v_b
        split of kv_b (3-D: llama.cpp absorbs them, so they must be split, not one kv_b)."""
        cfg, H, nh = self.cfg, self.H, self.cfg.n_heads
        k_mla, rope, kv_r = cfg.head_dim, cfg.n_rot, cfg.kv_lora_rank
        v_mla = cfg.v_head_dim or cfg.head_dim
        g = GAIN / math.sqrt(H)
        if cfg.q_lora_rank:
            self._const(p + "attn_q_a_norm.weight", np.ones(cfg.q_lora_rank))
        self._const(p + "attn_kv_a_norm.weight", np.ones(kv_r))
        if cfg.q_lora_rank:
            self._dense(p + "attn_q_a.weight", (H, cfg.q_lora_rank), g)
            self._dense(p + "attn_q_b.weight", (cfg.q_lora_rank, nh * k_mla), GAIN / math.sqrt(cfg.q_lora_rank))
        else:
            self._dense(p + "attn_q.weight", (H, nh * k_mla), g)
        self._dense(p + "attn_kv_a_mqa.weight", (H, kv_r + rope), g)
        self._dense(p + "attn_k_b.weight", (k_mla - rope, kv_r, nh), GAIN / math.sqrt(kv_r))
        self._dense(p + "attn_v_b.weight", (kv_r, v_mla, nh), GAIN / math.sqrt(kv_r))
        self._dense(p + "attn_output.weight", (nh * v_mla, H), GAIN / math.sqrt(cfg.n_layers * nh * v_mla))

    def _linear_attention(self, p: str) -> None:
        """Qwen3-Next gated delta net (the modern split: attn_qkv + attn_gate, not legacy ssm_in).
        ssm_a is stored as -exp(A_log) (negative: a decay), ssm_dt as the dt bias."""
        cfg, H = self.cfg, self.H
        d, nk, nv = cfg.ssm_head_dim, cfg.ssm_k_heads, cfg.ssm_v_heads
        key_dim, value_dim = d * nk, d * nv
        conv_dim = 2 * key_dim + value_dim
        g = GAIN / math.sqrt(H)
        self._dense(p + "attn_qkv.weight", (H, conv_dim), g)
        self._dense(p + "attn_gate.weight", (H, value_dim), g)
        self._const(p + "ssm_conv1d.weight", lambda: rng_for(cfg.seed, p + "conv").standard_normal((conv_dim, cfg.ssm_conv))
                    / math.sqrt(cfg.ssm_conv), shape=(conv_dim, cfg.ssm_conv))
        self._small(p + "ssm_dt.bias", (nv,), 0.1)
        self._const(p + "ssm_a", -np.exp(rng_for(cfg.seed, p + "a_log").uniform(-1.0, 0.5, nv)))
        self._dense(p + "ssm_ba.weight", (H, 2 * nv), g)
        self._const(p + "ssm_norm.weight", np.ones(d))
        self._dense(p + "ssm_out.weight", (value_dim, H), GAIN / math.sqrt(cfg.n_layers * value_dim))

    def _gated_attention(self, p: str) -> None:
        """Qwen3-Next full attention: q projection carries q and its output gate (2 x q width)."""
        cfg, H, hd = self.cfg, self.H, self.cfg.head_dim
        q_w, kv_w = cfg.n_heads * hd, cfg.n_kv_heads * hd
        g = GAIN / math.sqrt(H)
        self._dense(p + "attn_q.weight", (H, 2 * q_w), g)
        self._dense(p + "attn_k.weight", (H, kv_w), g)
        self._dense(p + "attn_v.weight", (H, kv_w), g)
        self._dense(p + "attn_output.weight", (q_w, H), GAIN / math.sqrt(cfg.n_layers * q_w))
        self._const(p + "attn_q_norm.weight", np.ones(hd))
        self._const(p + "attn_k_norm.weight", np.ones(hd))

    def _experts(self, i: int, p: str) -> None:
        cfg, H, E, ff = self.cfg, self.H, self.cfg.n_experts, self.cfg.expert_ff
        out_scale = 1.0 / math.sqrt(cfg.n_layers)
        types = {k: GGMLQuantizationType[v] for k, v in cfg.expert_types(i).items()}
        self._const(p + "ffn_gate_inp.weight", lambda i=i: self.plant.router(i), shape=(E, H))
        if cfg.arch == "gpt-oss":
            self._small(p + "ffn_gate_inp.bias", (E,), 0.01)
        if cfg.probs_bias or cfg.arch in ("glm4moe", "deepseek2"):
            self._const(p + "exp_probs_b.bias", lambda i=i: self.plant.probs_bias(i), shape=(E,))
        down = (p + "ffn_down_exps.weight", (ff, H, E), types["down"], GAIN * cfg.expert_gain * out_scale / math.sqrt(ff))
        if cfg.tensor_order == "converter":  # llama.cpp's convert_hf_to_gguf merges down, gate, up
            self._add(*down, experts=E)
        if cfg.fused_gate_up:  # gate rows then up rows of each expert (one mul_mat_id in llama.cpp)
            self._add_fused(p, (H, ff, E), types["gate"], GAIN / math.sqrt(H))
        else:
            self._add(p + "ffn_gate_exps.weight", (H, ff, E), types["gate"], GAIN / math.sqrt(H), experts=E)
            self._add(p + "ffn_up_exps.weight", (H, ff, E), types["up"], GAIN / math.sqrt(H), experts=E)
        if cfg.tensor_order != "converter":
            self._add(*down, experts=E)
        if cfg.expert_bias or cfg.arch == "gpt-oss":
            for proj, width in (("gate", ff), ("up", ff), ("down", H)):
                self._small(p + f"ffn_{proj}_exps.bias", (E, width), 0.01)
        if cfg.arch in SHARED_GATED:
            sf = cfg.shared_ff
            self._const(p + "ffn_gate_inp_shexp.weight", rng_for(cfg.seed, p + "shexp_gate").standard_normal(H) / math.sqrt(H))
        elif cfg.arch in SHARED_BY_COUNT:
            sf = cfg.n_shared * ff
        else:
            return
        self._dense(p + "ffn_gate_shexp.weight", (H, sf), GAIN / math.sqrt(H))
        self._dense(p + "ffn_up_shexp.weight", (H, sf), GAIN / math.sqrt(H))
        self._dense(p + "ffn_down_shexp.weight", (sf, H), GAIN * out_scale / math.sqrt(sf))

    def _build(self) -> None:
        cfg, H = self.cfg, self.H
        out_scale = 1.0 / math.sqrt(cfg.n_layers)
        self._const("token_embd.weight", self.plant.embeddings)
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self._const(p + "attn_norm.weight", np.ones(H))
            if cfg.arch == "deepseek2":
                self._mla(p)
            elif cfg.arch == "qwen3next":
                self._linear_attention(p) if cfg.is_recurrent(i) else self._gated_attention(p)
            else:
                self._attention(i, p)
            # the pre-FFN norm: post_attention_norm in llama.cpp's glm4moe / gpt-oss / qwen3next
            post = cfg.arch in ("glm4moe", "gpt-oss", "qwen3next")
            self._const(p + ("post_attention_norm.weight" if post else "ffn_norm.weight"), np.ones(H))
            if i < cfg.dense_layers:
                self._dense(p + "ffn_gate.weight", (H, cfg.dense_ff), GAIN / math.sqrt(H))
                self._dense(p + "ffn_up.weight", (H, cfg.dense_ff), GAIN / math.sqrt(H))
                self._dense(p + "ffn_down.weight", (cfg.dense_ff, H), GAIN * out_scale / math.sqrt(cfg.dense_ff))
                continue
            self._experts(i, p)
        self._const("output_norm.weight", np.ones(H))
        self._dense("output.weight", (H, self.V), 1.0 / math.sqrt(H))

    # ---- metadata ----
    def kv(self) -> list[bytes]:
        cfg = self.cfg
        a = cfg.gguf_arch
        U32, F32, STR, ARR, BOOL = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING,
                                    GGUFValueType.ARRAY, GGUFValueType.BOOL)
        ff_key = cfg.expert_ff if cfg.arch in ("olmoe", "mixtral") else cfg.dense_ff
        name = cfg.name or f"mbolt-synth-{cfg.preset or cfg.arch}"
        k_len = v_len = cfg.head_dim
        if cfg.arch == "deepseek2":  # MLA: the cache holds the latent (kv_lora_rank) + rotary key
            k_len, v_len = cfg.kv_lora_rank + cfg.n_rot, cfg.kv_lora_rank
        G, LLM, Att, Rope, SSM, Tok = Keys.General, Keys.LLM, Keys.Attention, Keys.Rope, Keys.SSM, Keys.Tokenizer

        def arch_kv(template, vtype, value):  # gguf-py's "{arch}.…" key template, filled in
            return encode_kv(template.format(arch=a), vtype, value)

        kvs = [
            encode_kv(G.ARCHITECTURE, STR, a), encode_kv(G.NAME, STR, name),
            encode_kv(G.ALIGNMENT, U32, cfg.alignment), encode_kv(G.FILE_TYPE, U32, FILE_TYPE[cfg.expert_type]),
            arch_kv(LLM.CONTEXT_LENGTH, U32, cfg.context_length),
            arch_kv(LLM.EMBEDDING_LENGTH, U32, cfg.hidden),
            arch_kv(LLM.BLOCK_COUNT, U32, cfg.n_layers),
            arch_kv(LLM.FEED_FORWARD_LENGTH, U32, ff_key),
            arch_kv(LLM.EXPERT_FEED_FORWARD_LENGTH, U32, cfg.expert_ff),
            arch_kv(Att.HEAD_COUNT, U32, cfg.n_heads),
            arch_kv(Att.HEAD_COUNT_KV, U32, cfg.n_kv_heads),
            arch_kv(Att.KEY_LENGTH, U32, k_len),
            arch_kv(Att.VALUE_LENGTH, U32, v_len),
            arch_kv(Att.LAYERNORM_RMS_EPS, F32, cfg.rms_eps),
            arch_kv(Rope.FREQ_BASE, F32, cfg.rope_base),
            arch_kv(Rope.DIMENSION_COUNT, U32, cfg.n_rot),
            arch_kv(LLM.EXPERT_COUNT, U32, cfg.n_experts),
            arch_kv(LLM.EXPERT_USED_COUNT, U32, cfg.n_used),
            arch_kv(LLM.VOCAB_SIZE, U32, self.V),
        ]
        if cfg.arch in SHARED_GATED:
            kvs.append(arch_kv(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, U32, cfg.shared_ff))
        if cfg.dense_layers:
            kvs.append(arch_kv(LLM.LEADING_DENSE_BLOCK_COUNT, U32, cfg.dense_layers))
        if cfg.arch in SHARED_BY_COUNT:  # sigmoid router, normalised top-k, scaled, shared expert
            kvs += [arch_kv(LLM.EXPERT_SHARED_COUNT, U32, cfg.n_shared),
                    arch_kv(LLM.EXPERT_GATING_FUNC, U32, SIGMOID),
                    arch_kv(LLM.EXPERT_WEIGHTS_NORM, BOOL, True),
                    arch_kv(LLM.EXPERT_WEIGHTS_SCALE, F32, cfg.weights_scale)]
        if cfg.arch == "deepseek2":
            kvs += [arch_kv(Att.KV_LORA_RANK, U32, cfg.kv_lora_rank),
                    arch_kv(Att.KEY_LENGTH_MLA, U32, cfg.head_dim),
                    arch_kv(Att.VALUE_LENGTH_MLA, U32, cfg.v_head_dim or cfg.head_dim),
                    # required unless the layer count is a "lite" one (26/27): 0 = plain attn_q
                    arch_kv(Att.Q_LORA_RANK, U32, cfg.q_lora_rank)]
        if cfg.arch == "gpt-oss":  # llama.cpp: sliding window on every other layer (pattern 2)
            kvs.append(arch_kv(Att.SLIDING_WINDOW, U32, cfg.sliding_window))
        if cfg.arch == "qwen3next":  # the last two spelled out: gguf 0.17 (pyproject's oldest) lacks them
            kvs += [arch_kv(SSM.CONV_KERNEL, U32, cfg.ssm_conv),
                    arch_kv(SSM.INNER_SIZE, U32, cfg.ssm_head_dim * cfg.ssm_v_heads),
                    arch_kv(SSM.STATE_SIZE, U32, cfg.ssm_head_dim),
                    arch_kv(SSM.TIME_STEP_RANK, U32, cfg.ssm_v_heads),
                    arch_kv("{arch}.ssm.group_count", U32, cfg.ssm_k_heads),
                    arch_kv("{arch}.full_attention_interval", U32, cfg.full_attn_every)]
        kvs += self.vocab_entries or [
            encode_kv(Tok.MODEL, STR, "gpt2"),
            encode_kv(Tok.PRE, STR, "gpt-2"),
            encode_kv(Tok.LIST, ARR, self.tokens, GGUFValueType.STRING),
            encode_kv(Tok.TOKEN_TYPE, ARR, self.token_types, GGUFValueType.INT32),
            encode_kv(Tok.MERGES, ARR, self.merges, GGUFValueType.STRING),
            encode_kv(Tok.BOS_ID, U32, self.bos), encode_kv(Tok.EOS_ID, U32, self.eos),
            encode_kv(Tok.ADD_BOS, BOOL, False), encode_kv(Tok.ADD_EOS, BOOL, False),
        ]
        kvs += [
            encode_kv("mbolt.synth.structure", STR, cfg.structure),
            encode_kv("mbolt.synth.seed", U32, cfg.seed & 0xFFFFFFFF),
            encode_kv("mbolt.synth.n_groups", U32, cfg.groups),
            encode_kv("mbolt.synth.strength", F32, cfg.strength),
            encode_kv("mbolt.synth.heat_skew", F32, cfg.heat_skew),
            encode_kv("mbolt.synth.fast_random", BOOL, cfg.fast_random),
            encode_kv("mbolt.synth.context", F32, cfg.context),
            encode_kv("mbolt.synth.groups", ARR, self.groups.reshape(-1), GGUFValueType.INT32),
            encode_kv("mbolt.synth.token_topic", ARR, self.token_topic.astype(np.int32), GGUFValueType.INT32),
        ]
        if cfg.preset:
            kvs.append(encode_kv("mbolt.synth.preset", STR, cfg.preset))
        if cfg.expert_gain != 1.0:  # only then: the benchmarks' files keep their bytes
            kvs.append(encode_kv("mbolt.synth.expert_gain", F32, cfg.expert_gain))
        if cfg.tensor_order != "use":
            kvs.append(encode_kv("mbolt.synth.tensor_order", STR, cfg.tensor_order))
        kvs += self.plant.kv() if cfg.routing_like is not None else []
        return kvs


def _header(model: _Model) -> bytes:
    cfg = model.cfg
    kvs = model.kv()
    out = [encode_header_start(len(model.tensors), len(kvs))] + kvs
    offset = 0
    for t in model.tensors:
        t.offset = offset
        offset += -(-t.nbytes // cfg.alignment) * cfg.alignment
        out.append(encode_tensor_info(t.name, t.ne, t.type, t.offset))
    return b"".join(out)


def synth_tensors(cfg: SynthConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ne, ggml type name) of every tensor write_synth(cfg) writes, in file order."""
    cfg.validate()
    return [(t.name, t.ne, t.type.name) for t in _Model(cfg).tensors]


def synth_size(cfg: SynthConfig) -> int:
    """File size write_synth(cfg) will produce, without writing it."""
    cfg.validate()
    m = _Model(cfg)
    header = _header(m)
    data_offset = -(-len(header) // cfg.alignment) * cfg.alignment
    last = m.tensors[-1]
    return data_offset + last.offset + last.nbytes


def write_synth(path: str | os.PathLike, cfg: SynthConfig, *, force: bool = True,
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the synthetic model described by `cfg` to `path` (atomically); returns the path.
    `progress(done_bytes, total_bytes)` is called after every chunk."""
    return Path(write_synth_info(path, cfg, force=force, progress=progress).path)


def write_synth_info(path: str | os.PathLike, cfg: SynthConfig, *, force: bool = True,
                     progress: Callable[[int, int], None] | None = None) -> SynthInfo:
    """write_synth, returning a SynthInfo summary."""
    cfg.validate()
    if cfg.fused_gate_up and cfg.arch not in FUSED_GATE_UP_ARCHS:
        warn(f"{path}: llama.cpp's {cfg.arch} loader refuses ffn_gate_up_exps (it accepts it in "
             f"{', '.join(FUSED_GATE_UP_ARCHS)}): this file is for mbolt's own tools")
    path = Path(path)
    model = _Model(cfg)
    header = _header(model)
    data_offset = -(-len(header) // cfg.alignment) * cfg.alignment
    total = data_offset + model.tensors[-1].offset + model.tensors[-1].nbytes
    done = 0
    with atomic_output(path, force=force) as f:
        f.write(header)
        f.write(b"\0" * (data_offset - len(header)))
        done = data_offset
        for t in model.tensors:
            assert done == data_offset + t.offset, t.name
            n = 0
            for chunk in t.chunks():
                mv = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(mv)
                n += mv.nbytes
                done += mv.nbytes
                if progress:
                    progress(done, total)
            if n != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {n} bytes, expected {t.nbytes}")
            pad = (-n) % cfg.alignment
            if pad and t is not model.tensors[-1]:
                f.write(b"\0" * pad)
                done += pad
    if progress:
        progress(total, total)
    sha = hashlib.sha256(header).hexdigest()
    geometry = {k: getattr(cfg, k) for k in ("n_layers", "n_experts", "n_used", "hidden", "expert_ff",
                                             "n_heads", "n_kv_heads", "head_dim", "dense_layers")}
    if cfg.arch in SHARED_GATED:
        geometry["shared_ff"] = cfg.shared_ff
    if cfg.arch in SHARED_BY_COUNT:
        geometry["n_shared"] = cfg.n_shared
    geometry["n_groups"] = cfg.groups
    return SynthInfo(
        path=str(path), bytes=path.stat().st_size, arch=cfg.arch, gguf_arch=cfg.gguf_arch,
        preset=cfg.preset, geometry=geometry, expert_type=cfg.expert_type, structure=cfg.structure,
        fast_random=cfg.fast_random, n_tensors=len(model.tensors), header_sha256=sha, fingerprint=sha[:32],
        extra={"seed": cfg.seed, "strength": cfg.strength, "heat_skew": cfg.heat_skew, "context": cfg.context,
               "fused_gate_up": cfg.fused_gate_up, "down_type": cfg.down_type, "layer_types": cfg.layer_types,
               **({"note": cfg.note} if cfg.note else {}),
               **({"routing_like": model.plant.summary()} if cfg.routing_like is not None else {})},
    )
