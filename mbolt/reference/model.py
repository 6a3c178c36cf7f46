"""The reference engine's model: hyperparameters, weights, and the MoE decoder shared by every arch.

`load_model(path, route="file"|"map", expert_source=None)` (engine/arch) reads the header, picks the
architecture module (engine/arch/*.py) and returns a `Model`. Non-expert weights are
dequantized once and cached; routed experts are fetched per forward through `expert_source`
(by ORIGINAL expert id) and dequantized per fetch, since they are what gets streamed.

Permutation invariance by construction: router logits are computed row by row (a row's value
does not depend on where the row sits), then placed in ORIGINAL-id order; the softmax sums in
that order, top-k ties break by original id, and expert outputs are summed in rank order. So a
reordered file gives bit-identical logits and the same routing (as original ids).
  route="file": the router rows in the file are at positions (as `mbolt reorder` writes them);
                position p is mapped to original id perm[l, p].
  route="map":  the router rows are in original order (untouched); only the expert slices moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, Keys

from mbolt.reference.blocks import KVCache, RopeCache, apply_rope, attention, rms_norm, sigmoid, silu, softmax
from mbolt.reference.quant import check_supported, dequantize, q8_1_correction, round_activations
from mbolt.reference.source import MmapExpertSource
from mbolt.core.routemap import RouteMap
from mbolt.core.checks import MAX_LAYERS, check_range
from mbolt.core.errors import MboltError
from mbolt.core.hparams import ShapeNumbers
from mbolt.core.header import GGUFHeader, MappedFile
from mbolt.core.moe_map import MoeMap

F32 = np.float32


@dataclass
class HParams:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_rot: int
    rope_base: float
    rms_eps: float
    n_experts: int
    n_used: int
    n_vocab: int
    weights_scale: float = 0.0
    attn_scale: float = 0.0  # 0 -> 1/sqrt(head_dim)

    @classmethod
    def from_header(cls, h: GGUFHeader, s: ShapeNumbers, n_vocab: int) -> "HParams":
        """The tensor-shaping numbers as core.hparams resolved them and checked them against the
        tensors when the model was opened (one the file lacks is refused here), the rest (rope,
        norm, scales) read with llama.cpp's defaults."""
        arch = s.arch

        def n(name: str, lo=1, hi=1 << 20) -> int:
            v = s.uniform(name, h.path)
            if v is None:
                raise MboltError(f"{h.path}: missing metadata {s.said[name]}")
            return check_range(v, f"{h.path}: {s.said[name]}", lo, hi)

        def f(template, default):
            key = template.format(arch=arch)
            v = h.get(key, default)
            if isinstance(v, (bool, str, np.ndarray, list)) or not np.isfinite(v):
                raise MboltError(f"{h.path}: {key} is {v!r:.40}, expected a number")
            return float(v)

        hidden = n("hidden")
        n_heads = n("heads", hi=hidden)
        hd = n("key_length")
        if n("value_length") != hd:
            raise MboltError(f"{h.path}: {s.said['value_length']} differs from {s.said['key_length']}: the reference "
                             "engine needs one head size")
        rot_key = Keys.Rope.DIMENSION_COUNT.format(arch=arch)
        n_rot = h.get(rot_key, hd)
        return cls(
            arch=arch, n_layers=n("n_layers", hi=MAX_LAYERS), hidden=hidden, n_heads=n_heads,
            n_kv_heads=n("kv_heads", hi=n_heads), head_dim=hd,
            n_rot=check_range(n_rot, f"{h.path}: {rot_key}", 0, hd),
            rope_base=f(Keys.Rope.FREQ_BASE, 10000.0),
            rms_eps=f(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6),
            n_experts=s.n_experts, n_used=s.n_used, n_vocab=n_vocab,
            weights_scale=f(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0),
            attn_scale=f(Keys.Attention.SCALE, 0.0),
        )


class Weights:
    """Non-expert tensors of a GGUF, dequantized to float32 on first use and cached."""

    def __init__(self, header: GGUFHeader):
        self.header = header
        self.files = [MappedFile(p) for p in header.paths]  # one map per file (the shards of a split set)
        self.bufs = [f.buf for f in self.files]
        self._cache: dict[str, tuple[np.ndarray, T]] = {}

    def has(self, name: str) -> bool:
        return self.header.tensor(name) is not None

    def info(self, name: str):
        t = self.header.tensor(name)
        if t is None:
            raise MboltError(f"{self.header.path}: missing tensor {name}")
        return t

    def raw(self, name: str) -> np.ndarray:
        t = self.info(name)
        return self.bufs[t.file][t.data_offset: t.data_offset + t.nbytes]

    def get(self, name: str) -> np.ndarray:
        return self.get_typed(name)[0]

    def get_typed(self, name: str) -> tuple[np.ndarray, T]:
        hit = self._cache.get(name)
        if hit is None:
            t = self.info(name)
            shape = tuple(reversed(t.ne))
            hit = (dequantize(self.raw(name), t.type, shape, name).astype(F32, copy=False), t.type)
            self._cache[name] = hit
        return hit

    def opt(self, name: str) -> np.ndarray | None:
        return self.get(name) if self.has(name) else None


def linear(x: np.ndarray, w: np.ndarray, wtype: T, bias: np.ndarray | None = None) -> np.ndarray:
    """x [n, in] @ w[out, in].T with llama.cpp's activation rounding for the weight type."""
    y = round_activations(x, wtype) @ w.T
    return y + bias if bias is not None else y


@dataclass
class Routing:
    experts: np.ndarray  # int32 [n_tok, k] ORIGINAL expert ids, rank order
    weights: np.ndarray  # float32 [n_tok, k] combine weights (after normalisation/scale)


@dataclass
class ExpertStats:
    fetches: int = 0
    experts: int = 0
    bytes: int = 0


class Model:
    """An MoE decoder. Arch modules subclass it and set the class attributes below."""

    rope_mode = "neox"  # "neox" (rotate halves) or "norm" (rotate adjacent pairs)
    qk_norm: str | None = None  # "head" (per head, qwen3) or "full" (whole q/k, olmoe)
    norm_topk = False  # renormalise the top-k weights to sum to 1
    gating = "softmax"  # router probabilities: "softmax" over the experts or "sigmoid" per expert
    ffn_norm = "ffn_norm.weight"  # the pre-FFN norm (glm4moe: post_attention_norm.weight)

    def __init__(self, path: Path, header: GGUFHeader, mmap_: MoeMap, hp: HParams, routes: RouteMap,
                 route: str, expert_source):
        self.path, self.header, self.map, self.hp, self.routes = path, header, mmap_, hp, routes
        self.route = route
        self.w = Weights(header)
        self.source = expert_source if expert_source is not None else MmapExpertSource(mmap_)
        self.rope = RopeCache(hp.n_rot, hp.rope_base)
        self.last_routing: list[Routing | None] = [None] * hp.n_layers
        self.stats = ExpertStats()
        self._check_types()

    # ---- setup ----

    def _check_types(self) -> None:
        for t in self.header.tensors:
            if t.name.endswith(".ffn_exps_packed"):  # packed layout blob (I8): its roles are checked below
                continue
            check_supported(t.type, t.name)
        for layer in self.map.layers:  # virtual tensors inside packed blobs
            for w in layer.weights:
                if w.container:
                    check_supported(T[w.type], w.name)

    @property
    def n_layers(self) -> int:
        return self.hp.n_layers

    def new_cache(self) -> KVCache:
        return KVCache(self.hp.n_layers)

    # ---- forward ----

    def forward(self, token_ids, cache: KVCache | None = None, all_logits: bool = False) -> np.ndarray:
        """Run tokens at positions cache.n.. ; returns logits of the last token [n_vocab]
        (or of every token [n_tok, n_vocab] with all_logits). Routing -> self.last_routing."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise MboltError("forward: no tokens")
        if ids.min() < 0 or ids.max() >= self.hp.n_vocab:
            raise MboltError(f"forward: token id out of range 0..{self.hp.n_vocab - 1}")
        if cache is None:
            cache = self.new_cache()
        start = cache.n
        positions = np.arange(start, start + ids.size)
        x = self.embed(ids)
        for li in range(self.hp.n_layers):
            x = self.layer(li, x, cache, start, positions)
        cache.n = start + ids.size
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.w.get("output_norm.weight"), self.hp.rms_eps)
        out_name = "output.weight" if self.w.has("output.weight") else "token_embd.weight"
        w, wt = self.w.get_typed(out_name)
        logits = linear(x, w, wt)
        return logits if all_logits else logits[0]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Rows of token_embd, dequantized row by row (a real vocabulary is too big to expand)."""
        t = self.w.info("token_embd.weight")
        rows = self.w.raw("token_embd.weight").reshape(t.ne[1], -1)[ids]
        return dequantize(rows, t.type, (len(ids), t.ne[0]), t.name).astype(F32, copy=True)

    def layer(self, li: int, x: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        p = f"blk.{li}."
        h = rms_norm(x, self.w.get(p + "attn_norm.weight"), self.hp.rms_eps)
        x = x + self.attn(li, h, cache, start, positions)
        h = rms_norm(x, self.w.get(p + self.ffn_norm), self.hp.rms_eps)
        return x + self.ffn(li, h)

    def lin(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        w, wt = self.w.get_typed(name)
        b = self.w.opt(bias) if bias else None
        return linear(x, w, wt, b)

    def attn(self, li: int, h: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        hp, p = self.hp, f"blk.{li}."
        n = h.shape[0]
        q = self.lin(p + "attn_q.weight", h, p + "attn_q.bias")
        k = self.lin(p + "attn_k.weight", h, p + "attn_k.bias")
        v = self.lin(p + "attn_v.weight", h, p + "attn_v.bias")
        if self.qk_norm == "full":
            q = rms_norm(q, self.w.get(p + "attn_q_norm.weight"), hp.rms_eps)
            k = rms_norm(k, self.w.get(p + "attn_k_norm.weight"), hp.rms_eps)
        q = q.reshape(n, hp.n_heads, hp.head_dim)
        k = k.reshape(n, hp.n_kv_heads, hp.head_dim)
        v = v.reshape(n, hp.n_kv_heads, hp.head_dim)
        if self.qk_norm == "head":
            q = rms_norm(q, self.w.get(p + "attn_q_norm.weight"), hp.rms_eps)
            k = rms_norm(k, self.w.get(p + "attn_k_norm.weight"), hp.rms_eps)
        cos, sin = self.rope.get(positions)
        q = apply_rope(q, cos, sin, self.rope_mode)
        k = apply_rope(k, cos, sin, self.rope_mode)
        kc, vc = cache.append(li, k, v, start)
        scale = hp.attn_scale or 1.0 / np.sqrt(float(hp.head_dim))
        o = attention(q, kc, vc, start, float(F32(scale)))
        return self.lin(p + "attn_output.weight", o, p + "attn_output.bias")

    def ffn(self, li: int, h: np.ndarray) -> np.ndarray:
        if self.map.layers[li].dense:
            return self.dense_ffn(f"blk.{li}.ffn_", h)
        return self.moe(li, h)

    def dense_ffn(self, prefix: str, h: np.ndarray, suffix: str = "") -> np.ndarray:
        """Plain SwiGLU FFN: {prefix}gate{suffix}.weight etc. (dense layers, shared experts)."""
        g = self.lin(f"{prefix}gate{suffix}.weight", h)
        u = self.lin(f"{prefix}up{suffix}.weight", h)
        return self.lin(f"{prefix}down{suffix}.weight", silu(g) * u)

    # ---- routed experts ----

    def router_logits(self, li: int, h: np.ndarray) -> np.ndarray:
        """[n_tok, E] logits in ORIGINAL-id order. Row by row, so a row's value is position-free."""
        p = f"blk.{li}."
        w, wt = self.w.get_typed(p + "ffn_gate_inp.weight")
        hq = round_activations(h, wt)
        logits = np.empty((h.shape[0], w.shape[0]), dtype=F32)
        step = max(1, (1 << 22) // max(w.size, 1))  # ~16 MB of products per chunk
        for t in range(0, h.shape[0], step):  # each (token, row) reduced alone: pairwise over the row
            logits[t:t + step] = np.add.reduce(w[None] * hq[t:t + step, None, :], axis=2, dtype=F32)
        b = self.w.opt(p + "ffn_gate_inp.bias")
        if b is not None:
            logits = logits + b
        if self.route == "file":  # rows are at positions: position p holds original perm[p]
            out = np.empty_like(logits)
            out[:, self.routes.perm[li]] = logits
            logits = out
        return logits

    def select(self, li: int, logits: np.ndarray) -> Routing:
        """Softmax in original-id order (or sigmoid), top-k by (prob + exp_probs_b desc, original id
        asc), weights in rank order."""
        k = self.hp.n_used
        probs = sigmoid(logits) if self.gating == "sigmoid" else softmax(logits)
        sel = probs
        pb = self.w.opt(f"blk.{li}.exp_probs_b.bias")
        if pb is not None:
            if self.route == "file":
                pb = pb[self.routes.pos[li]]  # position-ordered -> original order
            sel = probs + pb
        # stable sort of -sel keeps lower original id first among equals
        order = np.argsort(-sel, axis=1, kind="stable")[:, :k].astype(np.int32)
        w = np.take_along_axis(probs, order, axis=1)
        if self.norm_topk:
            s = w[:, 0].copy()
            for r in range(1, k):
                s = s + w[:, r]
            s = np.maximum(s, F32(6.103515625e-5))
            w = w / s[:, None]
        ws = self.hp.weights_scale
        if ws not in (0.0, 1.0):
            w = w * F32(ws)
        return Routing(order, w.astype(F32))

    def moe(self, li: int, h: np.ndarray) -> np.ndarray:
        routing = self.select(li, self.router_logits(li, h))
        self.last_routing[li] = routing
        n, k = routing.experts.shape
        uniq = np.unique(routing.experts)
        raw = self.source.fetch(li, uniq.tolist())
        self.stats.fetches += 1
        self.stats.experts += len(uniq)
        y = np.empty((n, k, self.hp.hidden), dtype=F32)
        for e in uniq:
            tok, rank = np.nonzero(routing.experts == e)
            y[tok, rank] = self.expert(li, int(e), raw[int(e)], h[tok])
        out = y[:, 0] * routing.weights[:, 0:1]
        for r in range(1, k):  # rank order, as llama.cpp's chain of adds
            out = out + y[:, r] * routing.weights[:, r:r + 1]
        return out

    def expert(self, li: int, e: int, raw: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
        """SwiGLU expert on rows h [m, hidden] from the raw slices of one expert."""
        ml = self.map.layers[li]
        mats = {}
        for t in ml.weights:
            buf = raw[t.role]
            self.stats.bytes += buf.size
            shape = tuple(reversed(t.ne[:-1]))
            mats[t.role] = (dequantize(buf, t.type, shape, t.name), T[t.type], buf)

        def mm(x, role):
            w, wt, buf = mats[role]
            y = linear(x, w, wt)
            c = q8_1_correction(x, buf, wt, w.shape[0])
            return y if c is None else y + c

        if "gate_up" in mats:
            gu = self._add_expert_bias(li, "gate_up", e, mm(h, "gate_up"))
            ff = mats["gate_up"][0].shape[0] // 2
            g, u = gu[:, :ff], gu[:, ff:]
        else:
            u = self._add_expert_bias(li, "up", e, mm(h, "up"))
            g = self._add_expert_bias(li, "gate", e, mm(h, "gate"))
        a = silu(g) * u
        d = mm(a, "down")
        return self._add_expert_bias(li, "down", e, d)

    def _add_expert_bias(self, li: int, role: str, e: int, y: np.ndarray) -> np.ndarray:
        name = f"blk.{li}.ffn_{role}_exps.bias"
        if not self.w.has(name):
            return y
        b = self.w.get(name)  # [E, n] at positions
        return y + b[self.routes.pos[li, e]]

    def close(self) -> None:
        if hasattr(self.source, "close") and isinstance(self.source, MmapExpertSource):
            self.source.close()
