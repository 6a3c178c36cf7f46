"""colibri's routing files (JustVugg/colibri, ``c/route_trace.h``): the ``.coli_usage`` heat
histogram (read and written) and the ``ROUTE_TRACE`` text log (read).

``.coli_usage``
    Text, one record per non-zero count, ``"%d %d %u\\n"`` = ``<layer> <expert> <count>``;
    header records ``-1 <n_layers> <n_experts>`` and ``-2 <version> <engine_id>`` (version 1;
    engine_id = FNV-1a-32 of colibri's engine name, e.g. ``qwen3_moe``; colibri refuses a file of
    another engine unless its path is given with ``PIN=<path>``). colibri writes -1 then -2 and
    skips other negative layers; rows run 0..n_layers inclusive (GLM keeps its MTP head at row
    n_layers). It is a cumulative histogram: no tokens, no order, prefill and decode mixed. So
    it drives heat order and pins, not a co-activation order.
``ROUTE_TRACE``
    Text, no header: one line per (row, layer) of every MoE call,
    ``"%d %d %d"`` = ``<call> <row> <layer>``, then `` <id>:<gate>`` per selected expert
    (``%.4f``, the weight after top-k renormalisation; the count can vary by line with top-p).
    ``call`` counts MoE invocations (one per layer per forward), ``row`` is the token's row in
    that forward's batch. Lines are layer-major; a layer lower than the previous one starts a
    new forward (as colibri's own ``tools/route_pairs.py`` reads it). Nothing marks prefill: a
    forward of one row is a decode step, more rows are a prefill (or a speculative batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_cells
from mbolt.core.errors import MboltError
from mbolt.core.trace import Trace
from mbolt.trace.formats.common import (MAX_CELLS_IMPORT, assemble, decode_ascii, infer_n_experts, infer_n_layers,
                                        numbered_lines)

USAGE_VERSION = 1
MAX_COUNT = (1 << 32) - 1  # counts are %u
MAX_USAGE_CELLS = 1 << 22
MAX_GATE = 1e6  # routing weights (after routed_scale) are of order 1; float32 holds them


def engine_id(name: str) -> int:
    """colibri's engine id: FNV-1a-32 of the engine name."""
    h = 2166136261
    for b in name.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


@dataclass
class Usage:
    """Per-layer expert selection counts with no tokens: heat only."""
    n_layers: int
    n_experts: int
    heat: np.ndarray  # float64 [n_layers, n_experts]
    engine_id: int | None = None
    notes: list[str] = field(default_factory=list)

    def moe_layers(self) -> np.ndarray:
        return np.flatnonzero(self.heat.sum(axis=1) > 0)


def looks_like_usage(first_line: str) -> bool:
    parts = first_line.split()
    return len(parts) == 3 and parts[0] in ("-1", "-2") and all(p.isdigit() for p in parts[1:])


def read_usage(path: Path, data: bytes, n_layers=None, n_experts=None) -> Usage:
    where = str(path)
    text = decode_ascii(where, data, "a .coli_usage file")
    dims = version = eid = None
    recs: list[tuple[int, int, int]] = []
    linenos: list[int] = []
    for i, line, parts in numbered_lines(text):
        try:
            a, b, c = (int(x) for x in parts) if len(parts) == 3 else (None, None, None)
        except ValueError:
            a = None
        if a is None:
            raise MboltError(f"{where}: line {i}: expected three integers '<layer> <expert> <count>', got "
                             f"{line.strip()[:60]!r}")
        if a == -1:
            dims = (b, c, i)
        elif a == -2:
            version, eid = b, c
            if version != USAGE_VERSION:
                raise MboltError(f"{where}: line {i}: .coli_usage version {version} (mbolt reads version "
                                 f"{USAGE_VERSION})")
        elif a >= 0:  # other negative layers: header records colibri reserves, skipped as it does
            if not 0 <= b <= MAX_EXPERTS or not 0 <= c <= MAX_COUNT or a > MAX_LAYERS:
                raise MboltError(f"{where}: line {i}: layer {a}, expert {b} or count {c} out of range")
            recs.append((a, b, c))
            linenos.append(i)
    if not recs:
        raise MboltError(f"{where}: no usage counts (an empty .coli_usage: colibri writes one when nothing "
                         "was counted)")
    arr = np.asarray(recs, np.int64)
    L, E = int(arr[:, 0].max()) + 1, int(arr[:, 1].max()) + 1
    notes = []
    if dims is not None:
        hl, he, line = dims
        if not 1 <= hl < MAX_LAYERS or not 1 <= he <= MAX_EXPERTS:
            raise MboltError(f"{where}: line {line}: header says {hl} layers x {he} experts")
        if L > hl + 1 or E > he:
            r = int(np.argmax((arr[:, 0] > hl) | (arr[:, 1] >= he)))
            raise MboltError(f"{where}: line {linenos[r]}: layer {recs[r][0]}, expert {recs[r][1]} outside the "
                             f"header's {hl} layers x {he} experts")
        if L == hl + 1:
            notes.append(f"{path.name}: counts at layer {hl} (colibri's extra row after the last layer: GLM's "
                         "MTP head) kept as a layer")
        L, E = max(L, hl), he
    if n_experts is not None:
        if E > n_experts:
            raise MboltError(f"{where}: has {E} experts, expected {n_experts}")
        E = n_experts
    if n_layers is not None:
        if L > n_layers:
            raise MboltError(f"{where}: counts at layer {L - 1}, the model has {n_layers} layers")
        L = n_layers
    # the dense table is allocated from these counts: bounded (real models: < 100 layers x 1,024)
    check_cells(f"{where}: layers x experts", (L, E), MAX_USAGE_CELLS)
    key = arr[:, 0] * E + arr[:, 1]
    uniq, cnt = np.unique(key, return_counts=True)
    if (cnt > 1).any():
        r = int(np.flatnonzero(key == uniq[np.argmax(cnt > 1)])[1])
        raise MboltError(f"{where}: line {linenos[r]}: layer {recs[r][0]} expert {recs[r][1]} counted twice")
    heat = np.zeros((L, E))
    heat[arr[:, 0], arr[:, 1]] = arr[:, 2]
    return Usage(L, E, heat, eid, notes)


def usage_text(heat: np.ndarray, engine: str | None = None) -> str:
    """A .coli_usage of `heat` [n_layers, E] (counts rounded to integers): -1 and -2 headers, then
    the non-zero counts layer by layer. Without `engine` the id is 0: colibri then takes the
    file only with PIN=<path>."""
    heat = np.rint(np.asarray(heat, np.float64))
    if (heat < 0).any() or heat.max(initial=0) > MAX_COUNT:
        raise MboltError("heat counts must lie in 0..2^32-1 for .coli_usage")
    L, E = heat.shape
    lines = [f"-1 {L} {E}", f"-2 {USAGE_VERSION} {engine_id(engine) if engine else 0}"]
    ls, es = np.nonzero(heat)
    lines += [f"{l} {e} {int(heat[l, e])}" for l, e in zip(ls.tolist(), es.tolist())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# ROUTE_TRACE


def looks_like_route_trace(first_line: str) -> bool:
    parts = first_line.split()
    return len(parts) >= 4 and all(p.isdigit() for p in parts[:3]) and ":" in parts[3]


def read_route_trace(path: Path, data: bytes, n_layers=None, n_experts=None) -> Trace:
    where = str(path)
    text = decode_ascii(where, data, "a ROUTE_TRACE log")
    heads: list[tuple[int, int, int]] = []
    sels: list[list[tuple[int, float]]] = []
    linenos: list[int] = []
    for i, line, parts in numbered_lines(text):
        try:
            call, row, layer = (int(x) for x in parts[:3])
            pairs = [(int(a), float(g)) for a, g in (p.split(":") for p in parts[3:])]
        except ValueError:
            raise MboltError(f"{where}: line {i}: expected '<call> <row> <layer> <id>:<gate> ...', got "
                             f"{line.strip()[:60]!r}") from None
        if not pairs or min(call, row, layer) < 0 or len(pairs) > MAX_EXPERTS:
            raise MboltError(f"{where}: line {i}: a call, row and layer >= 0 and at least one expert expected")
        if call >= 1 << 62 or row >= 1 << 31 or layer >= MAX_LAYERS:
            raise MboltError(f"{where}: line {i}: call {call}, row {row} or layer {layer} out of range")
        ids = [a for a, _ in pairs]
        if min(ids) < 0 or max(ids) >= MAX_EXPERTS or len(set(ids)) != len(ids):
            raise MboltError(f"{where}: line {i}: expert ids out of range or repeated: {ids}")
        if not all(np.isfinite(g) and abs(g) <= MAX_GATE for _, g in pairs):
            raise MboltError(f"{where}: line {i}: a gate is not a finite number of at most {MAX_GATE:g}")
        heads.append((call, row, layer))
        sels.append(pairs)
        linenos.append(i)
    if not heads:
        raise MboltError(f"{where}: no routing lines")
    K = max(len(s) for s in sels)
    check_cells(f"{where}: lines x k", (len(sels), K), 8 * len(data) + 1024)
    H = np.asarray(heads, np.int64)
    ids = np.full((len(sels), K), -1, np.int64)
    gates = np.zeros((len(sels), K), np.float32)
    for r, s in enumerate(sels):
        ids[r, :len(s)] = [a for a, _ in s]
        gates[r, :len(s)] = [g for _, g in s]
    lines = np.asarray(linenos)
    E = infer_n_experts(where, ids, n_experts, lambda i: f"line {lines[i // K]}")
    # records: the lines of one MoE call (one layer of one forward), rows 0.. in order
    new_rec = np.ones(len(H), bool)
    new_rec[1:] = (H[1:, 0] != H[:-1, 0]) | (H[1:, 2] != H[:-1, 2])
    rstart = np.flatnonzero(new_rec)
    rec_of = np.cumsum(new_rec) - 1
    want_row = np.arange(len(H)) - rstart[rec_of]
    bad = np.flatnonzero(H[:, 1] != want_row)
    if len(bad):
        r = int(bad[0])
        raise MboltError(f"{where}: line {lines[r]}: row {int(H[r, 1])} of call {int(H[r, 0])}, expected row "
                         f"{int(want_row[r])} (rows of a call are written 0, 1, ... in order)")
    ntok = np.diff(np.append(rstart, len(H)))
    layer = H[rstart, 2]

    def loc(r):
        return f"line {int(lines[rstart[r]])}"

    def span(lo, hi):
        return f"lines {int(lines[rstart[lo]])}-{int(lines[rstart[hi - 1] + ntok[hi - 1] - 1])}"

    L = infer_n_layers(where, layer, n_layers, loc)
    check_cells(f"{where}: tokens x layers x k", (len(H), L, K), MAX_CELLS_IMPORT)
    return assemble(where, ids.ravel(), rstart * K, layer, np.full(len(rstart), K, np.int64), ntok,
                    L, E, K, loc, span, gates=gates.ravel(), strided_bug=False)
