"""Tensor bytes of a synthetic model: real quantization, and random valid blocks (fast_random).

Real mode quantizes Gaussian weights with `gguf.quants.quantize` (F32 F16 BF16 Q8_0 Q4_0 Q4_1
Q5_0 Q5_1 MXFP4). K- and I-quants (Q2_K..Q6_K, IQ*) have no quantizer in gguf-py and are written
as random valid blocks only: random quant bits with finite fp16 scales at the byte offsets of
ggml's block structs (ggml-common.h), scaled so the dequantized values have about the wanted
std. The scale is calibrated by dequantizing a sample with gguf-py (`calibrated_scale`), not by
a hand table, so every type gets the same value spread.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from mbolt.synth.routing import rng_for

POOL_BYTES = 8 << 20  # random-block pool per type (fast_random)

# Byte offsets of the fp16 super-block scale d (and of dmin, for types with mins) inside one
# block (ggml-common.h struct order). Q2_K/Q3_K/Q6_K keep d at the end of the block.
FP16_SCALES = {
    "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_XS": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ1_S": (0,),
}


def encode(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return x.astype("<f4", copy=False)
    if qtype == GGMLQuantizationType.F16:
        return x.astype("<f2")
    return quantize(x, qtype)  # uint8 [rows, bytes per row]


def _set_scales(raw: np.ndarray, name: str, d: np.ndarray, dmin: np.ndarray | None) -> None:
    offs = FP16_SCALES[name]
    raw[:, offs[0]:offs[0] + 2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    if len(offs) > 1:
        raw[:, offs[1]:offs[1] + 2] = (dmin if dmin is not None else np.zeros_like(d)).astype("<f2").view(np.uint8).reshape(-1, 2)


def calibrated_scale(name: str, raw: np.ndarray) -> tuple[float, float]:
    """(std of the dequantized values at d = 1, dmin/d that centres them) for random blocks `raw`."""
    qt = GGMLQuantizationType[name]
    sample = raw[:64].copy()
    ones = np.ones(len(sample), np.float32)
    _set_scales(sample, name, ones, None)  # dmin = 0
    v = dequantize(sample.reshape(1, -1), qt).astype(np.float64)
    if len(FP16_SCALES[name]) == 1:
        return float(v.std()), 0.0
    _set_scales(sample, name, np.zeros_like(ones), ones)  # values of the mins alone (negative)
    m = dequantize(sample.reshape(1, -1), qt).astype(np.float64)
    ratio = float(v.mean() / -m.mean()) if m.mean() else 0.0
    return float((v + ratio * m).std()), ratio


def fill_pool(qtype: GGMLQuantizationType, std: float, seed: int) -> tuple[np.ndarray, int]:
    """POOL_BYTES of random valid blocks of `qtype` whose values have about `std`, doubled so
    any window of up to n_blocks blocks is contiguous; returns (uint8 pool, n_blocks)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = POOL_BYTES // size
    rng = rng_for(seed, "pool", qtype.name, f"{std:.6g}")
    name = qtype.name
    if name in ("F32", "F16", "BF16"):
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        if name == "BF16":
            raw = (x.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
        else:
            raw = x.astype("<f4" if name == "F32" else "<f2").view(np.uint8)
        raw = raw.reshape(n, size)
    elif name == "MXFP4":  # e8m0 scale byte first; ggml value = kvalue * 2^(e - 128)
        raw = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
        e = int(np.clip(round(math.log2(std / 5.7)) + 128, 1, 254))
        raw[:, 0] = rng.integers(e - 1, e + 2, n, dtype=np.uint8)
    else:
        raw = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
        unit_std, ratio = calibrated_scale(name, raw)
        d = (std / unit_std) * (0.5 + rng.random(n, dtype=np.float32))
        _set_scales(raw, name, d, d * ratio if ratio else None)
    flat = raw.reshape(-1)
    return np.concatenate([flat, flat]), n


class Pools:
    """Random valid blocks for fast_random, one pool per (type, std); slices are views."""

    def __init__(self, seed: int):
        self.seed, self._pools = seed, {}

    def stream(self, qtype: GGMLQuantizationType, std: float, start: int, n_blocks: int) -> Iterator[np.ndarray]:
        key = (qtype, f"{std:.3g}")
        if key not in self._pools:
            self._pools[key] = fill_pool(qtype, float(key[1]), self.seed)
        pool, n = self._pools[key]
        size = GGML_QUANT_SIZES[qtype][1]
        pos = start % n
        while n_blocks > 0:
            take = min(n_blocks, n)
            yield pool[pos * size:(pos + take) * size]
            n_blocks -= take
            pos = (pos + take * 7919 + 1) % n  # next window elsewhere in the pool

    def n_blocks(self, qtype: GGMLQuantizationType) -> int:
        return POOL_BYTES // GGML_QUANT_SIZES[qtype][1]


def coprime_stride(n: int) -> int:
    """A stride coprime with n near n / golden ratio: experts start far apart in a pool."""
    s = int(n * 0.6180339887) | 1
    while math.gcd(s, n) != 1:
        s += 2
    return s
