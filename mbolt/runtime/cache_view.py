"""What a server shows of a streaming arm (serve/stats.py: /stats, /metrics, the page's cache map),
in one shape whichever arm streams: the mapped runtime (runtime.streamer) or the kernel layout's
(runtime.kernel_stream). Each builds it with `runtime_view()`; the driver hands it on
(`Driver.runtime_view`), so nothing above the driver reads an arm's attributes.

A snapshot: the arrays are copies, taken while the server's worker may be in a step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class RuntimeView:
    """Counters since the load (`experts`, `hits`, `misses`, `bytes`: every step; `prompt_*`: the
    prompt passes' part of them), the budget's numbers, and per MoE layer by original expert id
    (rows indexed by layer, as `perm`): what the cache holds, what the last decode step used, and
    what it read (None where the arm does not mark its reads)."""

    experts: int
    hits: int
    misses: int
    bytes: int
    prompt_hits: int
    prompt_misses: int
    prompt_bytes: int
    prompt_passes: int
    prompt_from_start: int  # prompt layers read from their start (under their attention)
    locked_bytes: int
    copied_bytes: int
    decode_slots: int | None
    prefill_slots: int | None
    reclaimed: int
    slots_given_back: int
    n_experts: int
    n_used: int
    moe_layers: list[int]
    perm: np.ndarray  # [layer, position in the file] -> original expert id
    cached: np.ndarray  # [layer, expert] 1: in the cache
    used: np.ndarray  # [layer, expert] True: selected by the last decode step
    read: np.ndarray | None  # [layer, expert] 1: read by the last decode step


def view_of(arm, counters, cached: np.ndarray, used: np.ndarray, read: np.ndarray | None) -> RuntimeView:
    """The view of a streaming arm (its `prompt`, budget and map; the rest given)."""
    p = replace(arm.prompt)
    return RuntimeView(
        experts=int(counters.experts), hits=int(counters.hits), misses=int(counters.misses), bytes=int(counters.bytes),
        prompt_hits=int(p.hits), prompt_misses=int(p.misses), prompt_bytes=int(p.bytes), prompt_passes=int(p.passes),
        prompt_from_start=int(p.from_start), locked_bytes=int(arm.locked_bytes),
        copied_bytes=int(arm.copied_bytes), decode_slots=arm.decode_slots,
        prefill_slots=arm.prefill_slots, reclaimed=int(arm.reclaimed),
        slots_given_back=int(arm.budget.given_back) if arm.budget else 0, n_experts=int(arm.mm.n_experts),
        n_used=int(arm.mm.n_used), moe_layers=sorted(int(x) for x in arm.moe_layers), perm=arm.perm.copy(),
        cached=np.array(cached, np.uint8), used=np.asarray(used, bool).copy(),
        read=None if read is None else np.array(read, np.uint8))

