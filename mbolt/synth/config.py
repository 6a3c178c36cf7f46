"""What a synthetic model is: architectures, expert types, presets of public models, SynthConfig.

Each family is written with the tensor set and the metadata keys llama.cpp's loader for it
requires (src/models/<arch>.cpp of the build CI uses); `SYNTH_ARCHS` says what each one models.
`PRESETS` hold the real tensor shapes of public MoE models; `SynthConfig.from_preset` fills a
config from one (with overrides such as `n_layers` to scale it down).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from mbolt.core.errors import MboltError
from mbolt.synth.mixes import MIXES, mix_type

SYNTH_ARCHS = {
    "qwen3moe": "Qwen3-MoE: GQA attention with per-head q/k RMSNorm, softmax top-k router",
    "olmoe": "OLMoE: q/k RMSNorm over the full q/k width (needs kv heads == heads, heads x head_dim == hidden)",
    "mixtral": "Mixtral: llama architecture with expert_count (gguf arch 'llama')",
    "qwen2moe": "Qwen2-MoE: q/k/v biases, routed experts + shared expert with sigmoid shared gate "
                "(needs heads x head_dim == hidden)",
    "glm4moe": "GLM-4.5/4.6/4.7: leading dense layers, sigmoid router + exp_probs_b selection bias, "
               "normalised top-k, one ungated shared expert, q/k/v biases, post-attention norm",
    "deepseek2": "DeepSeek-V2/V3, Kimi-K2, GLM-5 (as deepseek2): MLA attention (q_a/q_b, kv_a_mqa, k_b/v_b), "
                 "leading dense layers, sigmoid router + exp_probs_b, shared expert",
    "gpt-oss": "gpt-oss: router bias, per-expert gate/up/down biases, attention sinks, sliding window "
               "on every other layer, SwiGLU-OAI experts, softmax over the selected experts",
    "qwen3next": "Qwen3-Next: hybrid of gated-delta-net linear attention (3 of 4 layers) and gated full "
                 "attention, 512-way routed experts + sigmoid-gated shared expert",
}
GGUF_ARCH = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "qwen2moe": "qwen2moe",
             "glm4moe": "glm4moe", "deepseek2": "deepseek2", "gpt-oss": "gpt-oss", "qwen3next": "qwen3next"}
# llama.cpp loaders that accept a fused blk.N.ffn_gate_up_exps.weight (create_tensor_gate_up_exps
# in src/models/<arch>.cpp); qwen3moe, glm4moe, gpt-oss and the others refuse it.
FUSED_GATE_UP_ARCHS = ("deepseek2", "qwen3next")
# Families with a shared expert whose FFN size is `n_shared * expert_ff` (llama.cpp derives it).
SHARED_BY_COUNT = ("glm4moe", "deepseek2")
# Families with a shared expert of size `shared_ff` and a sigmoid shared gate.
SHARED_GATED = ("qwen2moe", "qwen3next")

# Geometry of public models (HF config.json). Each is a dict of SynthConfig fields. Expert types
# are ones gguf-py can quantize; the real files are K-quant mixes: add --fast-random --type Q4_K_M
# --dense-type Q4_K_M for a Q4_K_M-like file. deepseek2 head_dim = qk_nope + qk_rope (key_length_mla).
PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(  # Qwen/Qwen3-30B-A3B
        arch="qwen3moe", n_layers=48, n_experts=128, n_used=8, hidden=2048, expert_ff=768,
        n_heads=32, n_kv_heads=4, head_dim=128, dense_ff=6144, rope_base=1e6, expert_type="Q4_0",
        context_length=40960,  # its max_position_embeddings: an agent's 8-20k-token prefix fits
        note="Qwen3-30B-A3B tensor shapes",
    ),
    "qwen3-next-80b-a3b": dict(  # Qwen/Qwen3-Next-80B-A3B-Instruct
        arch="qwen3next", n_layers=48, n_experts=512, n_used=10, hidden=2048, expert_ff=512,
        shared_ff=512, n_heads=16, n_kv_heads=2, head_dim=256, dense_ff=5120, rope_base=1e7,
        rope_dim=64, ssm_conv=4, ssm_k_heads=16, ssm_v_heads=32, ssm_head_dim=128, full_attn_every=4,
        expert_type="Q4_0", note="Qwen3-Next-80B-A3B tensor shapes (hybrid: 36 gated-delta-net + 12 full-attention layers)",
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
    "glm-4.5-air": dict(  # zai-org/GLM-4.5-Air
        arch="glm4moe", n_layers=46, dense_layers=1, n_experts=128, n_used=8, n_shared=1, hidden=4096,
        expert_ff=1408, dense_ff=10944, n_heads=96, n_kv_heads=8, head_dim=128, rope_dim=64,
        rope_base=1e6, weights_scale=1.0, expert_type="Q4_0",
        note="GLM-4.5-Air tensor shapes (its MTP layer is not written)",
    ),
    "deepseek-v3": dict(  # deepseek-ai/DeepSeek-V3
        arch="deepseek2", n_layers=61, dense_layers=3, n_experts=256, n_used=8, n_shared=1, hidden=7168,
        expert_ff=2048, dense_ff=18432, n_heads=128, n_kv_heads=1, q_lora_rank=1536, kv_lora_rank=512,
        head_dim=192, rope_dim=64, v_head_dim=128, rope_base=1e4, weights_scale=2.5, expert_type="Q4_0",
        note="DeepSeek-V3 tensor shapes (MLA; its expert groups n_group=8/topk_group=4 and MTP layer are not written)",
    ),
    "gpt-oss-20b": dict(  # openai/gpt-oss-20b
        arch="gpt-oss", n_layers=24, n_experts=32, n_used=4, hidden=2880, expert_ff=2880, n_heads=64,
        n_kv_heads=8, head_dim=64, dense_ff=2880, rope_base=150000.0, sliding_window=128,
        expert_type="MXFP4", note="gpt-oss-20b tensor shapes (YaRN rope scaling not written)",
    ),
    "glm-5.2": dict(  # GLM-5.2 routing geometry (its co-activation atlas: 75 MoE layers after 3 dense, 256 experts, k=8)
        arch="deepseek2", n_layers=78, dense_layers=3, n_experts=256, n_used=8, n_shared=1, hidden=512,
        expert_ff=256, dense_ff=1024, n_heads=8, n_kv_heads=1, q_lora_rank=256, kv_lora_rank=128,
        head_dim=64, rope_dim=32, v_head_dim=64, rope_base=1e6, weights_scale=2.5, expert_type="Q4_0",
        note="GLM-5.2 routing geometry (3 dense + 75 MoE layers, 256 routed + 1 shared expert, k=8, sigmoid + "
        "exp_probs_b) as deepseek2 MLA; slices scaled down (hidden 512, expert ff 256: ~4 GB at Q4_0/Q4_K, "
        "not the real 6144 x 2048); the DSA indexer and the MTP layer are not written",
    ),
}

QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")  # gguf-py quantizes these
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
K_I_TYPES = K_TYPES + ("IQ4_XS", "IQ4_NL", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS",
                       "IQ1_S")  # written as random valid blocks (fast_random) only
# Q4_K_M: llama-quantize's per-tensor mix (gguf/mixes.py), as an expert type and as a dense type
EXPERT_TYPES = ("F32", "F16", "BF16") + QUANT_TYPES + K_I_TYPES + MIXES
DENSE_TYPES = ("F32", "F16", "Q8_0") + K_TYPES + MIXES  # K-quants and mixes need fast_random
# llama_ftype (gguf.LlamaFileType) named after the expert type; mixes name the dominant type
FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
             "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23,
             "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ4_XS": 30, "BF16": 32, "MXFP4": 38, "Q4_K_M": 15}


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
    shared_ff: int = 64  # qwen2moe / qwen3next shared expert FFN size
    dense_ff: int = 128  # FFN size of dense layers (dense_layers > 0)
    expert_type: str = "F32"
    down_type: str = ""  # type of ffn_down_exps ("" = expert_type); Q4_K_M keeps down in Q6_K
    layer_types: str = ""  # per-layer expert types "0-2:Q6_K,5:Q5_K" (over expert_type)
    fused_gate_up: bool = False  # one ffn_gate_up_exps tensor per layer (llama.cpp: FUSED_GATE_UP_ARCHS only)
    dense_type: str = "F32"  # attention / dense FFN / shared expert / output matrices
    seed: int = 0
    structure: str = "planted"  # "planted" | "none"
    n_groups: int = 0  # 0 = auto: max(2, n_experts // (2 * n_used))
    strength: float = 0.5
    heat_skew: float = 0.5
    context: float = 0.0  # > 0: attention adds recent tokens' topics (context-dependent routing)
    routing_like: object = None  # a RoutingTarget (gguf/routing_like.py): plant a profile's routing instead
    preset: str | None = None
    fast_random: bool = False
    # --routing-like: the attention of every layer past the first is all zeros; True writes those
    # matrices in the dense type (a Q4_K_M's Q4_K, Q6_K, ...: zero blocks are exact in every type)
    # as a real file types them, instead of F16 (the bytes a real file's attention costs)
    typed_zero_attention: bool = False
    probs_bias: bool = False  # exp_probs_b on families that do not have it (llama.cpp refuses it)
    expert_bias: bool = False  # ffn_*_exps.bias on families that do not have it (llama.cpp refuses it)
    dense_layers: int = 0
    n_shared: int = 1  # glm4moe / deepseek2: shared experts (FFN = n_shared * expert_ff)
    rope_dim: int = 0  # rotary dims (0 = head_dim; deepseek2: head_dim / 2); deepseek2: the qk_rope part
    q_lora_rank: int = 32  # deepseek2 MLA (0 = plain attn_q, as DeepSeek-V2-Lite)
    kv_lora_rank: int = 32  # deepseek2 MLA
    v_head_dim: int = 0  # deepseek2 MLA value head size (0 = head_dim)
    # scale of the routed experts' output (ffn_down_exps) over the default: at 1 a wrong expert
    # byte barely moves the logits (experts are ~5% of them); tests that compare predictions use
    # more, so their predictions depend on every expert byte
    expert_gain: float = 1.0
    # the routed tensors' order in each block: "use" gate, up, down (llama.cpp's matmul order);
    # "converter" down, gate, up (llama.cpp's convert_hf_to_gguf merges them so: real files)
    tensor_order: str = "use"
    weights_scale: float = 1.0  # glm4moe / deepseek2 expert_weights_scale (routed_scaling_factor)
    sliding_window: int = 128  # gpt-oss
    ssm_conv: int = 4  # qwen3next gated delta net: conv kernel
    ssm_k_heads: int = 2  # linear-attention key heads
    ssm_v_heads: int = 4  # linear-attention value heads (a multiple of the key heads)
    ssm_head_dim: int = 16  # linear-attention head size (key = value)
    full_attn_every: int = 4  # qwen3next: every Nth layer is full attention
    context_length: int = 4096
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    alignment: int = 32
    vocab: str = ""  # a GGUF whose tokenizer.* keys the model takes (a real vocabulary); "" = byte-level gpt2
    note: str = ""
    name: str = ""

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "SynthConfig":
        if preset not in PRESETS:
            raise MboltError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        fields = dict(PRESETS[preset])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        if fields.get("dense_layers", 0) >= fields["n_layers"]:  # --layers below a preset's dense lead
            fields["dense_layers"] = max(0, fields["n_layers"] - 1)
        return cls(preset=preset, **fields)

    @property
    def groups(self) -> int:
        if self.n_groups:
            return self.n_groups
        return min(self.n_experts, max(2, self.n_experts // (2 * self.n_used)))

    @property
    def n_rot(self) -> int:
        return self.rope_dim or (self.head_dim // 2 if self.arch == "deepseek2" else self.head_dim)

    @property
    def gguf_arch(self) -> str:
        return GGUF_ARCH[self.arch]

    def is_recurrent(self, layer: int) -> bool:
        """qwen3next: a gated-delta-net layer (llama.cpp's rule for full_attention_interval)."""
        return self.arch == "qwen3next" and (layer + 1) % self.full_attn_every != 0

    def expert_types(self, layer: int) -> dict[str, str]:
        """{projection: ggml type name} of a MoE layer's routed experts (gate, up, down); a mix
        (Q4_K_M) resolves to the type llama-quantize gives that tensor of that layer."""
        base = self.expert_type
        for part in filter(None, self.layer_types.split(",")):
            span, _, t = part.partition(":")
            lo, _, hi = span.partition("-")
            if int(lo) <= layer <= int(hi or lo):
                base = t.upper()
        down = self.down_type.upper() or base

        def resolve(t, proj, ne0):
            if t not in MIXES:
                return t
            return mix_type(t, f"blk.{layer}.ffn_{proj}_exps.weight", ne0, self.n_layers, self.n_experts)

        gate = resolve(base, "gate", self.hidden)
        return {"gate": gate, "up": gate, "down": resolve(down, "down", self.expert_ff)}

    def validate(self) -> None:
        def bad(msg):
            raise MboltError(f"synth: {msg}")

        if self.arch not in SYNTH_ARCHS:
            bad(f"unknown arch {self.arch!r} (known: {', '.join(SYNTH_ARCHS)})")
        try:
            types = {t for i in range(self.n_layers) for t in self.expert_types(i).values()}
        except ValueError:
            bad(f"layer types: expected 'L:TYPE' or 'L-M:TYPE' items separated by commas, got {self.layer_types!r}")
        for t in sorted(types):
            if t not in EXPERT_TYPES:
                bad(f"unknown expert type {t!r} (known: {', '.join(EXPERT_TYPES)})")
            if t in K_I_TYPES and not self.fast_random:
                bad(f"expert type {t} needs --fast-random (gguf-py has no quantizer for it)")
        if self.dense_type not in DENSE_TYPES:
            bad(f"dense type must be one of {', '.join(DENSE_TYPES)}, got {self.dense_type!r}")
        if self.dense_type in K_TYPES + MIXES and not self.fast_random:
            bad(f"dense type {self.dense_type} needs --fast-random (gguf-py has no quantizer for it)")
        if self.structure not in ("planted", "none"):
            bad(f"structure must be 'planted' or 'none', got {self.structure!r}")
        if self.tensor_order not in ("use", "converter"):
            bad(f"tensor order must be 'use' or 'converter', got {self.tensor_order!r}")
        for name in ("n_layers", "n_experts", "n_used", "hidden", "expert_ff", "n_heads",
                     "n_kv_heads", "head_dim", "shared_ff", "dense_ff", "context_length", "n_shared"):
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
        if self.head_dim % 2 or self.n_rot % 2 or self.n_rot > self.head_dim:
            bad(f"head_dim ({self.head_dim}) and rope dims ({self.n_rot}) must be even, rope dims <= head_dim")
        if self.arch == "olmoe" and self.n_kv_heads != self.n_heads:
            bad("olmoe needs kv heads == heads (its k norm spans the full width)")
        if self.arch in ("olmoe", "qwen2moe") and self.n_heads * self.head_dim != self.hidden:
            bad(f"{self.arch} needs heads x head_dim == hidden (llama.cpp checks it): "
                f"{self.n_heads} x {self.head_dim} != {self.hidden}")
        if self.arch == "deepseek2" and self.n_kv_heads != 1:
            bad(f"deepseek2 (MLA) has one latent kv head: kv heads must be 1, got {self.n_kv_heads}")
        if self.arch == "deepseek2" and (self.n_rot >= self.head_dim or self.kv_lora_rank < 1):
            bad(f"deepseek2 needs rope dims < head_dim (a non-rotary part) and kv_lora_rank >= 1, "
                f"got rope {self.n_rot}, head_dim {self.head_dim}, kv_lora_rank {self.kv_lora_rank}")
        if self.arch == "qwen3next" and (self.ssm_v_heads % self.ssm_k_heads or self.full_attn_every < 2):
            bad(f"qwen3next needs value heads ({self.ssm_v_heads}) a multiple of key heads ({self.ssm_k_heads}) "
                f"and full_attn_every >= 2 (got {self.full_attn_every})")
        if self.arch == "qwen3next" and self.n_layers < self.full_attn_every:
            # llama.cpp aborts (GGML_ASSERT(buffer)) on a hybrid with no attention layer: empty KV cache
            bad(f"qwen3next: {self.n_layers} layers have no full-attention layer (every "
                f"{self.full_attn_every}th is one); use more layers")
        if not 1 <= self.groups <= self.n_experts:
            bad(f"groups must be in 1..{self.n_experts}, got {self.groups}")
        if not 0.0 <= self.strength <= 1.0:
            bad(f"strength must be in [0, 1], got {self.strength}")
        if self.context < 0:
            bad(f"context must be >= 0, got {self.context}")
        if self.routing_like is not None:
            from mbolt.synth.routing_like import check

            check(self)
        if self.context and self.arch not in ("qwen3moe", "olmoe", "mixtral", "qwen2moe"):
            bad(f"context attention is built for plain GQA attention (qwen3moe, olmoe, mixtral, qwen2moe), not {self.arch}")
        if self.heat_skew < 0:
            bad(f"heat skew must be >= 0, got {self.heat_skew}")
        if self.alignment < 8 or self.alignment & (self.alignment - 1):
            bad(f"alignment must be a power of two >= 8, got {self.alignment}")
        for i in range(self.dense_layers, self.n_layers):
            for proj, t in self.expert_types(i).items():
                block = GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]
                for what, n in (("hidden", self.hidden), ("expert_ff", self.expert_ff)):
                    if n % block:
                        bad(f"{what} ({n}) must be a multiple of the {t} block ({block}) "
                            f"({proj} experts of layer {i})")


def tiny(arch: str = "qwen3moe", **overrides) -> SynthConfig:
    """A few-MB model of `arch` that llama.cpp loads: the smallest geometry each loader accepts
    (4 layers x 8 experts, k=2, hidden 64; hidden and expert FFN 256 when an expert type has
    256-element super-blocks). Overrides are SynthConfig fields."""
    kw: dict = dict(arch=arch, n_layers=4, n_experts=8, n_used=2, hidden=64, expert_ff=32, n_heads=4,
                    n_kv_heads=2, head_dim=16)
    if arch == "olmoe":
        kw["n_kv_heads"] = 4
    if arch in ("glm4moe", "deepseek2"):
        kw.update(dense_layers=1, rope_dim=8)  # GLM rotates half of each head, DeepSeek a part
    if arch == "qwen3next":
        kw.update(full_attn_every=2)  # layers 0, 2 linear attention, 1, 3 full attention
    if arch == "deepseek2":
        kw.update(n_kv_heads=1, head_dim=24, v_head_dim=16, q_lora_rank=32, kv_lora_rank=32)
    kw.update(overrides)
    probe = SynthConfig(**kw)
    types = {t for i in range(probe.n_layers) for t in probe.expert_types(i).values() if t in EXPERT_TYPES}
    block = max((GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] for t in types), default=1)
    for what in ("hidden", "expert_ff"):
        if what not in overrides and kw[what] % block:
            kw[what] = block
    if "hidden" not in overrides and kw["hidden"] != 64 and arch in ("olmoe", "qwen2moe"):
        kw["head_dim"] = kw["hidden"] // kw["n_heads"]
    return SynthConfig(**kw)


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
