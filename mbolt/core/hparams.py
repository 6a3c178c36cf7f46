"""The numbers that shape a model's tensors, read once as llama.cpp reads them and checked against
the tensors when the model is opened (`moe_map`, which every command that reads a model calls),
before any forward pass.

A metadata value that disagrees with the tensors would otherwise surface deep inside an engine as
a reshape error. Two ways a byte breaks one: in the value (`head_count_kv` 2 becomes 3), or in
the name, which leaves the key absent and llama.cpp's default in its place (`head_count_kv`
becomes `head_count`'s 4). So `shape_numbers` resolves each key with llama.cpp's default
(llama-model.cpp's load_hparams: head_count_kv = head_count; key_length = value_length =
embedding_length / head_count), `check_hparams` holds every number to the tensors it sizes, in
the form llama.cpp's loaders create them (`{n_embd, n_head * head_dim}` and so on), and a
mismatch is one line naming the key and the tensor. The reference engine takes its numbers from
the same `shape_numbers`, so what it reshapes by is what was checked.

A number is checked only where its tensor exists: families whose attention has other tensors
(MLA, linear attention) keep their own forms, which llama.cpp checks when it loads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import Keys

from mbolt.core.checks import MAX_LAYERS, as_int
from mbolt.core.errors import MboltError


class HparamError(MboltError):
    """A hyperparameter disagrees with a tensor's shape: the file is not a usable model."""


@dataclass
class ShapeNumbers:
    """The hyperparameters that size tensors, resolved; None where the file does not say and
    llama.cpp has no default. `said[name]` is how a value was found, for messages: the key, or
    "the key is absent: <default>"."""

    arch: str
    n_layers: int  # {arch}.block_count (core.checks.n_layers_of)
    n_experts: int  # {arch}.expert_count
    n_used: int  # {arch}.expert_used_count
    hidden: int | None  # embedding_length
    heads: list[int] | None  # attention.head_count, per layer (one value or an array)
    kv_heads: list[int] | None  # attention.head_count_kv, per layer; default: heads
    key_length: int | None  # attention.key_length; default: hidden // heads of layer 0
    value_length: int | None  # attention.value_length; default: as key_length
    expert_ff: int | None  # expert_feed_forward_length
    vocab_size: int | None  # vocab_size
    n_tokens: int | None  # the length of tokenizer.ggml.tokens
    said: dict[str, str]

    def uniform(self, name: str, path) -> int | None:
        """A per-layer number that one value must describe (the reference engine's attention)."""
        v = getattr(self, name)
        if v is None or not isinstance(v, list):
            return v
        if len(set(v)) > 1:
            raise MboltError(f"{path}: {self.said[name]} differs between layers ({v[:4]}...): the reference engine "
                             "needs one value")
        return v[0] if v else None


def _read(header, key: str, n_layers: int, per_layer: bool = False):
    """An integer key as an int (or, per_layer, a list of n_layers ints); None when absent. A
    string, float, boolean or wrong-length array is refused naming the key."""
    kv = header.kv.get(key)
    if kv is None:
        return None
    where = f"{header.path}: {key}"
    v = kv.value
    if per_layer and isinstance(v, (list, tuple, np.ndarray)):
        if len(v) != n_layers:
            raise MboltError(f"{where}: has {len(v)} values, expected one per layer ({n_layers})")
        return [as_int(x, where) for x in v]
    v = as_int(v, where)
    if v < 0:
        raise MboltError(f"{where}: is {v}, expected a count >= 0")
    return [v] * n_layers if per_layer else v


def shape_numbers(header, arch: str, n_experts: int, n_used: int, n_layers: int) -> ShapeNumbers:
    """The tensor-shaping numbers of a model, with llama.cpp's defaults for the absent ones."""
    LLM, Att = Keys.LLM, Keys.Attention
    keys = {name: template.format(arch=arch) for name, template in (
        ("hidden", LLM.EMBEDDING_LENGTH), ("heads", Att.HEAD_COUNT), ("kv_heads", Att.HEAD_COUNT_KV),
        ("key_length", Att.KEY_LENGTH), ("value_length", Att.VALUE_LENGTH),
        ("expert_ff", LLM.EXPERT_FEED_FORWARD_LENGTH), ("vocab_size", LLM.VOCAB_SIZE),
        ("n_tokens", Keys.Tokenizer.LIST), ("n_layers", LLM.BLOCK_COUNT), ("n_experts", LLM.EXPERT_COUNT))}
    said = dict(keys)

    def key(name, per_layer=False):
        return _read(header, keys[name], n_layers, per_layer)

    hidden, heads = key("hidden"), key("heads", per_layer=True)
    kv_heads = key("kv_heads", per_layer=True)
    if kv_heads is None and heads is not None:
        kv_heads = list(heads)
        said["kv_heads"] += " (absent, so head_count's)"
    key_length, value_length = key("key_length"), key("value_length")
    if hidden is not None and heads and heads[0]:
        for name in ("key_length", "value_length"):
            if (key_length if name == "key_length" else value_length) is None:
                said[name] += " (absent, so embedding_length / head_count)"
        key_length = hidden // heads[0] if key_length is None else key_length
        value_length = hidden // heads[0] if value_length is None else value_length
    tokens = header.kv.get(Keys.Tokenizer.LIST)
    n_tokens = len(tokens.value) if tokens is not None and isinstance(tokens.value, (list, np.ndarray)) else None
    return ShapeNumbers(arch, n_layers, n_experts, n_used, hidden, heads, kv_heads, key_length, value_length,
                        key("expert_ff"), key("vocab_size"), n_tokens, said)


def check_hparams(header, arch: str, n_experts: int, n_layers: int, n_used: int = 1) -> ShapeNumbers:
    """Every tensor-shaping number of the model against the tensors it sizes; HparamError names
    the first that disagrees (the key and the tensor). Returns the numbers."""
    s = shape_numbers(header, arch, n_experts, n_used, n_layers)
    path = header.path

    def bad(name: str, v, t, why: str) -> HparamError:
        return HparamError(f"{path}: {s.said[name]} = {v} disagrees with tensor {t.name} of shape {list(t.ne)} "
                           f"({why})")

    def tensor(name: str, dims: int):
        t = header.tensor(name)
        return t if t is not None and len(t.ne) == dims else None

    _check_layers(header, s)
    emb = tensor("token_embd.weight", 2)
    if emb is not None:
        if s.hidden is not None and emb.ne[0] != s.hidden:
            raise bad("hidden", s.hidden, emb, "its rows are the embedding width")
        if s.n_tokens is not None and emb.ne[1] != s.n_tokens:
            raise bad("n_tokens", f"{s.n_tokens} tokens", emb, "one row per token")
        if s.vocab_size is not None and emb.ne[1] != s.vocab_size:
            raise bad("vocab_size", s.vocab_size, emb, "one row per token")
    out = tensor("output.weight", 2)
    if out is not None and emb is not None and out.ne[1] != emb.ne[1]:
        raise HparamError(f"{path}: tensor {out.name} of shape {list(out.ne)} disagrees with {emb.name} of shape "
                          f"{list(emb.ne)} (one row per token in both)")
    kl, vl = s.key_length, s.value_length
    for layer in range(n_layers):
        p = f"blk.{layer}."
        heads = s.heads[layer] if s.heads else None
        kv_heads = s.kv_heads[layer] if s.kv_heads else None
        q, o = tensor(p + "attn_q.weight", 2), tensor(p + "attn_output.weight", 2)
        if o is not None and header.tensor(p + "attn_v.weight") is None:
            o = None  # MLA (deepseek2): its output's width is not heads x value_length
        # gated attention (qwen3next) puts a gate of the same width after the queries
        q_agrees = q is None or None in (heads, kl) or q.ne[1] in (heads * kl, 2 * heads * kl)
        o_agrees = o is None or None in (heads, vl) or o.ne[0] == heads * vl
        # where one tensor disagrees and the other agrees, the head count is right: the head size
        # is the number at fault; where both disagree, the head count
        if not q_agrees:
            size = o is not None and o_agrees
            raise bad("key_length" if size else "heads", kl if size else heads, q, f"expected {heads} heads x {kl}")
        if not o_agrees:
            size = q is not None
            raise bad("value_length" if size else "heads", vl if size else heads, o,
                      f"its rows are {heads} heads x {vl}")
        # keys and values: the queries and the output agree with the head count and sizes, so a
        # disagreement here is the KV head count's
        for name, length in (("attn_k", kl), ("attn_v", vl)):
            t = tensor(p + name + ".weight", 2)
            if t is None or kv_heads is None or length is None:
                continue
            if kv_heads < 1 or (heads and heads % kv_heads):
                raise bad("kv_heads", kv_heads, t, f"{heads} query heads need a whole number of query heads per "
                          "key/value head")
            if t.ne[1] != kv_heads * length:
                raise bad("kv_heads", kv_heads, t, f"expected {kv_heads} heads x {length}")
        for norm in ("attn_k_norm", "attn_q_norm"):
            t = tensor(p + norm + ".weight", 1)
            # per-head norms span one head (qwen3); olmoe's span every head
            if t is not None and kl is not None and (kl < 1 or t.ne[0] % kl):
                raise bad("key_length", kl, t, "a norm over whole heads")
        _check_experts(s, header, p, bad)
    return s


def _check_experts(s: ShapeNumbers, header, p: str, bad) -> None:
    t = header.tensor(p + "ffn_gate_inp.weight")
    if t is not None and len(t.ne) == 2 and t.ne[1] != s.n_experts:
        raise bad("n_experts", s.n_experts, t, "the router has one row per expert")
    for role, units in (("gate", 1), ("up", 1), ("down", 1), ("gate_up", 2)):
        t = header.tensor(f"{p}ffn_{role}_exps.weight")
        if t is None or len(t.ne) != 3:
            continue
        ff_dim, hidden_dim = (0, 1) if role == "down" else (1, 0)
        if t.ne[2] != s.n_experts:
            raise bad("n_experts", s.n_experts, t, "the experts are its outermost dimension")
        if s.expert_ff is not None and t.ne[ff_dim] != units * s.expert_ff:
            raise bad("expert_ff", s.expert_ff, t, "its rows are the expert FFN width" if ff_dim == 0 else
                      f"{'two' if units == 2 else 'one'} row{'s' if units == 2 else ''} per expert FFN unit")
        if s.hidden is not None and t.ne[hidden_dim] != s.hidden:
            raise bad("hidden", s.hidden, t, "the experts read and write the embedding width")


def _check_layers(header, s: ShapeNumbers) -> None:
    """block_count against the layers the tensors hold: core.checks.n_layers_of refuses a tensor
    past it; a layer with no tensor at all is a count too high (llama.cpp needs every layer's)."""
    key = Keys.LLM.BLOCK_COUNT.format(arch=s.arch)
    kv = header.kv.get(key)
    if kv is None or not 0 < s.n_layers <= MAX_LAYERS:
        return
    seen = set()
    for t in header.tensors:
        if t.name.startswith("blk."):
            head = t.name.split(".", 2)[1]
            if head.isdigit():
                seen.add(int(head))
    missing = next((i for i in range(s.n_layers) if i not in seen), None)
    if missing is not None:
        last = max(seen, default=None)
        shown = f"the last layer with tensors is blk.{last}" if last is not None else "no blk.N tensors"
        raise HparamError(f"{header.path}: {key} = {s.n_layers} disagrees with the tensors: layer "
                          f"{missing} has none ({shown})")
