"""What every arm in the driver shares (the streaming runtime, runtime.streamer; plain
llama.cpp, runtime.plain): the check that llama.cpp can stream a file, the prompt passes' counters,
and this process's own memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap


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

    def to_dict(self) -> dict:
        return asdict(self)
