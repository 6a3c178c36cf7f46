"""The streaming runtime: what mbolt does inside llama.cpp's eval callback, whoever drives the
decoding (`LlamaStream` for generate/ab/trace, the server's `Llama`).

llama.cpp's scheduler asks the eval callback about every graph node; for `ffn_moe_topk-N` we
answer yes, so it computes the graph up to layer N's expert selection, hands us the selected
ids, and waits for our answer before it runs layer N's expert matmuls. There we map the ids
(positions in the file) through the file's route map to original experts and make their bytes
resident; returning true lets llama.cpp go on, and its mapping finds those pages in the page cache.

A step is one graph (one llama_decode of up to n_ubatch tokens). The first MoE layer's rows say
which kind: one row is a decode step, more is a prompt pass.
- Decode step: the layer's k experts not in the per-layer LRU slot cache are read
  (`ExpertStore.read`: merged ranges; asynchronous by default: posix_fadvise WILLNEED, and
  llama.cpp's page faults wait for pages in flight, which overlaps the reads with compute).
- Prompt pass: the union of the pass's experts, most of the layer when n_ubatch is hundreds of
  tokens, is read with long merged preadv in use order (runtime.prefill), and when two
  layers fit the budget the next layer's uncached experts are read in the background while this
  one computes; what that read brought and the layer did not select is dropped at once, and
  the layer's victims go when the next layer starts (its matmuls are done then).

Under a real memory limit (`budget` bytes: --ram, else the cgroups' tightest limit, else available
memory) the budget is planned before the model is loaded (runtime.budget: dense weights, the
KV cache for n_ctx, the compute buffer of the micro-batch, the reads of one layer, the cache) and
refused in one line when it cannot work. After the load, the dense weights are held resident
(mlock as far as RLIMIT_MEMLOCK allows, anonymous copies for the rest: runtime.pages), the expert
spans of llama.cpp's mapping get MADV_RANDOM (a stray fault reads one page), and an expert that
leaves the LRU is dropped at once (mapping and page cache), so the group stays under its limit and
the kernel never has to reclaim. The cache is smaller during a prompt pass (it reads up to a layer
beyond it) and grows back for decode steps.

Without a budget, the emulation: every expert page dropped after every decode step (or, with
cache slots, when it leaves the LRU): the s = 1 bound of a model far larger than RAM.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.runtime.budget import (PREFETCH_SHARE, BudgetPlan, expert_bytes_all_layers, margin, plan_budget,
                                       slots_for, step_bytes)
from mbolt.runtime.memory import DEFAULT_UBATCH, ContextMemory, resolve_ctx
from mbolt.core.pagecache import willneed_bytes
from mbolt.runtime.prefill import LayerReader
from mbolt.runtime.pages import ExpertPages
from mbolt.runtime.store import ExpertStore

PIN_SHARE = 0.75  # nuthatch's learned-pin default: that share of the slots pinned, the rest LRU
ENGINE_EXTRA = 16 << 20  # llama.cpp's own structures, threads and work buffers beyond the process before the load


def check_llama_streamable(mm: MoeMap, path: str) -> None:
    """llama.cpp loads stock and reorder files; a packed file is refused in one line."""
    if mm.route_map.layout == "packed":
        raise MboltError(f"{path}: packed layout: llama.cpp cannot load it (its experts are mbolt blobs); "
                         "stream the reorder layout instead")
    if not mm.moe_layers:
        raise MboltError(f"{path}: no routed expert tensors: nothing to stream")


def own_bytes() -> int:
    """This process's own memory: anonymous (heap, KV cache, buffers, dense copies) and shared
    anonymous resident pages, not the mapped file."""
    n = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                n += int(line.split()[1]) * 1024
    return n


def swap_bytes() -> int:
    """VmSwap of this process: anonymous memory (dense copies included) the kernel swapped out."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSwap:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class PromptStats:
    """What the prompt passes did (cumulative)."""

    passes: int = 0
    tokens: int = 0  # rows the first MoE layer routed in prompt passes
    hits: int = 0
    misses: int = 0
    bytes: int = 0  # read by the pass reader (foreground and background)
    reads: int = 0  # merged ranges
    read_s: float = 0.0  # wall time with a read outstanding
    prefetched_unused: int = 0  # experts read ahead for a layer that did not select them

    def to_dict(self) -> dict:
        return asdict(self)


def _by_last_use(positions: np.ndarray) -> np.ndarray:
    """Unique positions of a step's rows, ordered by their last use (the last token's experts last:
    the LRU then keeps what the next token most likely needs)."""
    flat = positions.reshape(-1)
    flat = flat[flat >= 0]
    if flat.size == 0:
        return flat.astype(np.int64)
    u, first_in_reversed = np.unique(flat[::-1], return_index=True)
    return u[np.argsort(-first_in_reversed, kind="stable")].astype(np.int64)


class StreamRuntime:
    """mbolt's reads and bounded expert memory inside a llama.cpp context (see the module docstring).

    reads: explicit reads at ffn_moe_topk-N (False: page faults read; with evict=False and no
      callback that is plain llama.cpp).
    evict: drop expert pages after every decode step, or only the slot cache's victims when it
      has slots (False: keep whatever the kernel keeps).
    callback: install the eval callback even without reads (the callback-overhead control).
    cache_slots: per-layer LRU budget of experts kept resident across steps (0: none).
    budget: bytes this run may use (a real memory limit).
    n_ctx: context size (default 4096, capped by the model's training context); n_ubatch: the
      largest micro-batch (under a budget the plan may choose a smaller one).
    asynchronous: decode steps submit their reads (WILLNEED) and let llama.cpp's faults wait.
    pins: pin the hottest experts of each layer (PIN_SHARE of the slots) by the route map's heat.
    """

    def __init__(self, path, *, reads: bool = True, gap: int = 0, qd: int = 1, cache_slots: int = 0,
                 evict: bool = True, callback: bool | None = None, n_ctx: int | None = None,
                 n_ubatch: int = DEFAULT_UBATCH, mm: MoeMap | None = None, record: bool = False,
                 budget: int | None = None, f32_kv: bool = False, asynchronous: bool = False, pins: bool = False,
                 flash_attn: bool | None = None):
        from mbolt.core.gguf_set import open_model_header

        self.path = str(path)
        self.mm = mm or moe_map(self.path)
        check_llama_streamable(self.mm, self.path)
        self.n_ctx, warning = resolve_ctx(n_ctx, self.mm)
        if warning:
            warnings.warn(warning, stacklevel=2)
        self.flash_attn = (not f32_kv) if flash_attn is None else bool(flash_attn)
        self.f32_kv = f32_kv
        self.n_ubatch = max(1, min(int(n_ubatch), self.n_ctx))
        self.reads, self.evict, self.record = reads, evict, record
        self.budget = budget if reads else None
        if self.budget:
            self.evict = True  # the slot cache's victims leave memory; nothing else is dropped
            cache_slots = cache_slots or self.mm.n_used  # sized from the budget in make_cold
        self.uses_callback = bool(reads or record or callback)
        self.locked_bytes = self.copied_bytes = 0
        self.prefill_slots = self.decode_slots = None  # under a budget: set by fit_budget
        self.pins, self.pinned_per_layer = pins, 0
        if pins and not reads:
            raise MboltError("pins keep experts the runtime reads: they need explicit reads")
        if pins and not self.mm.route_map.heat.any():
            raise MboltError(f"{self.path}: pins need the training heat of a route map (a file written by mbolt "
                             "reorder from a trace); this file has none")
        if cache_slots and cache_slots < self.mm.n_used:
            raise MboltError(f"--cache-slots {cache_slots} is below the {self.mm.n_used} experts a token uses: "
                             "give 0 (no cache) or at least that many")
        self.cache_slots = int(cache_slots) if reads else 0
        self.perm = self.mm.route_map.perm  # position in the file -> original expert id
        self.model_path = str(open_model_header(self.path).path)  # llama.cpp opens a split set from shard 1
        self._evicted: list[tuple[int, int]] = []
        self._victims: list[tuple[int, int]] = []  # left the cache in the call under way: dropped after it
        self._calling: set[int] = set()  # the experts of the read under way (llama.cpp needs them next)
        self.reclaimed = 0  # cached experts found reclaimed by the kernel (read again)
        self.store = self.reader = None
        self.plan: BudgetPlan | None = None
        self.memory: ContextMemory | None = None  # what llama.cpp allocated (logged at creation)
        self.prompt = PromptStats()
        self._step: dict[int, np.ndarray] = {}
        self._seen: set[int] = set()
        self._prev_layer = 1 << 30
        self._in_prompt = False
        self._spec: dict[int, set[int]] = {}  # layer -> experts read ahead for it (not in its LRU)
        self._computed = False  # no graph ran yet (the compute buffer's pages are not resident)
        self._own_group = False  # the budget is the limit of the cgroup this process runs in
        self.given_back = 0  # slots the cache gave up to stay under the group's limit
        moe = sorted(l.index for l in self.mm.moe_layers)
        self.moe_layers = set(moe)
        self._next_moe = dict(zip(moe, moe[1:]))
        self._last_moe = moe[-1]
        self.pages = ExpertPages(self.path, self.mm)
        try:
            if self.budget:
                self.plan = plan_budget(self.model_path, self.mm, self.budget, n_ctx=self.n_ctx,
                                        n_ubatch=self.n_ubatch, dense_bytes=self.dense_bytes(),
                                        engine_bytes=own_bytes() + ENGINE_EXTRA,
                                        flash_attn=self.flash_attn, f32_kv=f32_kv)
                self.n_ubatch = self.plan.n_ubatch
            if reads:
                self.store = ExpertStore(self.path, mm=self.mm, gap=gap, io_threads=qd, cache_slots=self.cache_slots,
                                         drop_pages=False, on_evict=self._on_evict, asynchronous=asynchronous)
            if self.budget:
                self.reader = LayerReader(self.mm, self.store.fds, [willneed_bytes(f) for f in self.mm.paths])
        except BaseException:
            self.close()
            raise

    def dense_bytes(self) -> int:
        """Bytes of the pages that hold a dense weight (what is kept resident)."""
        return sum(b - a for fp in self.pages.files for a, b in fp.dense_pages)

    # ---- the callback ----

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        """llama.cpp computed layer `layer`'s selection (`rows` [n_tokens, k] positions); its
        expert matmuls run when this returns."""
        if layer >= self.perm.shape[0]:
            return
        self._computed = True
        new_step = layer <= self._prev_layer
        self._prev_layer = layer
        ids = self.perm[layer][_by_last_use(rows)]
        self._seen.add(layer)
        if self.record and rows.shape[0]:
            self._step[layer] = np.asarray(rows[-1], np.int16)
        if self.store is None:
            return
        if self.budget:
            if self._in_prompt:
                self.reader.wait()  # the previous layer's reads and drops (and this one's read-ahead) are done
            if new_step:
                self._begin_step(rows.shape[0])
            if self._in_prompt:
                self._prompt_layer(layer, ids)
                return
            self._keep_budget(layer, ids)
        self._calling = set(int(e) for e in ids)
        try:
            self.store.read(layer, ids)
        finally:
            self._calling = set()
            self._drop_victims()

    def _begin_step(self, n_tokens: int) -> None:
        """The first MoE layer of a step: more than one token is a prompt pass."""
        if n_tokens > 1:
            if not self._in_prompt:
                self._in_prompt = True
                self._resize_cache(self.prefill_slots)
            self.prompt.passes += 1
            self.prompt.tokens += n_tokens
            return
        if self._in_prompt:
            self.finish_prompt()
        self._keep_under_limit()

    def _keep_under_limit(self) -> None:
        """Before a decode step inside the group that enforces the budget: when its charge has
        crept within half the margin of the limit (memory the plan does not see: the interpreter's
        heap, page cache of other files), the cache gives up as many slots as it took, for good,
        before the kernel starts reclaiming cached experts (which then come back through 4 KiB
        faults: about 1,600 in one run of q72 at 40%)."""
        if not self._own_group:
            return
        from mbolt.core.memlimit import group_usage

        used = group_usage()
        if used is None:
            return
        over = used - (self.budget - margin(self.budget) // 2)
        if over <= 0:
            return
        n = -(-over // max(expert_bytes_all_layers(self.mm), 1))
        self.decode_slots = max(self.mm.n_used, self.decode_slots - n)
        self.prefill_slots = min(self.prefill_slots, self.decode_slots)
        self.given_back += n
        self._resize_cache(self.decode_slots)

    def _prompt_layer(self, layer: int, ids: np.ndarray) -> None:
        """One layer of a prompt pass: its union's reads queued in use order (llama.cpp starts at
        once; its matmuls wait on pages in flight), the next layer's queued behind them when the
        budget holds two layers."""
        self._keep_budget(layer, ids)  # the previous layer's victims go; reclaimed hits are read again
        spec = self._spec.pop(layer, set())
        sel = [int(e) for e in ids]
        unused = spec.difference(sel)
        if unused:  # read ahead, not selected: out before anything else is read
            self._drop(layer, unused)
            self.prompt.prefetched_unused += len(unused)
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
        nxt = self._next_moe.get(layer)
        if (self.plan.prefetch and nxt is not None and nxt != self._last_moe
                and len(sel) >= PREFETCH_SHARE * self.mm.n_experts):
            ahead = set(range(self.mm.n_experts)).difference(self.store.cached(nxt))
            self._spec[nxt] = ahead
            self.reader.submit(nxt, ahead)

    def finish_prompt(self) -> None:
        """After a prompt's last pass: the read-ahead finished and its leftovers dropped, the
        last layer's victims dropped, the cache grown back to its decode size."""
        if not self._in_prompt:
            return
        self._in_prompt = False  # drops from here on are done at once
        if self.reader is not None:
            self.reader.wait()
            c = self.reader.counters
            self.prompt.bytes, self.prompt.reads, self.prompt.read_s = c.bytes, c.reads, c.busy_s
        for layer, es in self._spec.items():
            self._drop(layer, es)
            self.prompt.prefetched_unused += len(es)
        self._spec.clear()
        self.drop_experts()
        self._resize_cache(self.decode_slots)

    def _keep_budget(self, layer: int, ids) -> None:
        """Before a layer's read: the previous layer's deferred victims go now (its matmuls are
        done), and in a decode step a selected expert the cache holds but the kernel reclaimed in
        part is read again rather than faulted in page by page (each such fault read 4 KiB:
        thousands per token). Only this step's hits are checked: a few mincore calls per layer."""
        if self._evicted:
            self.drop_experts()
        if self._in_prompt:
            return  # a pass reads hundreds of experts: a reclaimed hit costs a few faults, checking all costs more
        cached = set(self.store.cached(layer))
        for e in ids:
            e = int(e)
            if e in cached and not self.pages.expert_resident(layer, e):
                self.pages.drop(self.pages.expert_spans_of(layer, [e]))  # what is left of it, too
                self.store.forget(layer, e)
                self.reclaimed += 1

    def _on_evict(self, layer: int, e: int) -> None:
        """An expert left the slot cache. Under a budget its pages go at once (with the other
        victims of the same call, `_drop_victims`), so the group never holds more than the cache
        (dropped after the step, a step's new experts overran the margin: the kernel then reclaimed
        experts the cache still counted, ~4,800 faults per token); one the running read still needs
        (a pass's union can exceed the slots) goes when the next layer starts."""
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
        if self._in_prompt and self.reader is not None:
            self.reader.call(lambda: self.pages.drop(spans))
        else:
            self.pages.drop(spans)

    def drop_experts(self) -> None:
        """After a step: make the experts cold again (all of them, or those the slot cache let go)."""
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

    def check_routed(self) -> None:
        """Every MoE layer reported its selection in this step, or the reads missed experts."""
        missing = self.moe_layers - self._seen
        if missing:
            raise MboltError(f"{self.path}: llama.cpp computed no ffn_moe_topk for layer(s) "
                             f"{', '.join(map(str, sorted(missing)))} in a step: its experts were not read "
                             "(a llama.cpp build that fuses or renames the expert selection?)")
        self._seen = set()

    # ---- setup ----

    def attach(self, memory: ContextMemory | None) -> None:
        """After llama.cpp mapped the model and created its context (`memory`: what it logged)."""
        self.memory = memory
        self.pages.attach()

    def make_cold(self) -> None:
        """Before a run: no expert page resident (the slot cache starts empty too); the dense
        weights resident (and, with a budget, held; the cache sized from what is left)."""
        if self.reader is not None:
            self.reader.wait()
        if self.store is not None:
            self.store.clear_cache()
        self._evicted.clear()
        self._in_prompt = False
        self.pages.reset()
        if self.budget:
            self.fit_budget()
        if self.pins:
            self.pin_hottest()

    def fit_budget(self) -> None:
        from mbolt.core.memlimit import group_usage, lockable_bytes, own_limit

        if not (self.locked_bytes or self.copied_bytes):
            self.locked_bytes, self.copied_bytes = self.pages.hold_dense(lockable_bytes())
            self.pages.advise_experts()
        self.store.reserve(self.mm.n_used)
        # inside the group that enforces this budget, its charge is what is used; elsewhere (a
        # shared group, or none) the dense weights and this process's own memory
        lim = own_limit()
        used = None
        if lim is not None and lim <= self.budget:  # v1 rounds a limit down to whole pages
            self.budget = lim
            used = group_usage()
            self._own_group = used is not None
        if used is None:
            used = self.locked_bytes + own_bytes()  # the copied dense weights are anonymous: in own_bytes
        if not self._computed and self.memory is not None:
            used += self.memory.compute_bytes  # its pages become resident in the first pass
        self.prefill_slots = slots_for(self.mm, self.budget, used, self.plan.prefill_reserve)
        self.decode_slots = max(self.prefill_slots, slots_for(self.mm, self.budget, used, step_bytes(self.mm)))
        self.cache_slots = self.store.cache_slots = self.decode_slots

    def _resize_cache(self, slots: int | None) -> None:
        """Under a budget: the slot count of the next phase (the victims of a shrink leave memory
        now, before the phase reads anything)."""
        if not self.budget or not slots or self.store is None or slots == self.store.cache_slots:
            return
        self.cache_slots = slots
        self.store.resize(slots)
        self._drop_victims()

    def pin_hottest(self) -> None:
        """Pin PIN_SHARE of each layer's slots to its hottest experts (route map heat is per
        position; pins name original experts), leaving at least k slots to the LRU."""
        rm = self.mm.route_map
        slots = self.prefill_slots or self.cache_slots  # pins stay through a prompt's smaller cache
        n = max(0, min(int(PIN_SHARE * slots), slots - self.mm.n_used))
        for layer in self.moe_layers:
            hottest = np.argsort(-rm.heat[layer], kind="stable")[:n]  # positions
            self.store.pin(layer, rm.perm[layer][hottest])
        self.pinned_per_layer = n

    def describe_budget(self) -> str:
        """One line: where the budget goes."""
        p, mib = self.plan, 2**20
        mem = self.memory or p.memory
        held = f"{self.locked_bytes / 1e6:.0f} MB of dense weights locked"
        if self.copied_bytes:
            held += f", {self.copied_bytes / 1e6:.0f} MB held as anonymous copies (RLIMIT_MEMLOCK)"
        lost = mem.compute_bytes // max(expert_bytes_all_layers(self.mm), 1)
        return (f"{held}; context {mem.n_ctx} tokens (KV cache {mem.kv_bytes / mib:.0f} MiB); prompt passes of "
                f"{self.n_ubatch} tokens (compute buffer {mem.compute_bytes / mib:.0f} MiB: {lost} decode "
                f"slot{'s' if lost != 1 else ''}{', next layer read ahead' if p.prefetch else ''}); "
                f"{self.decode_slots} expert slots per layer ({self.prefill_slots} during a prompt, "
                f"{self.pinned_per_layer} pinned)")

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if getattr(self, "pages", None) is not None:
            self.pages.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def passes_for(n_tokens: int, n_ubatch: int) -> int:
    """The passes over the experts a prompt of n_tokens takes: ceil(n_tokens / n_ubatch)."""
    return -(-int(n_tokens) // max(int(n_ubatch), 1))
