"""Shared blocks of the reference engine: norms, RoPE, attention with a KV cache, softmax.

Each block follows the arithmetic of llama.cpp's CPU backend where that is cheap to do (double
accumulation in RMSNorm and softmax, RoPE angles by repeated float32 multiplication), so that the
engine's logits stay within float32 rounding of llama.cpp's.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (ggml_rms_norm: sum of squares in double, scale in float)."""
    sq = (x * x).astype(np.float64).sum(axis=-1, keepdims=True)
    mean = (sq / x.shape[-1]).astype(F32)
    scale = F32(1.0) / np.sqrt(mean + F32(eps))
    y = x * scale
    return y * w if w is not None else y


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """ggml_soft_max: exp(x - max), sum in double, multiply by float(1/sum)."""
    m = x.max(axis=axis, keepdims=True)
    e = np.exp(x - m)
    s = e.astype(np.float64).sum(axis=axis, keepdims=True)
    return e * (1.0 / s).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml_sigmoid: 1 / (1 + exp(-x)) in float32 (the sigmoid router of GLM / DeepSeek-V3)."""
    return F32(1.0) / (F32(1.0) + np.exp(-x))


def rope_tables(positions: np.ndarray, n_rot: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_tok, n_rot/2] with llama.cpp's angle recurrence theta_{i+1} = theta_i * base^(-2/n)."""
    theta_scale = F32(np.power(F32(base), F32(-2.0) / F32(n_rot), dtype=F32))
    half = n_rot // 2
    theta = np.empty((len(positions), half), dtype=F32)
    t = np.asarray(positions, dtype=F32)
    for i in range(half):  # theta_i = ((p * s) * s) ... in float32, as ggml_rope_cache_init
        theta[:, i] = t
        t = (t * theta_scale).astype(F32)
    return np.cos(theta).astype(F32), np.sin(theta).astype(F32)


class RopeCache:
    """Per-model cache of rope tables by position (decode asks for one position at a time)."""

    def __init__(self, n_rot: int, base: float):
        self.n_rot, self.base = n_rot, base
        self.cos = np.zeros((0, n_rot // 2), dtype=F32)
        self.sin = np.zeros((0, n_rot // 2), dtype=F32)

    def get(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 64)
            c, s = rope_tables(np.arange(n), self.n_rot, self.base)
            self.cos, self.sin = c, s
        return self.cos[positions], self.sin[positions]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """x [n_tok, n_heads, head_dim]; cos/sin [n_tok, n_rot/2]. mode: 'neox' (halves) or 'norm' (pairs)."""
    n_rot = cos.shape[-1] * 2
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = x.copy()
    if mode == "neox":
        a = x[..., : n_rot // 2]
        b = x[..., n_rot // 2: n_rot]
        out[..., : n_rot // 2] = a * c - b * s
        out[..., n_rot // 2: n_rot] = a * s + b * c
    else:
        a = x[..., 0:n_rot:2]
        b = x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    return out


class KVCache:
    """Per-layer K/V in float32, [n_kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.n = 0  # tokens already in the cache (positions 0..n-1)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
        """k, v [n_tok, n_kv, hd] at positions start.. ; returns views [n_kv, start+n_tok, hd]."""
        n_tok, n_kv, hd = k.shape
        end = start + n_tok
        kc = self.k[layer]
        if kc is None or kc.shape[1] < end:
            cap = max(end, 2 * (kc.shape[1] if kc is not None else 0), 64)
            nk = np.zeros((n_kv, cap, hd), dtype=F32)
            nv = np.zeros((n_kv, cap, hd), dtype=F32)
            if kc is not None:
                nk[:, :start] = kc[:, :start]
                nv[:, :start] = self.v[layer][:, :start]
            self.k[layer], self.v[layer] = nk, nv
        self.k[layer][:, start:end] = k.transpose(1, 0, 2)
        self.v[layer][:, start:end] = v.transpose(1, 0, 2)
        return self.k[layer][:, :end], self.v[layer][:, :end]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float) -> np.ndarray:
    """Causal GQA. q [n_tok, n_head, hd] at positions start..; k, v [n_kv, L, hd] -> [n_tok, n_head*hd]."""
    n_tok, n_head, hd = q.shape
    n_kv, L, _ = k.shape
    group = n_head // n_kv
    qh = q.transpose(1, 0, 2).reshape(n_kv, group * n_tok, hd)  # heads of one group share K/V
    scores = np.matmul(qh, k.transpose(0, 2, 1)) * F32(scale)  # [n_kv, group*n_tok, L]
    scores = scores.reshape(n_kv, group, n_tok, L)
    if n_tok > 1:
        qpos = start + np.arange(n_tok)[:, None]
        mask = np.arange(L)[None, :] > qpos
        scores = np.where(mask, F32(-np.inf), scores)
    p = softmax(scores.astype(F32)).reshape(n_kv, group * n_tok, L)
    out = np.matmul(p, v).reshape(n_kv, group, n_tok, hd)  # [n_kv, group, n_tok, hd]
    return out.reshape(n_head, n_tok, hd).transpose(1, 0, 2).reshape(n_tok, n_head * hd)
