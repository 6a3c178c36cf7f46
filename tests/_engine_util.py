"""Helpers for the engine tests: a permuted copy of a GGUF, written by the test itself.

`permuted_copy(src, dst, perm, router=True)` moves every expert slice of every expert-indexed
tensor (gate/up/down weights and biases, and with router=True also the router rows,
router bias and exp_probs_b) so position p holds original expert perm[l, p], and records
`mbolt.perm` / `mbolt.layout=reorder`. Independent of mbolt.rewrite on purpose.
"""

from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFValueType as V

from mbolt.core.header import read_header
from mbolt.core.moe_map import moe_map

_PACK = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
         V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_NP = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
       V.FLOAT32: "<f4", V.BOOL: "?", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8"}
ROUTER_ROLES = {"router", "router_bias", "probs_bias"}


def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype, value, sub=None) -> bytes:
    out = _s(key) + struct.pack("<I", vtype)
    if vtype == V.STRING:
        return out + _s(value)
    if vtype == V.ARRAY:
        out += struct.pack("<IQ", sub, len(value))
        if sub == V.STRING:
            return out + b"".join(_s(v) for v in value)
        return out + np.asarray(value).astype(_NP[sub]).tobytes()
    return out + struct.pack(_PACK[vtype], value)


def random_perm(n_layers: int, n_experts: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n_experts) for _ in range(n_layers)]).astype(np.int32)


def permuted_copy(src, dst, perm: np.ndarray, router: bool = True) -> None:
    h = read_header(src)
    m = moe_map(h)
    E = m.n_experts
    data = bytearray(open(src, "rb").read()[h.data_offset:])
    for layer in m.layers:
        for t in layer.experts:
            if t.role == "unknown" or (not router and t.role in ROUTER_ROLES):
                continue
            start = t.data_offset - h.data_offset
            old = bytes(data[start: start + t.nbytes])
            sb = t.slice_bytes
            new = b"".join(old[int(e) * sb: (int(e) + 1) * sb] for e in perm[layer.index])
            data[start: start + t.nbytes] = new
    kvs = [_kv(k, kv.type, kv.value, kv.sub_type) for k, kv in h.kv.items()]
    kvs.append(_kv("mbolt.version", V.UINT32, 1))
    kvs.append(_kv("mbolt.layout", V.STRING, "reorder"))
    kvs.append(_kv("mbolt.n_layers", V.UINT32, m.n_layers))
    kvs.append(_kv("mbolt.n_experts", V.UINT32, E))
    kvs.append(_kv("mbolt.source.fingerprint", V.STRING, h.fingerprint))
    kvs.append(_kv("mbolt.perm", V.ARRAY, perm.reshape(-1), V.INT32))
    infos = [_s(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
             + struct.pack("<IQ", t.type, t.offset) for t in h.tensors]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(h.tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    pad = -len(head) % h.alignment
    with open(dst, "wb") as f:
        f.write(head + b"\0" * pad + bytes(data))


# f16 scale fields (byte offsets inside one block) of the K-quants; values are linear in them
K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_kquant_blocks(qtype: str, n_values: int, std: float, seed: int) -> np.ndarray:
    """Random but valid blocks of a K-quant (gguf-py cannot quantize them) with value std ~std."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf.quants import dequantize

    t = T[qtype]
    block, size = GGML_QUANT_SIZES[t]
    nb = n_values // block
    raw = np.random.default_rng(seed).integers(0, 256, (nb, size), dtype=np.uint8)

    def set_scale(v):
        for off in K_SCALE_FIELDS[qtype]:
            raw[:, off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)

    set_scale(1.0)
    s = float(dequantize(raw.reshape(-1), t).std())
    set_scale(std / s)
    return raw.reshape(-1)


def with_expert_type(src, dst, qtype: str, seed: int = 0) -> None:
    """Copy of a GGUF whose routed expert weights are random valid `qtype` blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    h = read_header(src)
    m = moe_map(h)
    roles = {t.name for layer in m.layers for t in layer.weights}
    data = open(src, "rb").read()
    t_new = T[qtype]
    blobs, infos, off = [], [], 0
    for i, t in enumerate(h.tensors):
        if t.name in roles:
            n = int(np.prod(t.ne))
            fan_in = t.ne[0]
            blob = random_kquant_blocks(qtype, n, 0.5 / np.sqrt(fan_in), seed + i).tobytes()
            ttype = t_new
        else:
            blob = data[t.data_offset: t.data_offset + t.nbytes]
            ttype = t.type
        assert len(blob) == int(np.prod(t.ne)) // GGML_QUANT_SIZES[ttype][0] * GGML_QUANT_SIZES[ttype][1]
        infos.append(_s(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
                     + struct.pack("<IQ", ttype, off))
        pad = -len(blob) % h.alignment
        blobs.append(blob + b"\0" * pad)
        off += len(blob) + pad
    kvs = [_kv(k, kv.type, kv.value, kv.sub_type) for k, kv in h.kv.items()]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(h.tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    with open(dst, "wb") as f:
        f.write(head + b"\0" * (-len(head) % h.alignment) + b"".join(blobs))
