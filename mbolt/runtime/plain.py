"""Plain llama.cpp: the arm the runtime is measured against, as users run a model larger than
RAM (the file mapped, weight repacking off, no eval callback: page faults and the kernel's
readahead decide what is read). It stands where the streaming runtime stands in the driver
(runtime.driver): the same steps, none of the reads.

Variants for controlled measurements, all off by default:
- `drop_after_step`: every expert page dropped after every decode step (the emulation of a model
  far larger than RAM, without a memory limit: every expert read every token);
- `callback`: the eval callback installed at ffn_moe_topk-N, doing nothing (what it costs alone);
- `record`: the callback keeps each decode step's selections (`step_routing`), as the runtime's;
- `repacked`: llama.cpp's default load (Q4_0/Q4_K/... experts repacked into its own memory), the
  speed its fastest kernels give when the whole model fits (a warm reference, not a streaming arm).
"""

from __future__ import annotations

import time

import numpy as np

from mbolt.core.moe_map import MoeMap
from mbolt.runtime.arm import Arm, PromptStats
from mbolt.runtime.memory import DEFAULT_UBATCH, ContextMemory
from mbolt.runtime.pages import ExpertPages
from mbolt.runtime.runner import Phase


class PlainLlama(Arm):
    store = budget = filter = plan = None
    prefill_slots = decode_slots = None
    cache_slots = pinned_per_layer = reclaimed = locked_bytes = copied_bytes = 0

    def __init__(self, path, *, mm: MoeMap | None = None, n_ctx: int | None = None, n_ubatch: int = DEFAULT_UBATCH,
                 drop_after_step: bool = False, callback: bool = False, record: bool = False,
                 f32_kv: bool = False, flash_attn: bool | None = None, repacked: bool = False):
        from mbolt.core.gguf_set import open_model_header

        self._open(path, mm, n_ctx, n_ubatch, f32_kv, flash_attn)
        self.drop_after_step, self.record = drop_after_step, record
        if repacked:  # llama.cpp's default load: the repackable weights copied into its repack buffer
            self.load_mode, self.repacking = None, "on (llama.cpp's default load)"
        self.uses_callback = bool(callback or record)
        self.model_path = str(open_model_header(self.path).path)
        self.memory: ContextMemory | None = None
        self.phase = Phase.LOAD
        self.prompt = PromptStats()
        self.step_routing: dict[int, np.ndarray] = {}
        self.after_step_s = 0.0  # dropping the expert pages after a decode step (not the step's time)
        self.pages = ExpertPages(self.path, self.mm, before_load=True)

    def begin(self, phase: Phase, n_rows: int) -> None:
        self.phase = phase
        self.step_routing = {}
        if phase is Phase.PROMPT:
            self.prompt.passes += 1
            self.prompt.tokens += n_rows

    def on_topk(self, layer: int, rows: np.ndarray) -> None:
        if self.record and rows.shape[0]:
            self.step_routing[layer] = np.asarray(rows[-1], np.int16)

    def end(self) -> None:
        if self.phase is Phase.DECODE and self.drop_after_step:
            t0 = time.perf_counter()
            self.pages.drop()
            self.after_step_s += time.perf_counter() - t0

    def end_prompt(self) -> None:
        if self.phase is Phase.PROMPT:
            self.phase = Phase.DECODE
            if self.drop_after_step:
                self.pages.drop()

    def attach(self, memory: ContextMemory | None, tap=None) -> None:
        self.memory = memory
        if self.llama_model is None:  # a model the caller loaded (a probe's own load) may not map this file
            self.pages.attach()

    def make_cold(self) -> None:
        """No expert page resident; the dense weights resident (nothing held: plain holds nothing)."""
        self.phase = Phase.LOAD
        self.pages.reset()

    def close(self) -> None:
        if getattr(self, "pages", None) is not None:
            self.pages.close()
