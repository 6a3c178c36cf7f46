"""Long reads of a layer's experts for a prompt pass, queued to one background thread: the layer
about to compute (llama.cpp starts at once; its matmuls wait on pages still in flight, and the
reads run ahead of them in the order they use the bytes) and, when the budget holds two layers,
the next layer while this one computes.

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
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import split_vaddr
from mbolt.core.ranges import merge_ranges
from mbolt.core.routemap import expert_ranges

USE_ORDER = {"gate": 0, "gate_up": 0, "up": 1, "down": 2}  # llama.cpp's order of the expert matmuls


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
        self._tensors: dict[int, list[list[int]]] = {}
        for l in mm.moe_layers:
            groups: dict[str, list[int]] = {}
            rank: dict[str, int] = {}
            for i, t in enumerate(l.weights):
                key = t.container or t.name
                groups.setdefault(key, []).append(i)
                rank[key] = min(rank.get(key, 9), USE_ORDER.get(t.role, 3))
            self._tensors[l.index] = [groups[k] for k in sorted(groups, key=lambda k: rank[k])]
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

    def _read(self, layer: int, experts) -> int:
        jobs = self.jobs(layer, experts)
        if not jobs:
            return 0
        t0 = time.perf_counter()
        for off, n in jobs:
            f, o = split_vaddr(off)
            os.posix_fadvise(self.fds[f], o, n, os.POSIX_FADV_WILLNEED)
        for off, n in jobs:  # done when each piece's last page is (a read of it waits while it is in flight)
            f, o = split_vaddr(off)
            if len(os.pread(self.fds[f], 1, o + n - 1)) != 1:
                raise MboltError(f"{self.mm.paths[f]}: short read at byte {o + n - 1}")
        self.counters.busy_s += time.perf_counter() - t0
        n = sum(n for _, n in jobs)
        self.counters.bytes += n
        return n

    def submit(self, layer: int, experts) -> None:
        """Queue these experts' reads and return: one background thread works the queue in order
        (this layer while llama.cpp starts on it: its matmuls wait on pages in flight; the next
        layer while this one computes)."""
        experts = list(experts)
        self.call(lambda: self._read(layer, experts))

    def call(self, fn) -> None:
        """Queue any work for the background thread, in order with the reads (dropping the pages
        of experts llama.cpp is done with: freeing hundreds of MB of pages per layer took 35-55 ms
        of the callback, while llama.cpp waited)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="mbolt-reader", daemon=True)
            self._worker.start()
        self._queue.put(fn)

    def _work(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                if fn is None:
                    return
                if self._error is None:
                    fn()
            except BaseException as e:  # raised in the caller's thread by wait()
                self._error = e
            finally:
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
            self._queue.put(None)
            self._worker.join()
            self._worker = None
