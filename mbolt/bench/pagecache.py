"""Page-cache control: evict a file's cached pages and prove it with mincore.

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

import numpy as np

from mbolt.core.errors import MboltError

PAGE = mmap.PAGESIZE

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def resident_pages(path: str | os.PathLike) -> np.ndarray:
    """Per page of the file, whether it is in the page cache (bool array), via mincore."""
    size = os.path.getsize(path)
    n = (size + PAGE - 1) // PAGE
    if size == 0:
        return np.zeros(0, bool)
    lib = _lib()
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
        for w in layer.weights:
            if w.file != file:
                continue
            n = (w.stride or w.slice_bytes) * mm.n_experts
            out.add((int(w.data_offset), int(w.data_offset) + int(n)))
    return sorted(out)


def expert_resident_share(mm) -> float:
    """Share of the pages of the expert tensors resident, over every file of the model."""
    total = resident = 0.0
    for f, path in enumerate(mm.paths):
        spans = expert_spans(mm, f)
        if not spans:
            continue
        n = sum(-(-b // PAGE) - a // PAGE for a, b in spans)
        resident += resident_share(path, spans) * n
        total += n
    return resident / total if total else 0.0


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


def _inflight_file(path: str) -> str | None:
    from mbolt.bench.env import _mount_of

    dev = _mount_of(path)[0]
    name = os.path.basename(dev)
    base = f"/sys/class/block/{name}"
    if not os.path.exists(base):
        return None
    if os.path.exists(f"{base}/partition"):
        base = os.path.dirname(os.path.realpath(base))
    f = f"{base}/inflight"
    return f if os.path.exists(f) else None


def wait_quiet(path: str | os.PathLike, timeout: float = 2.0, poll: float = 0.005) -> dict:
    """Wait until the block device holding `path` has no I/O in flight (e.g. the readahead a
    previous arm left behind), at most `timeout` seconds. Returns what it saw."""
    import time

    f = _inflight_file(str(path))
    t0 = time.perf_counter()
    first = None
    while f is not None:
        try:
            r, w = (int(x) for x in open(f).read().split())
        except (OSError, ValueError):
            break
        if first is None:
            first = r + w
        if r + w == 0 or time.perf_counter() - t0 >= timeout:
            return {"inflight_at_start": first, "inflight_at_end": r + w, "waited_s": time.perf_counter() - t0}
        time.sleep(poll)
    return {"inflight_at_start": first, "inflight_at_end": None, "waited_s": time.perf_counter() - t0}
