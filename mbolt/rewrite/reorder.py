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

from mbolt.core.atomic import check_output, clean_stale_parts
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import (SET_ID_KEY, combine_shards, is_set_key, open_model_header, set_paths,
                                 split_vaddr, vaddr)
from mbolt.core.header import _parse, encode_header_start, encode_kv, encode_tensor_info
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
    data_offset: int  # virtual (core.gguf_set.vaddr: file << 48 | offset); expert-indexed: position 0's slice
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
                out.append(LTensor(x.name, tuple(x.ne), GGMLQuantizationType[x.type], x.nbytes, vaddr(x.file, x.data_offset),
                                   li, x.role, x.slice_bytes, x.stride, x.container))
        elif t.name in experts:
            li, x = experts[t.name]
            out.append(LTensor(t.name, tuple(t.ne), t.type, t.nbytes, vaddr(t.file, t.data_offset), li, x.role,
                               x.slice_bytes, x.slice_bytes))
        else:
            out.append(LTensor(t.name, tuple(t.ne), t.type, t.nbytes, vaddr(t.file, t.data_offset)))
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
    pieces: list[tuple[int | None, int]]  # (source virtual offset or None for zeros, length), in order
    offset: int = 0  # relative to the data section of its shard, set by _place
    file: int = 0  # output shard

    @property
    def src_file(self) -> int:
        return next(split_vaddr(s)[0] for s, _ in self.pieces if s is not None)

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
    files: list[str] = field(default_factory=list)  # the output's files (a set's shards in order)

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


def _copy_ops(tensors: list[OutTensor], data_start: list[int]) -> list[tuple[int, int, int]]:
    """(src, dst, length) virtual ranges in output order; contiguous neighbours merged (never
    across files: virtual offsets of two files are 2^48 apart)."""
    ops: list[list[int]] = []
    for t in tensors:
        dst = vaddr(t.file, data_start[t.file] + t.offset)
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
    """Copies virtual ranges between lists of files (the shards of the input and the output)."""

    def __init__(self, fins: list[int], fouts: list[int], total: int, progress: Progress | None, src_names: list[str]):
        self.fins, self.fouts, self.total, self.progress, self.src_names = fins, fouts, total, progress, src_names
        self.mode = "copy_file_range" if hasattr(os, "copy_file_range") else "buffered"
        self.done = 0
        self._buf = None
        self._last = 0

    def copy(self, src: int, dst: int, n: int) -> None:
        fi, src = split_vaddr(src)
        fo, dst = split_vaddr(dst)
        self.fin, self.fout, self.src_name = self.fins[fi], self.fouts[fo], self.src_names[fi]
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

    def __init__(self, fds: int | list[int], ops: list[tuple[int, int, int]], window: int = READAHEAD):
        self.fds = [fds] if isinstance(fds, int) else fds  # ops' first field is a virtual offset into these
        self.ops, self.window = ops, window
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
            f, s = split_vaddr(s)
            try:
                os.posix_fadvise(self.fds[f], s, n, os.POSIX_FADV_WILLNEED)
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
        import ctypes

        from mbolt.core.pagecache import libc

        try:
            fn = libc().sync_file_range
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


# ---- output shards ----


@dataclass
class SplitSpec:
    """How the output is cut into shards: like the input (default), one file, or by limits."""
    no_split: bool = False
    max_tensors: int = 0  # 0 = no limit
    max_size: int = 0  # bytes of tensor data per shard; 0 = no limit

    def check(self) -> None:
        if self.max_tensors < 0 or self.max_size < 0:
            raise MboltError("--split-max-tensors and --split-max-size must be >= 0")
        if self.no_split and (self.max_tensors or self.max_size):
            raise MboltError("--no-split cannot be combined with --split-max-tensors/--split-max-size")


def parse_size(text: str | None) -> int:
    """'4G', '500M', '4096' -> bytes (binary units, as gguf-split's --split-max-size)."""
    if not text:
        return 0
    t = str(text).strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if t[-1:] in "KMGT" else t) * mult)
    except ValueError:
        raise MboltError(f"--split-max-size: {text!r} is not a size (e.g. 4G, 500M)") from None
    if n <= 0:
        raise MboltError(f"--split-max-size must be positive, got {text!r}")
    return n


def assign_shards(tensors: list[OutTensor], spec: SplitSpec, n_in: int) -> int:
    """Set every output tensor's shard (in order, none empty); returns the number of shards.
    A tensor is never cut, so a packed layer's blob never straddles shards."""
    if spec.max_tensors or spec.max_size:
        shard, count, size = 0, 0, 0
        for t in tensors:
            if count and ((spec.max_tensors and count >= spec.max_tensors)
                          or (spec.max_size and size + t.nbytes > spec.max_size)):
                shard, count, size = shard + 1, 0, 0
            t.file = shard
            count, size = count + 1, size + t.nbytes
        return shard + 1
    if spec.no_split or n_in <= 1:
        for t in tensors:
            t.file = 0
        return 1
    # the input's assignment: a tensor goes where its (first) source bytes are; renumbered so
    # that no shard is empty (a packed blob gathers a layer's weights into one shard)
    used = sorted({t.src_file for t in tensors})
    index = {f: i for i, f in enumerate(used)}
    last = 0
    for t in tensors:
        t.file = max(last, index[t.src_file])  # keep shards in tensor order
        last = t.file
    return len(used)


def _split_kvs(no: int, count: int, n_tensors: int, set_id: str) -> list[bytes]:
    return [
        encode_kv("split.no", GGUFValueType.UINT16, no),
        encode_kv("split.count", GGUFValueType.UINT16, count),
        encode_kv("split.tensors.count", GGUFValueType.INT32, n_tensors),
        encode_kv(SET_ID_KEY, GGUFValueType.STRING, set_id),
    ]


def _headers(m: MoeMap, tensors: list[OutTensor], n_shards: int, model_kvs: list[bytes], A: int,
             version: int) -> tuple[list[bytes], list[int]]:
    """The header bytes of every output shard and the data start of each. Shard 1 carries the
    model's metadata and the route map; every shard of a set carries the split keys, a set id
    (readers refuse shards with different ids: a mix of two runs) and general.alignment."""
    by_shard = [[t for t in tensors if t.file == i] for i in range(n_shards)]
    set_id = ""
    if n_shards > 1:
        import hashlib

        h = hashlib.sha256(b"".join(model_kvs))
        for t in tensors:
            h.update(f"{t.name}:{t.file};".encode())
        set_id = h.hexdigest()[:32]
    heads, starts = [], []
    for i, ts in enumerate(by_shard):
        kvs = list(model_kvs) if i == 0 else [encode_kv("general.alignment", GGUFValueType.UINT32, A)]
        if n_shards > 1:
            kvs += _split_kvs(i, n_shards, len(tensors), set_id)
        _place(ts, A)
        head = encode_header_start(len(ts), len(kvs), version) + b"".join(kvs) + b"".join(
            encode_tensor_info(t.name, t.ne, t.type, t.offset) for t in ts)
        heads.append(head)
        starts.append(-(-len(head) // A) * A)
    return heads, starts


def _shard_sizes(tensors: list[OutTensor], starts: list[int], A: int) -> list[int]:
    sizes = list(starts)
    for t in tensors:
        sizes[t.file] = max(sizes[t.file], starts[t.file] + t.offset + -(-t.nbytes // A) * A)
    return sizes


# ---- writing a set atomically ----

LOCK_SUFFIX = ".lock"
JOURNAL_SUFFIX = ".journal"


@contextlib.contextmanager
def output_lock(dst: Path):
    """Serialise writers of one output: an flock on `.NAME.lock` beside it; a second writer
    is refused (never waits, never interleaves). The lock file is removed on release."""
    import fcntl

    lock = dst.with_name(f".{dst.name}{LOCK_SUFFIX}")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise MboltError(f"{lock}: cannot create the output lock: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise MboltError(f"{dst}: another mbolt reorder is writing this output (lock {lock.name}); "
                             "wait for it or write to another path") from None
        try:  # the holder before us may have removed the file after we opened it: retry on the new one
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def recover_interrupted(dst: Path) -> list[Path]:
    """Remove what a writer of `dst` killed during its final renames left: it journals the set
    it is renaming into place; shards of that set found here (which readers refuse beside the
    old ones, their set ids differ) are removed with the shards they were replacing.
    Call with the output lock held. Returns what was removed."""
    import json

    removed = []
    for j in dst.parent.glob(f".{_glob(dst.name)}.*{JOURNAL_SUFFIX}"):
        try:
            d = json.loads(j.read_text())
            paths, set_id = [Path(p) for p in d["paths"]], d["set_id"]
        except (OSError, ValueError, KeyError, TypeError):
            paths, set_id = [], None
        started = False
        for p in paths:
            with contextlib.suppress(MboltError, OSError):
                from mbolt.core.header import read_header

                started |= bool(set_id) and read_header(p).get(SET_ID_KEY) == set_id
        if started:
            for p in paths + [Path(x) for x in d.get("sidecar", [])]:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
        with contextlib.suppress(FileNotFoundError):
            j.unlink()
            removed.append(j)
    return removed


def _glob(name: str) -> str:
    import glob

    return glob.escape(name)


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_outputs(paths: list[Path], side: Path | None, inputs: list, force: bool, protected: set[str]) -> None:
    """core.atomic.check_output for every output file, plus: an existing shard of the set an
    input was made from is never replaced (its set fingerprint is protected)."""
    for p in paths:
        check_output(p, kind="gguf-mbolt", inputs=inputs, force=force, protected_fingerprints=protected,
                     what="rewritten model")
        if p.exists() and protected:
            try:
                fp = open_model_header(p).fingerprint
            except MboltError:
                fp = ""  # not a readable model or set: check_output decided
            if fp in protected:
                raise MboltError(f"{p}: is part of the model an input was made from; refusing to replace it "
                                 "(write the rewritten model to a new path)")
    if side is not None and side.exists():
        check_output(side, kind="json", inputs=inputs, force=True, what="route-map sidecar")


# ---- the rewrite ----


def reorder(
    src: str | os.PathLike | MoeMap,
    dst: str | os.PathLike,
    perm: np.ndarray | None = None,
    *,
    heat: np.ndarray | None = None,
    method: str = "identity",
    layout: str = "reorder",
    force: bool = False,
    progress: Progress | None = None,
    sidecar: bool = True,
    split: SplitSpec | None = None,
    inputs: tuple = (),
    protect: tuple = (),
) -> ReorderResult:
    """Rewrite `src` (a path, or the model already opened) into `dst` with experts in `perm`
    order ([n_layers, E] original ids per position; None = identity) and the given layout.
    `heat` is per position ([n_layers, E]). A split set is written as a set named after `dst`
    (out.gguf -> out-00001-of-0000N.gguf ...), cut as `split` says. `inputs`: other input
    files of the command (plan, trace), never written over; `protect`: fingerprints of models
    they were made from (a plan's or trace's model), never replaced either."""
    t0 = time.perf_counter()
    m = src if isinstance(src, MoeMap) else moe_map(src)
    src = Path(m.path)
    dst = Path(dst)
    split = split or SplitSpec()
    split.check()
    if layout not in ("reorder", "packed"):
        raise MboltError(f"unknown layout {layout!r} (reorder or packed)")
    unknown = m.unknown()
    if unknown:
        u = unknown[0]
        raise MboltError(f"{src}: tensor {u.name} is expert-indexed but mbolt does not know how to permute it "
                         f"({u.why}); refusing to rewrite" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
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
    n_shards = assign_shards(tensors, split, len(m.paths))
    out_paths = set_paths(dst, n_shards)
    side = sidecar_path(out_paths[0]) if sidecar else None
    in_paths = [Path(p) for p in m.paths]
    all_inputs = in_paths + [Path(x) for x in inputs if x is not None]
    protected = {m.source_fingerprint, m.fingerprint} | {s.fingerprint for s in m.header.shards} | {
        fp for fp in protect if fp}
    if dst.is_dir():
        raise MboltError(f"{dst}: is a directory (give a file path for the rewritten model)")
    if not dst.parent.is_dir():
        raise MboltError(f"{dst.parent}: output directory does not exist")
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(output_lock(dst))  # one writer per output, from the checks to the renames
        removed = recover_interrupted(dst)
        _check_outputs(out_paths, side, all_inputs, force, protected)
        # another model already written under this name (a set of another shard count, or one
        # file where a set goes): replaced as a whole with --force, so `verify OUT` is unambiguous
        others = [p for p in other_outputs(dst) if p not in out_paths]
        _check_outputs(others, None, all_inputs, force, protected)
        res = _write(m, dst, perm, ident, heat, method, layout, tensors, packed, notes, out_paths, side,
                     in_paths, removed, stack, progress, t0)
        for p in others:
            for q in (p, sidecar_path(p)):
                with contextlib.suppress(FileNotFoundError):
                    q.unlink()
                    res.removed_stale.append(str(q))
        return res


def other_outputs(dst: Path) -> list[Path]:
    """Model files named after `dst`: dst itself and the shards of any set named after it."""
    import glob

    stem = dst.name[:-5] if dst.name.endswith(".gguf") else dst.name
    found = sorted(dst.parent.glob(glob.escape(stem) + "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].gguf"))
    return ([dst] if dst.exists() else []) + found


def _write(m, dst, perm, ident, heat, method, layout, tensors, packed, notes, out_paths, side, in_paths,
           removed, stack, progress, t0) -> ReorderResult:
    in_rm = m.route_map
    src = Path(m.path)
    n_shards = len(out_paths)

    header = m.header
    with src.open("rb") as f:  # metadata is copied verbatim from shard 1's header bytes
        head_src = f.read(header.header_size)
    A = max(header.alignment, PAGE)  # every tensor (so every expert tensor) starts 4 KiB aligned
    kv_bytes = []
    for k, kv in header.kv.items():
        if is_route_map_key(k) or is_set_key(k):
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
    heads, starts = _headers(m, tensors, n_shards, kv_bytes, A, header.version)
    sizes = _shard_sizes(tensors, starts, A)
    total = sum(sizes)
    # the output's header, parsed from the bytes about to be written: fingerprint and sidecar
    # are known before anything is renamed into place
    out_shards = [_parse(h, p, size) for h, p, size in zip(heads, out_paths, sizes)]
    out_header = combine_shards(out_shards) if n_shards > 1 else out_shards[0]
    out_map = moe_map(out_header)

    free = shutil.disk_usage(dst.parent).free
    if free < total:
        raise MboltError(f"{dst.parent}: {free / 2**30:.2f} GiB free, the output needs {total / 2**30:.2f} GiB")
    ops = _copy_ops(tensors, starts)
    n_data = sum(n for _, _, n in ops)

    with interrupt_on_terminate():
        for p in out_paths + ([side] if side else []):
            removed += clean_stale_parts(p)
        fins = [stack.enter_context(open(p, "rb")) for p in in_paths]
        for f, s in zip(fins, m.header.shards or [m.header]):
            if os.fstat(f.fileno()).st_size != s.file_size:
                raise MboltError(f"{s.path}: file changed size while reading")
        temps: list[Path] = []
        renamed: list[Path] = []

        def cleanup():
            for t in temps:
                if t not in renamed:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(t)
        stack.callback(cleanup)
        fouts = []
        import tempfile

        for p in out_paths:
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}.", suffix=".part", dir=p.parent)
            temps.append(Path(tmp))
            fouts.append(fd)
            stack.callback(os.close, fd)
        umask = os.umask(0)
        os.umask(umask)
        try:
            for fd, head, size in zip(fouts, heads, sizes):
                os.fchmod(fd, 0o666 & ~umask)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise
                    os.ftruncate(fd, size)
                w = 0
                while w < len(head):
                    w += os.pwrite(fd, head[w:], w)
            copier = _Copier([f.fileno() for f in fins], fouts, n_data, progress, [str(p) for p in in_paths])
            ahead = _Readahead([f.fileno() for f in fins], ops)
            flush = [_Writeback(fd) for fd in fouts]
            for i, (s, d, n) in enumerate(ops):
                ahead.advance(i)
                copier.copy(s, d, n)
                f_out, end = split_vaddr(d + n)
                flush[f_out].wrote(end)
            for fd, size in zip(fouts, sizes):
                os.ftruncate(fd, size)  # zero padding beyond the last tensor (fallocate already sized it)
                os.fsync(fd)
            side_tmp = None
            if side is not None:
                import json

                fd, tmp = tempfile.mkstemp(prefix=f".{side.name}.{os.getpid()}.", suffix=".part", dir=side.parent)
                temps.append(Path(tmp))
                side_tmp = Path(tmp)
                with os.fdopen(fd, "w") as f:
                    os.fchmod(f.fileno(), 0o666 & ~umask)
                    f.write(json.dumps(sidecar_dict(out_map), indent=1) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as e:
            raise MboltError(f"{dst}: cannot write the output: {e.strerror}") from None
        # Renames: the sidecar first (beside the old GGUF it is refused: its fingerprint is the
        # new one's), then the shards last to first. A kill in between leaves shards of two set
        # ids (every reader refuses the mix) and a journal: the next run removes them.
        journal = None
        if n_shards > 1:
            import json

            journal = dst.with_name(f".{dst.name}.{os.getpid()}{JOURNAL_SUFFIX}")
            journal.write_text(json.dumps({"set_id": out_header.get(SET_ID_KEY), "paths": [str(p) for p in out_paths],
                                           "sidecar": [str(side)] if side else []}))
        if side_tmp is not None:
            os.replace(side_tmp, side)
            renamed.append(side_tmp)
        for tmp, p in reversed(list(zip(temps, out_paths))):
            os.replace(tmp, p)
            renamed.append(tmp)
        _fsync_dir(dst.parent)
        if journal is not None:
            journal.unlink()
    return ReorderResult(
        str(src), str(out_paths[0]), layout, method, total, time.perf_counter() - t0, len(ops), copier.mode,
        bool((perm == ident).all()), len(m.moe_layers), notes, [str(p) for p in removed], str(side or ""),
        out_header.fingerprint, in_rm.source_fingerprint, [str(p) for p in out_paths],
    )


def reorder_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    plan: str | os.PathLike | None = None,
    trace: str | os.PathLike | list | None = None,
    identity: bool = False,
    layout: str = "reorder",
    force: bool = False,
    progress: Progress | None = None,
    split: SplitSpec | None = None,
) -> ReorderResult:
    """`mbolt reorder`: the perm comes from a plan file, traces (merged, then planned inline
    with the default method) or the identity (a control for the whole pipeline). The model
    is opened once and handed down."""
    traces = [] if trace is None else ([trace] if isinstance(trace, (str, os.PathLike)) else list(trace))
    given = [name for name, v in (("--plan", plan), ("--trace", traces), ("--identity", identity)) if v]
    if len(given) != 1:
        raise MboltError("give exactly one of --plan, --trace or --identity" + (f" (got {' and '.join(given)})" if given else ""))
    m = moe_map(src)
    made_from: tuple = ()
    if identity:
        perm, heat, method = None, None, "identity"
    else:
        from mbolt.core.compat import check_compatible
        from mbolt.core.plan import load_plan

        if plan is not None:
            p = load_plan(plan)
            check_compatible(p, m, str(plan))
        else:
            from mbolt.core.trace_import import load_traces
            from mbolt.layout.plan import make_plan

            tr = load_traces(traces)
            check_compatible(tr, m, ", ".join(map(str, traces)))
            p = make_plan(tr)
        made_from = (p.meta.get("fingerprint", ""),)  # the model the plan or trace was made on
        perm, method = p.perm, p.method
        rows = np.arange(p.n_layers)[:, None]
        heat = np.asarray(p.heat, np.float32)[rows, p.perm]  # plan heat is per original id; the map's per position
    return reorder(m, dst, perm, heat=heat, method=method, layout=layout, force=force, progress=progress,
                   split=split, inputs=(plan, *traces), protect=made_from)
