"""A kernel-layout file (`mbolt repack`) in llama.cpp: the weights go straight into llama.cpp's own
buffers, the repacked ones into its repack buffer, with no repacking on the CPU.

Stock llama.cpp refuses a kernel-layout file (its architecture is mbolt-kernel), and would repack
what it reads anyway. So llama.cpp is given a stand-in: the file's own header with the real
architecture (core.kernel_file.llama_header) over a data section of holes, in a memfd. It loads
that with repacking on and the file read, not mapped: every weight gets its buffer (the repack
buffer for Q4_0/Q4_K/IQ4_NL/MXFP4 matrices), filled with zeros. Those pages are given back while
it loads (each progress callback drops the model buffers' pages), so
the load never holds more than one tensor. The buffers are found at the first progress callback,
when llama.cpp has allocated and not yet written them: the new anonymous memory whose pages are
not resident (a buffer glibc serves from heap memory it had touched before is missed there, and
dropped exactly once the weights' places are known). A first graph on a small context finds every weight's
address; then `fill` reads a tensor, or one expert's rows, from the kernel-layout file into its
place, and `drop` gives an expert's whole pages back. What lands there is what llama.cpp would
have made of the stock file: the logits are identical, bit for bit (tests/test_kernel_layout.py).

Binding-specific (llama-cpp-python 0.3.36): the ggml_tensor layout of runtime.binding; a loader
that allocates every buffer before it writes the first tensor and calls the progress callback
before each.
"""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.kernel_file import KernelFile, check_build, llama_header, read_kernel
from mbolt.core.pagecache import MADV_DONTNEED, MADV_HUGEPAGE, MADV_NOHUGEPAGE, PAGE, libc, memory_resident
from mbolt.core.repack import Build, build_of
from mbolt.runtime.binding import GgmlTensor, captured_log, lib, set_fields

PROT_READ, MAP_SHARED = 1, 1
M_MMAP_THRESHOLD = -3  # mallopt: allocations from this size up get maps of their own


def _writable_anonymous() -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for ln in f:
            parts = ln.split()
            # no path: anonymous; the brk heap too (glibc serves a buffer from it when it can)
            if (len(parts) < 6 or parts[5] == "[heap]") and parts[1].startswith("rw"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b))
    return out


def _minus(spans: list[tuple[int, int]], old: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` outside every interval of `old` (the kernel merges adjacent maps, so a
    new buffer can share a line of /proc/self/maps with an older map)."""
    out = []
    for a, b in spans:
        cuts = sorted((max(a, x), min(b, y)) for x, y in old if x < b and y > a)
        for x, y in cuts:
            if x > a:
                out.append((a, x))
            a = max(a, y)
        if b > a:
            out.append((a, b))
    return out


def _untouched_runs(spans: list[tuple[int, int]], least: int) -> list[tuple[int, int]]:
    """The runs of at least `least` bytes of pages that are not resident (mincore): the model's
    buffers before llama.cpp writes them. Its other new allocations (tensor metadata, the model's
    structures) are written as soon as they are made, so they are never in a run."""
    runs = []
    for a, b in spans:
        res = memory_resident(a, b) if b - a >= least else None
        if res is None:
            continue
        edges = np.flatnonzero(np.diff(np.concatenate([[1], res, [1]])))  # starts and ends of zero runs
        for s, e in zip(edges[::2], edges[1::2]):
            if (e - s) * PAGE >= least:
                runs.append((a + int(s) * PAGE, a + int(e) * PAGE))
    return runs


class _LoadDrops:
    """The progress callback of a kernel-layout load: at its first call (every buffer allocated,
    none written) it finds the model's buffers; at every call it gives their pages back.

    While llama.cpp loads, the buffers take huge pages: it writes every weight once (the stand-in's
    zeros, repacked) and each page is given back at the next call, so most of the load's time was
    the kernel's 4 KiB faults (full depth: 33.5 s, 25.3 s with huge pages; results/kernel_load_q48.json).
    `done` turns them off before any weight is read: a huge page would bring a dropped expert's
    neighbours back."""

    def __init__(self, least: int, huge_pages: bool = True):
        self.before = _writable_anonymous()
        self.least, self.huge_pages = least, huge_pages
        self.runs: list[tuple[int, int]] | None = None

    def __call__(self, progress, user) -> bool:
        if self.runs is None:
            self.runs = _untouched_runs(_minus(_writable_anonymous(), self.before), self.least)
            if self.huge_pages:
                self._advise(MADV_HUGEPAGE)  # refused where the kernel has none: the load is the same, slower
        self._advise(MADV_DONTNEED)
        return True

    def _advise(self, advice: int) -> None:
        for a, b in self.runs or []:
            libc().madvise(a, b - a, advice)

    def done(self) -> None:
        if self.huge_pages:
            self._advise(MADV_NOHUGEPAGE)


@dataclass
class WeightPlace:
    addr: int  # where llama.cpp holds the tensor
    nbytes: int
    offset: int  # where the kernel-layout file holds it
    tensor: int = 0  # llama.cpp's ggml_tensor


@dataclass
class KernelModel:
    """A llama.cpp model over a kernel-layout file, its weights' places, and the file open for reads."""

    L: object
    model: int
    kernel: KernelFile
    places: dict[str, WeightPlace]
    fd: int
    timings: dict = field(default_factory=dict)
    mapped: tuple[int, int] | None = None  # (address, bytes) of the file mapped by `map_weights`

    def fill(self, name: str, start: int = 0, n: int | None = None) -> int:
        """Read bytes [start, start + n) of a tensor from the file into llama.cpp's copy of it."""
        p = self.places[name]
        n = p.nbytes - start if n is None else n
        if self.in_map(p):
            raise MboltError(f"{self.kernel.header.path}: tensor {name} is mapped from the file: it is read by faults, not filled")
        buf = (ctypes.c_char * n).from_address(p.addr + start)
        got = os.preadv(self.fd, [memoryview(buf).cast("B")], p.offset + start)
        if got != n:
            raise MboltError(f"{self.kernel.header.path}: tensor {name}: read {got} of {n} bytes (truncated?)")
        return n

    def drop(self, name: str, start: int = 0, n: int | None = None) -> int:
        """Give back the whole pages of bytes [start, start + n) of a tensor (they read as zeros after)."""
        p = self.places[name]
        n = p.nbytes - start if n is None else n
        a = -(-(p.addr + start) // PAGE) * PAGE
        b = (p.addr + start + n) // PAGE * PAGE
        self.release(a, b)
        return max(0, b - a)

    def in_map(self, p: WeightPlace) -> bool:
        """The weight is pages of the file's map (`map_weights`), not rows of llama.cpp's buffers."""
        return self.mapped is not None and p.addr == self.mapped[0] + p.offset

    def release(self, lo: int, hi: int) -> None:
        """Give back the pages [lo, hi) (page-aligned addresses): rows of llama.cpp's buffers read as
        zeros after; pages of the file's map are unmapped and leave the page cache too."""
        if hi <= lo:
            return
        libc().madvise(lo, hi - lo, MADV_DONTNEED)
        if self.mapped is not None and self.mapped[0] <= lo < self.mapped[0] + self.mapped[1]:
            os.posix_fadvise(self.fd, lo - self.mapped[0], hi - lo, os.POSIX_FADV_DONTNEED)

    def fill_all(self, experts: bool = True) -> int:
        return sum(self.fill(n) for n in self.places if experts or "_exps." not in n)

    def map_weights(self, names) -> None:
        """These weights become pages of the kernel-layout file, mapped read-only: their tensors point
        into the map, their rows in llama.cpp's buffers are given back. The bytes there are already
        the repacked layout, and the repacked kernels read a weight wherever its data points, so
        the compute is the repacked load's; the page cache reads them (faults, WILLNEED) and gives
        them back, as for a mapped stock file."""
        if self.mapped is None:
            size = os.fstat(self.fd).st_size
            addr = libc().mmap(None, size, PROT_READ, MAP_SHARED, self.fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise MboltError(f"{self.kernel.header.path}: mmap failed (errno {ctypes.get_errno()})")
            self.mapped = (addr, size)
        base = self.mapped[0]
        for name in names:
            p = self.places[name]
            if self.in_map(p):
                continue
            self.drop(name)
            GgmlTensor.from_address(p.tensor).data = base + p.offset
            p.addr = base + p.offset

    def close(self) -> None:
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None
        if self.mapped is not None:  # after the model: its tensors pointed here
            libc().munmap(*self.mapped)
            self.mapped = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def find_weights(L, model, names: set[str]) -> dict[str, int]:
    """Each weight's `ggml_tensor`, from the sources of a first graph's nodes on a small context."""
    found: dict[str, int] = {}

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
    def look(t, ask, user):
        if ask:
            for s in GgmlTensor.from_address(t).src:
                if s:
                    g = GgmlTensor.from_address(s)
                    name = g.name.decode(errors="replace")
                    if name in names and not g.view_src:
                        found[name] = int(s)
        return not ask

    cp = L.llama_context_default_params()
    # the thread count the contexts after it use (runner's default): a one-thread context first
    # left OpenMP's team at one thread and later decodes 4-10x slower (seen on llama-cpp-python 0.3.36)
    n = max(1, os.cpu_count() or 1)
    set_fields(cp, n_ctx=64, n_batch=1, n_ubatch=1, n_threads=n, n_threads_batch=n, cb_eval=look)
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise MboltError("llama.cpp could not create a context to find the weights")
    try:
        tok = (ctypes.c_int32 * 1)(0)
        if L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) != 0:
            raise MboltError("llama.cpp could not run the graph that finds the weights")
    finally:
        L.llama_free(ctx)
    return found


@contextmanager
def stand_in(k: KernelFile):
    """A path llama.cpp loads for the kernel-layout file `k`: its header with the real architecture
    (core.kernel_file.llama_header) over a data section of holes (read as zeros, no I/O), in a
    memfd that lives as long as the block (what a load, or llama.cpp's memory-fit pass, reads)."""
    header = llama_header(k)
    start = -(-len(header) // k.header.alignment) * k.header.alignment
    fd = os.memfd_create("mbolt-kernel-header")
    try:
        os.write(fd, header)
        os.ftruncate(fd, start + (k.header.file_size - k.header.data_offset))
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def this_build(L) -> Build:
    info = L.llama_print_system_info()
    return build_of(info.decode() if isinstance(info, bytes) else str(info))


def load_kernel_model(path: str | os.PathLike | KernelFile, *, build: Build | None = None,
                      huge_pages: bool = True) -> KernelModel:
    """Load a kernel-layout file (its path, or its records already read) into llama.cpp (nothing
    filled yet: see `fill`/`fill_all`). `huge_pages`: the buffers take huge pages while llama.cpp
    writes its stand-in's zeros (_LoadDrops; off only to measure what they save)."""
    L = lib()
    L.llama_backend_init()
    k = path if isinstance(path, KernelFile) else read_kernel(path)
    check_build(k, build or this_build(L))
    t0, c0 = time.perf_counter(), time.process_time()
    # a run this long is a model buffer (the smallest weight's size would do; 1 MiB leaves out the
    # loader's 1 MiB staging buffers)
    drops = _LoadDrops(least=2 << 20, huge_pages=huge_pages)
    try:
        with stand_in(k) as shadow_path:
            # every buffer a fresh map while llama.cpp loads: glibc would otherwise serve one below its
            # dynamic threshold (up to 32 MiB) from heap pages already touched, which the drops miss
            libc().mallopt(M_MMAP_THRESHOLD, 1 << 20)
            on_progress = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)(drops)
            with captured_log(L) as lines:
                mp = L.llama_model_default_params()
                set_fields(mp, n_gpu_layers=0, load_mode=L.LLAMA_LOAD_MODE_NONE, use_extra_bufts=True,
                           progress_callback=on_progress)
                model = L.llama_model_load_from_file(shadow_path.encode(), mp)
                if not model:
                    tail = [ln for ln in lines if "error" in ln.lower()][-1:] or ["(no message)"]
                    raise MboltError(f"{k.header.path}: llama.cpp could not load it: {tail[0].strip()}")
                load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
                names = {t.name for t in k.header.tensors}
                tensors = find_weights(L, model, names)
                addr = {n: int(GgmlTensor.from_address(t).data) for n, t in tensors.items()}
    finally:
        drops.done()
        libc().mallopt(M_MMAP_THRESHOLD, 128 << 10)  # glibc's initial threshold (now fixed)
    missing = sorted(names - set(addr))
    if missing:
        L.llama_model_free(model)
        raise MboltError(f"{k.header.path}: llama.cpp's graph does not use tensor {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    places = {t.name: WeightPlace(addr[t.name], t.nbytes, t.data_offset, tensors[t.name]) for t in k.header.tensors}
    fd = os.open(k.header.path, os.O_RDONLY)
    km = KernelModel(L, model, k, places, fd, {"load_s": load_s, "load_cpu_s": load_cpu,
                                               "buffers_dropped": sum(b - a for a, b in drops.runs or [])})
    # now that every weight's place is known: each given back exactly (what the load's drops missed
    # in a buffer glibc served from memory it had touched before, and the zeros the graph read)
    for name in places:
        km.drop(name)
    return km
