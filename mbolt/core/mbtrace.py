"""The `.mbtrace` file: routing of every token, append-only and crash-safe.

Layout (all integers little-endian)
-----------------------------------
Header::

    magic        8 bytes   b"MBTRACE\\0"
    version      u32       1
    n_layers     u32       layers in the model (dense layers are recorded as -1)
    n_experts    u32       routed experts per layer
    k            u32       experts used per token (1 <= k <= n_experts)
    flags        u32       bit 0: records carry routing weights (float32)
    fp_len       u16       length of the fingerprint
    fingerprint  fp_len    ASCII hex of the source model's fingerprint ("" for imports)
    crc          u32       zlib.crc32 of every header byte before it

Then records, appended one after another until the end of the file. Every record is
self-delimiting::

    tag          1 byte    b"T" token, b"D" domain tag, b"N" note
    length       u32       payload bytes
    payload      length bytes
    crc          u32       zlib.crc32(tag + length + payload)

Payloads:

* ``T`` (one token): ``phase u8`` (0 prefill, 1 decode), ``seq i32``, ``pos i32``,
  ``experts i16[n_layers * k]`` (row-major [layer, rank], rank order, -1 where a layer is
  dense or was not recorded), then ``weights f32[n_layers * k]`` when flag bit 0 is set.
  All ``T`` records of a file have the same size, so runs of them are read with one
  ``np.frombuffer``.
* ``D`` (domain of a sequence): ``seq i32`` then the tag as UTF-8. A later ``D`` for the same
  sequence replaces the earlier one.
* ``N`` (note): UTF-8 text, e.g. what an importer dropped. Becomes ``Trace.notes``.

Crash behaviour
---------------
`TraceWriter` writes the header and then appends records straight to the final path (no
temporary file: the point is that the file exists, and is readable, while a long trace is being
recorded). Every record is flushed to the OS when it is appended and the file is fsynced on
close. A process that dies mid-write leaves a torn last record; `read_trace` drops it (a record
that runs past the end of the file, whose checksum fails, or a tail of zero bytes), warns, and
says so in ``Trace.notes``. A bad checksum anywhere *before* the last record, bad magic, an
unknown version, ``k > n_experts``, an expert id out of range or an unknown phase is an
`MboltError` naming the file and the record (or token) index and byte offset. The writers also
refuse an expert repeated within one (token, layer); the reader, which must stay fast, trusts
the checksummed records on that point. `write_trace` writes a whole `Trace` atomically
(temporary file + rename). Whether a trace fits a model is `mbolt.core.compat`'s
one rule.

API: ``TraceWriter(path, n_layers, n_experts, k, fingerprint="", weights=False)`` with
``.append(phase, seq, pos, experts[n_layers, k], weights=None)``, ``.extend(...)`` for many
tokens, ``.set_domain(seq, tag)``, ``.add_note(text)``, ``.close()``; ``write_trace(path,
trace)``; ``read_trace(path) -> Trace``; ``is_mbtrace(path)``.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np

from mbolt.core.atomic import atomic_output
from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS
from mbolt.core.errors import MboltError
from mbolt.core.trace import DECODE, PREFILL, Trace

MAGIC = b"MBTRACE\0"
VERSION = 1
FLAG_WEIGHTS = 1

TAG_TOKEN = b"T"
TAG_DOMAIN = b"D"
TAG_NOTE = b"N"

_HEAD = struct.Struct("<IIIIIH")  # version, n_layers, n_experts, k, flags, fp_len
_REC_HEAD = struct.Struct("<cI")  # tag, payload length
_CRC = struct.Struct("<I")
_I32 = struct.Struct("<i")

_PHASES = {"prefill": PREFILL, "decode": DECODE, PREFILL: PREFILL, DECODE: DECODE}


def _token_dtype(n_layers: int, k: int, weights: bool) -> np.dtype:
    """Packed numpy dtype of one complete T record (framing included)."""
    fields = [
        ("tag", "S1"), ("length", "<u4"),
        ("phase", "u1"), ("seq", "<i4"), ("pos", "<i4"),
        ("experts", "<i2", (n_layers, k)),
    ]
    if weights:
        fields.append(("weights", "<f4", (n_layers, k)))
    fields.append(("crc", "<u4"))
    return np.dtype(fields)  # packed (align=False): offsets are exactly the byte layout


def _header_bytes(n_layers: int, n_experts: int, k: int, fingerprint: str, weights: bool) -> bytes:
    fp = fingerprint.encode("ascii")
    body = MAGIC + _HEAD.pack(VERSION, n_layers, n_experts, k, FLAG_WEIGHTS if weights else 0,
                              len(fp)) + fp
    return body + _CRC.pack(zlib.crc32(body))


def _frame(tag: bytes, payload: bytes) -> bytes:
    head = _REC_HEAD.pack(tag, len(payload))
    return head + payload + _CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def _check_shape(where: str, n_layers: int, n_experts: int, k: int) -> None:
    if n_layers < 1 or n_experts < 1 or k < 1:
        raise MboltError(f"{where}: n_layers, n_experts and k must be >= 1 "
                         f"(got {n_layers}, {n_experts}, {k})")
    if k > n_experts:
        raise MboltError(f"{where}: k={k} is larger than the number of experts ({n_experts})")
    if n_experts > MAX_EXPERTS:
        raise MboltError(f"{where}: {n_experts} experts do not fit int16 expert ids")
    if n_layers > MAX_LAYERS:
        raise MboltError(f"{where}: {n_layers} layers (at most {MAX_LAYERS} supported: damaged file?)")


def validate_experts(where: str, experts: np.ndarray, n_experts: int, first_record: int = 0,
                      offsets: np.ndarray | None = None, unique: bool = True) -> None:
    """Range (and with `unique`, no repeats per token and layer) of expert ids [N, L, k]; the
    error names the first bad token."""
    if experts.size == 0:
        return
    what = "out of range"
    if int(experts.min()) >= -1 and int(experts.max()) < n_experts:
        if not unique:
            return
        bad = None
        s = np.sort(experts, axis=-1)
        dup = s[..., 1:] == s[..., :-1]
        dup &= s[..., 1:] >= 0
        if dup.any():
            bad = np.zeros(experts.shape, bool)
            bad[..., 1:] = dup  # marks sorted positions; only the (token, layer) matters
            what = "repeated in one layer"
        if bad is None:
            return
    else:
        bad = (experts < -1) | (experts >= n_experts)
    if bad.any():
        t, layer, r = (int(x[0]) for x in np.nonzero(bad))
        rec = first_record + t
        at = f" at byte {int(offsets[t])}" if offsets is not None else ""
        if what == "out of range":
            val = int(experts[t, layer, r])
            raise MboltError(f"{where}: token {rec}{at}: expert id {val} at layer {layer} is "
                             f"out of range (n_experts={n_experts})")
        raise MboltError(f"{where}: token {rec}{at}: an expert id is {what} at layer {layer}: "
                         f"{experts[t, layer].tolist()}")


class TraceWriter:
    """Append tokens to a new `.mbtrace` file as they are routed.

    The file is created (or replaced) at `path` at once with its header; each `append` writes
    one self-checking record and flushes it (every `flush_every` records), so a crash loses at
    most the record being written. `close()` fsyncs. Use as a context manager. `force=False`
    refuses to replace an existing file.
    """

    def __init__(self, path: str | os.PathLike, n_layers: int, n_experts: int, k: int,
                 fingerprint: str = "", weights: bool = False, flush_every: int = 1,
                 force: bool = True):
        self.path = Path(path)
        _check_shape(str(self.path), n_layers, n_experts, k)
        if not force and self.path.exists():
            raise MboltError(f"{self.path}: output exists (use --force to overwrite)")
        self.n_layers, self.n_experts, self.k = int(n_layers), int(n_experts), int(k)
        self.weights = bool(weights)
        self.fingerprint = fingerprint or ""
        self.flush_every = max(1, int(flush_every))
        self.n_records = 0
        self._pending = 0
        self._dtype = _token_dtype(self.n_layers, self.k, self.weights)
        try:
            self._f = open(self.path, "wb")
        except OSError as e:
            raise MboltError(f"{self.path}: cannot create trace file: {e.strerror}") from None
        self._put(_header_bytes(self.n_layers, self.n_experts, self.k, self.fingerprint, self.weights))

    # -- writing --------------------------------------------------------------------------
    def append(self, phase, seq: int, pos: int, experts, weights=None) -> None:
        """One token: `experts` [n_layers, k] expert ids in rank order (-1 = not recorded)."""
        self.extend(phase, np.array([seq]), np.array([pos]), np.asarray(experts)[None],
                    None if weights is None else np.asarray(weights)[None])

    def extend(self, phase, seq, pos, experts, weights=None) -> None:
        """Many tokens at once: seq/pos [n] (or scalars), experts [n, n_layers, k]."""
        if self._f is None:
            raise MboltError(f"{self.path}: trace writer is closed")
        experts = np.asarray(experts)
        if experts.ndim != 3 or experts.shape[1:] != (self.n_layers, self.k):
            raise MboltError(f"{self.path}: expected experts of shape [n, {self.n_layers}, "
                             f"{self.k}], got {list(experts.shape)}")
        n = experts.shape[0]
        if n == 0:
            return
        validate_experts(str(self.path), experts, self.n_experts, self.n_records)
        if self.weights and weights is None:
            raise MboltError(f"{self.path}: this trace records routing weights; pass weights")
        if not self.weights and weights is not None:
            raise MboltError(f"{self.path}: weights given but the trace was opened without them")
        ph = np.asarray(phase)
        if ph.dtype.kind in "US":
            ph = np.vectorize(lambda p: _PHASES.get(str(p), 255), otypes=[np.int64])(ph)
        ph = np.broadcast_to(ph.astype(np.int64), (n,))
        if not np.isin(ph, (PREFILL, DECODE)).all():
            raise MboltError(f"{self.path}: phase must be 'prefill' or 'decode' "
                             f"(got {np.asarray(phase).ravel()[:3].tolist()})")
        recs = np.zeros(n, self._dtype)
        recs["tag"] = TAG_TOKEN
        recs["length"] = self._dtype.itemsize - _REC_HEAD.size - _CRC.size
        recs["phase"] = ph
        recs["seq"] = np.broadcast_to(np.asarray(seq), (n,))
        recs["pos"] = np.broadcast_to(np.asarray(pos), (n,))
        recs["experts"] = experts
        if self.weights:
            w = np.asarray(weights, dtype=np.float32)
            if w.shape != experts.shape:
                raise MboltError(f"{self.path}: weights shape {list(w.shape)} does not match "
                                 f"experts {list(experts.shape)}")
            recs["weights"] = w
        _fill_crc(recs)
        self._put(recs.tobytes(), flush=False)
        self.n_records += n
        self._pending += n
        if self._pending >= self.flush_every:
            self._put(b"")
            self._pending = 0

    def set_domain(self, seq: int, tag: str) -> None:
        """Tag sequence `seq` with a domain (e.g. "code"); the last tag written wins."""
        self._write(TAG_DOMAIN, _I32.pack(int(seq)) + str(tag).encode("utf-8"))

    def add_note(self, text: str) -> None:
        self._write(TAG_NOTE, str(text).encode("utf-8"))

    def _write(self, tag: bytes, payload: bytes) -> None:
        if self._f is None:
            raise MboltError(f"{self.path}: trace writer is closed")
        self._put(_frame(tag, payload))

    def _put(self, data: bytes, flush: bool = True) -> None:
        """Write (and flush) to the trace; a write error (no space left) names the file."""
        try:
            self._f.write(data)
            if flush:
                self._f.flush()
        except OSError as e:
            raise MboltError(f"{self.path}: cannot write the trace: {e.strerror or e}") from None

    def close(self) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            raise MboltError(f"{self.path}: cannot write the trace: {e.strerror or e}") from None
        finally:
            f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fill_crc(recs: np.ndarray) -> None:
    """Set the crc field of each packed T record (crc over everything but the crc itself)."""
    size = recs.dtype.itemsize
    raw = recs.view(np.uint8).reshape(len(recs), size)
    crcs = np.fromiter((zlib.crc32(row) for row in raw[:, : size - 4]), np.uint32, len(recs))
    recs["crc"] = crcs


def write_trace(path: str | os.PathLike, trace: Trace, *, force: bool = True) -> Path:
    """Write a whole `Trace` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    _check_shape(str(path), trace.n_layers, trace.n_experts, trace.k)
    weights = trace.weights is not None
    dtype = _token_dtype(trace.n_layers, trace.k, weights)
    n = trace.n_tokens
    experts = np.asarray(trace.experts)
    if experts.shape != (n, trace.n_layers, trace.k):
        raise MboltError(f"{path}: trace experts have shape {list(experts.shape)}, header says "
                         f"[n, {trace.n_layers}, {trace.k}]")
    validate_experts(str(path), experts, trace.n_experts)
    recs = np.zeros(n, dtype)
    recs["tag"] = TAG_TOKEN
    recs["length"] = dtype.itemsize - _REC_HEAD.size - _CRC.size
    recs["phase"] = trace.phase
    recs["seq"] = trace.seq
    recs["pos"] = trace.pos
    recs["experts"] = experts
    if weights:
        recs["weights"] = trace.weights
    _fill_crc(recs)
    with atomic_output(path, force=force) as f:
        f.write(_header_bytes(trace.n_layers, trace.n_experts, trace.k, trace.fingerprint,
                              weights))
        for note in trace.notes:
            f.write(_frame(TAG_NOTE, note.encode("utf-8")))
        for s, tag in sorted(trace.domains.items()):
            f.write(_frame(TAG_DOMAIN, _I32.pack(int(s)) + tag.encode("utf-8")))
        f.write(recs.tobytes())
    return path


def is_mbtrace(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _zeros_from(buf: bytes, i: int) -> bool:
    """True when nothing but zero bytes (or nothing) follows offset i: a torn tail."""
    return buf.count(b"\0", i) == len(buf) - i


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a `.mbtrace` file into a `Trace` of numpy arrays."""
    path = Path(path)
    try:
        buf = path.read_bytes()
    except FileNotFoundError:
        raise MboltError(f"{path}: trace file not found") from None
    except OSError as e:
        raise MboltError(f"{path}: cannot read trace file: {e.strerror}") from None
    where = str(path)

    # -- header ---------------------------------------------------------------------------
    if len(buf) < len(MAGIC) or buf[: len(MAGIC)] != MAGIC:
        raise MboltError(f"{where}: not an .mbtrace file (bad magic {buf[:8]!r})")
    if len(buf) < len(MAGIC) + _HEAD.size:
        raise MboltError(f"{where}: header truncated ({len(buf)} bytes)")
    version, n_layers, n_experts, k, flags, fp_len = _HEAD.unpack_from(buf, len(MAGIC))
    if version != VERSION:
        raise MboltError(f"{where}: unsupported .mbtrace version {version} (this mbolt reads "
                         f"version {VERSION})")
    hend = len(MAGIC) + _HEAD.size + fp_len
    if len(buf) < hend + _CRC.size:
        raise MboltError(f"{where}: header truncated ({len(buf)} bytes)")
    (hcrc,) = _CRC.unpack_from(buf, hend)
    if hcrc != zlib.crc32(buf[:hend]):
        raise MboltError(f"{where}: header checksum mismatch (byte 0-{hend})")
    _check_shape(f"{where}: header", n_layers, n_experts, k)
    if flags & ~FLAG_WEIGHTS:
        raise MboltError(f"{where}: unknown header flags 0x{flags:x}")
    fingerprint = buf[len(MAGIC) + _HEAD.size: hend].decode("ascii", "replace")
    weights = bool(flags & FLAG_WEIGHTS)
    dtype = _token_dtype(n_layers, k, weights)
    tsize = dtype.itemsize
    tpayload = tsize - _REC_HEAD.size - _CRC.size

    # -- records: walk the framing, verify checksums ----------------------------------------
    off = hend + _CRC.size
    end = len(buf)
    runs: list[tuple[int, int]] = []  # (offset, count) of back-to-back T records
    domains: dict[int, str] = {}
    notes: list[str] = []
    dropped = None
    rec = 0
    mv = memoryview(buf)
    unpack_head = _REC_HEAD.unpack_from
    crc32 = zlib.crc32
    while off < end:
        # fast path: a run of T records of the expected size, checked in chunks
        if end - off >= tsize and buf[off] == 0x54:  # b"T"
            m = min((end - off) // tsize, 8192)
            head = np.frombuffer(buf, dtype, count=m, offset=off)
            ok = (head["tag"] == TAG_TOKEN) & (head["length"] == tpayload)
            j = m if ok.all() else int(np.argmin(ok))
            if j:
                stored = head["crc"][:j].tolist()
                for i in range(j):
                    o = off + i * tsize
                    if stored[i] != crc32(mv[o:o + tsize - 4]):
                        if _zeros_from(buf, o + tsize):
                            dropped = (rec + i, o, "its checksum does not match")
                            break
                        raise MboltError(f"{where}: record {rec + i} at byte {o}: "
                                         f"checksum mismatch")
                else:
                    i = j
                if runs and runs[-1][0] + runs[-1][1] * tsize == off:
                    runs[-1] = (runs[-1][0], runs[-1][1] + i)
                elif i:
                    runs.append((off, i))
                off += i * tsize
                rec += i
                if dropped is not None:
                    break
                continue
        # general path
        if end - off < _REC_HEAD.size:
            dropped = (rec, off, "it is cut short")
            break
        tag, length = unpack_head(buf, off)
        rend = off + _REC_HEAD.size + length + _CRC.size
        if tag not in (TAG_TOKEN, TAG_DOMAIN, TAG_NOTE) or rend > end:
            if _zeros_from(buf, off):
                dropped = (rec, off, f"the last {end - off} bytes are zeros")
                break
            if rend > end and tag in (TAG_TOKEN, TAG_DOMAIN, TAG_NOTE):
                dropped = (rec, off, "it is cut short")
                break
            raise MboltError(f"{where}: record {rec} at byte {off}: unknown record tag {tag!r}")
        (crc,) = _CRC.unpack_from(buf, rend - 4)
        if crc != crc32(mv[off:rend - 4]):
            if _zeros_from(buf, rend):
                dropped = (rec, off, "its checksum does not match")
                break
            raise MboltError(f"{where}: record {rec} at byte {off}: checksum mismatch")
        payload = buf[off + _REC_HEAD.size: rend - 4]
        if tag == TAG_TOKEN:
            raise MboltError(f"{where}: record {rec} at byte {off}: token record of {length} "
                             f"bytes, expected {tpayload} for {n_layers} layers x k={k}")
        if tag == TAG_DOMAIN:
            if length < 4:
                raise MboltError(f"{where}: record {rec} at byte {off}: domain record too short")
            (s,) = _I32.unpack_from(payload)
            domains[s] = payload[4:].decode("utf-8", "replace")
        else:
            notes.append(payload.decode("utf-8", "replace"))
        off = rend
        rec += 1

    # -- token arrays ---------------------------------------------------------------------
    parts = [np.frombuffer(buf, dtype, count=c, offset=o) for o, c in runs]
    recs = np.concatenate(parts) if parts else np.zeros(0, dtype)
    experts = np.ascontiguousarray(recs["experts"], dtype=np.int16)
    phase = np.ascontiguousarray(recs["phase"], dtype=np.uint8)
    if len(recs):
        offsets = np.concatenate([o + tsize * np.arange(c) for o, c in runs])
        bad = ~np.isin(phase, (PREFILL, DECODE))
        if bad.any():
            t = int(np.flatnonzero(bad)[0])
            raise MboltError(f"{where}: token {t} at byte {int(offsets[t])}: unknown phase "
                             f"{int(phase[t])}")
        validate_experts(where, experts, n_experts, 0, offsets, unique=False)
    if dropped is not None:
        r, o, why = dropped
        msg = (f"{path.name}: dropped a torn last record (record {r} at byte {o}: {why}); "
               f"the writer was probably interrupted")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    return Trace(
        n_layers=n_layers, n_experts=n_experts, k=k, experts=experts, phase=phase,
        seq=np.ascontiguousarray(recs["seq"], dtype=np.int32),
        pos=np.ascontiguousarray(recs["pos"], dtype=np.int32),
        weights=np.ascontiguousarray(recs["weights"], dtype=np.float32) if weights else None,
        domains=domains, fingerprint=fingerprint, notes=notes,
    )
