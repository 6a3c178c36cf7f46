"""Dequantization of GGML tensors, and the activation rounding llama.cpp's CPU matmuls apply.

`dequantize(raw, type, shape, name)` turns the raw bytes of a tensor (or of one expert slice)
into a float32 array. F32/F16/BF16/Q8_0/Q4_0 have vectorised numpy paths (they are what experts
are streamed as); every other supported type goes through `gguf.quants.dequantize`.

`round_activations(x, type)` mimics what ggml does to the *activations* before a matmul with a
weight of that type: ggml's CPU `vec_dot` for Q8_0/Q4_0/Q5_0/MXFP4 weights takes activations
quantized to Q8_0 (Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants, F16 for F16, BF16 for BF16). A
reference engine that skips this differs from llama.cpp by ~1% of an activation per layer; with
it, the two agree to float32 rounding (see tests/test_engine_llama.py for the measured bounds).
`q8_1_correction` adds the one Q8_1 detail rounding alone cannot express (the fp16 block sum
that multiplies a Q4_1/Q5_1 weight minimum).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gq

from mbolt.core.errors import MboltError

SUPPORTED = {
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4,
}
_Q8_0_ACT = {T.Q8_0, T.Q4_0, T.Q5_0, T.MXFP4}
_Q8_1_ACT = {T.Q4_1, T.Q5_1}
_Q8_K_ACT = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


def qtype(t) -> T:
    return t if isinstance(t, T) else T[t] if isinstance(t, str) else T(int(t))


def check_supported(t, name: str) -> T:
    t = qtype(t)
    if t not in SUPPORTED:
        names = ", ".join(sorted(x.name for x in SUPPORTED))
        raise MboltError(f"tensor {name}: ggml type {t.name} is not supported by the reference engine "
                         f"(supported: {names})")
    return t


def row_bytes(t, n: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype(t)]
    return n // block * size


def dequantize(raw: np.ndarray, t, shape: tuple[int, ...], name: str = "?") -> np.ndarray:
    """Raw bytes -> float32 array of `shape` (numpy order: shape[-1] is ne[0], the row)."""
    t = check_supported(t, name)
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    n = int(np.prod(shape))
    if raw.size != row_bytes(t, n):
        raise MboltError(f"tensor {name}: {raw.size} bytes for {n} {t.name} values "
                         f"(expected {row_bytes(t, n)})")
    if t == T.F32:
        out = raw.view(np.float32)  # no copy: callers only read (an mmap view stays read-only)
    elif t == T.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif t == T.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif t == T.Q8_0:
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        out = b[:, 2:].view(np.int8).astype(np.float32)
        out *= d
    elif t == T.Q4_0:
        b = raw.reshape(-1, 18)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        qs = b[:, 2:]
        q = np.empty((b.shape[0], 32), dtype=np.int8)
        np.bitwise_and(qs, 0x0F, out=q[:, :16].view(np.uint8))
        np.right_shift(qs, 4, out=q[:, 16:].view(np.uint8))
        q -= 8
        out = q.astype(np.float32)
        out *= d
    else:
        out = gq.dequantize(raw, t)
    return out.reshape(shape)


# ---- activation rounding (what ggml's vec_dot_type conversion does to the right-hand side) ----


def _q8_blocks(x: np.ndarray, block: int = 32):
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv)
    return xb, q, amax


def _q8_0(x: np.ndarray) -> np.ndarray:
    xb, q, amax = _q8_blocks(x)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)  # stored as fp16
    return (q * d).reshape(x.shape)


def _q8_k(x: np.ndarray) -> np.ndarray:
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 256, 256)
    idx = np.abs(xb).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xb, idx, axis=-1)  # signed value of largest magnitude
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0.0)).astype(np.float32)
        d = np.where(iscale != 0, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale), 127)
    return (q * d).reshape(x.shape)


def round_activations(x: np.ndarray, t) -> np.ndarray:
    """x (float32, last axis = the weight's row) as llama.cpp's CPU matmul sees it."""
    t = qtype(t)
    if t == T.F32:
        return x
    if t == T.F16:
        return x.astype(np.float16).astype(np.float32)
    if t == T.BF16:
        u = x.astype(np.float32).view(np.uint32)
        u = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) << 16  # round to nearest even
        return u.astype(np.uint32).view(np.float32)
    if t in _Q8_0_ACT or t in _Q8_1_ACT:
        return _q8_0(x)
    if t in _Q8_K_ACT:
        return _q8_k(x)
    return x


def q8_1_correction(x: np.ndarray, raw: np.ndarray, t, rows: int) -> np.ndarray | None:
    """Extra term for Q4_1/Q5_1 weights: ggml's Q8_1 activations store each block's sum
    s = fp16(d * sum(q)) and the dot adds m_w * s; `round_activations` gives m_w * fp16(d) * sum(q).
    Returns [n, rows] to add to `round_activations(x, t) @ W.T` (None for other types)."""
    t = qtype(t)
    if t not in _Q8_1_ACT:
        return None
    bs = GGML_QUANT_SIZES[t][1]
    nb = x.shape[-1] // 32
    mins = np.asarray(raw, np.uint8).reshape(rows, nb, bs)[:, :, 2:4].copy().view(np.float16)
    mins = mins.reshape(rows, nb).astype(np.float32)
    _, q, amax = _q8_blocks(x)
    d32 = (amax / np.float32(127.0)).astype(np.float32)[..., 0]
    qsum = q.sum(axis=-1, dtype=np.float32)
    s = (d32 * qsum).astype(np.float16).astype(np.float32)
    mine = d32.astype(np.float16).astype(np.float32) * qsum
    return (s - mine) @ mins.T
