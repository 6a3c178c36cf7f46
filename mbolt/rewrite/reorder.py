"""Streaming bit-exact rewriter: permute the experts of a MoE GGUF, or pack them per expert.

Nothing but byte order changes. The header is rebuilt from the source's own bytes (every
metadata key/value pair is copied verbatim, old `mbolt.*` keys are replaced by the new route
map), then the data section is assembled from source byte ranges with `os.copy_file_range`
(bytes stay in the kernel; buffered pread/pwrite when the kernel refuses), one merged range at
a time, so memory stays flat whatever the model size.

Plans name ORIGINAL expert ids (traces record original ids through the route map), so the
output's route map is the plan itself; reordering an already rewritten file composes through
its route map, and the identity plan restores the stock order.

layouts
  reorder  standard tensor names; loads in unmodified llama.cpp. Every expert-indexed tensor
           (gate/up/down/gate_up exps, router weight and bias, exp_probs_b, per-expert biases)
           is permuted with the layer's perm; everything else is copied unchanged.
  packed   each MoE layer's routed weights become one I8 tensor `blk.N.ffn_exps_packed` where
           position p holds its expert's gate|up|down slices back to back (core/packed.py);
           for explicit-read engines (the reference engine reads it; llama.cpp does not).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from mbolt.core.atomic import atomic_output, clean_stale_parts, write_text_atomic
from mbolt.core.errors import MboltError
from mbolt.core.header import encode_header_start, encode_kv, encode_tensor_info, read_header
from mbolt.core.moe_map import PAGE, WEIGHT_ROLES, MoeMap, moe_map
from mbolt.core.packed import PACK_PAD_MAX, PackedLayer, PackedRole, packed_kvs, packed_name, slot_stride
from mbolt.core.routemap import (ROUTE_MAP_VERSION, check_perm, identity_perm, is_route_map_key, sidecar_dict,
                                  sidecar_path)

CHUNK = 64 << 20  # bytes per copy_file_range call (progress granularity)
SPLIT = 16 << 20  # copy ranges are cut to this size
BUF = 8 << 20  # buffer of the fallback copy
READAHEAD = 64 << 20  # source bytes advised (WILLNEED) ahead of the copy
WRITEBACK = 32 << 20  # start writeback of the output every this many bytes

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


# ---- the logical tensors of a file (packed blobs expanded into their virtual tensors) ----


@dataclass
class LTensor:
    name: str
    ne: tuple[int, ...]
    type: GGMLQuantizationType
    nbytes: int
    data_offset: int  # absolute; for expert-indexed tensors, position 0's slice
    layer: int = -1  # >= 0 for expert-indexed tensors
    role: str = ""  # moe_map role of an expert-indexed tensor; "" for a plain tensor
    slice_bytes: int = 0
    stride: int = 0
    container: str = ""  # packed blob holding this virtual tensor

    @property
    def expert_indexed(self) -> bool:
        return self.layer >= 0

    def at(self, position: int) -> int:
        return self.data_offset + position * self.stride


def logical_tensors(m: MoeMap) -> list[LTensor]:
    """Every tensor of the model as the stock file would have it, in file (info) order."""
    experts = {x.name: (layer.index, x) for layer in m.layers for x in layer.experts if not x.container}
    virtual: dict[str, list] = {}
    for layer in m.layers:
        for x in layer.weights:
            if x.container:
                virtual.setdefault(x.container, []).append((layer.index, x))
    out = []
    for t in m.header.tensors:
        if t.name in virtual:
            for li, x in virtual[t.name]:
                out.append(LTensor(x.name, tuple(x.ne), GGMLQuantizationType[x.type], x.nbytes, x.data_offset,
                                   li, x.role, x.slice_bytes, x.stride, x.container))
        elif t.name in experts:
            li, x = experts[t.name]
            out.append(LTensor(t.name, tuple(t.ne), t.type, t.nbytes, t.data_offset, li, x.role, x.slice_bytes, x.slice_bytes))
        else:
            out.append(LTensor(t.name, tuple(t.ne), t.type, t.nbytes, t.data_offset))
    return out


# ---- GGUF header encoding ----


_KIND = {"i32": GGUFValueType.INT32, "u32": GGUFValueType.UINT32, "u64": GGUFValueType.UINT64,
         "f32": GGUFValueType.FLOAT32, "str": GGUFValueType.STRING}


def route_map_kvs(layout: str, perm: np.ndarray, heat: np.ndarray, method: str, source_fp: str,
                  packed: list[PackedLayer]) -> list[bytes]:
    A, S = GGUFValueType.ARRAY, GGUFValueType.STRING
    kvs = [
        encode_kv("mbolt.version", GGUFValueType.UINT32, ROUTE_MAP_VERSION),
        encode_kv("mbolt.layout", S, layout),
        encode_kv("mbolt.n_layers", GGUFValueType.UINT32, perm.shape[0]),
        encode_kv("mbolt.n_experts", GGUFValueType.UINT32, perm.shape[1]),
        encode_kv("mbolt.perm", A, perm.reshape(-1).astype(np.int32), GGUFValueType.INT32),
        encode_kv("mbolt.heat", A, heat.reshape(-1).astype(np.float32), GGUFValueType.FLOAT32),
        encode_kv("mbolt.source.fingerprint", S, source_fp),
        encode_kv("mbolt.plan.method", S, method),
    ]
    if packed:
        for key, (kind, value) in packed_kvs(packed).items():
            kvs.append(encode_kv(key, A, value, _KIND[kind]))
    return kvs


# ---- output plan ----


@dataclass
class OutTensor:
    name: str
    ne: tuple[int, ...]
    type: GGMLQuantizationType
    pieces: list[tuple[int | None, int]]  # (source offset or None for zeros, length), in order
    offset: int = 0  # relative to the data section, set by _place

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.pieces)


@dataclass
class ReorderResult:
    src: str
    dst: str
    layout: str
    method: str
    bytes_written: int
    seconds: float
    copy_ops: int
    copy_mode: str  # "copy_file_range" or "buffered"
    identity: bool
    n_moe_layers: int
    alignment: list[str] = field(default_factory=list)  # what is 4 KiB aligned and what is not
    removed_stale: list[str] = field(default_factory=list)
    sidecar: str = ""
    fingerprint: str = ""
    source_fingerprint: str = ""

    @property
    def throughput(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"throughput_bytes_s": self.throughput}


def plan_output(m: MoeMap, perm: np.ndarray, layout: str) -> tuple[list[OutTensor], list[PackedLayer], list[str]]:
    """The output tensors (each a list of source byte ranges), the packed metadata and
    alignment notes. `perm` [n_layers, E] names original expert ids per output position."""
    in_pos = m.route_map.pos
    tensors = logical_tensors(m)
    notes: list[str] = []
    out: list[OutTensor] = []
    packed: list[PackedLayer] = []
    done_layers: set[int] = set()
    slice_ok, slice_bad, slot_ok, slot_bad = [], [], [], []
    weights_by_layer: dict[int, list[LTensor]] = {}
    for t in tensors:
        if t.role in WEIGHT_ROLES:
            weights_by_layer.setdefault(t.layer, []).append(t)

    def src_positions(layer: int) -> np.ndarray:  # input position of each output position's expert
        return in_pos[layer][perm[layer]]

    for t in tensors:
        if not t.expert_indexed:
            out.append(OutTensor(t.name, t.ne, t.type, [(t.data_offset, t.nbytes)]))
            continue
        q = src_positions(t.layer)
        if layout == "packed" and t.role in WEIGHT_ROLES:
            if t.layer in done_layers:
                continue
            done_layers.add(t.layer)
            ws = sorted(weights_by_layer[t.layer], key=lambda w: w.data_offset)
            raw = sum(w.slice_bytes for w in ws)
            stride, granule = slot_stride(raw)
            pl = PackedLayer(t.layer, stride)
            off = 0
            for w in ws:
                if len(w.ne) > 4:
                    raise MboltError(f"{m.path}: tensor {w.name} has {len(w.ne)} dimensions")
                pl.roles.append(PackedRole(w.name, int(w.type), w.ne, off, w.slice_bytes))
                off += w.slice_bytes
            pieces = []
            for p in range(len(q)):
                for w in ws:
                    pieces.append((w.at(int(q[p])), w.slice_bytes))
                if stride > raw:
                    pieces.append((None, stride - raw))
            packed.append(pl)
            out.append(OutTensor(packed_name(t.layer), (stride, len(q)), GGMLQuantizationType.I8, pieces))
            if granule == "4 KiB":
                slot_ok.append((t.layer, stride, stride - raw))
            else:
                slot_bad.append((t.layer, raw, granule))
            continue
        pieces = [(t.at(int(q[p])), t.slice_bytes) for p in range(len(q))]
        is_weight = t.role in WEIGHT_ROLES
        out.append(OutTensor(t.name, t.ne, t.type, pieces))
        if is_weight:
            (slice_ok if t.slice_bytes % PAGE == 0 else slice_bad).append((t.name, t.slice_bytes))
    notes.append("every tensor starts 4 KiB aligned (general.alignment 4096)")
    if slice_ok:
        notes.append(f"{len(slice_ok)} expert tensors: every slice 4 KiB aligned")
    if slice_bad:
        name, sb = slice_bad[0]
        notes.append(f"{len(slice_bad)} expert tensors: slices not 4 KiB aligned (e.g. {name}: {sb} B, not a "
                     "multiple of 4 KiB); only their first slice is")
    if slot_ok:
        pads = sorted({pad for _, _, pad in slot_ok})
        notes.append(f"{len(slot_ok)} packed layers: every expert slot 4 KiB aligned (slot {slot_ok[0][1]} B"
                     + (f", {pads[-1]} B padding per slot at most)" if pads[-1] else ", no padding)"))
    if slot_bad:
        layer, raw, granule = slot_bad[0]
        notes.append(f"{len(slot_bad)} packed layers: expert slots NOT 4 KiB aligned (e.g. layer {layer}: "
                     f"{raw} B per expert; padding would cost more than {PACK_PAD_MAX:.0%})"
                     + (f"; {granule} aligned" if granule else ""))
    return out, packed, notes


def _place(tensors: list[OutTensor], alignment: int) -> int:
    """Assign relative offsets; returns the data section size.

    llama.cpp requires tensors back to back in info order, each padded to general.alignment
    (any other offset is rejected), so 4 KiB alignment comes from general.alignment = 4096."""
    rel = 0
    for t in tensors:
        t.offset = rel
        rel += -(-t.nbytes // alignment) * alignment
    return rel


def _copy_ops(tensors: list[OutTensor], data_start: int) -> list[tuple[int, int, int]]:
    """(src, dst, length) ranges in output order; contiguous neighbours merged."""
    ops: list[list[int]] = []
    for t in tensors:
        dst = data_start + t.offset
        for src, n in t.pieces:
            if src is not None and n:
                if ops and ops[-1][0] + ops[-1][2] == src and ops[-1][1] + ops[-1][2] == dst:
                    ops[-1][2] += n
                else:
                    ops.append([src, dst, n])
            dst += n
    return split_ops([tuple(o) for o in ops], SPLIT)


def split_ops(ops, most: int) -> list[tuple[int, int, int]]:
    """Cut ranges into pieces of at most `most` bytes (bounded readahead advice per piece)."""
    out = []
    for s, d, n in ops:
        for k in range(0, n, most):
            out.append((s + k, d + k, min(most, n - k)))
    return out


# ---- copying ----


class _Copier:
    def __init__(self, fin: int, fout: int, total: int, progress: Progress | None, src_name: str):
        self.fin, self.fout, self.total, self.progress, self.src_name = fin, fout, total, progress, src_name
        self.mode = "copy_file_range" if hasattr(os, "copy_file_range") else "buffered"
        self.done = 0
        self._buf = None
        self._last = 0

    def copy(self, src: int, dst: int, n: int) -> None:
        while n > 0:
            step = min(n, CHUNK)
            k = self._cfr(src, dst, step) if self.mode == "copy_file_range" else None
            if k is None:
                k = self._buffered(src, dst, step)
            if k <= 0:
                raise MboltError(f"{self.src_name}: unexpected end of file at byte {src} (changed while reading?)")
            src, dst, n, self.done = src + k, dst + k, n - k, self.done + k
            if self.progress and (self.done - self._last >= CHUNK or self.done == self.total):
                self._last = self.done
                self.progress(self.done, self.total)

    def _cfr(self, src, dst, n):
        try:
            return os.copy_file_range(self.fin, self.fout, n, src, dst)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF):
                self.mode = "buffered"
                return None
            raise

    def _buffered(self, src, dst, n):
        if self._buf is None:
            self._buf = memoryview(bytearray(BUF))
        n = min(n, BUF)
        k = os.preadv(self.fin, [self._buf[:n]], src)
        w = 0
        while w < k:
            w += os.pwrite(self.fout, self._buf[w:k], dst + w)
        return k


class _Readahead:
    """Ask the kernel to read the next READAHEAD bytes of source ranges asynchronously.

    A permuted tensor is read slice by slice in an order the kernel's readahead cannot guess;
    WILLNEED on the upcoming ranges keeps several reads in flight (page cache, not our memory)."""

    def __init__(self, fd: int, ops: list[tuple[int, int, int]], window: int = READAHEAD):
        self.fd, self.ops, self.window = fd, ops, window
        self.next = 0  # first op not advised yet
        self.bytes = 0  # advised bytes not yet copied
        self.ok = hasattr(os, "posix_fadvise")

    def advance(self, i: int) -> None:
        if not self.ok:
            return
        if i:
            self.bytes -= self.ops[i - 1][2]
        while self.next < len(self.ops) and (self.next <= i or self.bytes < self.window):
            s, _, n = self.ops[self.next]
            try:
                os.posix_fadvise(self.fd, s, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                self.ok = False
                return
            self.bytes += n
            self.next += 1


class _Writeback:
    """Start writeback of every WRITEBACK bytes written (sync_file_range, Linux) so the final
    fsync has little left to do and disk writes overlap the reads."""

    def __init__(self, fd: int):
        self.fd, self.done = fd, 0
        self.fn = _sync_file_range()

    def wrote(self, end: int) -> None:
        if self.fn is None or end - self.done < WRITEBACK:
            return
        if self.fn(self.fd, self.done, end - self.done, 2) != 0:  # SYNC_FILE_RANGE_WRITE
            self.fn = None
        self.done = end


_SFR = []


def _sync_file_range():
    if not _SFR:
        fn = None
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _SFR.append(fn)
    return _SFR[0]


@contextlib.contextmanager
def interrupt_on_terminate():
    """SIGTERM/SIGHUP raise KeyboardInterrupt so temp files are removed (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_file():
        raise MboltError(f"{src}: no such file")
    if src.resolve() == dst.resolve() or (dst.exists() and os.path.samefile(src, dst)):
        raise MboltError(f"{dst}: output is the input file; write the rewritten model to a new path")
    if dst.exists() and not force:
        raise MboltError(f"{dst}: output exists (use --force to overwrite)")
    if dst.exists() and dst.is_dir():
        raise MboltError(f"{dst}: is a directory")
    if not dst.parent.is_dir():
        raise MboltError(f"{dst.parent}: output directory does not exist")


def reorder(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    perm: np.ndarray | None = None,
    *,
    heat: np.ndarray | None = None,
    method: str = "identity",
    layout: str = "reorder",
    force: bool = False,
    progress: Progress | None = None,
    sidecar: bool = True,
) -> ReorderResult:
    """Rewrite `src` into `dst` with experts in `perm` order ([n_layers, E] original ids per
    position; None = identity) and the given layout. `heat` is per position ([n_layers, E])."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if layout not in ("reorder", "packed"):
        raise MboltError(f"unknown layout {layout!r} (reorder or packed)")
    check_paths(src, dst, force)
    removed = clean_stale_parts(dst)
    header = read_header(src)
    m = moe_map(header)
    unknown = m.unknown()
    if unknown:
        u = unknown[0]
        raise MboltError(f"{src}: tensor {u.name} is expert-indexed but mbolt does not know how to permute it "
                         f"({u.why}); refusing to rewrite" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    in_rm = m.route_map
    E, L = m.n_experts, m.n_layers
    ident = identity_perm(L, E)
    perm = ident.copy() if perm is None else check_perm(perm, L, E, "plan")
    for layer in m.layers:
        if layer.dense:
            perm[layer.index] = ident[layer.index]
    heat = np.zeros((L, E), np.float32) if heat is None else np.asarray(heat, np.float32)
    if heat.shape != (L, E):
        raise MboltError(f"plan heat has shape {heat.shape}, expected ({L}, {E})")

    tensors, packed, notes = plan_output(m, perm, layout)
    with src.open("rb") as f:  # metadata is copied verbatim from the source's header bytes
        head_src = f.read(header.header_size)
    A = max(header.alignment, PAGE)  # every tensor (so every expert tensor) starts 4 KiB aligned
    kv_bytes = []
    for k, kv in header.kv.items():
        if is_route_map_key(k):
            continue
        if k == "general.alignment":
            kv_bytes.append(encode_kv(k, kv.type, A))
        elif kv.span[1] > kv.span[0]:
            kv_bytes.append(head_src[kv.span[0]:kv.span[1]])
        else:
            raise MboltError(f"{src}: header reader gave no byte span for {k} (mbolt.core.header too old?)")
    if "general.alignment" not in header.kv:
        kv_bytes.append(encode_kv("general.alignment", GGUFValueType.UINT32, A))
    kv_bytes += route_map_kvs(layout, perm, heat, method, in_rm.source_fingerprint, packed)
    infos_len = sum(len(encode_tensor_info(t.name, t.ne, t.type, 0)) for t in tensors)
    prefix = encode_header_start(len(tensors), len(kv_bytes), header.version)
    head_len = len(prefix) + sum(map(len, kv_bytes)) + infos_len
    data_start = -(-head_len // A) * A
    data_size = _place(tensors, A)
    head = prefix + b"".join(kv_bytes) + b"".join(encode_tensor_info(t.name, t.ne, t.type, t.offset) for t in tensors)
    assert len(head) == head_len
    total = data_start + data_size

    free = shutil.disk_usage(dst.parent).free
    if free < total + (16 << 20):
        raise MboltError(f"{dst.parent}: {free / 2**30:.2f} GiB free, the output needs {total / 2**30:.2f} GiB")
    ops = _copy_ops(tensors, data_start)
    n_data = sum(n for _, _, n in ops)

    with interrupt_on_terminate(), open(src, "rb") as fin, atomic_output(dst, force=force) as fo:
        fd = fo.fileno()
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError:
            os.ftruncate(fd, total)
        w = 0
        while w < len(head):
            w += os.pwrite(fd, head[w:], w)
        copier = _Copier(fin.fileno(), fd, n_data, progress, str(src))
        if os.fstat(fin.fileno()).st_size != header.file_size:
            raise MboltError(f"{src}: file changed size while reading")
        ahead = _Readahead(fin.fileno(), ops)
        flush = _Writeback(fd)
        for i, (s, d, n) in enumerate(ops):
            ahead.advance(i)
            copier.copy(s, d, n)
            flush.wrote(d + n)
        os.ftruncate(fd, total)  # zero padding beyond the last tensor (fallocate already sized it)
    out_header = read_header(dst)
    out_map = moe_map(out_header)
    side = ""
    if sidecar:
        import json

        sp = sidecar_path(dst)
        write_text_atomic(sp, json.dumps(sidecar_dict(out_map), indent=1) + "\n")
        side = str(sp)
    return ReorderResult(
        str(src), str(dst), layout, method, total, time.perf_counter() - t0, len(ops), copier.mode,
        bool((perm == ident).all()), len(m.moe_layers), notes, [str(p) for p in removed], side,
        out_header.fingerprint, in_rm.source_fingerprint,
    )


def reorder_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    plan: str | os.PathLike | None = None,
    trace: str | os.PathLike | None = None,
    identity: bool = False,
    layout: str = "reorder",
    force: bool = False,
    progress: Progress | None = None,
) -> ReorderResult:
    """`mbolt reorder`: the perm comes from a plan file, a trace (planned inline with the
    default method) or the identity (a control for the whole pipeline)."""
    given = [name for name, v in (("--plan", plan), ("--trace", trace), ("--identity", identity)) if v]
    if len(given) != 1:
        raise MboltError("give exactly one of --plan, --trace or --identity" + (f" (got {' and '.join(given)})" if given else ""))
    check_paths(Path(src), Path(dst), force)
    m = moe_map(src)
    if identity:
        perm, heat, method = None, None, "identity"
    else:
        from mbolt.core.compat import check_compatible
        from mbolt.core.plan import load_plan

        if plan is not None:
            p = load_plan(plan)
            check_compatible(p, m, str(plan))
        else:
            from mbolt.core.trace_import import load_trace
            from mbolt.layout.plan import make_plan

            tr = load_trace(trace)
            check_compatible(tr, m, str(trace))
            p = make_plan(tr)
        perm, method = p.perm, p.method
        rows = np.arange(p.n_layers)[:, None]
        heat = np.asarray(p.heat, np.float32)[rows, p.perm]  # plan heat is per original id; the map's per position
    return reorder(src, dst, perm, heat=heat, method=method, layout=layout, force=force, progress=progress)

