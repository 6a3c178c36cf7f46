"""Import routing traces written by other tools into a `Trace`.

Formats (`fmt`; "auto" detects them from the first bytes):

``mbtrace``
    mbolt's own file (`mbolt.core.mbtrace`).
``mbolt``
    The original mbolt's llama.cpp ``MBOLT_TRACE`` dump: little-endian int32 words, header
    ``magic 0x544C424D ("MBLT"), version 1, n_expert``, then records
    ``layer, k, n_tokens, ids[n_tokens * k]`` (token-major). A record whose layer is <= the
    previous record's layer starts a new forward pass.
``nuthatch-text``
    chen3feng/nuthatch's text export: one line per (token, layer), ``layer e0 e1 ...``. The rows
    of one layer in one forward pass are consecutive lines with the same layer number; a line
    whose layer is lower than the previous line's starts a new pass.
``nuthatch-bin``
    nuthatch's ``NUTHTRC1`` binary (``src/trace/routing_trace.cc``): ``b"NUTHTRC1"``,
    u32 version=1, u32 n_layers, u32 n_expert, u64 n_records, then records
    ``u32 token, u32 layer, u32 n_sel, u32 ids[n_sel]`` (little-endian, as written on x86/ARM).
    nuthatch's generator (``GreedyGenerateCachedTrace``) writes ``token`` = absolute position,
    prompt tokens included, token-major; the file does not say where the prompt ends, so every
    token is imported as decode unless ``prefill_tokens`` says how many leading positions were
    the prompt. A file whose token field is a record counter (one layer per token, as nuthatch's
    own text reader numbers lines) is regrouped by layer order like the text format.

Forward passes (``mbolt`` and ``nuthatch-text``): a pass where every layer routed one token is a
decode step; otherwise it is a prefill of T tokens (T = the most rows any layer has). During
prefill llama.cpp's last layer routes only the output token, so a layer with fewer rows covers
the *last* rows of the pass; its other tokens get -1 there. Each prefill pass starts a new
sequence (a prompt split over several micro-batches therefore becomes several sequences);
positions count tokens within a sequence. A one-token prompt is indistinguishable from a decode
step.

The strided-view export bug: llama.cpp's ``ffn_moe_topk-N`` tensor is a view of the first k
columns of an argsort over all E experts, so row j starts at ``j * E`` ids, not ``j * k``. An
exporter that reads the n_tokens * k ids of a prefill layer contiguously writes, instead of each
token's top-k, the *full ranking* of the pass's first tokens split over E/k rows. It is
detected per prefill pass, without knowing line numbers: every complete E-id chunk of a layer's
rows is a permutation of all E experts (real top-k rows of different tokens would repeat ids).
In such a pass only the leading k ids of each complete ranking are real (token r's top-k sits at
``r * E``), a layer with a single row is real, and everything else is dropped; tokens left with
no layer at all are removed. Positions are kept, so the decode tokens that follow keep their
true positions. What was dropped is listed in ``Trace.notes``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_cells
from mbolt.core.errors import MboltError
from mbolt.core.mbtrace import MAGIC as MBTRACE_MAGIC
from mbolt.core.mbtrace import read_trace
from mbolt.core.trace import DECODE, PREFILL, Trace

MBOLT_MAGIC = 0x544C424D  # b"MBLT" as a little-endian int32
MBOLT_VERSION = 1
NUTH_MAGIC = b"NUTHTRC1"
NUTH_VERSION = 1
_NUTH_HEAD = struct.Struct("<8sIIIQ")

MAX_CELLS_IMPORT = 1 << 28
FORMATS = ("mbtrace", "mbolt", "nuthatch-text", "nuthatch-bin")


def detect_format(path: str | os.PathLike) -> str:
    """Which trace format a file is in, from its first bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise MboltError(f"{path}: trace file not found") from None
    except OSError as e:
        raise MboltError(f"{path}: cannot read: {e.strerror}") from None
    if head.startswith(MBTRACE_MAGIC):
        return "mbtrace"
    if head.startswith(NUTH_MAGIC):
        return "nuthatch-bin"
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == MBOLT_MAGIC:
        return "mbolt"
    text = head.decode("ascii", "replace")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if first and all(tok.isdigit() for tok in first.split()) and len(first.split()) >= 2:
        return "nuthatch-text"
    raise MboltError(f"{path}: unknown trace format (not .mbtrace, MBOLT_TRACE, NUTHTRC1 or "
                     f"nuthatch text; first bytes {head[:8]!r})")


def load_trace(path: str | os.PathLike, fmt: str = "auto", *, n_layers: int | None = None,
                 n_experts: int | None = None, prefill_tokens: int = 0) -> Trace:
    """Read any supported trace file into a `Trace`.

    `n_layers` / `n_experts` override what the file implies (formats that do not store them
    infer max+1, which misses trailing dense layers or never-used experts). `prefill_tokens`
    marks the first positions of a ``nuthatch-bin`` trace as prefill.
    """
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise MboltError(f"unknown trace format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt == "mbtrace":
        tr = read_trace(path)
        _check_override(path, tr, n_layers, n_experts)
        return tr
    data = _read(path)
    if fmt == "mbolt":
        return _import_mbolt(path, data, n_layers, n_experts)
    if fmt == "nuthatch-bin":
        return _import_nuthatch_bin(path, data, n_layers, n_experts, prefill_tokens)
    return _import_nuthatch_text(path, data, n_layers, n_experts)


def load_traces(paths, fmt: str = "auto", **kw) -> Trace:
    """Several trace files (e.g. shares traced on different machines) as one trace: each read
    with `load_trace`, then joined by `core.trace.merge_traces` (same model, sequences renumbered)."""
    from mbolt.core.trace import merge_traces

    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    traces = [load_trace(p, fmt, **kw) for p in paths]
    return traces[0] if len(traces) == 1 else merge_traces(traces, [str(p) for p in paths])


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MboltError(f"{path}: trace file not found") from None
    except OSError as e:
        raise MboltError(f"{path}: cannot read: {e.strerror}") from None


def _check_override(path, tr: Trace, n_layers, n_experts) -> None:
    if n_layers is not None and n_layers != tr.n_layers:
        raise MboltError(f"{path}: trace has {tr.n_layers} layers, expected {n_layers}")
    if n_experts is not None and n_experts != tr.n_experts:
        raise MboltError(f"{path}: trace has {tr.n_experts} experts, expected {n_experts}")


# ---------------------------------------------------------------------------------------------
# binary record walking (vectorised over runs of equal-size records)


def _walk(words: np.ndarray, n_ids, where: str, byte0: int, max_records: int | None = None):
    """Word offsets of records ``h0, h1, h2, ids[n_ids(h)]`` laid end to end in `words`.

    `byte0` is the file offset of words[0] (for messages). Stops at the end of `words` or after
    `max_records`. Runs of records with the same size are checked in bulk.
    """
    n = len(words)
    offs: list[np.ndarray] = []
    off = 0
    rec = 0
    limit = max_records if max_records is not None else 1 << 62
    while off < n and rec < limit:
        if n - off < 3:
            raise MboltError(f"{where}: record {rec} at byte {byte0 + 4 * off}: truncated "
                             f"(record header needs 12 bytes, {4 * (n - off)} left)")
        c = int(n_ids(words[off:off + 3].astype(np.int64)[None])[0])
        if c < 0:
            raise MboltError(f"{where}: record {rec} at byte {byte0 + 4 * off}: negative id "
                             f"count {c}")
        s = 3 + c
        if off + s > n:
            raise MboltError(f"{where}: record {rec} at byte {byte0 + 4 * off}: truncated "
                             f"(needs {c} expert ids, {max(n - off - 3, 0)} left)")
        m = min((n - off) // s, 65536, limit - rec)
        block = words[off:off + m * s].reshape(m, s)[:, :3].astype(np.int64)
        good = n_ids(block) == c
        j = m if good.all() else int(np.argmin(good))
        offs.append(off + s * np.arange(j, dtype=np.int64))
        off += j * s
        rec += j
    return (np.concatenate(offs) if offs else np.zeros(0, np.int64)), off


def _check_ids(where: str, ids: np.ndarray, starts: np.ndarray, counts: np.ndarray,
               n_experts: int, loc) -> None:
    """Every id in records [starts, starts+counts) of `ids` must be in [0, n_experts)."""
    bad = (ids < 0) | (ids >= n_experts)
    if not bad.any():
        return
    used = np.zeros(len(ids) + 1, np.int64)
    np.add.at(used, starts, 1)
    np.add.at(used, starts + counts, -1)
    bad &= np.cumsum(used)[:-1] > 0
    if not bad.any():
        return
    e = int(np.flatnonzero(bad)[0])
    r = int(np.searchsorted(starts, e, side="right") - 1)
    raise MboltError(f"{where}: {loc(r)}: expert id {int(ids[e])} out of range "
                     f"(n_experts={n_experts})")


# ---------------------------------------------------------------------------------------------
# mbolt MBOLT_TRACE


def _import_mbolt(path: Path, data: bytes, n_layers, n_experts) -> Trace:
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
    offs, _ = _walk(words, lambda h: h[:, 1] * h[:, 2], where, 12)

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
    _check_ids(where, words, starts, kr * ntok, n_expert, loc)
    L = _n_layers(where, layer, n_layers, loc)
    K = int(kr.max()) if len(kr) else 1
    tr = _assemble(where, words, starts, layer, kr, ntok, L, n_expert, max(K, 1), loc,
                   lambda lo, hi: _record_span(offs, 12, lo, hi))
    return tr


def _n_layers(where, layer: np.ndarray, n_layers, loc) -> int:
    L = int(layer.max()) + 1 if len(layer) else 1
    if L > MAX_LAYERS:
        r = int(np.argmax(layer))
        raise MboltError(f"{where}: {loc(r)}: layer {int(layer[r])} is out of range (at most {MAX_LAYERS} "
                         f"layers: damaged file?)")
    if n_layers is not None:
        if L > n_layers:
            r = int(np.argmax(layer))
            raise MboltError(f"{where}: {loc(r)}: layer {int(layer[r])} but the model has "
                             f"{n_layers} layers")
        L = n_layers
    return L


# ---------------------------------------------------------------------------------------------
# pass assembly shared by MBOLT_TRACE and nuthatch text


def _assemble(where: str, ids: np.ndarray, starts: np.ndarray, layer: np.ndarray,
              kr: np.ndarray, ntok: np.ndarray, n_layers: int, n_experts: int, K: int, loc,
              span) -> Trace:
    """Records (layer, kr, ntok rows of ids at starts) in file order -> Trace.

    `loc(r)` names record r for messages; `span(lo, hi)` names records lo..hi-1.
    """
    R = len(layer)
    name = Path(where).name
    if n_experts > MAX_EXPERTS:
        raise MboltError(f"{where}: {n_experts} experts do not fit int16 expert ids")
    notes: list[str] = []
    if R == 0:
        z = np.zeros(0, np.int32)
        return Trace(n_layers, n_experts, K, np.zeros((0, n_layers, K), np.int16),
                     np.zeros(0, np.uint8), z, z.copy(), notes=[f"{name}: no records"])
    new_pass = np.ones(R, bool)
    new_pass[1:] = layer[1:] <= layer[:-1]
    pass_start = np.flatnonzero(new_pass)
    pass_of = np.cumsum(new_pass) - 1
    P = len(pass_start)
    T = np.maximum.reduceat(ntok, pass_start)  # tokens per pass
    base = np.concatenate([[0], np.cumsum(T)[:-1]])  # first token index of each pass
    N = sum(int(t) for t in T)  # Python ints: cannot wrap
    # tokens x layers x k is what gets allocated: bounded by the expert ids the file holds (a
    # layer with fewer rows, or dense layers, leave gaps, hence the slack), so a few changed
    # bytes cannot ask for gigabytes
    check_cells(f"{where}: tokens x layers x k", (N, n_layers, K),
                min(MAX_CELLS_IMPORT, 64 * len(ids) + (1 << 20)))
    prefill_pass = T > 1

    # --- strided-view export bug ------------------------------------------------------------
    corrupt = np.zeros(P, bool)
    evidence = np.zeros(P, bool)
    for p in np.flatnonzero(prefill_pass):
        lo = pass_start[p]
        hi = pass_start[p + 1] if p + 1 < P else R
        seen = ok = False
        for r in range(lo, hi):
            total = int(ntok[r] * kr[r])
            c = total // n_experts
            if ntok[r] < 2 or c < 1 or kr[r] >= n_experts:  # k == E: strided == contiguous
                continue
            seen = True
            chunk = np.sort(ids[starts[r]:starts[r] + c * n_experts].reshape(c, n_experts), axis=1)
            ok = bool((chunk == np.arange(n_experts)).all())
            if not ok:
                break
        evidence[p] = seen and ok
    if evidence.any():
        corrupt = evidence.copy()
        # passes too short to show a full ranking: same exporter, so same bug, if their rows
        # look like consecutive slices of one ranking (no id repeated within a layer)
        for p in np.flatnonzero(prefill_pass & ~evidence):
            lo = pass_start[p]
            hi = pass_start[p + 1] if p + 1 < P else R
            multi = [r for r in range(lo, hi) if ntok[r] > 1]
            if multi and all(
                ntok[r] * kr[r] < n_experts
                and len(np.unique(ids[starts[r]:starts[r] + ntok[r] * kr[r]])) == ntok[r] * kr[r]
                for r in multi
            ):
                corrupt[p] = True

    experts = np.full((N, n_layers, K), -1, np.int16)
    tok0 = base[pass_of] + T[pass_of] - ntok  # first token row of each record
    in_corrupt = corrupt[pass_of]

    # --- clean records: one vectorised scatter, in chunks -------------------------------------
    clean = np.flatnonzero(~in_corrupt & (ntok > 0))
    counts = ntok * kr
    CH = 1 << 22
    i = 0
    while i < len(clean):
        csum = np.cumsum(counts[clean[i:]])
        j = i + max(1, int(np.searchsorted(csum, CH, side="right")))
        rs = clean[i:j]
        c = counts[rs]
        rec = np.repeat(rs, c)
        idx = np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
        kk = kr[rec]
        experts[tok0[rec] + idx // kk, layer[rec], idx % kk] = ids[starts[rec] + idx]
        i = j

    # --- corrupt passes: keep the real rows only ----------------------------------------------
    for p in np.flatnonzero(corrupt):
        lo = pass_start[p]
        hi = pass_start[p + 1] if p + 1 < P else R
        kept = dropped = 0
        kept_layers: dict[int, list[int]] = {}
        for r in range(lo, hi):
            k_r, t_r = int(kr[r]), int(ntok[r])
            flat = ids[starts[r]:starts[r] + t_r * k_r]
            for row in range(t_r):
                if row * n_experts + k_r <= t_r * k_r:
                    experts[tok0[r] + row, layer[r], :k_r] = flat[row * n_experts:
                                                                 row * n_experts + k_r]
                    kept += 1
                    kept_layers.setdefault(int(tok0[r] + row - base[p]), []).append(int(layer[r]))
                else:
                    dropped += 1
        how = ("each layer's rows are full rankings of all experts" if evidence[p]
               else "no full ranking to prove it, but the same exporter garbled other passes")
        tok_desc = "; ".join(f"token {t}: {_span(ls)}" for t, ls in sorted(kept_layers.items()))
        notes.append(
            f"{name}: {span(lo, hi)} (prefill pass {p}, {int(T[p])} tokens) "
            f"were exported from llama.cpp's strided top-k view as if contiguous ({how}); kept "
            f"{kept} real rows ({tok_desc}) and dropped {dropped} corrupt rows")

    # --- phases, sequences, positions -----------------------------------------------------
    phase_pass = np.where(prefill_pass, PREFILL, DECODE).astype(np.uint8)
    seq_pass = np.cumsum(prefill_pass) - (1 if prefill_pass[0] else 0)
    phase = np.repeat(phase_pass, T)
    seq = np.repeat(seq_pass, T).astype(np.int32)
    tok_idx = np.arange(N)
    seq_first = np.zeros(int(seq.max()) + 1 if N else 0, np.int64)
    if N:
        first = np.ones(N, bool)
        first[1:] = seq[1:] != seq[:-1]
        seq_first[seq[first]] = tok_idx[first]
    pos = (tok_idx - seq_first[seq]).astype(np.int32) if N else np.zeros(0, np.int32)

    keep = np.ones(N, bool)
    if corrupt.any():
        in_cp = np.repeat(corrupt, T)
        empty = (experts < 0).all(axis=(1, 2))
        keep = ~(in_cp & empty)
        gone = int((~keep).sum())
        if gone:
            notes.append(f"{name}: removed {gone} prompt tokens left with no real routing "
                         f"(positions kept for the others)")
    experts, phase, seq, pos = experts[keep], phase[keep], seq[keep], pos[keep]
    return Trace(n_layers, n_experts, K, experts, phase, seq, pos, notes=notes)


def _record_span(offs: np.ndarray, byte0: int, lo: int, hi: int) -> str:
    return (f"records {lo}-{hi - 1} (from byte {byte0 + 4 * int(offs[lo])})")


def _span(layers: list[int]) -> str:
    layers = sorted(layers)
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layer" + ("s " if len(layers) > 1 else " ") + ",".join(map(str, layers))


# ---------------------------------------------------------------------------------------------
# nuthatch text


def nuthatch_text_rows(text: str, where: str) -> tuple[list[list[int]], list[int]]:
    """The lines `layer e0 .. ek` of a nuthatch text export as integer rows, with line numbers."""
    rows: list[list[int]] = []
    linenos: list[int] = []
    for i, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
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


def _import_nuthatch_text(path: Path, data: bytes, n_layers, n_experts) -> Trace:
    where = str(path)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise MboltError(f"{where}: not a nuthatch text trace (non-ASCII byte at {e.start})") \
            from None
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
    E = int(sel.max()) + 1
    if n_experts is not None:
        if E > n_experts:
            i = int(np.argmax(sel.max(axis=1)))
            raise MboltError(f"{where}: line {lines[i]}: expert id {int(sel[i].max())} out of "
                             f"range (n_experts={n_experts})")
        E = n_experts
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

    L = _n_layers(where, layer, n_layers, loc)
    ids = sel.ravel()
    def span(lo, hi):
        return f"lines {int(lines[rstart[lo]])}-{int(lines[rstart[hi - 1] + ntok[hi - 1] - 1])}"

    return _assemble(where, ids, rstart * K, layer, np.full(len(rstart), K, np.int64), ntok,
                     L, E, K, loc, span)


# ---------------------------------------------------------------------------------------------
# nuthatch NUTHTRC1


def _import_nuthatch_bin(path: Path, data: bytes, n_layers, n_experts, prefill_tokens) -> Trace:
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
    offs, end = _walk(words, lambda h: h[:, 2], where, _NUTH_HEAD.size, max_records=n_records)
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
    _check_ids(where, ids, starts, nsel, E, loc)
    K = max(int(nsel.max()) if len(nsel) else 1, 1)

    uniq, first_idx, inverse, cnt = np.unique(token, return_index=True, return_inverse=True,
                                              return_counts=True)
    if len(token) > 1 and L > 1 and (cnt == 1).all():
        # token field is a record counter (nuthatch's text reader numbers lines that way):
        # regroup rows into tokens by layer order, like the text format
        tr = _assemble(where, ids, starts, layer, nsel, np.ones(len(layer), np.int64), L, E, K,
                       loc, lambda lo, hi: _record_span(offs, _NUTH_HEAD.size, lo, hi))
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
