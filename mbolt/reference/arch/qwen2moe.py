"""Qwen2-MoE (llama.cpp `qwen2moe`): QKV biases, NeoX RoPE, softmax router with un-normalised
top-k weights, plus a shared SwiGLU expert scaled by sigmoid(ffn_gate_inp_shexp . x)."""

import numpy as np

from mbolt.reference.blocks import silu
from mbolt.reference.model import Model


class Qwen2MoE(Model):
    rope_mode = "neox"
    qk_norm = None
    norm_topk = False

    def ffn(self, li: int, h: np.ndarray) -> np.ndarray:
        out = super().ffn(li, h)
        p = f"blk.{li}."
        if not self.w.has(p + "ffn_up_shexp.weight"):
            return out
        g = self.lin(p + "ffn_gate_inp_shexp.weight", h).reshape(-1, 1)  # [n, 1]
        gate = silu(g) / g  # llama.cpp computes the sigmoid as silu(x) / x
        shared = self.dense_ffn(p + "ffn_", h, suffix="_shexp")
        return out + shared * gate
