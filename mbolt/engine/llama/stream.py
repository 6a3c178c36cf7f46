"""llama.cpp as the streaming engine: explicit expert reads from its eval callback, no patch.

llama.cpp's scheduler asks the eval callback about every graph node; for `ffn_moe_topk-N` we
answer yes, so it computes the graph up to layer N's expert selection, hands us the selected
ids, and waits for our answer before it runs layer N's expert matmuls. There we map the ids
(positions in the file) through the file's route map to original experts, take their byte
ranges (`core.routemap.expert_ranges`), and read them with the expert store's reader
(`engine.store.ExpertStore.read`: merge_ranges with the arm's merge gap, preadv with its queue
depth, POSIX_FADV_RANDOM so the kernel adds no readahead). Returning true lets llama.cpp go on;
its mmap then finds those pages in the page cache.

Under a real memory limit (`budget` in bytes: `--ram`, else the cgroup's limit; core.memlimit) the
runtime keeps the dense weights locked in memory (mlock: the kernel never reclaims them), turns
off readahead on the expert spans of llama.cpp's mapping (MADV_RANDOM: a stray fault reads one
page, not the device's readahead window), and gives the rest of the budget to an expert cache:
a per-layer LRU of slots sized from the budget, whose victims' pages are dropped after each
step, so the group stays under its limit and the kernel never has to reclaim.

Cold and bounded memory emulated (no budget, the s = 1 bound): after every decode step (or, with
a per-layer slot budget, when an expert leaves the store's LRU) the expert pages are dropped from
llama.cpp's mapping (madvise MADV_DONTNEED on the mapped addresses, found in /proc/self/maps) and
then from the page cache (posix_fadvise DONTNEED; a page still mapped cannot be dropped). Only
the expert tensors' own pages are dropped, rounded inward to whole pages: a dense page dropped by
accident comes back through a page fault whose readahead pulls megabytes, experts included.
`ExpertPages.resident` (mincore: page cache) and `ExpertPages.mapped` (/proc/self/pagemap: this
process's page tables) prove it; dense weights stay resident.

The `os` arm: the same cold condition without explicit reads (llama.cpp's page faults and the
kernel's readahead decide what is read); by default without the callback, as users run llama.cpp.
llama.cpp cannot load the `packed` layout (its tensors are blobs llama.cpp does not know).
"""

from __future__ import annotations

import ctypes
import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from mbolt.engine.pages import ExpertPages
from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.engine.store import ExpertStore, proc_read_bytes



def check_llama_streamable(mm: MoeMap, path: str) -> None:
    """llama.cpp loads stock and reorder files; a packed file is refused in one line."""
    if mm.route_map.layout == "packed":
        raise MboltError(f"{path}: packed layout: llama.cpp cannot load it (its experts are mbolt blobs); "
                         "stream the reorder layout instead")
    if not mm.moe_layers:
        raise MboltError(f"{path}: no routed expert tensors: nothing to stream")


@dataclass
class StreamRun:
    """What one generation measured (prefill = the prompt, decode = the generated tokens)."""

    generated: list[list[int]]  # per prompt
    prefill_s: float = 0.0  # time to first token, summed over prompts
    decode_s: float = 0.0  # llama_decode wall time of the decode steps (eviction excluded)
    decode_tokens: int = 0
    io_s: float = 0.0  # decode: wall time of the explicit reads
    reads: int = 0  # decode: merged reads (os arm: major faults)
    ops: int = 0
    bytes: int = 0
    useful_bytes: int = 0
    hits: int = 0
    misses: int = 0
    major_faults: int = 0
    device_bytes: int | None = None  # decode: /proc/self/io read_bytes delta
    routing: list[dict] = field(default_factory=list)  # per decode step: {layer: positions}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("routing")
        return d


BUDGET_MARGIN = 64 << 20  # bytes of a budget left free for the KV cache's growth and compute buffers
PIN_SHARE = 0.75  # nuthatch's learned-pin default: that share of the slots pinned, the rest LRU
PREFILL_CHUNK = 8  # under a budget the prompt is evaluated this many tokens at a time (see prefill_bytes)


def expert_bytes_all_layers(mm: MoeMap) -> int:
    """Bytes of one expert in every MoE layer (what one slot of the per-layer cache costs)."""
    return sum(l.expert_bytes for l in mm.moe_layers)


def prefill_bytes(mm: MoeMap) -> int:
    """What a prompt chunk's layer needs beyond the cache: the union of PREFILL_CHUNK tokens' experts
    in the largest layer (its experts are read before its matmul; the victims go at the next layer)."""
    return max(l.expert_bytes for l in mm.moe_layers) * min(mm.n_experts, PREFILL_CHUNK * mm.n_used)


def own_bytes() -> int:
    """This process's own memory: anonymous (heap, KV cache, buffers) and shared anonymous (the
    store's read arena) resident pages, not the mapped file."""
    n = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                n += int(line.split()[1]) * 1024
    return n


def step_bytes(mm: MoeMap) -> int:
    """What a decode step's layer needs beyond the cache: its k experts, read before the victims go."""
    return max(l.expert_bytes for l in mm.moe_layers) * mm.n_used


def slots_for_budget(mm: MoeMap, budget: int, used: int, reserve: int | None = None) -> int:
    """Per-layer expert slots that fit in `budget` bytes when `used` are taken already (dense
    weights, process memory), less a margin (BUDGET_MARGIN or 5%) and `reserve`, what one layer
    reads beyond the cache (default a prompt chunk's experts, `prefill_bytes`; a decode step needs
    only `step_bytes`); at least the k experts a token uses."""
    per_slot = max(expert_bytes_all_layers(mm), 1)
    reserve = prefill_bytes(mm) if reserve is None else reserve
    free = budget - used - max(BUDGET_MARGIN, budget // 20) - reserve
    return int(min(mm.n_experts, max(mm.n_used, free // per_slot)))


class LlamaStream:
    """llama.cpp with mbolt's expert reads and bounded expert memory.

    reads: explicit reads at ffn_moe_topk-N (False: page faults read; with evict=False and no
      callback that is plain llama.cpp).
    evict: drop expert pages after every decode step, or only the slot cache's victims when it
      has slots (False: keep whatever the kernel keeps).
    callback: install the eval callback even without reads (the callback-overhead control).
    cache_slots: per-layer LRU budget of experts kept resident across steps (0: none).
    budget: bytes this run may use (a real memory limit): dense weights locked, expert readahead
      off, cache_slots sized from what is left (reads only; see the module docstring).
    f32_kv: F32 KV cache and no flash attention (parity tests); False is llama.cpp's default.
    asynchronous: submit the reads (posix_fadvise WILLNEED) and let llama.cpp's page faults wait
      for them, so its matmuls overlap the I/O (engine.store).
    pins: pin the hottest experts of each layer (PIN_SHARE of the slots) by the training heat the
      file's route map carries (a reorder file's `mbolt.heat`); the other slots stay LRU.
    """

    def __init__(self, path, *, reads: bool = True, gap: int = 0, qd: int = 1, cache_slots: int = 0,
                 evict: bool = True, callback: bool | None = None, n_ctx: int = 512, n_threads: int | None = None,
                 mm: MoeMap | None = None, record: bool = False, budget: int | None = None, f32_kv: bool = False,
                 asynchronous: bool = False, pins: bool = False):
        from mbolt.engine.llama.runner import LlamaRunner

        self.path = str(path)
        self.mm = mm or moe_map(self.path)
        check_llama_streamable(self.mm, self.path)
        self.reads, self.evict, self.record = reads, evict, record
        self.budget = budget if reads else None
        if self.budget:
            self.evict = True  # the slot cache's victims leave memory; nothing else is dropped
            cache_slots = cache_slots or self.mm.n_used  # sized from the budget in make_cold
        self.locked_bytes = 0
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
        self._evicted: list[tuple[int, int]] = []
        self._calling: set[int] = set()  # the experts of the read under way (llama.cpp needs them next)
        self.reclaimed = 0  # cached experts found reclaimed by the kernel (read again)
        self.store = None
        if reads:
            self.store = ExpertStore(self.path, mm=self.mm, gap=gap, io_threads=qd, cache_slots=self.cache_slots,
                                     drop_pages=False, on_evict=self._on_evict, asynchronous=asynchronous)
        self._step: dict[int, np.ndarray] = {}
        self._seen: set[int] = set()
        self.moe_layers = {l.index for l in self.mm.moe_layers}
        cb = self._on_topk if (reads or record or callback) else None
        self.pages = ExpertPages(self.path, self.mm)
        try:
            self.runner = LlamaRunner(self.path, n_ctx=n_ctx, n_threads=n_threads, capture=False, on_topk=cb,
                                      load_mode="mmap", f32_kv=f32_kv,
                                      n_batch=PREFILL_CHUNK if self.budget else 512)
            self.pages.attach()
        except BaseException:
            self.close()
            raise

    def _on_topk(self, layer: int, rows: np.ndarray) -> None:
        if layer >= self.perm.shape[0]:
            return
        ids = self.perm[layer][np.unique(rows[rows >= 0])]
        self._seen.add(layer)
        if self.record:
            self._step[layer] = np.asarray(rows[-1], np.int16)
        if self.store is not None:
            if self.budget:
                self._keep_budget(layer, ids)
            self._calling = set(int(e) for e in ids)
            try:
                self.store.read(layer, ids)
            finally:
                self._calling = set()

    def _keep_budget(self, layer: int, ids) -> None:
        """Before a layer's read: the previous layer's deferred victims go now (its matmuls are
        done), and a selected expert the cache holds but the kernel reclaimed in part is read again
        rather than faulted in page by page (each such fault read 4 KiB: thousands per token).
        Only this step's hits are checked: a few mincore calls per layer."""
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
        """An expert left the slot cache. Under a budget its pages go at once, so the group never
        holds more than the cache (dropped after the step, a step's new experts overran the margin:
        the kernel then reclaimed experts the cache still counted, ~4,800 faults per token); one the
        running read still needs (a prefill's union can exceed the slots) goes after the step."""
        if self.budget and e not in self._calling:
            self.pages.drop(self.pages.expert_spans_of(layer, [e]))
        else:
            self._evicted.append((layer, e))

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
            es -= set(self.store.cached(layer))  # evicted during a prefill, then used again
            if es:
                self.pages.drop(self.pages.expert_spans_of(layer, sorted(es)))

    def make_cold(self) -> None:
        """Before a run: no expert page resident (the slot cache starts empty too); the dense
        weights resident (and, with a budget, locked; the cache sized from what is left)."""
        if self.store is not None:
            self.store.clear_cache()
        self._evicted.clear()
        self.pages.reset()
        if self.budget:
            self.fit_budget()
        if self.pins:
            self.pin_hottest()

    def fit_budget(self) -> None:
        from mbolt.core.memlimit import group_usage, own_limit

        if not self.locked_bytes:
            dense = sum(b - a for a, b in self.pages.dense_tensors)
            floor = dense + own_bytes() + BUDGET_MARGIN
            if floor > self.budget:
                raise MboltError(f"{self.path}: a budget of {self.budget / 2**20:.0f} MiB is below the "
                                 f"{floor / 2**20:.0f} MiB that the dense weights ({dense / 2**20:.0f} MiB, kept "
                                 "resident), the engine and a margin take: give a larger --ram")
            self.locked_bytes = self.pages.lock_dense()
            self.pages.advise_experts()
        self.store.reserve(self.mm.n_used)
        # inside the group that enforces this budget, its charge is what is used; elsewhere (a
        # shared group, or none) the dense weights and this process's own memory
        lim = own_limit()
        if lim is not None and lim <= self.budget:  # v1 rounds a limit down to whole pages
            self.budget = lim
            used = group_usage()
        else:
            used = None
        if used is None:
            used = self.locked_bytes + own_bytes()
        # a prompt chunk reads up to PREFILL_CHUNK * k experts at a layer, a decode step k: the
        # cache shrinks to prefill_slots for each prompt and grows back to decode_slots after it
        self.prefill_slots = slots_for_budget(self.mm, self.budget, used)
        self.decode_slots = max(self.prefill_slots, slots_for_budget(self.mm, self.budget, used, step_bytes(self.mm)))
        self.cache_slots = self.store.cache_slots = self.decode_slots

    def _resize_cache(self, slots: int | None) -> None:
        """Under a budget: the slot count of the next phase (the victims of a shrink leave memory
        now, before the phase reads anything)."""
        if not self.budget or not slots or self.store is None or slots == self.store.cache_slots:
            return
        self.cache_slots = slots
        self.store.resize(slots)

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

    def _check_routed(self) -> None:
        """Every MoE layer reported its selection in this step, or the reads missed experts."""
        missing = self.moe_layers - self._seen
        if missing:
            raise MboltError(f"{self.path}: llama.cpp computed no ffn_moe_topk for layer(s) "
                             f"{', '.join(map(str, sorted(missing)))} in a step: its experts were not read "
                             "(a llama.cpp build that fuses or renames the expert selection?)")
        self._seen = set()

    _COUNTED = ("io_time", "reads", "ops", "bytes", "useful_bytes", "hits", "misses")

    def _counts(self) -> np.ndarray:
        c = self.store.counters if self.store is not None else None
        return np.array([getattr(c, k) if c else 0 for k in self._COUNTED], float)

    def generate(self, prompts: list[list[int]], n_new: int, on_token=None, forced: int = 0) -> StreamRun:
        """Decode `n_new` tokens after each prompt; timings and reads of the decode steps only (the
        prompt's reads count in its time to first token). Greedy by default; `forced` > 0 is
        teacher forcing: prefill the prompt's first `forced` tokens, then feed its next tokens one
        at a time (routing follows the text). `generated` holds the greedy prediction of every
        step either way, so arms that compute the same model agree."""
        run = StreamRun(generated=[])
        r = self.runner
        acc = np.zeros(len(self._COUNTED))
        dev: int | None = 0
        check = self.store is not None
        for p, ids in enumerate(prompts):
            if forced and len(ids) < forced + n_new:
                raise MboltError(f"prompt {p}: {len(ids)} tokens; teacher forcing needs {forced} + {n_new} "
                                 "(give a longer text or fewer --new-tokens)")
            r.reset()
            self._step = {}
            t0 = time.perf_counter()
            self._resize_cache(self.prefill_slots)
            logits = r.eval(list(ids[:forced] if forced else ids))
            run.prefill_s += time.perf_counter() - t0
            self._seen = set()
            self.drop_experts()
            self._resize_cache(self.decode_slots)
            out = []
            for i in range(n_new):
                pred = int(np.argmax(logits))
                out.append(pred)
                tok = int(ids[forced + i]) if forced else pred
                self._step = {}
                c0, d0 = self._counts(), proc_read_bytes()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
                t0 = time.perf_counter()
                logits = r.eval([tok])
                run.decode_s += time.perf_counter() - t0
                run.major_faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
                acc += self._counts() - c0
                d1 = proc_read_bytes()
                dev = None if (dev is None or d0 is None or d1 is None) else dev + d1 - d0
                if check:
                    self._check_routed()
                run.decode_tokens += 1
                if self.record:
                    run.routing.append(dict(self._step))
                self.drop_experts()
                if on_token:
                    on_token(i, tok)
            run.generated.append(out)
        run.device_bytes = dev
        if self.store is not None:
            run.io_s = float(acc[0])
            run.reads, run.ops, run.bytes, run.useful_bytes, run.hits, run.misses = (int(x) for x in acc[1:])
        else:
            # os arm: every major fault is one read the kernel issued, readahead included
            run.reads = run.ops = run.major_faults
            run.bytes = dev or 0
        return run

    def detokenize(self, ids: list[int]) -> str:
        L = self.runner.L
        out = b""
        buf = ctypes.create_string_buffer(256)
        for t in ids:
            n = L.llama_token_to_piece(self.runner.vocab, int(t), buf, len(buf), 0, False)
            if n > 0:
                out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    def close(self) -> None:
        if getattr(self, "runner", None) is not None:
            self.runner.close()
            self.runner = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if getattr(self, "pages", None) is not None:
            self.pages.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def routing_trace(runs: list[StreamRun], mm: MoeMap):
    """The decode routing llama.cpp computed, as a Trace of ORIGINAL expert ids (for the predictor)."""
    from mbolt.core.trace import DECODE, Trace

    steps = [s for r in runs for s in r.routing]
    k = mm.n_used
    ex = np.full((len(steps), mm.n_layers, k), -1, np.int16)
    perm = mm.route_map.perm
    for t, st in enumerate(steps):
        for layer, pos in st.items():
            if layer < mm.n_layers:
                p = np.asarray(pos[:k], np.int64)
                ex[t, layer, : p.size] = perm[layer][p]
    n = len(steps)
    return Trace(n_layers=mm.n_layers, n_experts=mm.n_experts, k=k, experts=ex,
                 phase=np.full(n, DECODE, np.uint8), seq=np.zeros(n, np.int32), pos=np.arange(n, dtype=np.int32),
                 fingerprint=mm.source_fingerprint)


def record_routing(path, prompts: list[list[int]], n_new: int, mm: MoeMap | None = None, forced: int = 0):
    """Generate once warm (no reads, no eviction) with the callback recording the decode routing;
    returns it as a Trace (original ids). Deterministic (greedy or teacher-forced): every arm routes
    the same."""
    with LlamaStream(path, reads=False, evict=False, record=True, mm=mm) as s:
        return routing_trace([s.generate(prompts, n_new, forced=forced)], s.mm)
