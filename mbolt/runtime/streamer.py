"""The streaming runtime: what mbolt does at each layer's expert selection inside llama.cpp.

llama.cpp's scheduler asks the eval callback about every graph node; for `ffn_moe_topk-N` we
answer yes, so it computes the graph up to layer N's expert selection, hands us the selected
ids, and waits for our answer before it runs layer N's expert matmuls. There we map the ids
(positions in the file) through the file's route map to original experts and make their bytes
resident; returning true lets llama.cpp go on, and its mapping finds those pages in the page cache.

The driver (runtime.driver) says what each llama_decode is before it runs it (`begin`), and when it
is done (`end`, and `end_prompt` after a prompt's last pass): the phases are explicit, and
`on_topk` is the one place that decides what a layer reads and drops.
- LOAD: before the first step; `make_cold` drops every expert page, holds the dense weights and
  sizes the cache (the budget: runtime.budget.Budget).
- PROMPT (a pass of up to n_ubatch tokens of one sequence): a layer whose selection misses most of
  it is laid over whole with huge pages that O_DIRECT fills (runtime.prefill.PassOverlay: the next
  while this one computes where two fit the budget, else from its start), the file mapped back once
  it is done; else the pass's union is read through the page cache in long merged reads in use
  order (LayerReader), and the layer's victims go when the next layer starts.
- DECODE (one token of each live sequence: one row, or several in a batched step): the union of
  the rows' experts not in the per-layer LRU slot cache is read (`ExpertStore.read`: merged ranges;
  asynchronous by default: posix_fadvise WILLNEED, and llama.cpp's page faults wait for pages in
  flight, which overlaps the reads with compute). A layer whose experts are all cached never
  reaches Python: the C filter (runtime.native) answers it and stamps the LRU's arrays.

Under a budget the expert spans of llama.cpp's mapping get MADV_RANDOM (a stray fault reads one
page), and an expert that leaves the LRU is dropped at once (mapping and page cache): the group
stays under its limit, the kernel never reclaims. The cache is smaller during a prompt pass (it
reads a layer ahead and fills the compute buffer) and grows back for decode steps, the buffer given
back. Without a budget, the emulation: every expert page dropped after every decode step (or, with
cache slots, when it leaves the LRU): the s = 1 bound of a model far larger than RAM.

Plain llama.cpp is not this class: runtime.plain.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.lru import by_last_use
from mbolt.core.moe_map import MoeMap
from mbolt.core.pagecache import willneed_bytes
from mbolt.runtime.arm import BudgetedArm, PromptStats, check_llama_streamable, own_bytes  # noqa: F401 (re-exported)
from mbolt.runtime.budget import PREFETCH_SHARE, Budget, budget_inputs, layer_bytes
from mbolt.runtime.memory import DEFAULT_UBATCH, ContextMemory
from mbolt.runtime.native import START
from mbolt.runtime.pages import ExpertPages, can_move_pages
from mbolt.runtime.prefill import LayerReader, PassOverlay, huge_pages, open_direct
from mbolt.runtime.runner import Phase
from mbolt.runtime.store import ExpertStore

PIN_SHARE = 0.75  # nuthatch's learned-pin default: that share of the slots pinned, the rest LRU


class StreamRuntime(BudgetedArm):
    """mbolt's reads and bounded expert memory inside a llama.cpp context (see the module docstring).

    gap, qd: the store's merge gap and read threads. cache_slots: per-layer LRU budget of experts
      kept resident across steps (0: none; under a budget sized from it). budget: bytes this run
      may use (a real memory limit). n_ctx (default 4096, capped by the model's training context),
      n_ubatch: the largest micro-batch (under a budget the plan may choose a smaller one).
    asynchronous: decode steps submit their reads (WILLNEED) and let llama.cpp's faults wait.
    pins: pin the hottest experts of each layer (PIN_SHARE of the slots) by the route map's heat.
    record: keep each decode step's selections (`step_routing`; the C fast path is then off).
    evict: False keeps whatever the kernel keeps (a warm control: nothing dropped after a step).
    n_seq: the sequences the driver decodes together (their KV caches and steps are budgeted).
    The A/B switches (True by default; False is the other path): native_misses, decode layers with
    misses answered in C (else Python); drop_behind, their victims dropped by the C filter's thread
    while llama.cpp computes (else at once); give_back_compute, the compute buffer given back after
    each prompt (else kept, budgeted); overlay, prompt passes laid over (prefill.PassOverlay; else
    the page cache); use_order, decode misses read in llama.cpp's use order (else in file order)."""

    uses_callback = True

    def __init__(self, path, *, gap: int = 0, qd: int = 1, cache_slots: int = 0, n_ctx: int | None = None,
                 n_ubatch: int = DEFAULT_UBATCH, mm: MoeMap | None = None, record: bool = False,
                 budget: int | None = None, f32_kv: bool = False, asynchronous: bool = False, pins: bool = False,
                 flash_attn: bool | None = None, evict: bool = True, n_seq: int = 1, native_misses: bool = True,
                 drop_behind: bool = True, give_back_compute: bool = True, overlay: bool = True, use_order: bool = True):
        from mbolt.core.gguf_set import open_model_header

        self._open(path, mm, n_ctx, n_ubatch, f32_kv, flash_attn)
        self.record, self.evict = record, evict or bool(budget)
        self.budget: Budget | None = None
        if budget:
            cache_slots = cache_slots or self.mm.n_used  # sized from the budget in make_cold
        if pins and not self.mm.route_map.heat.any():
            raise MboltError(f"{self.path}: pins need the training heat of a route map (a file written by mbolt "
                             "reorder from a trace); this file has none")
        if cache_slots and cache_slots < self.mm.n_used:
            raise MboltError(f"--cache-slots {cache_slots} is below the {self.mm.n_used} experts a token uses: "
                             "give 0 (no cache) or at least that many")
        self.cache_slots = int(cache_slots)
        self.native_misses, self.drop_behind, self.give_back_compute = native_misses, drop_behind, give_back_compute
        self.drop_behind_s = 0.0  # the drop thread's time in the kernel (it overlaps compute)
        self.locked_bytes = self.copied_bytes = 0
        self.pins, self.pinned_per_layer = pins, 0
        self.perm = self.mm.route_map.perm  # position in the file -> original expert id
        self.model_path = str(open_model_header(self.path).path)  # llama.cpp opens a split set from shard 1
        self.phase = Phase.LOAD
        self._evicted: list[tuple[int, int]] = []  # left the cache while the read under way needed them
        self._victims: list[tuple[int, int]] = []  # left the cache in the call under way: dropped after it
        self._calling: set[int] = set()  # the experts of the read under way (llama.cpp needs them next)
        self._spec: dict[int, set[int]] = {}  # layer -> experts read ahead for it (not in its LRU)
        self._seen: set[int] = set()
        self.step_routing: dict[int, np.ndarray] = {}  # layer -> positions of the last row (record)
        self.reclaimed = 0  # cached experts found reclaimed by the kernel (read again)
        self.after_step_s = 0.0  # dropping a decode step's leftovers after it (not the step's time)
        self.fast_layers = 0  # decode layers the C filter answered (every expert cached)
        self.native_layers = 0  # decode layers with misses the C filter answered (reads and drops)
        self.step_clock = 0  # the LRU's clock when the last decode step began
        self.store = self.reader = self.filter = self.overlay = None
        self._lay = False  # this prompt pass lays every layer over (PassOverlay)
        self._issued = None  # the layer read from its start: set once its reads are asked for (LayerReader.submit)
        self.memory: ContextMemory | None = None  # what llama.cpp allocated (logged at creation)
        self._computed = False  # no graph ran since the compute buffer's pages were last given back (or ever)
        self.tap = None  # the eval callback (it knows the compute buffer once a graph ran)
        self.prompt = PromptStats()
        moe = sorted(l.index for l in self.mm.moe_layers)
        self.moe_layers = set(moe)
        self._next_moe = dict(zip(moe, moe[1:]))
        self._half = PREFETCH_SHARE * self.mm.n_experts  # a pass this big reads ahead (or lays every layer over)
        self.pages = ExpertPages(self.path, self.mm, before_load=True)
        for hidden in self.pages.residency_hidden:  # a split set's shard at fault, by its own name
            warnings.warn(f"{hidden}: not this user's file and not writable by it: the kernel hides its page-cache "
                          "residency, so an expert the kernel reclaims from the cache comes back through 4 KiB faults "
                          "instead of one read (own the file to avoid it)", stacklevel=2)
        try:
            if budget:
                with budget_inputs(self.model_path, self.mm, pages=self.pages) as (llama_path, dense):
                    self.budget = Budget.planned(budget, self.mm, llama_path, n_ctx=self.n_ctx, n_ubatch=self.n_ubatch,
                                                 dense_bytes=dense, flash_attn=self.flash_attn, f32_kv=f32_kv,
                                                 n_seq=n_seq)
                self.n_ubatch = self.budget.plan.n_ubatch
            self.store = ExpertStore(self.path, mm=self.mm, gap=gap, io_threads=qd, cache_slots=self.cache_slots,
                                     drop_pages=False, on_evict=self._on_evict, asynchronous=asynchronous, use_order=use_order)
            if self.budget:
                self.reader = LayerReader(self.mm, self.store.fds, [willneed_bytes(f) for f in self.mm.paths])
                # a whole layer: two with read-ahead, else one laid over from its start (at its selection it lost:
                # q864 TTFT 1.04x)
                fds = (open_direct(self.mm.paths) if (overlay and self.plan.prefill_reserve >= layer_bytes(self.mm)
                                                      and huge_pages() and can_move_pages()) else None)
                if fds is not None:
                    self.overlay = PassOverlay(self.pages, self.reader, fds)
        except BaseException:
            self.close()
            raise

    # ---- the steps (called by the driver around each llama_decode) ----

    def begin(self, phase: Phase, n_rows: int) -> None:
        """Before a llama_decode of `n_rows` tokens: a prompt pass, or a decode step (one token of
        each live sequence)."""
        if self.filter is not None:
            self.filter.flush_drops()  # a llama_decode stopped half-way (abort) left drops queued
        self._seen = set()
        self.step_routing = {}
        if phase is Phase.PROMPT:
            was, self.phase = self.phase, phase  # the shrink's victims go on the reader's thread, before its reads
            if was is not Phase.PROMPT and self.budget:
                self._resize_cache(self.budget.prefill_slots)
            self.prompt.passes += 1
            self.prompt.tokens += n_rows
            started = self._start_first(n_rows)
            # a pass selecting half of each layer, a cache under half of one (laid over, nothing is cached): all
            # laid over, each layer while the one before computes (two in the budget) or under its own attention
            self._lay = (self.overlay is not None and n_rows * self.mm.n_used >= self._half > self.store.cache_slots
                         and (self.plan.prefetch or started))
            if self._lay and self.plan.prefetch:
                self.overlay.ahead(min(self.moe_layers))  # laid over while llama.cpp computes up to its selection
        else:
            if self.phase is Phase.PROMPT:
                self.end_prompt()
            self.phase = phase
            self.step_clock = int(self.store.lru_clock[0])  # experts stamped after it: used in this step
            self.store.mark_reads()
            if self.budget and self.budget.keep():
                self._resize_cache(self.budget.decode_slots)
        if self.filter is not None:
            self.filter.fast = phase is Phase.DECODE and not self.record
            self.filter.slots = self.store.cache_slots

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        """llama.cpp computed layer `layer`'s selection (`rows` [n_tokens, k] positions); its
        expert matmuls run when this returns."""
        if layer >= self.perm.shape[0]:
            return
        self._computed = True
        self._seen.add(layer)
        ids = self.perm[layer][by_last_use(rows)]
        if self.record and rows.shape[0]:
            self.step_routing[layer] = np.asarray(rows[-1], np.int16)
        if self.phase is Phase.PROMPT and self.budget:
            if self._issued is not None:  # read from its start: its reads in flight, in the order the matmuls use them
                issued, self._issued = self._issued, None
                self.reader.wait_issued(issued)
            else:
                self.reader.wait()  # the previous layer's reads and drops (and this one's read-ahead) are done
            self._prompt_layer(layer, ids)
            return
        if self.budget:
            self._keep_budget(layer, ids)
        self._calling = set(int(e) for e in ids)
        try:
            self.store.read(layer, ids)
        finally:
            self._calling = set()
            self._drop_victims()

    def end(self) -> None:
        """After a llama_decode: the C filter's hits counted, every MoE layer checked to have
        reported its selection (decode steps), a decode step's leftovers dropped."""
        seen = self._seen
        if self.filter is not None:
            seen, layers, experts = self.filter.take_counts()
            self.store.count_cached(layers, experts)
            self.fast_layers += layers
            done = self.filter.take_miss_counts(self.path)
            if done:
                self.store.counters.add_native(done)
                self.drop_behind_s += done["drop_ns"] * 1e-9
                self.reclaimed += done["reclaimed"]
                self.native_layers += done["layers"]
        if self.phase is Phase.DECODE:
            missing = self.moe_layers - seen
            if missing:
                raise MboltError(f"{self.path}: llama.cpp computed no ffn_moe_topk for layer(s) "
                                 f"{', '.join(map(str, sorted(missing)))} in a step: its experts were not read "
                                 "(a llama.cpp build that fuses or renames the expert selection?)")
            t0 = time.perf_counter()
            self.drop_experts()
            self.after_step_s += time.perf_counter() - t0

    def end_prompt(self) -> None:
        """After a prompt's last pass: the read-ahead finished and its leftovers dropped, the
        last layer's victims dropped, the cache grown back to its decode size."""
        if self.phase is not Phase.PROMPT:
            return
        self.phase = Phase.DECODE  # drops from here on are done at once
        self._clear_waits(START)
        self._issued = None
        if self.reader is not None:
            self.settle()
            c = self.reader.counters
            self.prompt.bytes, self.prompt.reads, self.prompt.read_s = c.bytes, c.reads, c.busy_s
        for layer, es in self._spec.items():
            self._unused_read_ahead(layer, es)
        self._spec.clear()
        self.drop_experts()
        if self.budget:
            if self.give_back_compute and not self.release_compute():
                self.budget.compute_kept()
            self._resize_cache(self.budget.decode_slots)

    # ---- a layer's reads and drops ----

    def _prompt_layer(self, layer: int, ids: np.ndarray) -> None:
        """One layer of a prompt pass: laid over whole and the next layer behind it (PassOverlay),
        or through the page cache: its union's reads queued in use order (llama.cpp starts at
        once; its matmuls wait on pages in flight), the next layer's queued behind them when the
        budget holds two layers."""
        if self._evicted:
            self.drop_experts()  # the previous layer's victims go (its matmuls are done)
        sel = [int(e) for e in ids]
        if self._lay and len(sel) < self._half and not self.plan.prefetch:
            # a layer the pass computes for few rows (the last MoE layer: its last row), not read
            # ahead: not laid over whole; its few experts through the page cache
            self.overlay.finish()
            self._lay = False
        if self._lay:
            self.overlay.start(layer)
            self.prompt.misses += len(sel)  # read whole: the cache's copies are not used
            self.store.counters.add_read_whole(len(sel))
            if not self.plan.prefetch:
                self._next_to_read(layer, len(sel))  # one slot: the next layer marked, laid over from its start
            elif (nxt := self._next_moe.get(layer)) is not None:
                self.overlay.ahead(nxt)
            return
        spec = self._spec.pop(layer, set())
        unused = spec.difference(sel)
        if unused:  # read ahead, not selected: out before anything else is read
            self._unused_read_ahead(layer, unused)
        cached = set(self.store.cached(layer))
        missing = [e for e in sel if e not in cached and e not in spec]
        self._calling = set(sel)
        try:
            misses = self.store.admit(layer, sel)
        finally:
            self._calling = set()
            self._drop_victims()
        self.prompt.hits += len(sel) - misses
        self.prompt.misses += misses
        self.reader.submit(layer, missing)
        if self.plan.prefetch and not spec and len(missing) > self.mm.n_used:
            # no read-ahead reached this layer (the first of a pass): llama.cpp would catch up with
            # the reads and fault the rest in 4 KiB at a time (about 1,000 faults in a 200-token
            # turn of q72); the one layer per pass is read before it computes
            self.reader.wait()
        if (nxt := self._next_to_read(layer, len(sel))) is not None:
            self._read_ahead(nxt)

    def _read_ahead(self, layer: int):
        """This layer's uncached experts queued to the reader (those it does not select are dropped
        at its selection); the event of their submission (LayerReader.submit)."""
        ahead = set(range(self.mm.n_experts)).difference(self.store.cached(layer))
        self._spec[layer] = ahead
        return self.reader.submit(layer, ahead)

    def _read_from_start(self, layer: int) -> None:
        if self._lay:
            self.overlay.begin(layer)  # the layer before goes back to the file, this one is laid over
            return
        if self._evicted:
            self.drop_experts()  # the layer before is done with them (queued ahead of the reads)
        self._issued = self._read_ahead(layer)

    def _unused_read_ahead(self, layer: int, experts) -> None:
        """Experts read ahead for a layer that did not select them: dropped, or cached when every
        expert fits (dropped, decode read them back: 7 MB a token at 48 layers)."""
        if self.store.cache_slots >= self.mm.n_experts:
            self.store.admit(layer, sorted(experts), count=False)
        else:
            self._drop(layer, experts)
        self.prompt.prefetched_unused += len(experts)

    def _keep_budget(self, layer: int, ids) -> None:
        """Before a decode layer's read: deferred victims go now, and a selected expert the cache
        holds but the kernel reclaimed in part is read again rather than faulted in page by page
        (each such fault read 4 KiB: thousands per token). Only this layer's hits are checked, and
        only on a layer with a miss (the C filter answers the others)."""
        if self._evicted:
            self.drop_experts()
        cached = set(self.store.cached(layer))
        for e in ids:
            e = int(e)
            if e in cached and not self.pages.expert_resident(layer, e):
                self.pages.drop(self.pages.expert_spans_of(layer, [e]))  # what is left of it, too
                self.store.forget(layer, e)
                self.reclaimed += 1

    def _on_evict(self, layer: int, e: int) -> None:
        """An expert left the slot cache. Under a budget its pages go at once (with the call's other
        victims), so the group never holds more than the cache; one the running read still needs (a
        pass's union can exceed the slots) goes when the next layer starts."""
        if self.budget and e not in self._calling:
            self._victims.append((layer, e))
        else:
            self._evicted.append((layer, e))

    def _drop_victims(self) -> None:
        """The victims of the call just made, in one drop per layer."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in self._victims:
            by_layer.setdefault(layer, []).append(e)
        self._victims.clear()
        for layer, es in by_layer.items():
            self._drop(layer, es)

    def _drop(self, layer: int, experts) -> None:
        """Drop these experts' pages (mapping and page cache): during a prompt on the reader's
        thread, queued ahead of the next reads (llama.cpp computes meanwhile), else now."""
        spans = self.pages.expert_spans_of(layer, sorted(experts))
        if self.phase is Phase.PROMPT and self.reader is not None:
            self.reader.call(lambda: self.pages.drop(spans))
        else:
            self.pages.drop(spans)

    def drop_experts(self) -> None:
        """After a step: make the experts cold again (all of them without a cache, or those the
        slot cache let go)."""
        if not self.evict:
            return
        if not self.cache_slots:
            self.pages.drop()
            return
        gone: dict[int, set[int]] = {}
        for layer, e in self._evicted:
            gone.setdefault(layer, set()).add(e)
        self._evicted.clear()
        for layer, es in gone.items():
            es -= set(self.store.cached(layer))  # evicted during a pass, then used again
            if es:
                self._drop(layer, es)

    # ---- setup ----

    def attach(self, memory: ContextMemory | None, tap=None) -> None:
        """After llama.cpp mapped the model and created its context (`memory`: what it logged;
        `tap`: the eval callback, whose C filter then answers cached selections itself)."""
        self.memory = memory
        self.tap = tap
        self.pages.attach()
        if self.overlay is not None and self.pages.single_maps() is None:  # a slot lies over one mapping
            self.overlay.close()
            self.overlay = None
        f = tap.filter if tap is not None else None
        if f is not None:
            f.share_cache(self.perm, self.store.lru_cached, self.store.lru_stamp, self.store.lru_clock)
            self.filter = f
            self._share_reads()
        if self.budget:
            self.share_waits(tap)

    def _share_reads(self) -> None:
        """Under a budget with asynchronous reads, the C filter answers decode layers with misses
        too (runtime.native: the same LRU, merge and drops as `on_topk`'s path, without Python):
        it needs each file mapped once by llama.cpp, and no pins (their rule stays in Python)."""
        st = self.store
        if (self.native_misses and self.budget and st.asynchronous and not self.pins
                and self.pages.single_maps() is not None and st.lru_cached.shape == self.perm.shape):
            self.filter.share_store_reads(st, self.pages, self.drop_behind)

    def settle(self) -> None:
        """No read in flight and no layer laid over (before llama.cpp unmaps the model too)."""
        if self.overlay is not None:
            self.overlay.finish()
        if self.reader is not None:
            self.reader.wait()

    def make_cold(self) -> None:
        """Before a run: no expert page resident (the slot cache starts empty too); the dense
        weights resident (and, with a budget, held; the cache sized from what is left)."""
        self.settle()
        self.store.clear_cache()
        self._evicted.clear()
        self._spec.clear()
        self._clear_waits(START)
        self._issued = None
        self.phase = Phase.LOAD
        self.pages.reset()
        if self._computed and self.give_back_compute:
            self.release_compute()  # a run before this one left it resident
        if self.budget:
            self.fit_budget()
        if self.pins:
            self.pin_hottest()

    def fit_budget(self) -> None:
        from mbolt.core.memlimit import lockable_bytes

        if not (self.locked_bytes or self.copied_bytes):
            self.locked_bytes, self.copied_bytes = self.pages.hold_dense(lockable_bytes())
            self.pages.advise_experts()
        self.store.reserve(self.mm.n_used)
        self.budget.fit(self.locked_bytes + own_bytes(), *self.compute_pending())  # copied dense: in own_bytes
        self.cache_slots = self.store.cache_slots = self.budget.decode_slots
        if self.overlay is not None and self._half > self.budget.prefill_slots:  # a pass will be laid over:
            self.overlay.prepare()  # its slot in the room the fit left for it

    def _resize_cache(self, slots: int | None) -> None:
        """Under a budget: the slot count of the next phase (the victims of a shrink leave memory
        now, before the phase reads anything)."""
        if not slots or slots == self.store.cache_slots:
            return
        self.cache_slots = slots
        self.store.resize(slots)
        self._drop_victims()

    def pin_hottest(self) -> None:
        """Pin PIN_SHARE of each layer's slots to its hottest experts (route map heat is per
        position; pins name original experts), leaving at least k slots to the LRU."""
        slots = self.prefill_slots or self.cache_slots  # pins stay through a prompt's smaller cache
        self.pinned_per_layer = self.store.pin_hottest(max(0, min(int(PIN_SHARE * slots), slots - self.mm.n_used)))

    def describe_budget(self) -> str:
        """One line: where the budget goes."""
        return self.budget.describe(self.memory, self.locked_bytes, self.copied_bytes, self.pinned_per_layer, bool(self.overlay))

    def close(self) -> None:
        if self.filter is not None:
            self.filter.fast = False
            self.filter = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.overlay is not None:
            self.overlay.close()
            self.overlay = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if getattr(self, "pages", None) is not None:
            self.pages.close()

    # ---- for the server (read-only) ----

    def runtime_view(self):
        """What a server shows of this arm (runtime.cache_view): the store's counters and slot cache,
        the experts stamped since the last decode step began, those it read."""
        from mbolt.runtime.cache_view import view_of

        st = self.store
        return view_of(self, st.counters, st.lru_cached, st.lru_stamp > self.step_clock, st.read_mark)

