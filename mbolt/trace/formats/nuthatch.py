"""chen3feng/nuthatch's traces: the text export and the `NUTHTRC1` binary (see the package
docstring)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_cells
from mbolt.core.errors import MboltError
from mbolt.core.trace import DECODE, PREFILL, Trace
from mbolt.trace.formats.common import (MAX_CELLS_IMPORT, assemble, check_ids, decode_ascii, infer_n_experts,
                                        infer_n_layers, numbered_lines, record_span, walk_records)

NUTH_MAGIC = b"NUTHTRC1"
NUTH_VERSION = 1
_NUTH_HEAD = struct.Struct("<8sIIIQ")


# ---------------------------------------------------------------------------------------------
# nuthatch text


def nuthatch_text_rows(text: str, where: str) -> tuple[list[list[int]], list[int]]:
    """The lines `layer e0 .. ek` of a nuthatch text export as integer rows, with line numbers."""
    rows: list[list[int]] = []
    linenos: list[int] = []
    for i, line, parts in numbered_lines(text):
        try:
            vals = [int(x) for x in parts]
        except ValueError:
            raise MboltError(f"{where}: line {i}: not integers: {line.strip()[:60]!r}") from None
        if len(vals) < 2:
            raise MboltError(f"{where}: line {i}: a layer and at least one expert id expected")
        if min(vals) < 0:
            raise MboltError(f"{where}: line {i}: negative number in {line.strip()[:60]!r}")
        if vals[0] >= MAX_LAYERS or max(vals[1:]) > MAX_EXPERTS or len(vals) > MAX_EXPERTS + 1:
            raise MboltError(f"{where}: line {i}: layer {vals[0]} or an expert id out of range (at most "
                             f"{MAX_LAYERS} layers, {MAX_EXPERTS} experts): {line.strip()[:60]!r}")
        rows.append(vals)
        linenos.append(i)
    return rows, linenos


def import_nuthatch_text(path: Path, data: bytes, n_layers, n_experts) -> Trace:
    where = str(path)
    text = decode_ascii(where, data, "a nuthatch text trace")
    rows, linenos = nuthatch_text_rows(text, where)
    if not rows:
        raise MboltError(f"{where}: no routing lines")
    K = max(len(r) for r in rows) - 1
    check_cells(f"{where}: lines x columns", (len(rows), K + 1), 8 * len(data) + 1024)
    M = np.full((len(rows), K + 1), -1, np.int64)
    for i, r in enumerate(rows):
        M[i, :len(r)] = r
    line_layer = M[:, 0]
    sel = M[:, 1:]
    lines = np.asarray(linenos)
    E = infer_n_experts(where, sel, n_experts, lambda i: f"line {lines[i // sel.shape[1]]}")
    srt = np.sort(sel, axis=1)
    dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1)
    if dup.any():
        i = int(np.argmax(dup))
        raise MboltError(f"{where}: line {lines[i]}: an expert id is repeated: "
                         f"{sel[i][sel[i] >= 0].tolist()}")
    width = (sel >= 0).sum(axis=1)
    if K > E:
        i = int(np.argmax(width))
        raise MboltError(f"{where}: line {lines[i]}: {int(width[i])} experts selected but only "
                         f"{E} exist (k > experts)")
    # records: runs of consecutive lines with the same layer = the rows of one layer in a pass
    new_rec = np.ones(len(rows), bool)
    new_rec[1:] = line_layer[1:] != line_layer[:-1]
    rstart = np.flatnonzero(new_rec)
    ntok = np.diff(np.append(rstart, len(rows)))
    layer = line_layer[rstart]

    def loc(r):
        return f"line {int(lines[rstart[r]])}"

    L = infer_n_layers(where, layer, n_layers, loc)
    ids = sel.ravel()
    def span(lo, hi):
        return f"lines {int(lines[rstart[lo]])}-{int(lines[rstart[hi - 1] + ntok[hi - 1] - 1])}"

    return assemble(where, ids, rstart * K, layer, np.full(len(rstart), K, np.int64), ntok,
                     L, E, K, loc, span)


# ---------------------------------------------------------------------------------------------
# nuthatch NUTHTRC1


def import_nuthatch_bin(path: Path, data: bytes, n_layers, n_experts, prefill_tokens) -> Trace:
    where = str(path)
    name = path.name
    if len(data) < _NUTH_HEAD.size:
        if not data.startswith(NUTH_MAGIC[:len(data)]):
            raise MboltError(f"{where}: bad NUTHTRC1 magic {data[:8]!r}")
        raise MboltError(f"{where}: NUTHTRC1 header truncated ({len(data)} bytes)")
    magic, version, L, E, n_records = _NUTH_HEAD.unpack_from(data)
    if magic != NUTH_MAGIC:
        raise MboltError(f"{where}: bad NUTHTRC1 magic {magic!r}")
    if version != NUTH_VERSION:
        raise MboltError(f"{where}: unsupported NUTHTRC1 version {version}")
    if not 1 <= L <= MAX_LAYERS or not 1 <= E <= MAX_EXPERTS:
        raise MboltError(f"{where}: header says {L} layers x {E} experts (expected 1..{MAX_LAYERS} x "
                         f"1..{MAX_EXPERTS}: damaged file?)")
    body = data[_NUTH_HEAD.size:]
    nb = len(body) // 4 * 4
    words = np.frombuffer(body[:nb], "<u4")
    offs, end = walk_records(words, lambda h: h[:, 2], where, _NUTH_HEAD.size, max_records=n_records)
    notes: list[str] = []

    def loc(r):
        return f"record {r} at byte {_NUTH_HEAD.size + 4 * int(offs[r])}"

    if len(offs) < n_records:
        at = _NUTH_HEAD.size + 4 * end
        raise MboltError(f"{where}: record {len(offs)} at byte {at}: truncated (header says "
                         f"{n_records} records, file ends after {len(offs)})")
    trailing = len(data) - _NUTH_HEAD.size - 4 * end
    if trailing:
        notes.append(f"{name}: ignored {trailing} bytes after the {n_records} records")
    token = words[offs].astype(np.int64)
    layer = words[offs + 1].astype(np.int64)
    nsel = words[offs + 2].astype(np.int64)
    if E == 0:
        raise MboltError(f"{where}: header says 0 experts")
    if len(nsel) and nsel.max() > E:
        r = int(np.argmax(nsel))
        raise MboltError(f"{where}: {loc(r)}: n_sel={int(nsel[r])} is larger than the number "
                         f"of experts ({E}) (k > experts)")
    if len(layer) and layer.max() >= L:
        r = int(np.argmax(layer))
        raise MboltError(f"{where}: {loc(r)}: layer {int(layer[r])} but the header says {L} "
                         f"layers")
    if n_experts is not None and n_experts != E:
        raise MboltError(f"{where}: trace has {E} experts, expected {n_experts}")
    if n_layers is not None:
        if n_layers < L:
            raise MboltError(f"{where}: trace has {L} layers, expected {n_layers}")
        L = n_layers
    starts = offs + 3
    ids = words.astype(np.int64)
    check_ids(where, ids, starts, nsel, E, loc)
    K = max(int(nsel.max()) if len(nsel) else 1, 1)

    uniq, first_idx, inverse, cnt = np.unique(token, return_index=True, return_inverse=True,
                                              return_counts=True)
    if len(token) > 1 and L > 1 and (cnt == 1).all():
        # token field is a record counter (nuthatch's text reader numbers lines that way):
        # regroup rows into tokens by layer order, like the text format
        tr = assemble(where, ids, starts, layer, nsel, np.ones(len(layer), np.int64), L, E, K,
                       loc, lambda lo, hi: record_span(offs, _NUTH_HEAD.size, lo, hi))
        tr.notes.insert(0, f"{name}: every token value has a single record; treated the token "
                           f"field as a record counter and grouped records into tokens by layer "
                           f"order")
        tr.notes[:0] = notes
        return tr
    # rows are ordered by first appearance of each token value
    order = np.argsort(first_idx, kind="stable")
    row_of_uniq = np.empty(len(uniq), np.int64)
    row_of_uniq[order] = np.arange(len(uniq))
    row = row_of_uniq[inverse]
    N = len(uniq)
    check_cells(f"{where}: tokens x layers x k", (N, L, K), min(MAX_CELLS_IMPORT, 64 * len(ids) + (1 << 20)))
    experts = np.full((N, L, K), -1, np.int16)
    dup = np.zeros((N, L), np.int32)
    np.add.at(dup, (row, layer), 1)
    if (dup > 1).any():
        notes.append(f"{name}: {int((dup > 1).sum())} (token, layer) pairs appear more than once;"
                     f" kept the last")
    c = nsel
    rec = np.repeat(np.arange(len(offs)), c)
    idx = np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
    experts[row[rec], layer[rec], idx] = ids[starts[rec] + idx]
    pos = uniq[order].astype(np.int64)
    if pos.max(initial=0) > np.iinfo(np.int32).max:
        raise MboltError(f"{where}: token position {int(pos.max())} does not fit int32")
    phase = np.where(pos < prefill_tokens, PREFILL, DECODE).astype(np.uint8)
    if not prefill_tokens:
        notes.append(f"{name}: NUTHTRC1 does not mark the prompt; all {N} tokens imported as "
                     f"decode (pass prefill_tokens to mark the first positions as prefill)")
    return Trace(L, E, K, experts, phase, np.zeros(N, np.int32), pos.astype(np.int32),
                 notes=notes)
