"""`mbolt ab --decode --engine llama.cpp`: one arm-round in llama.cpp (bench.llama_stream).

The protocol is run_ab's (rounds, arm order, A/A, pre-registration); this module only runs one
arm once and summarises what llama.cpp adds:
- an arm with reads (default) streams its experts with explicit reads from the eval callback;
  `os` leaves the reading to llama.cpp's page faults (no callback unless `callback`);
- cold: after the model is loaded, the expert tensors' pages are dropped from llama.cpp's mapping
  and the page cache, and mincore must show the expert spans' resident share <= the threshold
  (dense weights stay resident); the experts are dropped again after every decode step;
- `warm` keeps everything resident (the callback-overhead control: `os,warm` is plain llama.cpp,
  `os,warm,callback` the callback without reads); such a round is not cold, and says so.
Per round: decode time and tokens (wall_s/tokens), time to first token, reads, bytes, device
bytes, read time (io_s) of the decode steps, and the greedy tokens generated.
"""

from __future__ import annotations

import numpy as np

from mbolt.bench.ab import Arm, ArmJob, RoundResult
from mbolt.bench.llama_stream import LlamaStream, check_llama_streamable
from mbolt.bench.pagecache import wait_quiet
from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap


def check_llama_arms(arms: list[Arm], info: dict, mode: str) -> None:
    if mode != "decode":
        raise MboltError("--engine llama.cpp measures generation: use --decode (replay reads without an engine)")
    for a in arms:
        check_llama_streamable(info[a.path][0], a.path)
        if a.direct:
            raise MboltError(f"arm {a.name}: O_DIRECT bypasses the page cache, where llama.cpp's mmap finds the "
                             "experts: use buffered reads with --engine llama.cpp")
        if a.mode == "os" and a.cache_slots:
            raise MboltError(f"arm {a.name}: an os arm reads through page faults and has no slot cache (drop cache=)")
        if a.warm and a.cache_slots:
            raise MboltError(f"arm {a.name}: a warm arm keeps everything resident: cache= means nothing there")
        if a.resident_frac is not None:
            raise MboltError(f"arm {a.name}: give the llama.cpp slot budget as cache=N, not frac")


def _slots(arm: Arm) -> int:
    return arm.cache_slots if arm.mode != "os" else 0


def run_llama_arm(arm: Arm, mm: MoeMap, job: ArmJob) -> RoundResult:
    """One arm, one round, in llama.cpp (see the module docstring): run_ab's runner for
    --engine llama.cpp, with the signature of bench.ab.ARM_RUNNERS."""
    threshold, rnd, position, prompts, n_new = job.threshold, job.rnd, job.position, job.prompts, job.n_new
    stream = LlamaStream(arm.path, reads=arm.mode != "os", gap=arm.gap, qd=arm.io_threads,
                         cache_slots=_slots(arm), evict=not arm.warm, callback=arm.callback, mm=mm)
    try:
        quiet = wait_quiet(arm.path)  # the previous arm's readahead must not overlap this arm
        before = stream.pages.resident()
        if arm.warm:
            note = "warm arm: every page resident by design (not a cold measurement)"
            after, proven, rejected = before, False, False
        else:
            stream.make_cold()
            after = stream.pages.resident()
            proven = after <= threshold and stream.pages.mapped() <= threshold
            rejected = not proven
            note = "llama.cpp: resident share of the expert tensors' pages (mincore), unmapped from llama.cpp"
        run = stream.generate(prompts, n_new)
    finally:
        stream.close()
    n = max(len(prompts), 1)
    return RoundResult(arm.name, rnd, position, before, after, proven, rejected, run.decode_tokens, run.decode_s,
                       run.io_s, run.prefill_s / n, run.reads, run.bytes, run.useful_bytes, run.device_bytes,
                       run.hits, run.misses, run.major_faults, note, run.ops, quiet.get("inflight_at_start"),
                       quiet["waited_s"], prev_arm=job.prev_arm, generated=run.generated)


def check_same_tokens(rounds: list[RoundResult]) -> None:
    """Every arm of every round generated the same greedy tokens, or the result is refused."""
    ref = next((r for r in rounds if r.generated is not None), None)
    for r in rounds:
        if r.generated is None or r.generated == ref.generated:
            continue
        where = next((f"prompt {p}, token {i}" for p, (x, y) in enumerate(zip(ref.generated, r.generated))
                      for i, (u, v) in enumerate(zip(x, y)) if u != v), "token counts")
        raise MboltError(f"arm {r.arm} round {r.round} generated other tokens than arm {ref.arm} round {ref.round} "
                         f"(first difference at {where}): the arms do not compute the same model, refusing the result")


def llama_summary(arms: list[Arm], rounds: list[RoundResult], summary: list[dict]) -> list[dict]:
    """Add what llama.cpp runs report to run_ab's summary rows: decode tok/s, the read share s of
    decode time, and that the tokens agree (checked first: a disagreeing run is refused)."""
    check_same_tokens(rounds)
    by_arm = {a.name: a for a in arms}
    for row in summary:
        rs = [r for r in rounds if r.arm == row["arm"] and not r.rejected and r.tokens]
        if not rs:
            continue
        a = by_arm[row["arm"]]
        row["decode_tokens_per_s"] = float(np.median([r.tokens / r.wall_s for r in rs]))
        row["read_share_s"] = float(np.median([r.io_s / r.wall_s for r in rs])) if a.mode != "os" else None
        row["device_bytes_per_token"] = (float(np.median([r.device_bytes / r.tokens for r in rs]))
                                         if all(r.device_bytes is not None for r in rs) else None)
        if a.mode == "os":
            row["mb_per_s"] = None  # page faults happen inside the compute: no read time to divide by
        row["tokens_identical"] = True
        row["engine"] = "llama.cpp"
    return summary
