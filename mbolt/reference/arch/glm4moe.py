"""GLM-4.5/4.6/4.7 (llama.cpp `glm4moe`), the shape of most large MoEs: leading dense layers,
QKV biases, NeoX RoPE over the first rope.dimension_count dims of each head (partial rotary),
post_attention_norm before the FFN, a sigmoid router whose top-k is chosen on sigmoid + exp_probs_b
while the weights are the unbiased sigmoids (renormalised when expert_weights_norm, times
expert_weights_scale), and one ungated shared expert added to the routed output.

As llama.cpp: gating from `glm4moe.expert_gating_func` (sigmoid when absent, as its loader
defaults), normalisation from `glm4moe.expert_weights_norm` (false when absent)."""

import numpy as np
from gguf import Keys

from mbolt.reference.model import Model


class Glm4MoE(Model):
    rope_mode = "neox"
    qk_norm = None
    ffn_norm = "post_attention_norm.weight"

    def __init__(self, path, header, *args, **kw):
        arch = header.get(Keys.General.ARCHITECTURE)
        gating = header.get(Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch), 2)
        self.gating = {1: "softmax", 2: "sigmoid"}.get(int(gating), "sigmoid")
        self.norm_topk = bool(header.get(Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch), False))
        super().__init__(path, header, *args, **kw)
        if self.w.has("blk.0.attn_q_norm.weight") or any(self.w.has(f"blk.{i}.attn_q_norm.weight")
                                                          for i in range(self.hp.n_layers)):
            self.qk_norm = "head"  # GLM-4.5 (355B) has per-head q/k norms, Air does not

    def ffn(self, li: int, h: np.ndarray) -> np.ndarray:
        out = super().ffn(li, h)
        p = f"blk.{li}."
        if self.map.layers[li].dense or not self.w.has(p + "ffn_up_shexp.weight"):
            return out
        return out + self.dense_ffn(p + "ffn_", h, suffix="_shexp")  # routed + shared, as llama.cpp
