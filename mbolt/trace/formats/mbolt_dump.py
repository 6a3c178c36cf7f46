"""The original mbolt's llama.cpp `MBOLT_TRACE` dump (see the package docstring)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.trace import Trace
from mbolt.trace.formats.common import assemble, check_ids, infer_n_layers, record_span, walk_records

MBOLT_MAGIC = 0x544C424D  # b"MBLT" as a little-endian int32
MBOLT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# mbolt MBOLT_TRACE


def import_mbolt(path: Path, data: bytes, n_layers, n_experts) -> Trace:
    where = str(path)
    if len(data) < 12:
        raise MboltError(f"{where}: MBOLT_TRACE header truncated ({len(data)} bytes)")
    magic, version, n_expert = struct.unpack_from("<iii", data)
    if magic & 0xFFFFFFFF != MBOLT_MAGIC:
        raise MboltError(f"{where}: bad MBOLT_TRACE magic 0x{magic & 0xFFFFFFFF:08X}")
    if version != MBOLT_VERSION:
        raise MboltError(f"{where}: unsupported MBOLT_TRACE version {version}")
    if n_expert <= 0:
        raise MboltError(f"{where}: header says {n_expert} experts")
    if n_experts is not None and n_experts != n_expert:
        raise MboltError(f"{where}: trace has {n_expert} experts, expected {n_experts}")
    if len(data) % 4:
        raise MboltError(f"{where}: {len(data) % 4} stray bytes at the end (byte "
                         f"{len(data) - len(data) % 4}): the last record is truncated")
    words = np.frombuffer(data, "<i4", offset=12)
    offs, _ = walk_records(words, lambda h: h[:, 1] * h[:, 2], where, 12)

    def loc(r):
        return f"record {r} at byte {12 + 4 * int(offs[r])}"

    layer = words[offs].astype(np.int64)
    kr = words[offs + 1].astype(np.int64)
    ntok = words[offs + 2].astype(np.int64)
    for arr, what in ((layer, "layer"), (kr, "k"), (ntok, "n_tokens")):
        if len(arr) and arr.min() < 0:
            r = int(np.argmin(arr))
            raise MboltError(f"{where}: {loc(r)}: negative {what} {int(arr[r])}")
    if len(kr) and kr.max() > n_expert:
        r = int(np.argmax(kr))
        raise MboltError(f"{where}: {loc(r)}: k={int(kr[r])} is larger than the number of "
                         f"experts ({n_expert})")
    starts = offs + 3
    check_ids(where, words, starts, kr * ntok, n_expert, loc)
    L = infer_n_layers(where, layer, n_layers, loc)
    K = int(kr.max()) if len(kr) else 1
    tr = assemble(where, words, starts, layer, kr, ntok, L, n_expert, max(K, 1), loc,
                   lambda lo, hi: record_span(offs, 12, lo, hi))
    return tr
