"""Page-cache control, the one place for it: evict a file's cached pages and prove it with
mincore, drop ranges, find a file's mappings in this process. One libc loader (`libc()`).

Linux only, no privileges: posix_fadvise(POSIX_FADV_DONTNEED) drops a file's clean, unmapped
pages; mincore on a fresh read-only mapping reports which pages are still resident. The file is
fsync'ed first (dirty pages cannot be dropped). A cold arm starts only after `evict` returns a
resident share at or below the threshold; where that cannot be shown (no mincore, a filesystem
that ignores the advice) callers mark the run "not cold" instead of pretending.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError

PAGE = mmap.PAGESIZE

_libc = None


def libc():
    """The C library, loaded once, with the prototypes mbolt calls."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.mremap.restype = ctypes.c_void_p
        _libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return _libc


def resident_pages(path: str | os.PathLike) -> np.ndarray:
    """Per page of the file, whether it is in the page cache (bool array), via mincore."""
    size = os.path.getsize(path)
    n = (size + PAGE - 1) // PAGE
    if size == 0:
        return np.zeros(0, bool)
    lib = libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise MboltError(f"{path}: mmap for mincore failed (errno {ctypes.get_errno()})")
        try:
            vec = (ctypes.c_ubyte * n)()
            if lib.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise MboltError(f"{path}: mincore failed (errno {ctypes.get_errno()})")
            return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
        finally:
            lib.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def memory_resident(a: int, b: int) -> np.ndarray | None:
    """Per page of this process's memory [a, b) (page-aligned), whether it is resident (bool array,
    mincore); None when mincore refuses the range."""
    n = (b - a) // PAGE
    vec = (ctypes.c_ubyte * max(n, 0))()
    if n <= 0 or libc().mincore(ctypes.c_void_p(a), b - a, vec) != 0:
        return None
    return (np.frombuffer(vec, np.uint8) & 1).astype(bool)


def residency_visible(path: str | os.PathLike) -> bool:
    """Whether this process may see the file's page-cache residency: the kernel answers mincore
    (and cachestat) for a file only to its owner, to whom may write it, or to root; anyone else
    gets every page reported resident (mm/mincore.c, can_do_mincore)."""
    st = os.stat(path)
    return os.geteuid() in (0, st.st_uid) or os.access(path, os.W_OK)


def resident_share(path: str | os.PathLike, spans=None) -> float:
    """Share of the file's pages resident in the page cache (0..1); with `spans` [(start, end)],
    the share of the pages covering those byte spans only (e.g. the expert tensors)."""
    r = resident_pages(path)
    if spans is not None:
        keep = np.zeros(r.size, bool)
        for a, b in spans:
            keep[int(a) // PAGE: -(-int(b) // PAGE)] = True
        r = r[keep]
    return float(r.mean()) if r.size else 0.0


def expert_spans(mm, file: int = 0) -> list[tuple[int, int]]:
    """Byte spans of every routed expert weight tensor (or packed blob) of a MoE map in one of
    its files (a split set's shard `file`; 0 for a one-file model)."""
    out = set()
    for layer in mm.moe_layers:
        ws = [w for w in layer.weights if w.file == file]
        if ws and ws[0].container:
            # packed: the roles are views into one blob of slots; the blob starts at the first
            # role's offset (each later role starts inside the slot, so stride * E from its own
            # offset would run past the blob into the next layer's dense tensors)
            a = min(int(w.data_offset) for w in ws)
            out.add((a, a + int(ws[0].stride) * mm.n_experts))
            continue
        for w in ws:
            n = (w.stride or w.slice_bytes) * mm.n_experts
            out.add((int(w.data_offset), int(w.data_offset) + int(n)))
    return sorted(out)


def evict_model(mm, threshold: float = 0.01) -> Eviction:
    """`evict` every file of the model (a split set's shards); proven only if every one is."""
    evs = [evict(p, threshold) for p in mm.paths]
    if len(evs) == 1:
        return evs[0]
    return Eviction(mm.path, max(e.resident_before for e in evs), max(e.resident_after for e in evs),
                    all(e.proven for e in evs), threshold, "; ".join(e.note for e in evs if e.note))


@dataclass
class Eviction:
    path: str
    resident_before: float
    resident_after: float
    proven: bool  # mincore ran and showed resident_after <= threshold
    threshold: float
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def evict(path: str | os.PathLike, threshold: float = 0.01, tries: int = 3) -> Eviction:
    """fsync + posix_fadvise(DONTNEED) the whole file, then measure what stays resident."""
    path = str(path)
    try:
        before = resident_share(path)
    except (OSError, MboltError, AttributeError) as e:
        before = float("nan")
        note = f"mincore unavailable: {e}"
    else:
        note = ""
    after = float("nan")
    for _ in range(tries):
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if note:
            break
        after = resident_share(path)
        if after <= threshold:
            break
    proven = not note and after <= threshold
    if not note and not proven:
        note = f"{100 * after:.2f}% of the pages stayed resident after DONTNEED"
    return Eviction(path, before, after, proven, threshold, note)


MADV_RANDOM = 1
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15


def joined(spans, gap: int = PAGE) -> list[tuple[int, int]]:
    """Spans closer than `gap` (only alignment padding between them) as one span: the page cache
    keeps large folios (up to 2 MiB here) that can straddle two adjacent expert tensors, and a
    range drop removes only folios that lie wholly inside the range. The one merge rule
    (`core.ranges.merge_ranges`: a hole of at most its gap joins), with a hole under `gap`."""
    from mbolt.core.ranges import merge_ranges

    spans = list(spans)
    if not spans:
        return []
    s, e = merge_ranges([a for a, _ in spans], [b for _, b in spans], max(int(gap) - 1, 0))
    return [(int(a), int(b)) for a, b in zip(s, e)]


def inward(spans) -> list[tuple[int, int]]:
    """Byte spans shrunk to the whole pages inside them (pages shared with other tensors are kept)."""
    out = []
    for a, b in spans:
        a2 = -(-int(a) // PAGE) * PAGE
        b2 = int(b) // PAGE * PAGE
        if b2 > a2:
            out.append((a2, b2))
    return out


def file_mappings(path: str) -> list[tuple[int, int, int]]:
    """(start address, end address, file offset) of every mapping of `path` in this process."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            name = parts[5].strip()
            if name.endswith(" (deleted)") or os.path.realpath(name) != real:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16)))
    return out


# The page cache holds large folios (up to 2 MiB on current kernels): a read brings in whole
# folios, and DONTNEED only drops folios entirely inside the range. Drop whole 2 MiB blocks.
DROP_ALIGN = 2 << 20


def drop_cached(fd: int, a: int, b: int) -> None:
    """Drop bytes [a, b) of a file from the page cache, widened to whole DROP_ALIGN blocks: what a
    streaming reader does after each read so that the next one finds the data cold again."""
    a = a // DROP_ALIGN * DROP_ALIGN
    b = -(-b // DROP_ALIGN) * DROP_ALIGN
    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)


def drop_mapped(mapping, fd: int, a: int, b: int, size: int) -> None:
    """`drop_cached` for bytes [a, b) that our own `mmap.mmap` of the file (`size` bytes) maps:
    our mapping lets go of its pages first (MADV_DONTNEED), or the kernel keeps them."""
    a = a // DROP_ALIGN * DROP_ALIGN
    b = min(-(-b // DROP_ALIGN) * DROP_ALIGN, size)
    mapping.madvise(mmap.MADV_DONTNEED, a, b - a)
    drop_cached(fd, a, b)


def queue_file(path: str | os.PathLike, name: str) -> Path | None:
    """/sys/block/<disk>/queue/<name> of the device holding `path` (None: not a block device)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not base.exists():
        return None
    base = base.resolve()
    if (base / "partition").exists():
        base = base.parent
    f = base / "queue" / name
    return f if f.exists() else None


WILLNEED_MIN = 128 << 10


def willneed_bytes(path: str | os.PathLike) -> int:
    """The most one posix_fadvise(WILLNEED) reads: the kernel cuts the request to the larger of the
    device's readahead and its largest request (force_page_cache_ra), and drops the rest without
    a word. A longer range must be advised in pieces of this size (a reorder file's merged ranges
    of 5-7 MB were cut at 4 MB, and the tail came back through 4 KiB faults, 850 per token)."""
    best = WILLNEED_MIN
    for name in ("read_ahead_kb", "max_sectors_kb"):
        f = queue_file(path, name)
        try:
            best = max(best, int(f.read_text()) << 10) if f is not None else best
        except (OSError, ValueError):
            pass
    return best


def willneed(fd: int, offset: int, length: int, step: int) -> None:
    """posix_fadvise(WILLNEED) over [offset, offset + length) in pieces of `step` bytes
    (`willneed_bytes`): the kernel starts reading every piece and returns at once."""
    for a in range(offset, offset + length, step):
        os.posix_fadvise(fd, a, min(step, offset + length - a), os.POSIX_FADV_WILLNEED)


def proc_read_bytes() -> int | None:
    """Bytes this process caused to be fetched from storage (/proc/self/io), None if unknown."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
