"""Makers of damaged and hand-crafted input files, shared by the bad-input and fuzz suites.

Every file is written byte by byte here (GGUF through the header encoders, traces through their
documented layouts), so a test says exactly which field is wrong.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from mbolt.core.header import encode_header_start, encode_kv, encode_tensor_info

U32, STR, ARR = GGUFValueType.UINT32, GGUFValueType.STRING, GGUFValueType.ARRAY


def moe_kvs(n_experts=8, n_used=2, n_layers=1, **override):
    """Metadata of a minimal qwen3moe; `override` replaces (key suffix -> (vtype, value))."""
    kv = {
        "general.architecture": (STR, "qwen3moe"),
        "qwen3moe.expert_count": (U32, n_experts),
        "qwen3moe.expert_used_count": (U32, n_used),
        "qwen3moe.block_count": (U32, n_layers),
    }
    kv.update(override)
    return kv


def gguf_bytes(kvs: dict, tensors: list[tuple[str, tuple[int, ...], int]], data_bytes: int | None = None,
               alignment: int = 32) -> bytes:
    """A GGUF: `kvs` {key: (vtype, value[, sub])}, `tensors` [(name, ne, ggml type)] laid out
    back to back (F32 unless given), then `data_bytes` of zeros (default: what the tensors need)."""
    out = encode_header_start(len(tensors), len(kvs))
    for key, v in kvs.items():
        out += encode_kv(key, *v)
    off = 0
    sizes = []
    for name, ne, ttype in tensors:
        out += encode_tensor_info(name, ne, GGMLQuantizationType(ttype), off % (1 << 64))
        n = 4 * int(np.prod([int(x) for x in ne], dtype=object)) if ne else 4
        off += -(-n // alignment) * alignment
        if off <= 1 << 24:
            sizes.append(off)  # data the file can hold; a larger tensor is the damage itself
    out += b"\0" * (-len(out) % alignment)
    return out + b"\0" * (max(sizes, default=0) if data_bytes is None else data_bytes)


def moe_gguf(path: Path, n_experts=8, extra_tensors=(), data_bytes=None, **override) -> Path:
    """A one-layer MoE GGUF with gate/up/down expert tensors, optionally damaged."""
    t = [(f"blk.0.ffn_{r}_exps.weight", (32, 16, min(n_experts, 64)), 0) for r in ("gate", "up", "down")]
    path.write_bytes(gguf_bytes(moe_kvs(n_experts=n_experts, **override), t + list(extra_tensors), data_bytes))
    return path


def mbolt_trace_bytes(n_expert=8, records=((0, 2, 1, [1, 2]), (1, 2, 1, [3, 4]))) -> bytes:
    """MBOLT_TRACE: int32 words magic, version, n_expert, then (layer, k, n_tokens, ids...)."""
    words = [0x544C424D, 1, n_expert]
    for layer, k, ntok, ids in records:
        words += [layer, k, ntok, *ids]
    return struct.pack(f"<{len(words)}i", *words)


def nuthatch_bin_bytes(n_layers=2, n_expert=8, records=((0, 0, [1, 2]), (0, 1, [3, 4]), (1, 0, [2, 5]),
                                                        (1, 1, [6, 7]))) -> bytes:
    """NUTHTRC1: magic, u32 version, u32 n_layers, u32 n_expert, u64 n_records, then
    (u32 token, u32 layer, u32 n_sel, u32 ids[n_sel])."""
    out = struct.pack("<8sIIIQ", b"NUTHTRC1", 1, n_layers, n_expert, len(records))
    for token, layer, ids in records:
        out += struct.pack(f"<III{len(ids)}I", token, layer, len(ids), *ids)
    return out


def mbtrace_header(n_layers: int, n_experts: int, k: int, fingerprint: str = "", flags: int = 0) -> bytes:
    """An .mbtrace header with a VALID checksum (so only the counts are wrong)."""
    fp = fingerprint.encode("ascii")
    body = b"MBTRACE\0" + struct.pack("<IIIIIH", 1, n_layers, n_experts, k, flags, len(fp)) + fp
    return body + struct.pack("<I", zlib.crc32(body))


def flip(raw: bytes, at: int, value: int | None = None) -> bytes:
    b = bytearray(raw)
    b[at] = (b[at] ^ 0xFF) if value is None else value
    return bytes(b)


def set_kv(src: Path, dst: Path, key: str, vtype, value, sub=None) -> Path:
    """Copy of GGUF `src` with metadata `key` replaced (or added)."""
    def edit(kvs, raw):
        pairs = [encode_kv(key, vtype, value, sub) if k == key else raw[kv.span[0]:kv.span[1]] for k, kv in kvs.items()]
        return pairs + ([encode_kv(key, vtype, value, sub)] if key not in kvs else [])

    return _with_pairs(src, dst, edit)


def without_kv(src: Path, dst: Path, drop) -> Path:
    """Copy of GGUF `src` without the metadata keys for which `drop(key)` is true."""
    return _with_pairs(src, dst, lambda kvs, raw: [raw[kv.span[0]:kv.span[1]] for k, kv in kvs.items() if not drop(k)])


def _with_pairs(src: Path, dst: Path, edit) -> Path:
    """Copy of GGUF `src` with the key/value pairs `edit(kvs, raw)` returns (raw encoded pairs): the
    tensor infos are copied verbatim, the data section follows the new header at the same alignment."""
    from mbolt.core.header import read_header

    h = read_header(src)
    raw = src.read_bytes()
    pairs = edit(h.kv, raw)
    infos_start = max(kv.span[1] for kv in h.kv.values())
    out = encode_header_start(len(h.tensors), len(pairs), h.version) + b"".join(pairs) + raw[infos_start:h.header_size]
    out += b"\0" * (-len(out) % h.alignment)
    dst.write_bytes(out + raw[h.data_offset:])
    return dst
