"""The expert store: serve experts to the engine with explicit, merged reads.

Per call `fetch(layer, expert_ids)`: experts already in the layer's slot cache are hits; the
missed experts' byte ranges (every routed weight tensor, from the route map, indexed by ORIGINAL
expert id so stock, reorder and packed files are read through the same trace) are sorted and
merged by `mbolt.core.ranges.merge_ranges` (the planner's function, so a layout is read exactly
as it was scored) and read with `os.preadv` into one reusable buffer arena.

Reader options (an A/B "arm" is a file plus these):
- `gap`          merge gap in bytes (read through holes up to this size); a packed file's slot
                 padding is always read through (merge gap = max(gap, padding)).
- `io_threads`   queue depth: reads of one call are issued by that many threads at once.
- `direct`       O_DIRECT: page-aligned arena (anonymous mmap), offsets and lengths aligned to
                 4 KiB; the extra head/tail bytes are read and counted.
- `cache_slots`  per-layer LRU slot cache (experts kept in memory across calls); or
  `resident_frac`  the same budget as a share of each layer's experts.
- `asynchronous` for an engine that maps the file (llama.cpp): the merged reads are submitted
                 with posix_fadvise(WILLNEED) and not waited for; the engine's page faults wait
                 for what is still in flight (io_time is then the submission time only). The
                 kernel queues them as deep as the device takes: `io_threads` does not apply.
- `mode="os"`    map the file and let page faults read (layout-blind baseline); counters then
                 come from major faults and /proc/self/io.
- `on_evict`     called with (layer, expert) when an expert leaves the slot cache (an engine that
                 reads through the page cache drops that expert's pages then).
- `drop_pages`   buffered and os modes drop the pages they read (posix_fadvise DONTNEED, after
                 MADV_DONTNEED for the mapping) so the page cache never serves a second read: the
                 slot cache is then the only expert memory, standing for a model larger than RAM.
                 Buffered reads also set POSIX_FADV_RANDOM (no kernel readahead: the store reads
                 what the merge decided, nothing more).

Counters: calls, experts requested, hits, misses, reads, bytes (what the reader asked for, holes
and alignment included), useful bytes, io time (wall time of the read batches), device bytes
(/proc/self/io read_bytes delta, when available) and major faults (os mode).
"""

from __future__ import annotations

import mmap
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.lru import ArrayLru
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.core.pagecache import drop_cached, drop_mapped, proc_read_bytes, willneed, willneed_bytes
from mbolt.core.ranges import merge_ranges, split_jobs
from mbolt.core.gguf_set import split_vaddr
from mbolt.core.routemap import expert_ranges

ALIGN = 4096
PAGE = mmap.PAGESIZE


@dataclass
class StoreCounters:
    calls: int = 0
    experts: int = 0
    hits: int = 0
    misses: int = 0
    reads: int = 0  # merged ranges (what a layout changes)
    ops: int = 0  # read syscalls issued (a merged range may be split to fill the queue)
    bytes: int = 0
    useful_bytes: int = 0
    io_time: float = 0.0
    drop_time: float = 0.0  # time spent dropping read pages (posix_fadvise DONTNEED), outside io_time
    major_faults: int = 0
    device_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def add_read_whole(self, n: int) -> None:
        """A layer that a prompt pass read whole into memory of its own (runtime.prefill's overlay):
        its `n` selected experts are all misses, as the prompt's counters count them, so that the
        prompt's share stays a part of these totals (serve's decode counts are the difference)."""
        self.calls += 1
        self.experts += n
        self.misses += n

    def add_native(self, done: dict[str, int]) -> None:
        """Count what the runtime's C filter read itself (runtime.native's miss counts: decode
        layers with misses, under the same rule as a store's `read`)."""
        self.calls += done["layers"]
        self.experts += done["experts"]
        self.hits += done["hits"]
        self.misses += done["misses"]
        self.reads += done["reads"]
        self.ops += done["reads"]
        self.bytes += done["bytes"]
        self.useful_bytes += done["useful"]
        self.io_time += done["io_ns"] * 1e-9


class ExpertStore:
    def __init__(self, path, *, gap: int = 0, io_threads: int = 1, direct: bool = False,
                 cache_slots: int = 0, resident_frac: float | None = None, mode: str = "read",
                 drop_pages: bool = True, mm: MoeMap | None = None, on_evict=None, asynchronous: bool = False,
                 use_order: bool = True):
        if mode not in ("read", "os"):
            raise MboltError(f"store mode must be 'read' or 'os', not {mode!r}")
        if mode == "os" and direct:
            raise MboltError("the os arm maps the file: it cannot use O_DIRECT")
        if io_threads < 1:
            raise MboltError(f"--qd (io threads) must be at least 1, got {io_threads}")
        if gap < 0:
            raise MboltError(f"merge gap must be >= 0, got {gap}")
        self.path = str(path)
        self.use_order = use_order  # misses read tensor by tensor in llama.cpp's use order (else by offset)
        self.mm = mm or moe_map(self.path)
        self.gap, self.io_threads, self.direct, self.mode = int(gap), int(io_threads), bool(direct), mode
        if asynchronous and (direct or mode == "os"):
            raise MboltError("asynchronous reads fill the page cache: they need buffered reads (not O_DIRECT, not os)")
        self.drop_pages = drop_pages
        self.asynchronous = asynchronous
        self.on_evict = on_evict  # on_evict(layer, expert): an expert left the slot cache
        E = self.mm.n_experts
        if resident_frac is not None:
            if not 0 <= resident_frac <= 1:
                raise MboltError(f"--resident-frac must be within 0..1, got {resident_frac}")
            cache_slots = int(round(resident_frac * E))
        self._ranges = {l.index: expert_ranges(self.mm, l.index) for l in self.mm.moe_layers}
        self._roles = {l.index: [t.role for t in l.weights] for l in self.mm.moe_layers}
        # the role columns of each tensor of a layer (a packed blob holds every role), in use order
        self._tensor_cols = {l.index: l.tensor_columns() for l in self.mm.moe_layers}
        # the one slot cache rule (mbolt.core.lru), its state in arrays the runtime's C filter reads
        # and stamps (runtime.native: a decode step's layer whose experts are all cached is answered
        # there); the bytes of a cached expert (when kept) beside it
        n_rows = max(self._ranges, default=-1) + 1
        self.lru_cached = np.zeros((n_rows, E), np.uint8)
        self.lru_stamp = np.zeros((n_rows, E), np.int64)
        self.lru_clock = np.zeros(1, np.int64)
        self.lru_count = np.zeros(n_rows, np.int64)  # cached experts per layer
        self.read_mark = np.zeros((n_rows, E), np.uint8)  # read since `mark_reads` (what a server's page draws)
        self._lru: dict[int, ArrayLru] = {l: ArrayLru(0, self.lru_cached[l], self.lru_stamp[l], self.lru_clock,
                                                        count=self.lru_count[l:l + 1])
                                          for l in self._ranges}
        self._kept: dict[int, dict] = {l: {} for l in self._ranges}
        self.cache_slots = max(0, min(int(cache_slots), E))
        # A packed file pads each expert's slot (to 4 KiB or 512 B): read through the padding.
        self.pad_gap = max((layer.slot_padding for layer in self.mm.moe_layers), default=0)
        self.merge_gap = max(self.gap, self.pad_gap)
        self.counters = StoreCounters()
        self._arena: mmap.mmap | None = None
        # asynchronous reads are advice the kernel queues itself: no threads of ours read them
        self._pool = ThreadPoolExecutor(self.io_threads) if self.io_threads > 1 and not asynchronous else None
        self._dev0 = proc_read_bytes()
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        # One descriptor per file: a split set's shards (ranges are virtual offsets, core.gguf_set).
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        try:
            for p in self.mm.paths:
                try:
                    self.fds.append(os.open(p, flags))
                except OSError as e:
                    raise MboltError(f"{p}: cannot open{' with O_DIRECT' if direct else ''}: {e.strerror}") from None
            self.file_sizes = [os.fstat(fd).st_size for fd in self.fds]
            self.willneed_steps = [willneed_bytes(p) for p in self.mm.paths] if asynchronous else []
            if mode == "os":
                self._maps = [mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for fd in self.fds]
            elif not direct:
                for fd in self.fds:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            self.close()
            raise
        self.fd = self.fds[0]
        self.file_size = self.file_sizes[0]

    # ---- public ----

    def fetch(self, layer: int, expert_ids) -> dict[int, dict[str, np.ndarray]]:
        """{orig_id: {role: uint8 slice}} for the requested experts (copies, safe to keep)."""
        return self._serve(layer, expert_ids, want=True)

    def read(self, layer: int, expert_ids) -> None:
        """Do the I/O `fetch` would do, without handing out bytes (replay mode)."""
        self._serve(layer, expert_ids, want=False)

    def snapshot(self) -> StoreCounters:
        c = StoreCounters(**self.counters.to_dict())
        now = proc_read_bytes()
        c.device_bytes = None if (now is None or self._dev0 is None) else now - self._dev0
        return c

    def reset_counters(self) -> None:
        self.counters = StoreCounters()
        self._dev0 = proc_read_bytes()

    @property
    def cache_slots(self) -> int:
        return self._cache_slots

    @cache_slots.setter
    def cache_slots(self, n: int) -> None:
        self._cache_slots = int(n)
        for lru in self._lru.values():
            lru.slots = self._cache_slots

    def resize(self, slots: int) -> None:
        """A new slot count for every layer; a shrink evicts the least recently used now."""
        self.cache_slots = slots
        for layer in self._lru:
            self._admit(layer, ())

    def mark_reads(self) -> None:
        """Start a new step's marks of what was read."""
        self.read_mark[:] = 0

    def clear_cache(self) -> None:
        for layer in self._lru:
            self._lru[layer].clear()
            self._kept[layer].clear()

    def cached(self, layer: int) -> list[int]:
        """The experts of a layer's slot cache, least recently used first."""
        return list(self._lru[layer].order)

    def pin(self, layer: int, experts) -> None:
        """Keep these experts (original ids) in the layer's slot cache once read: the LRU evicts
        only unpinned ones (nuthatch's learned-pin policy: the hottest experts of a training
        trace pinned, the rest of the slots LRU). At most cache_slots - 1 pins per layer."""
        experts = [int(e) for e in experts]
        if len(experts) >= max(self.cache_slots, 1):
            raise MboltError(f"{self.path}: layer {layer}: {len(experts)} pins leave no LRU slot of {self.cache_slots}")
        self._lru[layer].pinned = set(experts)

    def pin_hottest(self, n: int) -> int:
        """Pin each layer's `n` hottest experts by the route map's heat (per position; pins name
        original experts); returns n."""
        rm = self.mm.route_map
        for l in self.mm.moe_layers:
            self.pin(l.index, rm.perm[l.index][np.argsort(-rm.heat[l.index], kind="stable")[:n]])
        return n

    def forget(self, layer: int, expert: int) -> None:
        """Take an expert out of the slot cache without calling on_evict (its bytes are gone
        already, e.g. reclaimed by the kernel): the next request reads it again."""
        self._lru[layer].discard(int(expert))
        self._kept[layer].pop(int(expert), None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for m in self._maps:
            m.close()
        self._maps = []
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ----

    def _serve(self, layer, expert_ids, want):
        R = self._ranges.get(layer)
        if R is None:
            raise MboltError(f"{self.path}: layer {layer} has no routed experts")
        ids = [int(e) for e in np.asarray(expert_ids).reshape(-1) if int(e) >= 0]
        ids = list(dict.fromkeys(ids))  # unique, first-seen order
        E = R.shape[0]
        for e in ids:
            if e >= E:
                raise MboltError(f"{self.path}: layer {layer}: expert {e} out of range (0..{E - 1})")
        c = self.counters
        c.calls += 1
        c.experts += len(ids)
        lru, kept = self._lru[layer], self._kept[layer]
        out: dict[int, dict[str, np.ndarray]] = {}
        missed = []
        for e in ids:
            # A hit is an expert resident as of the previous call (mbolt.core.lru); a call that
            # wants bytes needs them kept (an expert cached by a call that did not keep them is read)
            if e in lru and (e in kept or not want):
                c.hits += 1
                if want:
                    out[e] = kept[e]
            else:
                missed.append(e)
        c.misses += len(missed)
        if missed:
            self.read_mark[layer, missed] = 1
        got = {}
        if missed:
            got = self._read_os(layer, missed, want) if self.mode == "os" else self._read(layer, missed, want)
            if want:
                out.update(got)
        if self.cache_slots:
            for e in got:
                if want:
                    kept[e] = got[e]
                else:
                    kept.pop(e, None)
            self._admit(layer, ids)
        return out

    def _admit(self, layer: int, ids) -> None:
        """`ids` become the layer's most recently used; whatever leaves the cache loses its kept
        bytes and is handed to on_evict."""
        for gone in self._lru[layer].admit(ids):
            self._kept[layer].pop(gone, None)
            if self.on_evict is not None:
                self.on_evict(layer, gone)

    def admit(self, layer: int, expert_ids, count: bool = True) -> int:
        """Count and admit experts whose bytes the caller brought in itself (a prompt pass's long
        reads): hits and misses as `read` counts them (`count`: False for bytes nobody used, read
        ahead), the LRU as `read` leaves it (the last id the most recent). Returns the misses."""
        ids = list(dict.fromkeys(int(e) for e in expert_ids if int(e) >= 0))
        lru = self._lru[layer]
        misses = sum(e not in lru for e in ids)
        if count:
            c = self.counters
            c.calls += 1
            c.experts += len(ids)
            c.hits += len(ids) - misses
            c.misses += misses
        if self.cache_slots:
            for e in ids:
                self._kept[layer].pop(e, None)  # nobody holds their bytes: the page cache does
            self._admit(layer, ids)
        return misses

    def count_cached(self, calls: int, experts: int) -> None:
        """Count calls whose experts were all cached, answered without this store (the runtime's C
        filter stamped the LRU's arrays itself)."""
        c = self.counters
        c.calls += calls
        c.experts += experts
        c.hits += experts

    def reserve(self, experts_per_call: int) -> int:
        """Allocate the read arena for the largest call of `experts_per_call` misses and touch
        every page now, so that no timed read pays first-touch page faults (or grows the arena)
        and every arm starts with the same memory state. Returns the arena size in bytes."""
        n_ranges = max(int(experts_per_call), 1) * max((r.shape[1] for r in self._ranges.values()), default=1)
        longest = max((int(r[..., 1].max()) for r in self._ranges.values() if r.size), default=0)
        need = n_ranges * (longest + 3 * ALIGN + self.merge_gap)  # alignment head, tail, slot
        self._arena_view(need)
        self._arena.seek(0)
        self._arena.write(bytes(len(self._arena)))  # first touch, outside any timed read
        self._arena.seek(0)
        return len(self._arena)

    def _arena_view(self, size: int) -> memoryview:
        if self._arena is None or len(self._arena) < size:
            if self._arena is not None:
                self._arena.close()
            cap = max(size, 1 << 20)
            cap += (-cap) % ALIGN
            self._arena = mmap.mmap(-1, cap)  # anonymous: page aligned, as O_DIRECT wants
        return memoryview(self._arena)

    def _read(self, layer, missed, keep):
        R = self._ranges[layer][missed]  # [m, n_roles, 2]
        starts = R[..., 0].reshape(-1)
        # merged per tensor, as the planner's evaluator scores a layout: two tensors that happen to
        # touch (the last slice of one, the first of the next) are two reads; a packed blob's roles
        # are one tensor
        parts = [merge_ranges(R[:, cols, 0].reshape(-1), (R[:, cols, 0] + R[:, cols, 1]).reshape(-1), self.merge_gap)
                 for cols in self._tensor_cols[layer]]
        rs, re_ = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        if keep or not self.use_order:  # by offset (keep: each wanted slice is found in its read below)
            order = np.argsort(rs, kind="stable")
            rs, re_ = rs[order], re_[order]
        # else tensor by tensor in llama.cpp's use order (parts come so, each by offset): the gate's
        # pages arrive first, whichever tensor the file holds first
        if self.direct:
            a = rs - rs % ALIGN
            b = re_ + (-re_) % ALIGN
        else:
            a, b = rs, re_
        lens = b - a
        # Arena slots for the reads, each starting on an ALIGN boundary.
        slot = lens + (-lens) % ALIGN
        if keep:
            where = np.concatenate([[0], np.cumsum(slot)[:-1]]).astype(np.int64)
            view = self._arena_view(int(slot.sum()))
        else:
            # nobody reads the bytes (the page cache is the point): reads share io_threads slots of
            # the longest read, so the arena stays small however many experts a call misses (a
            # prefill's union grew it to 129 MB of shared memory inside a memory budget)
            big = int(slot.max()) if slot.size else 0
            where = (np.arange(len(slot)) % self.io_threads).astype(np.int64) * big
            view = self._arena_view(big * min(self.io_threads, len(slot)))
        jobs = [(int(a[i]), int(lens[i]), int(where[i])) for i in range(len(a))]
        if self.io_threads > 1 and jobs:
            jobs = split_jobs(jobs, self.io_threads)
        t0 = time.perf_counter()
        if self.asynchronous and not keep:
            # submit, do not wait: the engine's page faults wait for the pages still in flight, so
            # its matmuls start on the first experts while the rest arrive (blocking reads at any
            # queue depth stalled the whole layer: 8.3 vs 10.1 tok/s, issue 19)
            for off, n, _ in jobs:
                f, o = split_vaddr(off)
                willneed(self.fds[f], o, n, self.willneed_steps[f])
        elif self._pool is None or len(jobs) == 1:
            for j in jobs:
                self._pread(view, *j)
        else:
            for f in [self._pool.submit(self._pread, view, *j) for j in jobs]:
                f.result()
        dt = time.perf_counter() - t0
        c = self.counters
        c.io_time += dt
        c.reads += len(a)
        c.ops += len(jobs)
        c.bytes += int(lens.sum())
        c.useful_bytes += int(R[..., 1].sum())
        if self.drop_pages and not self.direct:
            t1 = time.perf_counter()
            self._drop(a, b)
            c.drop_time += time.perf_counter() - t1
        got = {e: None for e in missed}
        if keep:
            roles = self._roles[layer]
            # Each wanted range lies inside exactly one read: find it by its start.
            idx = np.searchsorted(a, starts, side="right") - 1
            pos = where[idx] + (starts - a[idx])
            for i, e in enumerate(missed):
                d = {}
                for r, role in enumerate(roles):
                    j = i * len(roles) + r
                    p, n = int(pos[j]), int(R[i, r, 1])
                    d[role] = np.frombuffer(view[p:p + n], dtype=np.uint8).copy()
                got[e] = d
        return got

    def _drop(self, a: np.ndarray, b: np.ndarray) -> None:
        """Drop the page-cache span of what was just read, per file."""
        (files, oa), (_, ob) = split_vaddr(a), split_vaddr(b)
        for f in np.unique(files):
            sel = files == f
            drop_cached(self.fds[int(f)], int(oa[sel].min()), int(ob[sel].max()))

    def _pread(self, view, off, n, where):
        f, off = split_vaddr(off)
        fd = self.fds[f]
        done = 0
        while done < n:
            k = os.preadv(fd, [view[where + done:where + n]], off + done)
            if k <= 0:
                if self.direct and off + done >= self.file_sizes[f]:
                    break  # aligned tail past the end of the file
                raise MboltError(f"{self.mm.paths[f]}: short read at byte {off + done} (wanted {n - done} more)")
            done += k

    def _read_os(self, layer, missed, keep):
        R = self._ranges[layer][missed]
        starts = R[..., 0].reshape(-1)
        sizes = R[..., 1].reshape(-1)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        t0 = time.perf_counter()
        roles = self._roles[layer]
        got = {}
        sink = 0
        for i, e in enumerate(missed):
            d = {}
            for r, role in enumerate(roles):
                j = i * len(roles) + r
                f, s = split_vaddr(starts[j])
                m, n = self._maps[f], int(sizes[j])
                if keep:
                    d[role] = np.frombuffer(m, dtype=np.uint8, count=n, offset=s).copy()
                else:
                    # touch one byte per page: the faults do the reading
                    sink += int(np.frombuffer(m, dtype=np.uint8, count=n, offset=s)[::PAGE].sum())
            got[e] = d
        dt = time.perf_counter() - t0
        c = self.counters
        c.io_time += dt
        c.major_faults += (faults := resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0)
        c.reads += faults  # each major fault is one read the kernel issued (readahead included)
        c.ops += faults
        c.useful_bytes += int(sizes.sum())
        c.bytes += int(sizes.sum())
        if self.drop_pages:
            t1 = time.perf_counter()
            files, offs = split_vaddr(starts)
            for f in np.unique(files):
                sel = files == f
                drop_mapped(self._maps[int(f)], self.fds[int(f)], int(offs[sel].min()),
                            int((offs + sizes)[sel].max()), self.file_sizes[int(f)])
            c.drop_time += time.perf_counter() - t1
        return got
