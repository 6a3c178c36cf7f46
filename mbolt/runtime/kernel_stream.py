"""The streaming runtime over a kernel-layout file (`mbolt repack`): experts read straight into
llama.cpp's own buffers, already in the layout its fastest CPU kernels use (issue 54).

The model is loaded by runtime.kernel_load: every weight in llama.cpp's buffers (the repacked
ones in its repack buffer), nothing filled. The dense weights are read in once and stay (anonymous
memory). Experts come and go at each layer's selection, as in runtime.streamer, but their bytes
are rows of those buffers, not pages of a mapped file:
- a miss is read from the file into its rows (O_DIRECT into an aligned bounce buffer, then one
  copy: llama.cpp's buffers are 64 bytes past a page, which O_DIRECT refuses; buffered reads with
  the page cache dropped behind them where the filesystem has no O_DIRECT), before the callback
  returns; no page cache is held and nothing is repacked on the CPU;
- an eviction gives the expert's pages back (MADV_DONTNEED); a page it shares with a neighbour
  that is cached, or in use by the layer computing, stays;
- a decode layer whose experts are all cached never reaches Python: the C filter (runtime.native)
  stamps the same LRU arrays (core.lru.ArrayLru: the one cache rule);
- a prompt pass reads each layer's union before its matmuls and, when the pass selects half a
  layer, the next layer's uncached experts on a thread: while this one computes when the budget
  holds two layers, else from the next one's start, under its attention (runtime.arm.BudgetedArm);
  those it does not select are given back at its selection.
The budget (runtime.budget) is planned and fitted as for the mapped runtime: everything here is
this process's own memory.

`paged` (the default; measured faster under a memory limit, docs/results.md): the experts are
not rows read in but pages of the kernel-layout file's map
(KernelModel.map_weights points llama.cpp's expert tensors there; the repacked kernels read a
weight wherever its data points). A miss is asked of the page cache (WILLNEED) and not waited for:
llama.cpp's page faults wait page by page, so an expert computes while the next ones arrive, with no
copy and no zeroed pages. An eviction gives the map's pages and the page cache's copy back. The cache
rule, the budget and the C filter are the same.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.lru import ArrayLru, by_last_use
from mbolt.core.moe_map import MoeMap
from mbolt.core.pagecache import residency_visible
from mbolt.runtime.arm import BudgetedArm, PromptStats, own_bytes
from mbolt.runtime.budget import Budget, budget_inputs
from mbolt.runtime.kernel_load import load_kernel_model
from mbolt.runtime.memory import DEFAULT_UBATCH, ContextMemory
from mbolt.runtime.native import BEHIND, START
from mbolt.runtime.runner import Phase
from mbolt.runtime.rows import ExpertRows, PagedReader, RowReader



class KernelRuntime(BudgetedArm):
    """The streaming runtime over a kernel-layout file (see the module docstring). Options as
    runtime.streamer.StreamRuntime's where the concept is the same: budget, cache_slots, qd (read
    threads), n_ctx, n_ubatch, record, evict, n_seq."""

    uses_callback = True
    AGAIN_TRIES = 8  # drops again of read-ahead experts: their reads land within a layer or two
    repacking = "stored (a kernel-layout file: read into llama.cpp's repacked buffers, never repacked here)"
    pins = False
    pinned_per_layer = locked_bytes = copied_bytes = 0

    def __init__(self, path, *, cache_slots: int = 0, n_ctx: int | None = None, n_ubatch: int = DEFAULT_UBATCH,
                 mm: MoeMap | None = None, record: bool = False, budget: int | None = None, f32_kv: bool = False,
                 flash_attn: bool | None = None, evict: bool = True, n_seq: int = 1, qd: int = 1,
                 give_back_compute: bool = True, read_behind: bool = True, buffered: bool = False,
                 paged: bool | None = None, native_misses: bool = True):
        from mbolt.core.kernel_file import read_kernel, stock_view
        from mbolt.core.moe_map import moe_map

        self.km = self.reader = None
        self._ahead: Future | None = None
        self._visible = False
        self._pool = None
        k = read_kernel(path)  # its header read once: the map, the budget's stand-in and the load use it
        self._open(path, mm or moe_map(stock_view(k)), n_ctx, n_ubatch, f32_kv, flash_attn)
        self.record, self.evict, self.give_back_compute = record, evict or bool(budget), give_back_compute
        E = self.mm.n_experts
        if cache_slots and cache_slots < self.mm.n_used:
            raise MboltError(f"--cache-slots {cache_slots} is below the {self.mm.n_used} experts a token uses: "
                             "give 0 (no cache) or at least that many")
        self.cache_slots = int(cache_slots) if (cache_slots or budget) else E  # no budget, no slots: all cached
        self.budget: Budget | None = None
        if budget:
            with budget_inputs(path, self.mm, kernel=k) as (shadow, dense):  # the model the file holds
                self.budget = Budget.planned(budget, self.mm, shadow, n_ctx=self.n_ctx, n_ubatch=self.n_ubatch,
                                             dense_bytes=dense, flash_attn=self.flash_attn, f32_kv=f32_kv, n_seq=n_seq)
            self.n_ubatch = self.budget.plan.n_ubatch
        self.model_path = self.path
        self.perm = self.mm.route_map.perm
        L = self.perm.shape[0]
        self.lru_cached = np.zeros((L, E), np.uint8)
        self.lru_stamp = np.zeros((L, E), np.int64)
        self.lru_clock = np.zeros(1, np.int64)
        self.lru_count = np.zeros(L, np.int64)  # cached experts per layer (the C filter's misses read it)
        self._lru = {layer.index: ArrayLru(self.cache_slots, self.lru_cached[layer.index], self.lru_stamp[layer.index],
                                           self.lru_clock, count=self.lru_count[layer.index:layer.index + 1])
                     for layer in self.mm.moe_layers}
        moe = sorted(self._lru)
        self.moe_layers, self._next_moe = set(moe), dict(zip(moe, moe[1:]))
        self.phase = Phase.LOAD
        self.prompt = PromptStats()
        self.step_routing: dict[int, np.ndarray] = {}
        self.after_step_s = 0.0
        self.fast_layers = 0
        self.native_layers = 0  # paged: decode layers with misses the C filter answered
        self.reclaimed = 0  # paged: cached experts the C filter found reclaimed by the kernel (read again)
        self.step_clock = 0  # the LRU's clock when the last decode step began
        self.memory: ContextMemory | None = None
        self.tap = self.filter = None
        self._seen: set[int] = set()
        self._later: list[tuple[int, list[int]]] = []  # victims the computing layer still uses
        self._spec: dict[int, set[int]] = {}  # layer -> experts read ahead for it (not in its cache)
        self._again: list[tuple[int, set[int], int]] = []  # read ahead, dropped while their reads may be in flight
        self._computed = False
        # paged unless rows are asked for (buffered, or inline: ways to read rows in)
        paged = (not buffered and read_behind) if paged is None else paged
        if paged and buffered:
            raise MboltError(f"{path}: paged experts are not read in: buffered means nothing there")
        self.read_behind = read_behind and not paged  # paged: llama.cpp's faults wait, page by page
        self.paged = paged
        self.native_misses = native_misses  # paged: decode layers with misses answered in C
        self.behind_layers = 0  # layers whose up and down rows were read behind their gate/up matmuls
        self.behind = False  # up and down rows read behind the gate/up matmuls (attach: rows of gate, up, down)
        self._behind: dict[int, list[Future]] = {}  # layer -> the reads of its up and down rows, in that order
        try:
            self.km = load_kernel_model(k)
            self.llama_model = self.km.model
            experts = {w.name for layer in self.mm.moe_layers for w in layer.weights}
            if paged:
                self.km.map_weights(sorted(experts))
            self.rows = ExpertRows(self.mm, self.km)
            self.reader = PagedReader(self.path) if paged else RowReader(self.path, qd, buffered=buffered)
            self._visible = residency_visible(self.path)  # mincore tells this process what the page cache holds
            for name in self.km.places:  # the dense weights, once: they stay
                if name not in experts:
                    self.km.fill(name)
            os.posix_fadvise(self.km.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # their copies in the page cache go
            self.store = self.reader  # the driver's counters (`store.counters`)
            self._pool = ThreadPoolExecutor(1)  # a prompt's read-ahead
        except BaseException:
            self.close()
            raise

    @property
    def pages(self) -> ExpertRows:
        return self.rows

    # ---- the steps ----

    def begin(self, phase: Phase, n_rows: int) -> None:
        self._finish_behind()  # a llama_decode stopped half-way (abort) left reads behind
        if self.filter is not None:
            self.filter.flush_drops()  # and paged, drops queued
        self._seen = set()
        self.step_routing = {}
        if phase is Phase.PROMPT:
            if self.phase is not Phase.PROMPT and self.budget:
                self._resize(self.budget.prefill_slots)
            self.phase = phase
            self.prompt.passes += 1
            self.prompt.tokens += n_rows
            self._start_first(n_rows)
        else:
            if self.phase is Phase.PROMPT:
                self.end_prompt()
            self.phase = phase
            if self.budget and self.budget.keep():
                self._resize(self.budget.decode_slots)
            self.step_clock = int(self.lru_clock[0])  # experts stamped after it: used in this step
        if self.filter is not None:
            self.filter.fast = phase is Phase.DECODE and not self.record

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        if layer not in self._lru:
            return
        self._computed = True
        self._seen.add(layer)
        ids = [int(e) for e in self.perm[layer][by_last_use(rows)]]
        if self.record and rows.shape[0]:
            self.step_routing[layer] = np.asarray(rows[-1], np.int16)
        self._finish_ahead()
        self._drop_later()
        self._drop_again()
        lru = self._lru[layer]
        spec = self._spec.pop(layer, set())
        if spec.difference(ids):  # read ahead, not selected: given back before anything else is read
            self._drop_unused(layer, spec.difference(ids), ids)  # a page shared with a selected one stays
        missing = [e for e in ids if e not in lru and e not in spec]
        read_ahead = len(spec.intersection(ids))  # misses read before this layer asked
        gone = lru.admit(ids)
        now = [e for e in gone if e not in ids]
        if now:
            self._drop(layer, now, ids)
        if len(gone) > len(now):  # the union outgrows the cache: what the layer uses goes after it
            self._later.append((layer, [e for e in gone if e in ids]))
        c = self.reader.counters
        c.calls += 1
        c.experts += len(ids)
        c.hits += len(ids) - len(missing) - read_ahead
        c.misses += len(missing) + read_ahead
        if self.phase is Phase.PROMPT:  # read ahead: a miss, as in the reader's counters
            self.prompt.hits += len(ids) - len(missing) - read_ahead
            self.prompt.misses += len(missing) + read_ahead
        by_tensor = self.rows.runs_by_tensor(layer, missing)
        self.reader.advise([r for t in by_tensor for r in t])  # buffered: every run queued with the drive now
        if self.behind and missing:
            # the gate rows now; up and down on a thread while the gate, then the up matmul compute
            # (the callbacks at ffn_moe_gate-N and ffn_moe_up-N wait for them: _on_wait)
            self.reader.read(by_tensor[0])
            self._behind[layer] = [self._pool.submit(self.reader.read, r) for r in by_tensor[1:]]
            self.waits[layer] |= BEHIND
            self.behind_layers += 1
        else:
            self.reader.read([r for t in by_tensor for r in t])
        if (nxt := self._next_to_read(layer, len(ids))) is not None:
            self._read_ahead(nxt)

    def _read_ahead(self, layer: int) -> None:
        """This layer's uncached experts read on the pool's thread (those it does not select are
        given back at its selection)."""
        ahead = set(np.flatnonzero(self.lru_cached[layer] == 0).tolist())
        self._spec[layer] = ahead
        self._ahead = self._pool.submit(self.reader.read, self.rows.runs(layer, ahead))

    def _read_from_start(self, layer: int) -> None:
        self._finish_ahead()
        self._drop_later()
        self._read_ahead(layer)

    def hold_all(self) -> None:
        """Every expert read into its rows and cached (a warm measurement: no reads while it runs)."""
        self.settle()
        E = self.mm.n_experts
        for layer, lru in self._lru.items():
            lru.slots = max(lru.slots, E)
            self.reader.read(self.rows.runs(layer, range(E)), wait=True)
            lru.admit(range(E))
        self.cache_slots = E

    def _on_wait(self, layer: int, role: str) -> None:
        """llama.cpp computed layer `layer`'s gate (or up) matmul: the up (or down) rows are waited for."""
        if role == "start":
            return super()._on_wait(layer, role)
        futs = self._behind.get(layer)
        if futs is None:
            self._clear_waits(BEHIND, layer)
            return
        i = 0 if role == "gate" else 1
        futs[i].result()
        if i == 1:
            del self._behind[layer]
            self._clear_waits(BEHIND, layer)

    def _finish_behind(self) -> list[int]:
        """Every read behind the compute finished; the layers whose matmuls did not wait for them."""
        late = sorted(self._behind)
        for futs in self._behind.values():
            for f in futs:
                f.result()
        self._behind.clear()
        self._clear_waits(BEHIND)
        return late

    def _finish_ahead(self) -> None:
        if self._ahead is not None:
            f, self._ahead = self._ahead, None
            f.result()

    def _keep_mask(self, layer: int, using=()) -> np.ndarray:
        """By position: the experts whose bytes must stay (cached, or used by the layer computing)."""
        keep = self.lru_cached[layer][self.perm[layer]].astype(bool)
        if using:
            keep[self.rows.pos[layer][np.asarray(list(using), np.int64)]] = True
        return keep

    def _drop(self, layer: int, experts, using=()) -> None:
        if self.evict:
            self.rows.drop(layer, experts, self._keep_mask(layer, using))

    def _drop_unused(self, layer: int, experts: set[int], using=()) -> None:
        """Experts read ahead and not selected, given back. Their reads (WILLNEED) may still be in
        flight, and the page cache keeps a page under I/O (it is locked: fadvise DONTNEED skips it),
        charged to the group and mapped by no one: 1.4 GB after a 64-token pass at 48 layers, which
        the kernel then reclaimed from the cache. So they are given back again after the next
        layer's selection and at each step's end (`_drop_again`): until mincore finds them gone
        (at most AGAIN_TRIES times: a page another process keeps is not retried for ever), or twice
        where it cannot see the file's page cache (core.pagecache.residency_visible)."""
        self._drop(layer, experts, using)
        if self.paged and self.evict:
            self._again.append((layer, set(experts), 0))

    def _drop_again(self) -> None:
        again, self._again = self._again, []
        for layer, es, tries in again:
            es = [e for e in es if not self.lru_cached[layer][e] and e not in self._spec.get(layer, ())]
            keep = self._keep_mask(layer)
            if self._visible:
                es = self.rows.held(layer, es, keep)
            if es:
                self.rows.drop(layer, es, keep)
                if tries < (self.AGAIN_TRIES if self._visible else 1):
                    self._again.append((layer, set(es), tries + 1))

    def _drop_later(self) -> None:
        later, self._later = self._later, []
        for layer, es in later:
            es = [e for e in es if not self.lru_cached[layer][e]]
            if es:
                self._drop(layer, es)

    def end(self) -> None:
        seen = self._seen
        if self.filter is not None:
            seen, layers, experts = self.filter.take_counts()
            self.fast_layers += layers
            c = self.reader.counters
            c.calls += layers
            c.experts += experts
            c.hits += experts
            done = self.filter.take_miss_counts(self.path)  # paged: decode layers with misses answered in C
            if done:
                c.add_native(done)
                self.reclaimed += done["reclaimed"]
                self.native_layers += done["layers"]
        self._drop_again()
        late = self._finish_behind()
        if late:
            self._stop_behind()
            raise MboltError(f"{self.path}: llama.cpp computed no ffn_moe_gate/ffn_moe_up node for layer(s) "
                             f"{', '.join(map(str, late))}: their up/down rows were not awaited, the step is void "
                             "(reads behind the compute are off from now on)")
        if self.phase is Phase.DECODE:
            self._drop_later()
            missing = self.moe_layers - seen
            if missing:
                raise MboltError(f"{self.path}: llama.cpp computed no ffn_moe_topk for layer(s) "
                                 f"{', '.join(map(str, sorted(missing)))} in a step: its experts were not read")

    def end_prompt(self) -> None:
        if self.phase is not Phase.PROMPT:
            return
        self.phase = Phase.DECODE
        self._clear_waits(START)
        self._finish_ahead()
        spec, self._spec = self._spec, {}
        for layer, es in spec.items():
            self._drop_unused(layer, es)
            self.prompt.prefetched_unused += len(es)
        self._drop_later()
        c = self.reader.counters
        self.prompt.bytes, self.prompt.reads, self.prompt.read_s = c.bytes, c.reads, c.io_time
        if self.budget:
            if self.give_back_compute and not self.release_compute():
                self.budget.compute_kept()
            self._resize(self.budget.decode_slots)

    def _resize(self, slots: int | None) -> None:
        if not slots or slots == self.cache_slots:
            return
        self.cache_slots = slots
        for layer, lru in self._lru.items():
            lru.slots = slots
            gone = lru.admit(())  # a shrink: the least recently used beyond the slots leave
            if gone:
                self._drop(layer, gone)
        if self.filter is not None:
            self.filter.slots = slots

    # ---- setup ----

    def attach(self, memory: ContextMemory | None, tap=None) -> None:
        self.memory, self.tap = memory, tap
        f = tap.filter if tap is not None else None
        if f is not None:
            f.share_cache(self.perm, self.lru_cached, self.lru_stamp, self.lru_clock)
            self.filter = f
        if f is not None and self.paged and self.evict and self.native_misses:
            self._share_reads(f)
        self.behind = (self.read_behind and tap is not None
                       and all(r == ["gate", "up", "down"] for r in self.rows.roles.values()))
        if self.behind or self.budget:
            self.share_waits(tap)

    def _share_reads(self, f) -> None:
        """Paged: the C filter answers decode layers with misses too, as for the mapped runtime
        (runtime.native's `with_misses`: the same LRU arrays, WILLNEED in use order, the victims
        unmapped and dropped from the page cache by its thread while llama.cpp computes)."""
        L, E = self.perm.shape
        R = max(len(r) for r in self.rows.tensors.values())
        ranges = np.zeros((L, E, R, 3), np.int64)
        for layer, rows in self.rows.tensors.items():
            pos = self.rows.pos[layer].astype(np.int64)  # original id -> position in the file
            for r, (off, _, _, size) in enumerate(rows):
                ranges[layer, :, r, 1] = off + pos * size
                ranges[layer, :, r, 2] = size
        base, size = self.km.mapped
        f.share_reads(ranges=ranges, fds=[self.reader.fd], maps=[(base, 0, size)], ra_steps=[self.reader.step],
                      merge_gap=0, count=self.lru_count, read_mark=np.zeros((L, E), np.uint8),
                      visible=[self._visible], drop_behind=True, use_order=True)
        f.slots = self.cache_slots

    def _stop_behind(self) -> None:
        """Reads behind the compute off (a step whose matmuls did not wait for them)."""
        self.behind = False
        self._clear_waits(BEHIND)

    def settle(self) -> None:
        self._finish_behind()
        self._finish_ahead()

    def make_cold(self) -> None:
        """No expert row resident, the cache empty; with a budget, the cache sized from what is left."""
        self.settle()
        if self.filter is not None:
            self.filter.flush_drops()  # paged: the C filter's drops behind done first
        self.phase = Phase.LOAD
        self._later.clear()
        self._clear_waits(START)
        self._spec.clear()
        self._again.clear()  # every expert given back below
        for lru in self._lru.values():
            lru.clear()
        for layer in self.mm.moe_layers:
            for w in layer.weights:
                self.km.drop(w.name)
        if self._computed and self.give_back_compute:
            self.release_compute()
        if self.budget:
            self.fit_budget()

    def fit_budget(self) -> None:
        self.budget.fit(own_bytes(), *self.compute_pending())
        self._resize(self.budget.decode_slots)

    def describe_budget(self) -> str:
        return self.budget.describe(self.memory, 0, 0, 0, False) + "; experts in llama.cpp's kernel layout"

    def close(self) -> None:
        if self.filter is not None:
            self.filter.fast = False
            self.filter.stop_drops()  # before the map and the descriptor go
            self.filter = None
        try:
            self._finish_behind()
            self._finish_ahead()
        except MboltError:
            pass
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.km is not None:
            self.km.close()
            self.km = None

    # ---- for the server (read-only) ----

    def runtime_view(self):
        """What a server shows of this arm (runtime.cache_view): the reader's counters, the LRU's
        arrays, the experts stamped since the last decode step began; its reads are not marked (None)."""
        from mbolt.runtime.cache_view import view_of

        return view_of(self, self.reader.counters, self.lru_cached, self.lru_stamp > self.step_clock, None)


# the mapped runtime's switches that a kernel-layout file's reads have no use for: paged, its reads
# are always advice in llama.cpp's use order with the victims dropped behind (rows: blocking reads
# into llama.cpp's buffers); no prompt pass is laid over. native_misses is honoured (paged).
_MAPPED_ONLY = ("asynchronous", "drop_behind", "overlay", "use_order")


def is_kernel_path(path) -> bool:
    from mbolt.core.gguf_set import open_model_header
    from mbolt.core.kernel_file import is_kernel_file

    return is_kernel_file(open_model_header(path))


def kernel_arm(path, reads: bool, evict: bool, n_seq: int, common: dict, options: dict, plain_flag: str):
    """The streaming runtime over a kernel-layout file; plain llama.cpp cannot load one (the one
    refusal, naming `plain_flag`: how the caller asked for plain llama.cpp). Of the mapped
    runtime's options, pins and a merge gap are refused; its switches for how reads reach the page
    cache (_MAPPED_ONLY) do not apply (see there)."""
    if not reads:
        raise MboltError(f"{path}: a kernel-layout file (mbolt repack) is read by the streaming runtime only, "
                         f"not by plain llama.cpp ({plain_flag}); `mbolt repack --restore` gives the stock file back "
                         "for plain llama.cpp")
    if options.get("pins"):
        raise MboltError(f"{path}: pins are not supported on a kernel-layout file")
    if options.get("gap"):
        raise MboltError(f"{path}: a merge gap is not used on a kernel-layout file (its reads join adjacent experts)")
    opts = {k: v for k, v in options.items() if k not in _MAPPED_ONLY + ("pins", "gap")}
    return KernelRuntime(path, evict=evict, n_seq=n_seq, **common, **opts)
