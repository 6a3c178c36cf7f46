"""Mixtral = llama.cpp `llama` with expert tensors: normal (adjacent-pair) RoPE, optional
attention biases, softmax router with top-k weights renormalised to sum to 1."""

from mbolt.reference.model import Model


class Mixtral(Model):
    rope_mode = "norm"
    qk_norm = None
    norm_topk = True
