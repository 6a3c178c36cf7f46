"""What every arm in the driver shares (the streaming runtime, runtime.streamer; plain
llama.cpp, runtime.plain): the check that llama.cpp can stream a file, the prompt passes' counters,
and this process's own memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap
from mbolt.runtime.budget import PREFETCH_SHARE
from mbolt.runtime.native import START
from mbolt.runtime.runner import Phase


class Arm:
    """What both arms are as objects: a model opened and checked, its context's size resolved;
    closed by `close`, also as a context manager. `llama_model`: a model the arm loaded itself
    (runtime.kernel_stream), else None and the driver's runner loads `model_path`."""

    llama_model: int | None = None
    repacking = "off"  # where the weights' repacked layout comes from: off (pages of the mapped file) or the file
    load_mode: str | None = "mmap"  # how the runner loads model_path (runtime.runner.LlamaRunner; None: llama.cpp's default)

    def hold_all(self) -> None:
        """Every expert resident before a warm measurement (a mapped file's pages are the page cache's:
        nothing to do here)."""

    def _open(self, path, mm: MoeMap | None, n_ctx: int | None, n_ubatch: int, f32_kv: bool,
              flash_attn: bool | None) -> None:
        import warnings

        from mbolt.core.moe_map import moe_map
        from mbolt.runtime.memory import resolve_ctx

        self.path = str(path)
        self.mm = mm or moe_map(self.path)
        check_llama_streamable(self.mm, self.path)
        self.n_ctx, warning = resolve_ctx(n_ctx, self.mm)
        if warning:
            warnings.warn(warning, stacklevel=3)
        self.n_ubatch = max(1, min(int(n_ubatch), self.n_ctx))
        self.f32_kv = f32_kv
        self.flash_attn = (not f32_kv) if flash_attn is None else bool(flash_attn)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BudgetedArm(Arm):
    """What both streaming arms (runtime.streamer, runtime.kernel_stream) share about their budget
    (runtime.budget.Budget, or None without one) and llama.cpp's compute buffer: `tap` (the eval
    callback, which knows the buffer once a graph ran), `memory` (what llama.cpp logged) and
    `_computed` (a graph ran since the buffer's pages were last given back)."""

    budget = tap = memory = None
    waits = None  # uint8 [n_layers]: bits of runtime.native.WAIT_BITS, shared with the eval callback
    give_back_compute = True
    compute_releases = 0  # prompts after which the compute buffer's pages were given back
    _computed = False

    @property
    def plan(self):
        return self.budget.plan if self.budget else None

    @property
    def prefill_slots(self) -> int | None:
        return self.budget.prefill_slots if self.budget else None

    @property
    def decode_slots(self) -> int | None:
        return self.budget.decode_slots if self.budget else None

    def share_waits(self, tap) -> None:
        """The eval callback asks about the layers' other nodes (runtime.native.WAIT_NODES) as
        `waits` says, and hands them to `_on_wait(layer, role)`."""
        if tap is not None and self.waits is None:
            self.waits = np.zeros(self.perm.shape[0], np.uint8)
            tap.share_waits(self.waits, self._on_wait)

    # A prompt pass whose budget holds one layer's reads (not two: no read-ahead under the layer
    # before) reads a layer from its start, under its attention, once the layer before is done with
    # its experts: a layer's selection comes after its attention, and at 8,000 tokens of context a
    # 200-token turn's attention took longer than its reads (q4km: 0.35 s a layer warm).
    def _start_first(self, n_rows: int) -> bool:
        """Before a prompt pass of `n_rows` rows: its first MoE layer is read from its start when the
        pass selects two layers' worth of experts (n_rows x k >= 2E: nearly all of them). Whether it is."""
        self._clear_waits(START)
        first = min(self.moe_layers)
        if (self._may_read_ahead(first) and not self.plan.prefetch and self.waits is not None
                and n_rows * self.mm.n_used >= 2 * self.mm.n_experts):
            self.waits[first] |= START
            return True
        return False

    def _next_to_read(self, layer: int, n_selected: int) -> int | None:
        """After a prompt layer's selection, the read-ahead's rule: the next MoE layer is read ahead
        when this one selected PREFETCH_SHARE of its experts. Returned when the budget holds two
        layers' passes (read it now, under this layer's matmuls); else marked to be read from its
        start (None)."""
        nxt = self._next_moe.get(layer)
        if not self._may_read_ahead(nxt) or n_selected < PREFETCH_SHARE * self.mm.n_experts:
            return None
        if self.plan.prefetch:
            return nxt
        if self.waits is not None:
            self.waits[nxt] |= START
        return None

    def _may_read_ahead(self, layer: int | None) -> bool:
        """Whether a prompt pass under a budget may read `layer` ahead: not the last MoE layer (a
        pass computes it for the rows whose logits are asked for: its last one)."""
        return self.phase is Phase.PROMPT and self.budget is not None and layer in self._next_moe

    def _clear_waits(self, bit: int, layer: int | None = None) -> None:
        """`bit` (runtime.native.WAIT_BITS) cleared in `waits`: one layer's, or every layer's."""
        if self.waits is not None:
            if layer is None:
                self.waits &= 0xFF ^ bit
            else:
                self.waits[layer] &= 0xFF ^ bit

    def _on_wait(self, layer: int, role: str) -> None:
        if role == "start":
            self._clear_waits(START, layer)
            if self.phase is Phase.PROMPT:
                self.prompt.from_start += 1
                self._read_from_start(layer)

    def _read_from_start(self, layer: int) -> None:
        """The layer before is done with its experts: its leftovers go and this layer's uncached
        experts are read (its selection then drops those it does not use)."""
        raise NotImplementedError

    def release_compute(self) -> bool:
        """The compute buffer's pages given back (runtime.memory.give_back); False when it is not
        known (no graph reached the callback) or not the one llama.cpp logged."""
        from mbolt.runtime.memory import give_back

        buf = self.tap.buffer if self.tap is not None else None
        if buf is None or self.memory is None or not give_back(buf, self.memory.compute_bytes):
            return False
        self._computed = False
        self.compute_releases += 1
        return True

    def compute_pending(self) -> tuple[int, int]:
        """The compute buffer's bytes not resident now that a prompt pass, and a decode step, will
        touch (a decode step touches its own graph's part: the buffer is given back after each prompt)."""
        pending = self.memory.compute_bytes if (not self._computed and self.memory is not None) else 0
        return pending, (min(pending, self.plan.decode_compute_bytes) if self.give_back_compute else pending)


def check_llama_streamable(mm: MoeMap, path: str) -> None:
    """llama.cpp loads stock and reorder files; a packed file is refused in one line."""
    if mm.route_map.layout == "packed":
        raise MboltError(f"{path}: packed layout: llama.cpp cannot load it (its experts are mbolt blobs); "
                         "stream the reorder layout instead")
    if not mm.moe_layers:
        raise MboltError(f"{path}: no routed expert tensors: nothing to stream")


def own_bytes(fields: tuple[str, ...] = ("RssAnon:", "RssShmem:")) -> int:
    """This process's own memory: anonymous (heap, KV cache, buffers, dense copies) and shared
    anonymous resident pages, not the mapped file. `fields`: the lines of /proc/self/status summed
    (("RssAnon:",): the anonymous pages alone)."""
    n = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(fields):
                n += int(line.split()[1]) * 1024
    return n


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
    from_start: int = 0  # layers read from their start, under their attention (BudgetedArm._start_first)

    def to_dict(self) -> dict:
        return asdict(self)
