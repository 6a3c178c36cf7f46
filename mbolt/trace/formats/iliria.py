"""iliria's ``FAROUTE1`` route trace (PhilipJohnBasile/iliria: written by
``c/tools/patch_m5max_route_trace.py``, read by ``c/tools/simulate_m5max_cache.py``).

Little-endian. Header (version 2, 40 bytes): ``char[8] "FAROUTE1"``, ``u32 version``,
``u32 record_size`` (24), ``u64 expert_bytes``, ``u32 cache_units``, ``u32 lru_per_layer``,
``u32 pinned_units``, ``u32 flags`` (bit 0: MTP expert tier). Version 1 has only the first 16
bytes. Then records of 24 bytes ``<QQHHHH``: ``event_id`` (0, 1, 2, ...), ``moe_call_id`` (one
per MoE invocation: one layer of one forward), ``layer``, ``batch_row``, ``route_rank``,
``expert_id``, written call by call, row by row, rank by rank. No gates, positions, layer or
expert counts (they are inferred, or given), and nothing marks prefill: a forward whose calls
have one row is a decode step. A layer lower than the previous call's starts a new forward.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, check_cells
from mbolt.core.errors import MboltError
from mbolt.core.trace import Trace
from mbolt.trace.formats.common import MAX_CELLS_IMPORT, assemble, infer_n_experts, infer_n_layers

FAROUTE_MAGIC = b"FAROUTE1"
_HEAD_V1 = struct.Struct("<8sII")
_HEAD_V2_TAIL = struct.Struct("<QIIII")
RECORD = np.dtype([("event", "<u8"), ("call", "<u8"), ("layer", "<u2"), ("row", "<u2"), ("rank", "<u2"),
                   ("expert", "<u2")])
assert RECORD.itemsize == 24


def header_size(version: int) -> int:
    return _HEAD_V1.size + (_HEAD_V2_TAIL.size if version >= 2 else 0)


def read_faroute(path: Path, data: bytes, n_layers=None, n_experts=None) -> Trace:
    where = str(path)
    if len(data) < _HEAD_V1.size:
        raise MboltError(f"{where}: FAROUTE1 header truncated ({len(data)} bytes)")
    magic, version, record_size = _HEAD_V1.unpack_from(data)
    if magic != FAROUTE_MAGIC:
        raise MboltError(f"{where}: bad FAROUTE1 magic {magic!r}")
    if version not in (1, 2):
        raise MboltError(f"{where}: unsupported FAROUTE1 version {version} (mbolt reads 1 and 2)")
    if record_size != RECORD.itemsize:
        raise MboltError(f"{where}: record_size {record_size}, expected {RECORD.itemsize}")
    head = header_size(version)
    if len(data) < head:
        raise MboltError(f"{where}: FAROUTE1 v{version} header truncated ({len(data)} of {head} bytes)")
    body = len(data) - head
    if body % RECORD.itemsize:
        at = head + body // RECORD.itemsize * RECORD.itemsize
        raise MboltError(f"{where}: record {body // RECORD.itemsize} at byte {at}: truncated "
                         f"({body % RECORD.itemsize} of {RECORD.itemsize} bytes)")
    rec = np.frombuffer(data, RECORD, offset=head)
    if not len(rec):
        raise MboltError(f"{where}: no routing records")

    def at(i):
        return f"record {i} at byte {head + RECORD.itemsize * int(i)}"

    bad = np.flatnonzero(rec["event"] != np.arange(len(rec), dtype=np.uint64))
    if len(bad):
        i = int(bad[0])
        raise MboltError(f"{where}: {at(i)}: event_id {int(rec['event'][i])}, expected {i} (records lost or "
                         "reordered)")
    call = rec["call"].astype(np.int64)
    layer_r = rec["layer"].astype(np.int64)
    row = rec["row"].astype(np.int64)
    rank = rec["rank"].astype(np.int64)
    expert = rec["expert"].astype(np.int64)
    # calls: runs of records with the same call id; one layer each
    new_call = np.ones(len(rec), bool)
    new_call[1:] = call[1:] != call[:-1]
    cstart = np.flatnonzero(new_call)
    call_of = np.cumsum(new_call) - 1
    mixed = np.flatnonzero(layer_r != layer_r[cstart][call_of])
    if len(mixed):
        i = int(mixed[0])
        raise MboltError(f"{where}: {at(i)}: layer {int(layer_r[i])} inside call {int(call[i])} of layer "
                         f"{int(layer_r[cstart[call_of[i]]])} (one MoE call is one layer)")
    K = int(rank.max()) + 1
    if K > MAX_EXPERTS:
        i = int(np.argmax(rank))
        raise MboltError(f"{where}: {at(i)}: route_rank {K - 1} out of range")
    E = infer_n_experts(where, expert, n_experts, at)
    if K > E:
        i = int(np.argmax(rank))
        raise MboltError(f"{where}: {at(i)}: route_rank {int(rank[i])} with {E} experts (k > experts)")
    ntok = np.maximum.reduceat(row, cstart) + 1
    check_cells(f"{where}: rows x k", (int(ntok.sum()), K), 4 * len(rec) + (1 << 20))
    base = np.concatenate([[0], np.cumsum(ntok)[:-1]])  # first row slot of each call
    slot = (base[call_of] + row) * K + rank
    ids = np.full(int(ntok.sum()) * K, -1, np.int64)
    dup = np.bincount(slot, minlength=len(ids)) > 1
    if dup.any():
        i = int(np.flatnonzero(dup[slot])[1])
        raise MboltError(f"{where}: {at(i)}: call {int(call[i])} row {int(row[i])} rank {int(rank[i])} "
                         "written twice")
    ids[slot] = expert
    layer = layer_r[cstart]

    def loc(r):
        return at(cstart[r])

    def span(lo, hi):
        return f"records {int(cstart[lo])}-{int(cstart[hi] - 1 if hi < len(cstart) else len(rec) - 1)}"

    L = infer_n_layers(where, layer, n_layers, loc)
    check_cells(f"{where}: tokens x layers x k", (int(ntok.sum()), L, K), MAX_CELLS_IMPORT)
    tr = assemble(where, ids, base * K, layer, np.full(len(cstart), K, np.int64), ntok, L, E, K, loc, span,
                  strided_bug=False)
    tr.notes.insert(0, f"{path.name}: FAROUTE1 v{version} has no gates and does not mark the prompt: forwards "
                       "of one row are decode, longer forwards prefill")
    return tr
