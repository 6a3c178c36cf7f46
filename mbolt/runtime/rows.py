"""A kernel-layout file's experts as rows of llama.cpp's buffers (runtime.kernel_stream): where
each expert's bytes are in the file and in memory (ExpertRows: runs to read, pages to give back,
what is resident) and the reads that put them there (RowReader: O_DIRECT into a bounce buffer and
one copy, on a few threads)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import USE_ORDER, MoeMap
from mbolt.core.pagecache import MADV_NOHUGEPAGE, MADV_RANDOM, PAGE, libc, memory_resident, willneed, willneed_bytes
from mbolt.runtime.kernel_load import KernelModel
from mbolt.runtime.store import StoreCounters

DIO = 4096  # O_DIRECT's offset and length unit (the drive's logical block, at most a page)
BOUNCE = 8 << 20  # the bounce buffer of each read thread
PIECE = int(os.environ.get("MBOLT_KERNEL_PIECE", 8 << 20))  # a merged run is read in pieces of this size, spread over the threads


def count_reads(c: StoreCounters, runs: list[tuple[int, int, int]], ops: int, t0: float) -> None:
    """These runs (file offset, address, bytes), asked in `ops` operations since `t0`, counted."""
    n = sum(r[2] for r in runs)
    c.reads += len(runs)
    c.ops += ops
    c.bytes += n
    c.useful_bytes += n
    c.io_time += time.perf_counter() - t0


class RowReader:
    """Reads byte runs of one file into memory: O_DIRECT into an aligned bounce buffer and one
    copy (per thread), or buffered reads straight into place with the page cache dropped after
    (`buffered`, and where the filesystem has no O_DIRECT); buffered, `advise` queues a layer's
    runs with the kernel at once (WILLNEED) before they are read in."""

    def __init__(self, path: str, threads: int = 1, buffered: bool = False):
        self.path = path
        try:
            if buffered:
                raise OSError
            self.fd, self.direct = os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:  # tmpfs and some filesystems have no O_DIRECT
            self.fd, self.direct = os.open(path, os.O_RDONLY), False
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = os.fstat(self.fd).st_size
        self._step = willneed_bytes(path)  # the kernel cuts a longer WILLNEED short, silently
        self.threads = max(1, int(threads))
        self._bounce = [mmap.mmap(-1, BOUNCE + DIO) for _ in range(self.threads + 1)]  # +1: the read-ahead thread
        self._free = list(range(len(self._bounce)))
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.counters = StoreCounters()

    def advise(self, runs: list[tuple[int, int, int]]) -> None:
        """Buffered: the kernel reads these runs now, all queued at once (WILLNEED); `read` then
        copies what has arrived and waits for the rest. O_DIRECT: nothing (no page cache)."""
        if not self.direct:
            for off, _, n in runs:
                willneed(self.fd, off, n, self._step)

    def read(self, runs: list[tuple[int, int, int]], wait: bool = True) -> None:
        """Each run (file offset, address, bytes) read into place; returns when all are (`wait`:
        always, as PagedReader's with it)."""
        t0 = time.perf_counter()
        pieces = [(off + s, addr + s, min(PIECE, n - s)) for off, addr, n in runs for s in range(0, n, PIECE)]
        if self._pool is None or len(pieces) < 2:
            self._read_pieces(pieces)
        else:
            parts = [pieces[i::self.threads] for i in range(self.threads)]
            for f in [self._pool.submit(self._read_pieces, p) for p in parts if p]:
                f.result()
        count_reads(self.counters, runs, len(pieces), t0)

    def _read_pieces(self, pieces) -> None:
        slot = self._free.pop()
        try:
            buf = self._bounce[slot]
            view = memoryview(buf)
            base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            for off, addr, n in pieces:
                if self.direct:
                    a = off - off % DIO
                    want = min(-(-(off + n) // DIO) * DIO, -(-self.size // DIO) * DIO) - a
                    got = os.preadv(self.fd, [view[:want]], a)
                    if got < off - a + n:
                        raise MboltError(f"{self.path}: read {got} of {want} bytes at offset {a} (truncated?)")
                    ctypes.memmove(addr, base + off - a, n)
                else:
                    got = os.preadv(self.fd, [memoryview((ctypes.c_char * n).from_address(addr)).cast("B")], off)
                    if got != n:
                        raise MboltError(f"{self.path}: read {got} of {n} bytes at offset {off} (truncated?)")
                    os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)
        finally:
            self._free.append(slot)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for b in self._bounce:
            b.close()
        self._bounce = []


class PagedReader:
    """The reads of a kernel-layout file whose experts are pages of its map (KernelModel.map_weights):
    each run asked of the page cache (WILLNEED) and not waited for; llama.cpp's page faults wait for
    the pages they touch, so an expert computes while the next ones arrive. `read(..., wait=True)`
    brings the pages in before it returns (a warm measurement)."""

    direct = False

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.step = willneed_bytes(path)  # the kernel cuts a longer WILLNEED short, silently
        self.counters = StoreCounters()

    def advise(self, runs) -> None:
        pass  # `read` asks for them: nothing waits on it

    def read(self, runs: list[tuple[int, int, int]], wait: bool = False) -> None:
        t0 = time.perf_counter()
        for off, _, n in runs:
            willneed(self.fd, off, n, self.step)
            if wait:
                for s in range(0, n, BOUNCE):
                    os.pread(self.fd, min(BOUNCE, n - s), off + s)
        count_reads(self.counters, runs, len(runs), t0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ExpertRows:
    """Where each expert of each MoE layer lives: its byte run in every routed weight tensor, in
    the file and in llama.cpp's buffers (by position in the file), and its pages given back."""

    def __init__(self, mm: MoeMap, km: KernelModel):
        self.mm = mm
        self.tensors: dict[int, list[tuple[int, int, int, int]]] = {}  # layer -> (file offset, address, bytes, slice)
        self.roles: dict[int, list[str]] = {}
        for layer in mm.moe_layers:
            rows = []
            weights = sorted(layer.weights, key=lambda w: USE_ORDER.get(w.role, 3))  # llama.cpp's use order
            self.roles[layer.index] = [w.role for w in weights]
            for w in weights:
                if w.stride or w.file:
                    raise MboltError(f"{mm.header.path}: {w.name}: a packed or split kernel-layout file is not streamed")
                p = km.places[w.name]
                rows.append((p.offset, p.addr, p.nbytes, w.slice_bytes))
            self.tensors[layer.index] = rows
        self.pos = mm.route_map.pos  # original id -> position in the file
        self.release = km.release  # a page given back (of the file's map: out of the page cache too)
        # 4 KiB pages only: a huge page would bring a dropped neighbour's rows back (zeros, but
        # memory), and khugepaged collapses a range around one resident page (max_ptes_none 511)
        for a, b in self.all_spans():
            lo, hi = a - a % PAGE, -(-b // PAGE) * PAGE
            libc().madvise(lo, hi - lo, MADV_NOHUGEPAGE)
            if km.mapped:  # the file's map: a fault reads its one page, not neighbours that may be evicted
                libc().madvise(lo, hi - lo, MADV_RANDOM)

    def runs_by_tensor(self, layer: int, experts) -> list[list[tuple[int, int, int]]]:
        """The merged (file offset, address, bytes) runs of these experts (original ids), one list
        per tensor in use order, adjacent positions joined."""
        ps = np.sort(self.pos[layer][np.asarray(sorted(experts), np.int64)])
        if ps.size == 0:
            return [[] for _ in self.tensors[layer]]
        spans = [(int(g[0]), int(g[-1]) + 1) for g in np.split(ps, np.flatnonzero(np.diff(ps) != 1) + 1)]
        return [[(off + a * s, addr + a * s, (b - a) * s) for a, b in spans] for off, addr, _, s in self.tensors[layer]]

    def runs(self, layer: int, experts) -> list[tuple[int, int, int]]:
        return [r for t in self.runs_by_tensor(layer, experts) for r in t]

    def _pages(self, layer: int, e: int, keep: np.ndarray):
        """The whole pages [lo, hi) of expert `e` (original id) in each tensor of the layer that it
        does not share with a position `keep` marks (by position) or with another tensor."""
        E = self.mm.n_experts
        p = int(self.pos[layer][e])
        for _, addr, _, s in self.tensors[layer]:
            a, b = addr + p * s, addr + (p + 1) * s
            lo, hi = a - a % PAGE, -(-b // PAGE) * PAGE
            if lo < a and (p == 0 or keep[p - 1]):
                lo += PAGE
            if hi > b and (p == E - 1 or keep[p + 1]):
                hi -= PAGE
            if hi > lo:
                yield lo, hi

    def drop(self, layer: int, experts, keep: np.ndarray) -> int:
        """Give back the pages of these experts (original ids) in every tensor of the layer; a page
        they share with a position `keep` marks (by position) or with another tensor stays."""
        n = 0
        for e in experts:
            for lo, hi in self._pages(layer, e, keep):
                self.release(lo, hi)
                n += hi - lo
        return n

    def held(self, layer: int, experts, keep: np.ndarray) -> list[int]:
        """Of these experts, those with a page `drop` gives back still resident (mincore: in the
        page cache, for pages of the file's map)."""
        return [e for e in experts
                if any((r := memory_resident(lo, hi)) is not None and r.any() for lo, hi in self._pages(layer, e, keep))]

    def all_spans(self) -> list[tuple[int, int]]:
        return [(addr, addr + nbytes) for rows in self.tensors.values() for _, addr, nbytes, _ in rows]

    def resident(self) -> float:
        """Share of the expert tensors' whole pages resident (mincore)."""
        have = total = 0
        for a, b in self.all_spans():
            res = memory_resident(-(-a // PAGE) * PAGE, b - b % PAGE)
            if res is not None:
                have += int(res.sum())
                total += res.size
        return have / total if total else 0.0

    mapped = resident  # anonymous rows: resident is mapped
