"""One arm, one round: the runners of `run_ab` (replay: the store's reads of held-out tokens;
decode: the reference engine reading experts through the store), each starting cold (device idle,
file evicted and proven) with what the previous arm left kept out of the timed part."""

from __future__ import annotations

import gc
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from mbolt.bench.arms import Arm, ArmJob, RoundResult
from mbolt.bench.env import wait_quiet
from mbolt.core.pagecache import evict_model
from mbolt.core.moe_map import MoeMap
from mbolt.core.trace import Trace
from mbolt.reference.generate import greedy_decode
from mbolt.runtime.pages import ExpertPages
from mbolt.runtime.store import ExpertStore

@contextmanager
def paused_gc():
    """Collect now, then keep the collector out of the timed part (it would otherwise free the
    previous arm's objects in whichever arm ran next)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cold_start(arm: Arm, mm: MoeMap, threshold: float, experts_only: bool = False):
    """Wait for the device to go idle, evict the arm's file and prove it (mincore).

    experts_only (decode: the engine has mapped the file): the dense weights come back resident
    and mapped before the clock, the experts stay cold, as in a model larger than RAM. Why: cold
    dense weights fault in during the timed part with the kernel's readahead, which reads megabytes
    of expert data around them, a cost outside io_s that depends on where the layout put the dense
    tensors (issue 14: 8 ms/token between stock and packed files)."""
    quiet = wait_quiet(arm.path)  # the previous arm's I/O must not overlap this arm
    ev = evict_model(mm, threshold)  # every shard of a split set
    if experts_only and ev.resident_after == ev.resident_after:
        pages = ExpertPages(arm.path, mm)  # every shard of a split set
        try:
            pages.attach()
            pages.reset()
            pages.map_dense()
            # pages shared with a dense tensor are dense pages now: the proof covers the rest
            ev.resident_after = pages.resident()
        finally:
            pages.close()
        note = ("decode: dense weights resident and mapped; resident share measured over the pages "
                "wholly inside expert tensors")
        ev.proven = ev.resident_after <= threshold
        ev.note = ev.note or note
    return quiet, ev


def round_result(arm: Arm, job: ArmJob, ev, quiet: dict, c, wall: float, ttft: float, tokens: int) -> RoundResult:
    rejected = bool(ev.resident_after == ev.resident_after and ev.resident_after > job.threshold)
    return RoundResult(arm.name, job.rnd, job.position, ev.resident_before, ev.resident_after, ev.proven, rejected,
                       tokens, wall, c.io_time, ttft, c.reads, c.bytes, c.useful_bytes, c.device_bytes, c.hits,
                       c.misses, c.major_faults, ev.note, c.ops, quiet.get("inflight_at_start"), quiet["waited_s"],
                       job.prev_arm, c.drop_time)


def run_replay_once(arm: Arm, mm: MoeMap, job: ArmJob) -> RoundResult:
    """Replay this round's tokens through a fresh store on a cold file; time the reads."""
    trace = job.trace
    store = ExpertStore(arm.path, mm=mm, **arm.options())
    try:
        store.reserve(trace.k)
        layers = np.array([l.index for l in mm.moe_layers])
        quiet, ev = cold_start(arm, mm, job.threshold)
        store.reset_counters()
        with paused_gc():
            ex = trace.experts
            t0 = time.perf_counter()
            ttft = 0.0
            for t in range(ex.shape[0]):
                row = ex[t]
                for l in layers:
                    ids = row[l]
                    store.read(int(l), ids[ids >= 0])
                if t == 0:
                    ttft = time.perf_counter() - t0
            wall = time.perf_counter() - t0
        c = store.snapshot()
    finally:
        store.close()
    return round_result(arm, job, ev, quiet, c, wall, ttft, trace.n_tokens)


def run_decode_once(arm: Arm, mm: MoeMap, job: ArmJob) -> RoundResult:
    """Generate from the prompts with the reference engine reading experts through the store."""
    from mbolt.reference import load_model

    store = ExpertStore(arm.path, mm=mm, **arm.options())
    try:
        store.reserve(mm.n_used)
        model = load_model(arm.path, expert_source=store)
        quiet, ev = cold_start(arm, mm, job.threshold, experts_only=True)
        store.reset_counters()
        with paused_gc():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            t0 = time.perf_counter()
            ttft = None
            n = 0
            for ids in job.prompts:
                cache = model.new_cache()
                for st in greedy_decode(lambda x: model.forward(x, cache), list(ids), job.n_new):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    n += st.index > 0
            wall = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
        c = store.snapshot()
        # the engine's own page faults (its mapping of the dense weights) cost wall time outside io_s
        c.major_faults += faults
    finally:
        store.close()
    return round_result(arm, job, ev, quiet, c, wall, ttft or 0.0, n)


# mode -> "run this arm once" (a new mode registers its runner here)
ARM_RUNNERS: dict[str, Callable[[Arm, MoeMap, ArmJob], RoundResult]] = {
    "replay": run_replay_once,
    "decode": run_decode_once,
}
MODE_METRIC = {"replay": "io_s", "decode": "wall_s"}


def run_arm(arm: Arm, mm: MoeMap, trace: Trace | None, *, threshold: float, rnd: int, position: int,
            mode: str = "replay", prompts=None, n_new: int = 0, prev_arm: str | None = None) -> RoundResult:
    return ARM_RUNNERS[mode](arm, mm, ArmJob(rnd, position, threshold, trace, prompts, n_new, prev_arm))


def round_tokens(trace: Trace, r: int, tokens_per_round: int) -> Trace:
    """Round r's tokens: the next slice of `tokens_per_round` held-out tokens (cycling); all of
    them when tokens_per_round is 0 or covers the trace."""
    if not tokens_per_round or tokens_per_round >= trace.n_tokens:
        return trace
    idx = (r * tokens_per_round + np.arange(tokens_per_round)) % trace.n_tokens
    mask = np.zeros(trace.n_tokens, bool)
    mask[idx] = True
    return trace.select(mask)


_HOST_CACHE: dict[int, dict] = {}


def host_cache_of(path: str) -> dict:
    """`probe.host_cache_probe` on the device holding `path`, measured once per process."""
    from mbolt.bench.probe import host_cache_probe

    dev = os.stat(path).st_dev
    if dev not in _HOST_CACHE:
        d = host_cache_probe(Path(path).parent)
        d["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _HOST_CACHE[dev] = d
    return _HOST_CACHE[dev]
