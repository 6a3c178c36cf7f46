"""The numbers a server shows (/stats for the page, /metrics for Prometheus, the chat's line):
the scheduler's counters, its slots, and the runtime's reads and cache."""

from __future__ import annotations

import resource
import time

from mbolt.core.pagecache import proc_read_bytes


def scheduler_stats(sched) -> dict:
    lo, d, c = sched.loaded, sched.driver, sched.counters
    rt = d.runtime_view()  # the streaming runtime's numbers (None: plain llama.cpp)
    now = time.perf_counter()
    window = [t for t in list(sched._recent) if now - t <= 10.0]
    slots = []
    for s in sched.slots:
        recent = [t for t in list(s.recent) if now - t <= 10.0]
        slots.append({"id": s.seq, "busy": s.job is not None, "prompting": bool(s.todo),
                      "prompt_tokens": len(s.job.tokens) if s.job else 0, "generated": len(s.out) if s.job else 0,
                      "held_tokens": len(d.tokens[s.seq]), "tokens_per_s": len(recent) / 10.0})
    out = {"model": sched.name, "mode": "mbolt runtime" if d.streaming else "plain llama.cpp",
           "budget_bytes": lo.budget, "budget_from": lo.budget_from or None, "n_ctx": lo.n_ctx,
           "n_ubatch": lo.n_ubatch, "parallel": d.n_seq, "slots": slots,
           "slots_busy": sum(s["busy"] for s in slots), "queue_length": sched.queue_length,
           "requests": c.requests, "prompt_tokens": c.prompt_tokens, "prompt_s": c.prompt_s,
           "decode_tokens": c.decode_tokens, "decode_s": c.decode_s, "decode_steps": c.decode_steps,
           "mixed_passes": c.mixed_passes,
           "last_decode_tokens_per_s": c.last_decode_tokens_per_s, "tokens_per_s_recent": len(window) / 10.0,
           "rows_per_step": c.step_rows / c.decode_steps if c.decode_steps else None,
           "device_read_bytes": proc_read_bytes(),
           "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}
    if rt is not None:
        decode_experts = rt.experts - (rt.prompt_hits + rt.prompt_misses)
        n_moe = max(len(rt.moe_layers), 1)
        out.update(dense_resident_bytes=rt.locked_bytes + rt.copied_bytes, dense_locked_bytes=rt.locked_bytes,
                   dense_copied_bytes=rt.copied_bytes, expert_slots=rt.decode_slots,
                   expert_slots_prompt=rt.prefill_slots, cache_hits=rt.hits - rt.prompt_hits,
                   cache_misses=rt.misses - rt.prompt_misses,  # decode steps (the prompt passes' are apart)
                   decode_read_bytes=rt.bytes, prompt_read_bytes=rt.prompt_bytes, prompt_passes=rt.prompt_passes,
                   prompt_layers_read_from_start=rt.prompt_from_start,
                   reclaimed=rt.reclaimed, slots_given_back=rt.slots_given_back,
                   expert_union_per_step=(decode_experts / (c.decode_steps * n_moe) if c.decode_steps else None),
                   n_experts=rt.n_experts, n_used=rt.n_used, cache_map=cache_map(rt))
    else:
        out.update(dense_resident_bytes=None, expert_slots=None, cache_hits=None, cache_misses=None)
    hm = (out.get("cache_hits") or 0) + (out.get("cache_misses") or 0)
    out["hit_rate"] = out["cache_hits"] / hm if hm else None
    out["decode_tokens_per_s"] = c.decode_tokens / c.decode_s if c.decode_s else None
    out["prompt_tokens_per_s"] = c.prompt_tokens / c.prompt_s if c.prompt_s else None
    out["mb_per_token"] = (out["decode_read_bytes"] / c.decode_tokens / 1e6
                           if rt is not None and c.decode_tokens else None)
    return out


def cache_map(rt) -> dict:
    """Per MoE layer, in file order (position p holds original expert perm[p]: a reorder file's
    neighbours are drawn side by side), three bitmaps as hex (bit p of the string's number, position
    0 first): the experts the cache holds, those the last decode step used, those it read (null
    where the runtime does not mark its reads: the kernel layout). `rt`: runtime.cache_view.RuntimeView."""
    import numpy as np

    perm, layers = rt.perm, rt.moe_layers

    def hexbits(row) -> str:
        bits = np.asarray(row, np.uint8)
        pad = (-bits.size) % 8
        return np.packbits(np.concatenate([bits, np.zeros(pad, np.uint8)]), bitorder="little").tobytes().hex()

    return {"n_experts": int(perm.shape[1]), "layers": layers,
            "cached": [hexbits(rt.cached[layer][perm[layer]]) for layer in layers],
            "used": [hexbits(rt.used[layer][perm[layer]]) for layer in layers],
            "read": None if rt.read is None else [hexbits(rt.read[layer][perm[layer]]) for layer in layers]}
