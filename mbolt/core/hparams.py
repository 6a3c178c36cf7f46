"""Hyperparameters against tensor shapes, checked when a model is opened (`moe_map`).

A metadata value that disagrees with the tensors (a flipped byte in `head_count_kv`, a vocabulary
of the wrong length) would otherwise surface deep inside an engine as a reshape error. Each check
runs only where the key and the tensor exist, in the form llama.cpp's loaders create the tensor
(`{n_embd, n_head * head_dim}` and so on), and names both in one line.
"""

from __future__ import annotations

import numpy as np

from mbolt.core.errors import MboltError


class HparamError(MboltError):
    """A hyperparameter disagrees with a tensor's shape: the file is not a usable model."""


def _int_or_list(v):
    if isinstance(v, (list, tuple, np.ndarray)):
        return [int(x) for x in v]
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else None


def _at(v, layer: int) -> int | None:
    if isinstance(v, list):
        return v[layer] if layer < len(v) else None
    return v


def check_hparams(header, arch: str, n_experts: int, n_layers: int) -> None:
    path = header.path

    def key(name: str):
        kv = header.kv.get(f"{arch}.{name}")
        return None if kv is None else _int_or_list(kv.value)

    def bad(k: str, v, t, why: str) -> HparamError:
        return HparamError(f"{path}: {k} = {v} disagrees with tensor {t.name} of shape {list(t.ne)} ({why})")

    hidden = key("embedding_length")
    emb = header.tensor("token_embd.weight")
    if emb is not None and len(emb.ne) == 2:
        if isinstance(hidden, int) and emb.ne[0] != hidden:
            raise bad(f"{arch}.embedding_length", hidden, emb, "its rows are the embedding width")
        tokens = header.kv.get("tokenizer.ggml.tokens")
        n_tok = len(tokens.value) if tokens is not None and hasattr(tokens.value, "__len__") else None
        if n_tok is not None and emb.ne[1] != n_tok:
            raise bad("tokenizer.ggml.tokens", f"{n_tok} tokens", emb, "one row per token")
        vocab = key("vocab_size")
        if isinstance(vocab, int) and emb.ne[1] != vocab:
            raise bad(f"{arch}.vocab_size", vocab, emb, "one row per token")
    n_head, n_kv = key("attention.head_count"), key("attention.head_count_kv")
    k_len, v_len = key("attention.key_length"), key("attention.value_length")
    ff = key("expert_feed_forward_length")
    for layer in range(n_layers):
        heads, kv_heads = _at(n_head, layer), _at(n_kv, layer)
        kl = k_len if isinstance(k_len, int) else (hidden // heads if isinstance(hidden, int) and heads else None)
        vl = v_len if isinstance(v_len, int) else kl
        t = header.tensor(f"blk.{layer}.attn_k.weight")
        if t is not None and kv_heads and kl and len(t.ne) == 2 and t.ne[1] != kv_heads * kl:
            raise bad(f"{arch}.attention.head_count_kv", n_kv, t, f"expected {kv_heads} heads x {kl}")
        t = header.tensor(f"blk.{layer}.attn_v.weight")
        if t is not None and kv_heads and vl and len(t.ne) == 2 and t.ne[1] != kv_heads * vl:
            raise bad(f"{arch}.attention.head_count_kv", n_kv, t, f"expected {kv_heads} heads x {vl}")
        t = header.tensor(f"blk.{layer}.attn_q.weight")
        # gated attention (qwen3next) puts a gate of the same width after the queries
        if t is not None and heads and kl and len(t.ne) == 2 and t.ne[1] not in (heads * kl, 2 * heads * kl):
            raise bad(f"{arch}.attention.head_count", n_head, t, f"expected {heads} heads x {kl}")
        t = header.tensor(f"blk.{layer}.attn_output.weight")
        standard = header.tensor(f"blk.{layer}.attn_v.weight") is not None  # not MLA (deepseek2's heads differ)
        if t is not None and standard and heads and vl and len(t.ne) == 2 and t.ne[0] != heads * vl:
            raise bad(f"{arch}.attention.head_count", n_head, t, f"its rows are {heads} heads x {vl}")
        t = header.tensor(f"blk.{layer}.attn_k.weight")
        if t is not None and isinstance(kv_heads, int) and (kv_heads < 1 or (heads and heads % kv_heads)):
            raise bad(f"{arch}.attention.head_count_kv", n_kv, t, f"{heads} query heads need a whole number of "
                      "query heads per key/value head")
        for norm in ("attn_k_norm", "attn_q_norm"):
            t = header.tensor(f"blk.{layer}.{norm}.weight")
            # per-head norms span one head (qwen3); olmoe's span every head
            if t is not None and kl and len(t.ne) == 1 and t.ne[0] % kl:
                raise bad(f"{arch}.attention.key_length", kl, t, "a norm over whole heads")
        t = header.tensor(f"blk.{layer}.ffn_gate_inp.weight")
        if t is not None and len(t.ne) == 2 and t.ne[1] != n_experts:
            raise bad(f"{arch}.expert_count", n_experts, t, "the router has one row per expert")
        for role in ("gate", "up"):
            t = header.tensor(f"blk.{layer}.ffn_{role}_exps.weight")
            if t is not None and isinstance(ff, int) and len(t.ne) == 3 and t.ne[1] != ff:
                raise bad(f"{arch}.expert_feed_forward_length", ff, t, "one row per expert FFN unit")
        t = header.tensor(f"blk.{layer}.ffn_down_exps.weight")
        if t is not None and isinstance(ff, int) and len(t.ne) == 3 and t.ne[0] != ff:
            raise bad(f"{arch}.expert_feed_forward_length", ff, t, "its rows are the expert FFN width")
