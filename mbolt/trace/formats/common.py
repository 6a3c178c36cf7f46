"""What the importers share: reading a file, walking int32 records with every count checked, the
forward-pass assembly of routing rows into tokens (prefill passes, the strided-view export bug),
and the override checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_cells
from mbolt.core.errors import MboltError
from mbolt.core.trace import DECODE, PREFILL, Trace

MAX_CELLS_IMPORT = 1 << 28


def read_bytes_of(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MboltError(f"{path}: trace file not found") from None
    except OSError as e:
        raise MboltError(f"{path}: cannot read: {e.strerror}") from None


def check_override(path, tr: Trace, n_layers, n_experts) -> None:
    if n_layers is not None and n_layers != tr.n_layers:
        raise MboltError(f"{path}: trace has {tr.n_layers} layers, expected {n_layers}")
    if n_experts is not None and n_experts != tr.n_experts:
        raise MboltError(f"{path}: trace has {tr.n_experts} experts, expected {n_experts}")


# ---------------------------------------------------------------------------------------------
# binary record walking (vectorised over runs of equal-size records)


def walk_records(words: np.ndarray, n_ids, where: str, byte0: int, max_records: int | None = None):
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


def check_ids(where: str, ids: np.ndarray, starts: np.ndarray, counts: np.ndarray,
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


# ---------------------------------------------------------------------------------------------
# pass assembly shared by MBOLT_TRACE and nuthatch text


def assemble(where: str, ids: np.ndarray, starts: np.ndarray, layer: np.ndarray,
              kr: np.ndarray, ntok: np.ndarray, n_layers: int, n_experts: int, K: int, loc,
              span, *, gates: np.ndarray | None = None, strided_bug: bool = True) -> Trace:
    """Records (layer, kr, ntok rows of ids at starts) in file order -> Trace.

    `loc(r)` names record r for messages; `span(lo, hi)` names records lo..hi-1. `gates`, when
    the format has them, are the routing weights laid out as `ids`. `strided_bug`: look for
    llama.cpp's strided-view export bug (formats written from llama.cpp's ffn_moe_topk only).
    Ids of -1 are padding (a row with fewer than K experts).
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
    for p in np.flatnonzero(prefill_pass & strided_bug):
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
    weights = None if gates is None else np.zeros((N, n_layers, K), np.float32)
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
        if weights is not None:
            weights[tok0[rec] + idx // kk, layer[rec], idx % kk] = gates[starts[rec] + idx]
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
        tok_desc = "; ".join(f"token {t}: {layer_span(ls)}" for t, ls in sorted(kept_layers.items()))
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
    return Trace(n_layers, n_experts, K, experts, phase, seq, pos, None if weights is None else weights[keep],
                 notes=notes)


def record_span(offs: np.ndarray, byte0: int, lo: int, hi: int) -> str:
    return (f"records {lo}-{hi - 1} (from byte {byte0 + 4 * int(offs[lo])})")


def layer_span(layers: list[int]) -> str:
    layers = sorted(layers)
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layer" + ("s " if len(layers) > 1 else " ") + ",".join(map(str, layers))


# ---------------------------------------------------------------------------------------------
# nuthatch text


def infer_n_experts(where, ids: np.ndarray, n_experts, loc) -> int:
    """Experts per layer: the largest id + 1, or `n_experts` when given (an id beyond it is an
    error naming where it is: `loc(i)` for the flat index i into `ids`)."""
    E = int(ids.max()) + 1
    if n_experts is not None:
        if E > n_experts:
            i = int(np.argmax(ids))
            raise MboltError(f"{where}: {loc(i)}: expert id {int(ids.flat[i])} out of range (n_experts={n_experts})")
        E = n_experts
    return E


def decode_ascii(where: str, data: bytes, what: str) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError as e:
        raise MboltError(f"{where}: not {what} (non-ASCII byte at {e.start})") from None


def numbered_lines(text: str):
    """(line number from 1, line, its whitespace-separated fields) of every non-blank line."""
    for i, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if parts:
            yield i, line, parts


def infer_n_layers(where, layer: np.ndarray, n_layers, loc) -> int:
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
