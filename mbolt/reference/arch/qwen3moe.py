"""Qwen3-MoE (llama.cpp `qwen3moe`): per-head QK RMSNorm before NeoX RoPE, softmax router,
top-k weights renormalised to sum to 1, SwiGLU experts, no shared expert."""

from mbolt.reference.model import Model


class Qwen3MoE(Model):
    rope_mode = "neox"
    qk_norm = "head"
    norm_topk = True
