"""Long reads of a layer's experts for a prompt pass, queued to one background thread: the layer
about to compute (llama.cpp starts at once; its matmuls wait on pages still in flight, and the
reads run ahead of them in the order they use the bytes) and, when the budget holds two layers,
the next layer while this one computes; when it holds one, a layer from its start, under its own
attention, once the layer before is done (runtime.arm.BudgetedArm).

A prompt pass of hundreds of tokens selects most of a layer's experts. Its reads are the missed
experts' slices merged per tensor (neighbours join into one range), in the order llama.cpp's graph
uses the tensors (gate, up, down: swiglu(gate, up) puts the gate's matmul first) and, within a
tensor, by offset (ggml's mul_mat_id walks the experts in index order). Each merged range is
submitted with posix_fadvise(WILLNEED) in pieces the kernel takes whole (`willneed_bytes`): the
kernel reads them into the page cache, where llama.cpp's mapping finds them, with as many requests
in flight as the device queue holds and no copy to user space (preadv into scratch buffers cost
twice the CPU, which the two cores' matmuls were using: 27.8 s against 24.8 s warm for a
2,000-token prompt). A job is done when the last page of each piece is read (a one-byte pread
waits for it); the descriptors carry POSIX_FADV_RANDOM, so the kernel adds no readahead.

Counters: bytes read, merged reads, and the time with a read outstanding (jobs run one after
another), so the read bandwidth of a prompt is bytes / busy seconds.

`PassOverlay` is the faster way when the budget holds a whole layer and the kernel has transparent
huge pages (two slots with read-ahead, else one, filled from the layer's start): a layer's expert
tensors are laid over with anonymous memory (huge pages) and filled by O_DIRECT reads, then the
file is mapped back once the layer is done. Through the page cache (the way above) a follow-up turn
of 200 tokens on q72 at a 40% limit took 2.5-2.9 s against 1.4-1.5 s warm: per 113 MB layer the
reader spent 20 ms of CPU reading and 20 ms dropping (page-cache insertion, charging, freeing: 4 KiB
at a time), llama.cpp's threads took 24,000 more minor faults, and on two cores every such
millisecond is taken from the matmuls. O_DIRECT into huge pages needs no page cache, no faults after
the read, and about 1 ms of CPU per 113 MB; this VM's drive reads 3.8 GB/s that way against 2.0
through WILLNEED and 1.1 into small pages (its requests are as large as the physically contiguous
memory behind them).
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import split_vaddr
from mbolt.core.pagecache import libc
from mbolt.core.ranges import merge_ranges
from mbolt.core.routemap import expert_ranges
from mbolt.runtime.pages import anonymous, move_pages

HUGE = 2 << 20  # a transparent huge page on x86-64


@dataclass
class ReadCounters:
    bytes: int = 0
    reads: int = 0  # merged ranges
    busy_s: float = 0.0  # wall time with a read outstanding

    def to_dict(self) -> dict:
        return asdict(self)


class LayerReader:
    """Reads experts of a layer (original ids) with long merged WILLNEED advice; see the module docstring."""

    def __init__(self, mm, fds: list[int], steps: list[int]):
        self.mm = mm
        self.fds = fds
        self.steps = steps  # per file: the most one WILLNEED reads (core.pagecache.willneed_bytes)
        self._ranges = {l.index: expert_ranges(mm, l.index) for l in mm.moe_layers}
        # the columns of each tensor of a layer (a packed blob holds every role), tensors in use order
        self._tensors = {l.index: l.tensor_columns() for l in mm.moe_layers}
        self.counters = ReadCounters()
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    def jobs(self, layer: int, experts) -> list[tuple[int, int]]:
        """(virtual offset, length) pieces of the merged ranges of these experts, in use order."""
        ex = np.asarray(sorted(int(e) for e in experts), np.int64)
        if ex.size == 0:
            return []
        R = self._ranges[layer][ex]  # [m, roles, 2]
        out = []
        for cols in self._tensors[layer]:
            s = R[:, cols, 0].reshape(-1)
            a, b = merge_ranges(s, s + R[:, cols, 1].reshape(-1), 0)
            for x, y in zip(a.tolist(), b.tolist()):
                self.counters.reads += 1
                step = self.steps[split_vaddr(x)[0]]
                while x < y:
                    n = min(step, y - x)
                    out.append((x, n))
                    x += n
        return out

    def _read(self, layer: int, experts, issued: threading.Event) -> int:
        jobs = self.jobs(layer, experts)
        if not jobs:
            return 0
        t0 = time.perf_counter()
        for off, n in jobs:
            f, o = split_vaddr(off)
            os.posix_fadvise(self.fds[f], o, n, os.POSIX_FADV_WILLNEED)
        issued.set()
        for off, n in jobs:  # done when each piece's last page is (a read of it waits while it is in flight)
            f, o = split_vaddr(off)
            if len(os.pread(self.fds[f], 1, o + n - 1)) != 1:
                raise MboltError(f"{self.mm.paths[f]}: short read at byte {o + n - 1}")
        self.counters.busy_s += time.perf_counter() - t0
        n = sum(n for _, n in jobs)
        self.counters.bytes += n
        return n

    def submit(self, layer: int, experts) -> threading.Event:
        """Queue these experts' reads and return: one background thread works the queue in order
        (this layer while llama.cpp starts on it: its matmuls wait on pages in flight; the next
        layer while this one computes). The event is set once every read is asked for (in flight:
        a page fault waits for its page), or the job ended without."""
        experts = list(experts)
        issued = threading.Event()
        self.call(lambda: self._read(layer, experts, issued), issued)
        return issued

    def wait_issued(self, issued: threading.Event) -> None:
        """Until `submit`'s reads are asked for (the first error, if any, raised here)."""
        issued.wait()
        if self._error is not None:
            self.wait()

    def call(self, fn, done: threading.Event | None = None) -> None:
        """Queue any work for the background thread, in order with the reads (dropping the pages
        of experts llama.cpp is done with: freeing hundreds of MB of pages per layer took 35-55 ms
        of the callback, while llama.cpp waited)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="mbolt-reader", daemon=True)
            self._worker.start()
        self._queue.put((fn, done))

    def _work(self) -> None:
        while True:
            fn, done = self._queue.get()
            try:
                if fn is None:
                    return
                if self._error is None:
                    fn()
            except BaseException as e:  # raised in the caller's thread by wait()
                self._error = e
            finally:
                if done is not None:
                    done.set()
                self._queue.task_done()

    def wait(self) -> None:
        """Until every queued read is done (the first error, if any, raised here)."""
        if self._worker is not None:
            self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put((None, None))
            self._worker.join()
            self._worker = None


def huge_pages() -> bool:
    """Whether the kernel gives transparent huge pages to a range advised MADV_HUGEPAGE."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def open_direct(paths) -> list[int] | None:
    """Each file opened with O_DIRECT, or None when one cannot be (a filesystem without it)."""
    fds: list[int] = []
    try:
        for p in paths:
            fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


class PassOverlay:
    """A prompt pass's layers laid over with anonymous memory filled by O_DIRECT (see the module
    docstring), on the reader's thread: at most two layers at a time (the one computing and the
    next, read while it computes), what a budget with read-ahead holds. The memory is two slots of
    a layer's size, allocated (in huge pages) as a prompt's first two layers need them and freed after its last:
    a layer is laid over by moving a slot's pages onto its expert tensors in llama.cpp's mapping
    (mremap: no copy, no new page to zero) and given back by moving them away and mapping the file
    again. A layer is laid over whole (the next layer's selection is not known when it is read);
    only whole pages of expert tensors ever are (never a dense page), and no advice ever drops them
    (MADV_DONTNEED would zero them). Each file must be mapped once (llama.cpp's one mapping: the
    runtime turns the overlay off otherwise)."""

    def __init__(self, pages, reader: LayerReader, direct_fds: list[int]):
        self.pages, self.reader, self.direct, self._fds = pages, reader, direct_fds, direct_fds
        E = pages.mm.n_experts
        self.spans = {l.index: pages.expert_spans_of(l.index, range(E)) for l in pages.mm.moe_layers}
        self.slot_bytes = -(-max(sum(b - a for a, b in sp) for sp in self.spans.values()) // HUGE) * HUGE
        self.laid: list[int] = []  # layers laid over or queued to be, oldest first (the caller's thread)
        self.layers_laid = 0  # layers filled so far (counted on the reader's thread)
        self._free: list[int] = []  # slots not laid over (the reader's thread, as what follows)
        self._held: dict[int, tuple[int, list]] = {}  # layer -> (its slot, its mapped pieces)
        self._slots: list[tuple[int, int]] = []  # (address, bytes) of each slot's memory

    def start(self, layer: int) -> None:
        """Layer `layer`'s selection is known and its matmuls run when the caller returns: it is
        laid over (`begin`), waited for."""
        self.begin(layer)
        self.reader.wait()

    def begin(self, layer: int) -> None:
        """The layers before `layer` go back to the file (their matmuls are done) and it is laid
        over, unless it was read ahead (queued: with one slot, at the layer's start, under its
        attention)."""
        for old in [l for l in self.laid if l != layer]:
            self.laid.remove(old)
            self.reader.call(lambda l=old: self._lift(l))
        self.ahead(layer)

    def ahead(self, layer: int) -> None:
        """Lay `layer` over on the reader's thread (queued behind what is there), unless it is; with
        both slots laid (a pass stopped half-way, then a new one), the oldest goes back first."""
        if layer in self.laid:
            return
        if len(self.laid) >= 2:
            old = self.laid.pop(0)
            self.reader.call(lambda: self._lift(old))
        self.laid.append(layer)
        self.reader.call(lambda: self._fill(layer))

    def finish(self) -> None:
        """The file back under every laid layer and the slots freed (queued: `reader.wait()` for it)."""
        for l in self.laid:
            self.reader.call(lambda l=l: self._lift(l))
        self.laid = []
        self.reader.call(self._free_slots)

    def prepare(self) -> None:
        """The first slot allocated and its pages touched now, before any prompt (on the reader's
        thread, waited for), as llama.cpp warms up at load: a process's first touch of new
        memory is its slowest, and a prompt's first layer would wait for it (in this VM, whose
        kernel reports free 8 MB blocks to its host: 0.4-0.9 s for 394 MB of huge pages, against
        20 ms for pages the process freed itself). The slot is in the budget's room for a pass;
        the prompt's end frees it (`finish`), so decode's cache has the room again."""
        self.reader.call(lambda: self._slots or self._add_slot())
        self.reader.wait()

    @property
    def held_bytes(self) -> int:
        """The slots' memory (each slot and a huge page to align it)."""
        return sum(size for _, size in self._slots)

    def _add_slot(self) -> None:
        base = anonymous(self.slot_bytes + HUGE)
        self._slots.append((base, self.slot_bytes + HUGE))
        self._free.append(-(-base // HUGE) * HUGE)  # on a huge-page boundary

    def _fill(self, layer: int) -> None:
        t0 = time.perf_counter()
        c = self.reader.counters
        if not self._free:  # one slot at a time: the second is allocated while the first layer computes
            self._add_slot()
        slot = self._free.pop()
        pieces = self.pages.mapped_pieces(self.spans[layer])
        at = slot
        for f, addr, n, off in pieces:
            move_pages(at, addr, n)
            at += n
        self._held[layer] = (slot, pieces)
        for f, addr, n, off in pieces:
            done = 0
            while done < n:
                view = memoryview((ctypes.c_char * (n - done)).from_address(addr + done)).cast("B")
                fd = self.direct[f] if self.direct is not None else self.pages.files[f].fd
                try:
                    got = os.preadv(fd, [view], off + done)
                except OSError as e:
                    if self.direct is None or e.errno != errno.EINVAL:
                        raise MboltError(f"{self.pages.mm.paths[f]}: read of {n - done} B at byte {off + done} "
                                         f"failed: {e.strerror}") from None
                    self.direct = None  # this filesystem refuses O_DIRECT reads: buffered ones fill it
                    continue
                if got <= 0:
                    raise MboltError(f"{self.pages.mm.paths[f]}: short read at byte {off + done}")
                done += got
            c.reads += 1
            c.bytes += n
        c.busy_s += time.perf_counter() - t0
        self.layers_laid += 1

    def _lift(self, layer: int) -> None:
        """A laid layer's pages back into its slot, the file mapped again under them."""
        slot, pieces = self._held.pop(layer)
        at = slot
        for f, addr, n, off in pieces:
            move_pages(addr, at, n)
            self.pages.map_file(f, off, off + n)
            at += n
        self._free.append(slot)

    def _free_slots(self) -> None:
        if not self._held:
            for base, size in self._slots:
                libc().munmap(ctypes.c_void_p(base), size)
            self._slots, self._free = [], []

    def close(self) -> None:
        """The files' descriptors closed and the slots freed (the reader's thread is gone: no
        layer is laid over after `finish`)."""
        self._free_slots()
        for fd in self._fds:
            os.close(fd)
        self._fds, self.direct = [], None
