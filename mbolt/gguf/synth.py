"""Synthetic MoE GGUF models that llama.cpp loads, with planted co-activation structure.

`write_synth(path, SynthConfig(...))` writes a complete model: byte-level `gpt2` vocabulary,
embeddings, attention, norms, a router per MoE layer and the routed experts, for one of
`SYNTH_ARCHS` (qwen3moe, olmoe, mixtral = llama with experts, qwen2moe = shared expert + shared
gate). `PRESETS` hold the real tensor shapes of public MoE models; `SynthConfig.from_preset`
fills a config from one (with overrides such as `n_layers` to scale it down).

Planted routing (structure="planted")
-------------------------------------
The router of a layer sees `x = RMSNorm(h)` of the residual stream `h`. Attention and expert
outputs are kept small (output projections scaled by 1/sqrt(n_layers)), so `h` stays close to
the token embedding at every layer, and routing is a function of the token embedding direction:

* `n_groups` topic directions `u_g` (orthonormal) and one common direction `m`. Every token id
  gets a topic `g(t)`; its embedding is `sqrt(H) * (a*u_g(t) + b*m + c*n_t)` with a random unit
  `n_t` (a=0.6, b=0.3, c=sqrt(1-a^2-b^2)): tokens of a topic point the same way.
* Per layer the experts are dealt into `n_groups` groups by a random permutation (groups are
  scattered over expert ids, so stock order is not already optimal). Expert e of group G(e)
  gets the router row `v_e / sqrt(H)` with
  `v_e = (TOPIC_GAIN * strength / a) * u_G(e) + INDIVIDUAL * sqrt(H) * r_e + (bias_e / b) * m`,
  `r_e` a random unit vector. For a token of topic g the logits are then about
  `TOPIC_GAIN*strength*[G(e) == g] + bias_e + INDIVIDUAL*N(0,1)`: the token picks its k
  experts mostly inside its topic's group (co-activation), with the individual term deciding
  which members. `strength` 0 leaves only the individual and bias terms.
* Heat: `bias_e = heat_skew * (HEAT_EXPERT * z_e + HEAT_GROUP * z_G(e))` with z ~ N(0,1), through
  the common direction m (every token has the same component b along m), so it acts as a
  per-expert logit bias: some experts and some groups are hotter. heat_skew 0 = flat.
* structure="none" (the null control): router rows are iid Gaussian (`NONE_SCALE` logit std)
  plus the same heat bias; embeddings are unchanged, but nothing ties groups to topics.

* context > 0 (opt-in; default 0 keeps routing a function of the token id, apart from small
  attention noise): attention is built to look at the recent tokens (q = k = a constant vector
  read off m, so the score depends only on the distance through RoPE) and to add `context` times
  their topics, plus a random projection of the rest of them, to the residual stream. Routing
  then depends on the token and its recent context: more distinct expert sets per token id, and
  co-activation across the groups of neighbouring topics (weaker group coherence).
  Also with fast_random (the attention matrices are then real, the experts random).

The planted groups are recorded in the file (`mbolt.synth.groups`: int32 [n_layers*E] group id of
every expert, -1 for dense layers) so tests and benchmarks can score a plan against the truth.

Vocabulary
----------
`tokenizer.ggml.model` "gpt2", `tokenizer.ggml.pre` "gpt-2" (GPT-2's pre-tokenizer regex). Ids
0..255 are the 256 bytes in GPT-2 byte-to-unicode form (token id == byte value), then one token
per merge of BYTE_MERGES ("Ġ t", "h e", "i n", "Ġ a", ranked in that order), then the control
tokens <|bos|> and <|eos|>. add_bos/add_eos are false. Each token id also has a planted topic
(`mbolt.synth.token_topic`).

Expert weights
--------------
Real mode: Gaussian weights (std gain/sqrt(fan_in)) quantized with `gguf.quants.quantize` to
`expert_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4). `fast_random=True` writes
random but valid blocks instead (finite small scales, random quants), copied from a pool at a
per-slice offset so every expert slice has its own bytes; this runs at memcpy speed, so big
files write at disk speed with bounded memory. Router, embeddings and norms are always real,
so the planted routing is there in fast-random files too (expert outputs are then noise).

Memory: the file is streamed tensor by tensor (experts slice by slice, large matrices in row
chunks); peak memory is a few pools of POOL_BYTES plus one chunk, independent of model size.
Everything is derived from `seed` and the tensor name: same config, same bytes.

What llama.cpp refuses: `probs_bias`, `expert_bias` and `dense_layers` add tensors (or drop
experts from layers) that llama.cpp's qwen3moe/olmoe/llama/qwen2moe loaders do not accept;
such files are for mbolt's own tools (map, rewriter, reference engine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quantize

from mbolt.core.atomic import atomic_output
from mbolt.core.vocab import bytes_to_unicode
from mbolt.core.header import encode_header_start, encode_kv, encode_tensor_info
from mbolt.core.errors import MboltError

SYNTH_ARCHS = {
    "qwen3moe": "Qwen3-MoE: GQA attention with per-head q/k RMSNorm, softmax top-k router",
    "olmoe": "OLMoE: q/k RMSNorm over the full q/k width (needs kv heads == heads, heads x head_dim == hidden)",
    "mixtral": "Mixtral: llama architecture with expert_count (gguf arch 'llama')",
    "qwen2moe": "Qwen2-MoE: q/k/v biases, routed experts + shared expert with sigmoid shared gate "
                "(needs heads x head_dim == hidden)",
}
GGUF_ARCH = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "qwen2moe": "qwen2moe"}

# Geometry of public models (HF config.json). Each is a dict of SynthConfig fields.
PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(  # Qwen/Qwen3-30B-A3B
        arch="qwen3moe", n_layers=48, n_experts=128, n_used=8, hidden=2048, expert_ff=768,
        n_heads=32, n_kv_heads=4, head_dim=128, dense_ff=6144, rope_base=1e6, expert_type="Q4_0",
        note="Qwen3-30B-A3B tensor shapes",
    ),
    "qwen3-next-80b-a3b": dict(  # Qwen/Qwen3-Next-80B-A3B-Instruct
        arch="qwen3moe", n_layers=48, n_experts=512, n_used=10, hidden=2048, expert_ff=512,
        n_heads=16, n_kv_heads=2, head_dim=256, dense_ff=5120, rope_base=1e7, expert_type="Q4_0",
        note="Qwen3-Next-80B-A3B routed-expert shapes written as qwen3moe geometry: its hybrid "
        "linear attention and its shared expert are not modelled (plain GQA attention instead)",
    ),
    "olmoe-1b-7b": dict(  # allenai/OLMoE-1B-7B-0924
        arch="olmoe", n_layers=16, n_experts=64, n_used=8, hidden=2048, expert_ff=1024,
        n_heads=16, n_kv_heads=16, head_dim=128, dense_ff=1024, rope_base=1e4, expert_type="Q4_0",
        note="OLMoE-1B-7B tensor shapes",
    ),
    "granite-moe-1b": dict(  # ibm-granite/granite-3.0-1b-a400m-base
        arch="mixtral", n_layers=24, n_experts=32, n_used=8, hidden=1024, expert_ff=512,
        n_heads=16, n_kv_heads=8, head_dim=64, dense_ff=512, rope_base=1e4, expert_type="Q4_0",
        note="granite-3.0-1b-a400m tensor shapes written as mixtral (llama arch with experts): "
        "granite's embedding/residual/attention/logit multipliers are not modelled",
    ),
}

EXPERT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
DENSE_TYPES = ("F32", "F16")
FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32,
             "MXFP4": 38}  # llama_ftype (gguf.LlamaFileType) named after the expert type

# Planted-routing constants (see module docstring).
TOPIC_A, TOPIC_B = 0.6, 0.3
TOPIC_GAIN = 8.0  # logit bonus of the token's own group at strength 1
INDIVIDUAL = 1.5  # std of the per-expert, per-token logit term
HEAT_EXPERT, HEAT_GROUP = 1.5, 1.0
NONE_SCALE = 3.0  # logit std of iid router rows (structure="none")
CONTEXT_NOISE = 0.5  # context attention: weight of the non-topic part of the context
KERNEL = 24.0  # context attention: score at distance 0 (recency sharpness)
ATTN_OUT_GAIN = 1.0  # attention output scale: larger = more context-dependent routing, weaker groups
GAIN = 0.5  # weight std = GAIN / sqrt(fan_in); output projections also / sqrt(n_layers)

POOL_BYTES = 8 << 20  # random-block pool per type (fast_random)
CHUNK_BYTES = 16 << 20  # target size of one generated chunk


@dataclass
class SynthConfig:
    arch: str = "qwen3moe"
    n_layers: int = 4
    n_experts: int = 8
    n_used: int = 2
    hidden: int = 64
    expert_ff: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    shared_ff: int = 64  # qwen2moe shared expert FFN size
    dense_ff: int = 128  # FFN size of dense layers (dense_layers > 0)
    expert_type: str = "F32"
    dense_type: str = "F32"  # attention / dense FFN / shared expert / output matrices
    seed: int = 0
    structure: str = "planted"  # "planted" | "none"
    n_groups: int = 0  # 0 = auto: max(2, n_experts // (2 * n_used))
    strength: float = 0.5
    heat_skew: float = 0.5
    context: float = 0.0  # > 0: attention adds recent tokens' topics (context-dependent routing)
    preset: str | None = None
    fast_random: bool = False
    probs_bias: bool = False
    expert_bias: bool = False
    dense_layers: int = 0
    context_length: int = 4096
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    alignment: int = 32
    note: str = ""
    name: str = ""

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "SynthConfig":
        if preset not in PRESETS:
            raise MboltError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        fields = dict(PRESETS[preset])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(preset=preset, **fields)

    @property
    def groups(self) -> int:
        if self.n_groups:
            return self.n_groups
        return min(self.n_experts, max(2, self.n_experts // (2 * self.n_used)))

    def validate(self) -> None:
        def bad(msg):
            raise MboltError(f"synth: {msg}")

        if self.arch not in SYNTH_ARCHS:
            bad(f"unknown arch {self.arch!r} (known: {', '.join(SYNTH_ARCHS)})")
        if self.expert_type not in EXPERT_TYPES:
            bad(f"unknown expert type {self.expert_type!r} (known: {', '.join(EXPERT_TYPES)})")
        if self.dense_type not in DENSE_TYPES:
            bad(f"dense type must be one of {', '.join(DENSE_TYPES)}, got {self.dense_type!r}")
        if self.structure not in ("planted", "none"):
            bad(f"structure must be 'planted' or 'none', got {self.structure!r}")
        for name in ("n_layers", "n_experts", "n_used", "hidden", "expert_ff", "n_heads",
                     "n_kv_heads", "head_dim", "shared_ff", "dense_ff", "context_length"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_experts < 2:
            bad(f"n_experts must be >= 2, got {self.n_experts}")
        if self.n_used > self.n_experts:
            bad(f"k (n_used={self.n_used}) is larger than the number of experts ({self.n_experts})")
        if not 0 <= self.dense_layers < self.n_layers:
            bad(f"dense_layers must be in 0..{self.n_layers - 1}, got {self.dense_layers}")
        if self.n_heads % self.n_kv_heads:
            bad(f"heads ({self.n_heads}) must be a multiple of kv heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            bad(f"head_dim must be even (rope), got {self.head_dim}")
        if self.arch == "olmoe" and self.n_kv_heads != self.n_heads:
            bad("olmoe needs kv heads == heads (its k norm spans the full width)")
        if self.arch in ("olmoe", "qwen2moe") and self.n_heads * self.head_dim != self.hidden:
            bad(f"{self.arch} needs heads x head_dim == hidden (llama.cpp checks it): "
                f"{self.n_heads} x {self.head_dim} != {self.hidden}")
        if not 1 <= self.groups <= self.n_experts:
            bad(f"groups must be in 1..{self.n_experts}, got {self.groups}")
        if not 0.0 <= self.strength <= 1.0:
            bad(f"strength must be in [0, 1], got {self.strength}")
        if self.context < 0:
            bad(f"context must be >= 0, got {self.context}")
        if self.heat_skew < 0:
            bad(f"heat skew must be >= 0, got {self.heat_skew}")
        if self.alignment < 8 or self.alignment & (self.alignment - 1):
            bad(f"alignment must be a power of two >= 8, got {self.alignment}")
        block = GGML_QUANT_SIZES[GGMLQuantizationType[self.expert_type]][0]
        for what, n in (("hidden", self.hidden), ("expert_ff", self.expert_ff)):
            if n % block:
                bad(f"{what} ({n}) must be a multiple of the {self.expert_type} block ({block})")


# ---- vocabulary ----

BYTE_MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a")]
SPECIALS = ["<|bos|>", "<|eos|>"]


def vocabulary() -> tuple[list[str], list[int], list[str], int, int]:
    """tokens (id = byte value for ids 0..255), token types, merges, bos id, eos id."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1] * 256  # NORMAL
    merges = []
    for a, b in BYTE_MERGES:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    bos = len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)  # CONTROL
    return tokens, types, merges, bos, bos + 1


# ---- GGUF serialisation ----




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


# ---- weight generators ----


def _rng(seed: int, *parts) -> np.random.Generator:
    key = [seed & 0xFFFFFFFF] + [zlib.crc32(str(p).encode()) for p in parts]
    return np.random.default_rng(key)


def _encode(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return x.astype("<f4", copy=False)
    if qtype == GGMLQuantizationType.F16:
        return x.astype("<f2")
    return quantize(x, qtype)  # uint8 [rows, bytes per row]


# typical |value| of a random quant (after subtracting the offset) per type, to pick scales
_Q_STD = {"Q8_0": 74.0, "Q4_0": 4.6, "Q4_1": 4.6, "Q5_0": 9.2, "Q5_1": 9.2, "MXFP4": 5.7}


def _fill_pool(qtype: GGMLQuantizationType, std: float, seed: int) -> tuple[np.ndarray, int]:
    """POOL_BYTES of random valid blocks of `qtype` whose values have about `std`, doubled so
    any window of up to n_blocks blocks is contiguous; returns (uint8 pool, n_blocks)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = POOL_BYTES // size
    rng = _rng(seed, "pool", qtype.name, f"{std:.6g}")
    name = qtype.name
    if name in ("F32", "F16", "BF16"):
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        if name == "BF16":
            raw = (x.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
        else:
            raw = x.astype("<f4" if name == "F32" else "<f2").view(np.uint8)
        raw = raw.reshape(n, size)
    else:
        raw = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
        d = std / _Q_STD[name]
        if name == "MXFP4":  # e8m0 scale byte first; ggml value = kvalue * 2^(e - 128)
            e = int(np.clip(round(math.log2(d)) + 128, 1, 254))
            raw[:, 0] = rng.integers(e - 1, e + 2, n, dtype=np.uint8)
        else:  # Q4_0/Q5_0/Q8_0: fp16 d first; Q4_1/Q5_1: fp16 d, fp16 m (min)
            nscale = 2 if name in ("Q4_1", "Q5_1") else 1
            ds = (d * (0.5 + rng.random((n, nscale), dtype=np.float32))).astype("<f2")
            if nscale == 2:
                ds[:, 1] = -ds[:, 0] * (8 if name == "Q4_1" else 16)
            raw[:, : 2 * nscale] = ds.view(np.uint8).reshape(n, 2 * nscale)
    flat = raw.reshape(-1)
    return np.concatenate([flat, flat]), n


class _Pools:
    """Random valid blocks for fast_random, one pool per (type, std); slices are views."""

    def __init__(self, seed: int):
        self.seed, self._pools = seed, {}

    def stream(self, qtype: GGMLQuantizationType, std: float, start: int, n_blocks: int) -> Iterator[np.ndarray]:
        key = (qtype, f"{std:.3g}")
        if key not in self._pools:
            self._pools[key] = _fill_pool(qtype, float(key[1]), self.seed)
        pool, n = self._pools[key]
        size = GGML_QUANT_SIZES[qtype][1]
        pos = start % n
        while n_blocks > 0:
            take = min(n_blocks, n)
            yield pool[pos * size:(pos + take) * size]
            n_blocks -= take
            pos = (pos + take * 7919 + 1) % n  # next window elsewhere in the pool

    def n_blocks(self, qtype: GGMLQuantizationType) -> int:
        return POOL_BYTES // GGML_QUANT_SIZES[qtype][1]


def _stride(n: int) -> int:
    s = int(n * 0.6180339887) | 1
    while math.gcd(s, n) != 1:
        s += 2
    return s


class _Model:
    """Builds the tensor list of a SynthConfig; data are generated lazily, in file order."""

    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        self.H = cfg.hidden
        self.pools = _Pools(cfg.seed)
        self.tokens, self.token_types, self.merges, self.bos, self.eos = vocabulary()
        self.V = len(self.tokens)
        self._routing()
        self.tensors: list[_Tensor] = []
        self._build()

    # planted structure: topics, embeddings, router rows
    def _routing(self) -> None:
        cfg, H = self.cfg, self.H
        G = cfg.groups
        rng = _rng(cfg.seed, "topics")
        n_dirs = G + 1
        basis = rng.standard_normal((H, n_dirs))
        if n_dirs <= H:
            basis, _ = np.linalg.qr(basis)  # orthonormal topic directions + common direction
        else:
            basis /= np.linalg.norm(basis, axis=0, keepdims=True)
        self.topic_dirs = basis[:, :G].T  # [G, H]
        self.common = basis[:, G]
        self.token_topic = rng.integers(0, G, self.V)
        noise = rng.standard_normal((self.V, H))
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        c = math.sqrt(1 - TOPIC_A**2 - TOPIC_B**2)
        emb = TOPIC_A * self.topic_dirs[self.token_topic] + TOPIC_B * self.common + c * noise
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        self.embeddings = (emb * math.sqrt(H)).astype(np.float32)  # [V, H]
        self.groups = np.full((cfg.n_layers, cfg.n_experts), -1, dtype=np.int32)
        for layer in range(cfg.dense_layers, cfg.n_layers):
            order = _rng(cfg.seed, "groups", layer).permutation(cfg.n_experts)
            self.groups[layer, order] = np.arange(cfg.n_experts) % G

    def router(self, layer: int) -> np.ndarray:
        """[E, H] router rows of a MoE layer (see module docstring)."""
        cfg, H, E = self.cfg, self.H, self.cfg.n_experts
        rng = _rng(cfg.seed, "router", layer)
        group = self.groups[layer]
        z_e = rng.standard_normal(E)
        z_g = rng.standard_normal(cfg.groups)
        bias = cfg.heat_skew * (HEAT_EXPERT * z_e + HEAT_GROUP * z_g[group])
        r = rng.standard_normal((E, H))
        if cfg.structure == "none":
            v = NONE_SCALE * r  # iid rows: logit = <v, x>/sqrt(H) ~ N(0, NONE_SCALE^2) as |x| = sqrt(H)
        else:
            r /= np.linalg.norm(r, axis=1, keepdims=True)
            v = (TOPIC_GAIN * cfg.strength / TOPIC_A) * self.topic_dirs[group] + INDIVIDUAL * math.sqrt(H) * r
        v = v + (bias / TOPIC_B)[:, None] * self.common[None, :]
        return (v / math.sqrt(H)).astype(np.float32)

    # tensor list
    def _dense(self, name: str, ne: tuple[int, ...], std: float, qtype: str | None = None) -> None:
        qt = GGMLQuantizationType[qtype or self.cfg.dense_type]
        self._add(name, ne, qt, std)

    def _add(self, name: str, ne, qt: GGMLQuantizationType, std: float, experts: int = 1) -> None:
        """A Gaussian (or fast-random) tensor, generated per expert / in row chunks."""
        cfg = self.cfg
        ne = tuple(int(n) for n in ne)
        rows_per_unit = int(np.prod(ne[1:], dtype=np.int64)) // experts  # rows of ne[0] per expert

        def chunks():
            if cfg.fast_random:  # random valid blocks, a different pool window per expert
                blocks_per_unit = ne[0] * rows_per_unit // GGML_QUANT_SIZES[qt][0]
                n_pool = self.pools.n_blocks(qt)
                base = int(_rng(cfg.seed, "offset", name).integers(0, n_pool))
                stride = _stride(n_pool)
                for e in range(experts):
                    yield from self.pools.stream(qt, std, base + e * stride, blocks_per_unit)
                return
            rng = _rng(cfg.seed, name)
            step = max(1, min(rows_per_unit, CHUNK_BYTES // (ne[0] * 4)))
            for _e in range(experts):
                for r0 in range(0, rows_per_unit, step):
                    n = min(step, rows_per_unit - r0)
                    x = rng.standard_normal((n, ne[0]), dtype=np.float32) * np.float32(std)
                    yield _encode(x, qt)

        self.tensors.append(_Tensor(name, ne, qt, chunks))

    def _matrix(self, name: str, ne: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        """A dense-type matrix computed by `make` (numpy shape = reversed ne)."""
        qt = GGMLQuantizationType[self.cfg.dense_type]
        self.tensors.append(_Tensor(name, ne, qt, lambda: iter([_encode(make().astype(np.float32), qt)])))

    def _context_attention(self, layer: int):
        """Per-head blocks of an attention that looks at recent tokens and adds their topics.

        q = k = a constant per-head vector (read off the common direction m that every token
        carries), so the score depends only on the distance i - j through RoPE: the sum of
        cos(theta_p * (i - j)) over the rotary pairs peaks at distance 0 and decays over the
        recent tokens (KERNEL = score at distance 0). v holds the topic coordinates of a token;
        o writes `context` times the attention-weighted topics of the context back into the
        residual stream, so routing depends on the token and on its recent context.
        Returns (q/k block [d, H], v block [d, H], o block [H, d]); see _context_norm.
        """
        cfg, H, d = self.cfg, self.H, self.cfg.head_dim
        G = min(cfg.groups, d)
        unit = np.full(d, 1 / math.sqrt(d))
        if cfg.arch in ("qwen3moe", "olmoe"):  # q/k RMSNorm: its weight (_context_norm) sets the scale
            qk = np.outer(unit, self.common) / TOPIC_B
        else:  # |q|^2 / sqrt(d) = KERNEL, with <m, x> = TOPIC_B * sqrt(H)
            qk = np.outer(unit, self.common) * math.sqrt(KERNEL * math.sqrt(d)) / (TOPIC_B * math.sqrt(H))
        # v: the token's topic coordinates (~ TOPIC_A * onehot) and a random projection of the
        # rest of it (so the context also moves which members of a group are picked)
        rng = _rng(cfg.seed, "context", layer)
        proj = rng.standard_normal((d - G, H)) / math.sqrt(H)
        v = np.concatenate([self.topic_dirs[:G], proj]) / math.sqrt(H)
        o = np.concatenate([self.topic_dirs[:G].T, proj.T * math.sqrt(H / (d - G or 1)) * CONTEXT_NOISE], axis=1)
        o *= cfg.context * math.sqrt(H) / cfg.n_heads
        return qk, v, o

    def _context_norm(self) -> float:
        """q/k norm weight of the context attention: |q|^2 / sqrt(d) = KERNEL after the norm."""
        return math.sqrt(KERNEL / math.sqrt(self.cfg.head_dim)) if self.cfg.arch in ("qwen3moe", "olmoe") else 1.0

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

    def _build(self) -> None:
        cfg, H, E = self.cfg, self.H, self.cfg.n_experts
        q_w, kv_w = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        ff, out_scale = cfg.expert_ff, 1.0 / math.sqrt(cfg.n_layers)
        et = GGMLQuantizationType[cfg.expert_type]
        self._const("token_embd.weight", self.embeddings)
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self._const(p + "attn_norm.weight", np.ones(H))
            ctx = cfg.context > 0
            if ctx:  # recency attention that carries the context's topics (module docstring)
                att = self._context_attention  # built when written, per layer (memory)
                self._matrix(p + "attn_q.weight", (H, q_w), lambda i=i: np.tile(att(i)[0], (cfg.n_heads, 1)))
                self._matrix(p + "attn_k.weight", (H, kv_w), lambda i=i: np.tile(att(i)[0], (cfg.n_kv_heads, 1)))
                self._matrix(p + "attn_v.weight", (H, kv_w), lambda i=i: np.tile(att(i)[1], (cfg.n_kv_heads, 1)))
            else:
                self._dense(p + "attn_q.weight", (H, q_w), GAIN / math.sqrt(H))
                self._dense(p + "attn_k.weight", (H, kv_w), GAIN / math.sqrt(H))
                self._dense(p + "attn_v.weight", (H, kv_w), GAIN / math.sqrt(H))
            if cfg.arch == "qwen2moe":
                self._const(p + "attn_q.bias", np.zeros(q_w))
                self._const(p + "attn_k.bias", np.zeros(kv_w))
                self._const(p + "attn_v.bias", np.zeros(kv_w))
            if ctx:
                self._matrix(p + "attn_output.weight", (q_w, H), lambda i=i: np.tile(att(i)[2], (1, cfg.n_heads)))
            else:
                self._dense(p + "attn_output.weight", (q_w, H), GAIN * ATTN_OUT_GAIN * out_scale / math.sqrt(q_w))
            qn = self._context_norm() if ctx else 1.0
            if cfg.arch == "qwen3moe":
                self._const(p + "attn_q_norm.weight", np.full(cfg.head_dim, qn))
                self._const(p + "attn_k_norm.weight", np.full(cfg.head_dim, qn))
            elif cfg.arch == "olmoe":
                self._const(p + "attn_q_norm.weight", np.full(q_w, qn))
                self._const(p + "attn_k_norm.weight", np.full(kv_w, qn))
            self._const(p + "ffn_norm.weight", np.ones(H))
            if i < cfg.dense_layers:
                self._dense(p + "ffn_gate.weight", (H, cfg.dense_ff), GAIN / math.sqrt(H))
                self._dense(p + "ffn_up.weight", (H, cfg.dense_ff), GAIN / math.sqrt(H))
                self._dense(p + "ffn_down.weight", (cfg.dense_ff, H), GAIN * out_scale / math.sqrt(cfg.dense_ff))
                continue
            self._const(p + "ffn_gate_inp.weight", lambda i=i: self.router(i), shape=(E, H))
            if cfg.probs_bias:
                self._const(p + "exp_probs_b.bias", _rng(cfg.seed, p + "exp_probs_b").standard_normal(E) * 0.1)
            self._add(p + "ffn_gate_exps.weight", (H, ff, E), et, GAIN / math.sqrt(H), experts=E)
            self._add(p + "ffn_up_exps.weight", (H, ff, E), et, GAIN / math.sqrt(H), experts=E)
            self._add(p + "ffn_down_exps.weight", (ff, H, E), et, GAIN * out_scale / math.sqrt(ff), experts=E)
            if cfg.expert_bias:
                for proj, width in (("gate", ff), ("up", ff), ("down", H)):
                    self._const(p + f"ffn_{proj}_exps.bias", shape=(E, width),
                                arr=lambda key=p + proj + "_bias", w=width: _rng(cfg.seed, key).standard_normal((E, w)) * 0.01)
            if cfg.arch == "qwen2moe":
                sf = cfg.shared_ff
                self._const(p + "ffn_gate_inp_shexp.weight", _rng(cfg.seed, p + "shexp_gate").standard_normal(H) / math.sqrt(H))
                self._dense(p + "ffn_gate_shexp.weight", (H, sf), GAIN / math.sqrt(H))
                self._dense(p + "ffn_up_shexp.weight", (H, sf), GAIN / math.sqrt(H))
                self._dense(p + "ffn_down_shexp.weight", (sf, H), GAIN * out_scale / math.sqrt(sf))
        self._const("output_norm.weight", np.ones(H))
        self._dense("output.weight", (H, self.V), 1.0 / math.sqrt(H))

    # metadata
    def kv(self) -> list[bytes]:
        cfg = self.cfg
        a = GGUF_ARCH[cfg.arch]
        U32, F32, STR, ARR, BOOL = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING,
                                    GGUFValueType.ARRAY, GGUFValueType.BOOL)
        ff_key = cfg.expert_ff if cfg.arch in ("olmoe", "mixtral") else cfg.dense_ff
        name = cfg.name or f"mbolt-synth-{cfg.preset or cfg.arch}"
        kvs = [
            encode_kv("general.architecture", STR, a),
            encode_kv("general.name", STR, name),
            encode_kv("general.alignment", U32, cfg.alignment),
            encode_kv("general.file_type", U32, FILE_TYPE[cfg.expert_type]),
            encode_kv(f"{a}.context_length", U32, cfg.context_length),
            encode_kv(f"{a}.embedding_length", U32, cfg.hidden),
            encode_kv(f"{a}.block_count", U32, cfg.n_layers),
            encode_kv(f"{a}.feed_forward_length", U32, ff_key),
            encode_kv(f"{a}.expert_feed_forward_length", U32, cfg.expert_ff),
            encode_kv(f"{a}.attention.head_count", U32, cfg.n_heads),
            encode_kv(f"{a}.attention.head_count_kv", U32, cfg.n_kv_heads),
            encode_kv(f"{a}.attention.key_length", U32, cfg.head_dim),
            encode_kv(f"{a}.attention.value_length", U32, cfg.head_dim),
            encode_kv(f"{a}.attention.layer_norm_rms_epsilon", F32, cfg.rms_eps),
            encode_kv(f"{a}.rope.freq_base", F32, cfg.rope_base),
            encode_kv(f"{a}.rope.dimension_count", U32, cfg.head_dim),
            encode_kv(f"{a}.expert_count", U32, cfg.n_experts),
            encode_kv(f"{a}.expert_used_count", U32, cfg.n_used),
            encode_kv(f"{a}.vocab_size", U32, self.V),
        ]
        if cfg.arch == "qwen2moe":
            kvs.append(encode_kv(f"{a}.expert_shared_feed_forward_length", U32, cfg.shared_ff))
        if cfg.dense_layers:
            kvs.append(encode_kv(f"{a}.leading_dense_block_count", U32, cfg.dense_layers))
        kvs += [
            encode_kv("tokenizer.ggml.model", STR, "gpt2"),
            encode_kv("tokenizer.ggml.pre", STR, "gpt-2"),
            encode_kv("tokenizer.ggml.tokens", ARR, self.tokens, GGUFValueType.STRING),
            encode_kv("tokenizer.ggml.token_type", ARR, self.token_types, GGUFValueType.INT32),
            encode_kv("tokenizer.ggml.merges", ARR, self.merges, GGUFValueType.STRING),
            encode_kv("tokenizer.ggml.bos_token_id", U32, self.bos),
            encode_kv("tokenizer.ggml.eos_token_id", U32, self.eos),
            encode_kv("tokenizer.ggml.add_bos_token", BOOL, False),
            encode_kv("tokenizer.ggml.add_eos_token", BOOL, False),
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


@dataclass
class SynthInfo:
    """What write_synth wrote (for --json and benchmarks)."""

    path: str
    bytes: int
    arch: str
    gguf_arch: str
    preset: str | None
    geometry: dict
    expert_type: str
    structure: str
    fast_random: bool
    n_tensors: int
    header_sha256: str
    fingerprint: str  # as mbolt.core.header.read_header computes it
    extra: dict = field(default_factory=dict)


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

    `progress(done_bytes, total_bytes)` is called after every chunk.
    """
    info = write_synth_info(path, cfg, force=force, progress=progress)
    return Path(info.path)


def write_synth_info(path: str | os.PathLike, cfg: SynthConfig, *, force: bool = True,
                     progress: Callable[[int, int], None] | None = None) -> SynthInfo:
    """write_synth, returning a SynthInfo summary."""
    cfg.validate()
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
    if cfg.arch == "qwen2moe":
        geometry["shared_ff"] = cfg.shared_ff
    geometry["n_groups"] = cfg.groups
    return SynthInfo(
        path=str(path), bytes=path.stat().st_size, arch=cfg.arch, gguf_arch=GGUF_ARCH[cfg.arch],
        preset=cfg.preset, geometry=geometry, expert_type=cfg.expert_type, structure=cfg.structure,
        fast_random=cfg.fast_random, n_tensors=len(model.tensors), header_sha256=sha,
        fingerprint=sha[:32],
        extra={"seed": cfg.seed, "strength": cfg.strength, "heat_skew": cfg.heat_skew, "context": cfg.context,
               **({"note": cfg.note} if cfg.note else {})},
    )


def config_dict(cfg: SynthConfig) -> dict:
    return dataclasses.asdict(cfg)
