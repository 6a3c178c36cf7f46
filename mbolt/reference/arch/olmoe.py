"""OLMoE (llama.cpp `olmoe`): RMSNorm over the whole Q and K projections (not per head), NeoX
RoPE, softmax router with un-normalised top-k weights, SwiGLU experts."""

from mbolt.reference.model import Model


class OLMoE(Model):
    rope_mode = "neox"
    qk_norm = "full"
    norm_topk = False
