"""The controlled A/B harness behind `mbolt ab` (DESIGN.md, measurement protocol).

An arm is a file plus reader options. Each round runs every arm once, in an order drawn from a
seeded, carry-over-balanced design (`arm_orders`: Williams squares with shuffled labels and rows):
over a block of rounds every arm runs once in every position and follows every other arm equally
often, and no arm runs twice in a row, across round boundaries too. The orders are recorded in the
result, and position and carry-over (which arm ran before) effects are estimated from the rounds
(`order_effects`). Before every arm the file is evicted (posix_fadvise DONTNEED) and coldness is
proven with mincore; a round whose resident share exceeds the threshold is rejected, and a run
where eviction cannot be proven says so (`cold: false`). An A/A control (the first arm again, as a
separate arm) is on by default.

Speedup = the median over rounds of (baseline time / arm time) in the same round
(`median_of_ratios`); `ratio_of_medians` (baseline median time / arm median time) stands beside
it. Its 95% interval is the exact order-statistic interval of the median (binomial), and none is
given from fewer than 10 rounds.

Rounds: a fixed number (`StopRule(rounds=N)`), or adaptive (the default): many short rounds until
the A/A interval lies inside the tolerance and every treated arm's interval is narrow enough, or the
time budget ends; the result says which stopped it.

Modes (one "run this arm once" function each, `ARM_RUNNERS`):
- replay: for every held-out token and MoE layer, read exactly that token's experts through the
  store (no compute). Metric: I/O time per token (wall time of the read batches).
- decode: the reference engine generates from prompts with the store as its expert source.
  Metric: wall time per generated token (compute + I/O); TTFT is recorded.

With engine="llama.cpp" the arms run in llama.cpp instead (bench.ab_llama: explicit reads from
the eval callback, or page faults for os arms; metric: decode time per token).

What one arm leaves for the next is kept out of the timed part: Python's garbage collector is
run before and paused during the timed part (a collection of the previous arm's objects landed on
whichever arm came next), the read arena is allocated and touched before timing (no first-touch
page faults inside a timed read), the device is idle and the file evicted before the clock starts.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable
from pathlib import Path

import numpy as np

from mbolt.bench.env import environment
from mbolt.bench.env import wait_quiet
from mbolt.core.pagecache import evict_model
from mbolt.engine.pages import ExpertPages
from mbolt.engine.generate import greedy_decode
from mbolt.engine.store import ExpertStore
from mbolt.core.compat import check_compatible
from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.core.trace import Trace


@dataclass
class Arm:
    name: str
    path: str
    gap: int = 0
    io_threads: int = 1
    direct: bool = False
    mode: str = "read"  # read | os
    cache_slots: int = 0
    control_of: str = ""  # the A/A copy names the arm it repeats
    resident_frac: float | None = None  # slot-cache budget as a share of each layer's experts
    warm: bool = False  # --engine llama.cpp: keep every page resident (no eviction)
    callback: bool = False  # --engine llama.cpp, os arm: install the eval callback anyway
    asynchronous: bool = False  # --engine llama.cpp: submit the reads (WILLNEED), let the page faults wait
    pins: bool = False  # --engine llama.cpp: pin each layer's hottest experts (the route map's training heat)

    def options(self) -> dict:
        return dict(gap=self.gap, io_threads=self.io_threads, direct=self.direct, mode=self.mode,
                    cache_slots=self.cache_slots, resident_frac=self.resident_frac)


ARM_KEYS = {"gap": int, "qd": int, "io_threads": int, "direct": bool, "os": bool, "mode": str,
            "cache": int, "cache_slots": int, "frac": float, "resident_frac": float, "name": str, "warm": bool,
            "callback": bool, "async": bool, "pins": bool}


def parse_arm(spec: str, index: int, defaults: dict | None = None) -> Arm:
    """`path[:key=value,...]`, keys: name, gap, qd|io_threads, direct, os, cache|cache_slots,
    frac|resident_frac, and for --engine llama.cpp warm, callback, async, pins."""
    path, _, opts = spec.partition(":")
    kw: dict = dict(defaults or {})
    for item in filter(None, (x.strip() for x in opts.split(","))):
        k, eq, v = item.partition("=")
        if k not in ARM_KEYS:
            raise MboltError(f"arm {spec!r}: unknown option {k!r} (name, gap, qd, direct, os, cache, frac, warm, callback, async, pins)")
        typ = ARM_KEYS[k]
        try:
            val = (v.lower() not in ("0", "false", "no") if eq else True) if typ is bool else typ(v)
        except ValueError:
            raise MboltError(f"arm {spec!r}: {k} needs a {typ.__name__}, got {v!r}") from None
        k = {"qd": "io_threads", "cache": "cache_slots", "frac": "resident_frac", "async": "asynchronous"}.get(k, k)
        if k == "os":
            k, val = "mode", "os" if val else "read"
        kw[k] = val
    name = kw.pop("name", None) or Path(path).stem
    return Arm(name=name, path=path, **kw)


def default_arm_name(arm: Arm) -> str:
    bits = [Path(arm.path).stem]
    if arm.mode == "os":
        bits.append("os")
    else:
        bits.append(f"qd{arm.io_threads}")
        bits.append("direct" if arm.direct else "buffered")
        if arm.gap:
            bits.append(f"gap{arm.gap}")
    if arm.cache_slots:
        bits.append(f"cache{arm.cache_slots}")
    return "/".join(bits)


def read_pattern(mm: MoeMap, arm: Arm, layout: str) -> dict:
    """The named read pattern of an arm: what a gain measured against it transfers to."""
    layer = mm.moe_layers[0]
    ws = layer.weights
    per_expert = 1 if layout == "packed" else len(ws)
    desc = (f"{layout} layout, {per_expert} range{'s' if per_expert > 1 else ''} per expert "
            f"({'+'.join(w.role for w in ws)}), slices {'/'.join(str(w.slice_bytes) for w in ws)} B, ")
    if arm.mode == "os":
        desc += "mmap page faults (kernel readahead decides)"
    else:
        desc += ("explicit reads submitted with posix_fadvise(WILLNEED), not waited for (page faults wait), "
                 if arm.asynchronous else
                 f"explicit preadv, QD{arm.io_threads}, {'O_DIRECT' if arm.direct else 'buffered (no readahead)'}, ")
        desc += f"merge gap {arm.gap} B"
    if arm.warm:
        desc += ", warm (every page resident)" + (", eval callback installed" if arm.callback else "")
    if arm.pins:
        desc += ", hottest experts pinned (route map heat)"
    if arm.cache_slots or arm.resident_frac:
        desc += (f", {arm.cache_slots} cache slots/layer" if arm.resident_frac is None
                 else f", slot cache {100 * arm.resident_frac:.0f}% of each layer's experts")
    return {"description": desc, "layout": layout, "ranges_per_expert": per_expert,
            "slice_bytes": [w.slice_bytes for w in ws], "queue_depth": arm.io_threads,
            "direct": arm.direct, "mode": arm.mode, "gap": arm.gap, "cache_slots": arm.cache_slots}


def bootstrap_ci(x: np.ndarray, n: int = 4000, seed: int = 0, stat=np.median) -> tuple[float, float]:
    """Percentile bootstrap 95% CI of `stat` over per-round values."""
    x = np.asarray(x, float)
    if x.size == 0:
        return (float("nan"), float("nan"))
    if x.size == 1:
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n, x.size))
    s = stat(x[idx], axis=1)
    return float(np.percentile(s, 2.5)), float(np.percentile(s, 97.5))


# ---- intervals ----

MIN_CI_ROUNDS = 10  # fewer rounds than this: no interval at all (3 rounds' min..max is not a CI)
CI_METHOD = "exact order-statistic interval of the median (binomial, coverage >= 95%)"


def median_ci(x, conf: float = 0.95, min_n: int = MIN_CI_ROUNDS) -> tuple[float, float] | None:
    """Distribution-free interval of the median: [x_(k), x_(n+1-k)] with the largest k such that
    P(Binomial(n, 1/2) <= k-1) <= (1-conf)/2, so it covers the true median with probability >=
    conf for any continuous distribution. None below `min_n` values."""
    v = np.sort(np.asarray(x, float))
    n = v.size
    if n < max(min_n, 1):
        return None
    from scipy.stats import binom

    alpha = (1.0 - conf) / 2
    # k = number of j in 0..n/2 with P(B <= j) <= alpha (binom.cdf is monotone in j)
    k = int(np.sum(binom.cdf(np.arange(n // 2 + 1), n, 0.5) <= alpha))
    if k == 0:
        return None
    return float(v[k - 1]), float(v[n - k])


def ci_note(n: int) -> str:
    return "" if n >= MIN_CI_ROUNDS else f"no interval: {n} rounds (an interval needs at least {MIN_CI_ROUNDS})"


# ---- design: the arm order of every round ----


def williams_rows(n: int) -> list[list[int]]:
    """Williams' carry-over-balanced Latin square: every item once per position, and every ordered
    pair (a, b) adjacent equally often (n rows for even n, 2n for odd n)."""
    if n <= 2:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    for j in range(1, n):
        if j % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [r[::-1] for r in rows]
    return rows


def arm_orders(n_arms: int, n_rounds: int, seed: int = 0) -> list[list[int]]:
    """The arm order (indices) of each round: blocks of a Williams square with randomly relabelled
    arms and shuffled rows, so that no arm runs twice in a row, across round and block boundaries
    too. Seeded: the same (n_arms, seed) always gives the same sequence, and a longer run extends
    a shorter one (so adaptive stopping keeps the prefix)."""
    out: list[list[int]] = []
    gen = order_blocks(n_arms, seed)
    while len(out) < n_rounds:
        out += next(gen)
    return out[:n_rounds]


def order_blocks(n_arms: int, seed: int = 0):
    """Yield blocks (lists of rows) of `arm_orders`."""
    rng = np.random.default_rng(seed)
    base = williams_rows(n_arms)
    prev = None
    while True:
        if n_arms == 1:
            yield [[0]]
            continue
        if n_arms == 2:  # only A B A B ... avoids repeats: keep the orientation after the first
            row = [0, 1] if prev is None and rng.random() < 0.5 else [1, 0] if prev is None else \
                ([0, 1] if prev == 1 else [1, 0])
            prev = row[-1]
            yield [row]
            continue
        for _ in range(1000):
            sigma = rng.permutation(n_arms)
            rows = [[int(sigma[x]) for x in base[i]] for i in rng.permutation(len(base))]
            seq = [prev] + [x for r in rows for x in r]
            if all(a != b for a, b in zip(seq, seq[1:])):
                break
        else:  # pragma: no cover - a valid shuffle exists for n >= 3 and is found long before
            raise MboltError(f"could not draw an arm order without repeats for {n_arms} arms")
        prev = rows[-1][-1]
        yield rows


def design_block(n_arms: int) -> int:
    """Rounds per balanced block of `arm_orders`."""
    return len(williams_rows(n_arms)) if n_arms >= 3 else 1


# ---- rounds ----


@dataclass
class RoundResult:
    arm: str
    round: int
    position: int  # order within the round
    resident_before: float
    resident_after: float
    cold_proven: bool
    rejected: bool
    tokens: int
    wall_s: float
    io_s: float
    ttft_s: float
    reads: int
    bytes: int
    useful_bytes: int
    device_bytes: int | None
    hits: int
    misses: int
    major_faults: int  # os arms: the faults the store caused; decode: every major fault of the timed part
    note: str = ""
    ops: int = 0
    inflight_before: int | None = None  # device I/O in flight when the arm was about to start
    settle_s: float = 0.0  # time waited for it to drain
    prev_arm: str | None = None  # the arm that ran just before (carry-over), None for the first run
    drop_s: float = 0.0  # time the store spent dropping the pages it read (outside io_s, inside wall_s)
    generated: list | None = None  # --engine llama.cpp: greedy tokens per prompt (must agree across arms)
    peak_bytes: int | None = None  # --ram: the memory cgroup's peak charge (page cache included)


@dataclass
class StopRule:
    """When a run stops. `rounds` set: exactly that many. Otherwise adaptive: at every check point
    (each `check_every` rounds, default one balanced block) from `min_rounds` on, stop once the
    A/A interval lies inside the tolerance and every treated arm's interval half-width is at most
    `precision` of its median; stop anyway at `max_rounds` or when `time_budget_s` is (about to be)
    spent."""
    rounds: int | None = None
    min_rounds: int = 12
    max_rounds: int = 400
    time_budget_s: float = 600.0
    precision: float = 0.05
    check_every: int = 0
    budget_at_checks: bool = True  # stop for time only at a check point (whole blocks stay balanced), when one
    # more check interval would overrun the budget; False: right after the round in which it was spent


@dataclass
class AbResult:
    name: str
    mode: str
    arms: list[dict]
    rounds: list[RoundResult]
    summary: list[dict]
    flags: list[str]
    cold: bool
    environment: dict
    trace: dict
    metric: str
    baseline: str
    prereg: dict | None = None
    prediction: list[dict] | None = None
    notes: list[str] = field(default_factory=list)
    design: dict = field(default_factory=dict)
    stop: dict = field(default_factory=dict)
    effects: dict = field(default_factory=dict)
    speedup_definition: str = ""
    non_io: dict = field(default_factory=dict)
    engine: str = "reference"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rounds"] = [asdict(r) for r in self.rounds]
        if self.arms:
            d["baseline_read_pattern"] = self.arms[0]["read_pattern"]["description"]
        return d


FORCED_PREFILL = 8  # teacher forcing: prompt tokens prefilled before the fed ones (issue 19)
SPEEDUP_DEFINITION = "median over rounds of (baseline time per token / arm time per token) in the same round"


# ---- checks ----


def check_same_model(arms: list[Arm]) -> dict[str, tuple[MoeMap, str]]:
    """Every arm must be the same model: source fingerprints through the route map agree."""

    out = {}
    ref = None
    for a in arms:
        if not Path(a.path).exists():
            raise MboltError(f"{a.path}: no such file")
        mm = moe_map(a.path)
        rm = mm.route_map
        fp = rm.source_fingerprint
        if ref is None:
            ref = (a, fp, mm)
        elif fp != ref[1]:
            raise MboltError(f"{a.path} is not the same model as {ref[0].path} (source fingerprint {fp[:12]} vs "
                             f"{ref[1][:12]}): refusing to compare them")
        elif (mm.n_layers, mm.n_experts) != (ref[2].n_layers, ref[2].n_experts):
            raise MboltError(f"{a.path}: shape differs from {ref[0].path}")
        out[a.path] = (mm, rm.layout)
    return out


# ---- one arm, one round ----


@dataclass
class ArmJob:
    """What one arm does in one round (the same for every arm of the round)."""
    rnd: int
    position: int
    threshold: float
    trace: Trace | None = None  # replay: this round's tokens
    prompts: list | None = None  # decode
    n_new: int = 0
    prev_arm: str | None = None
    ram: int = 0  # --engine llama.cpp: run the arm as a process inside a memory cgroup of this many bytes
    forced: int = 0  # teacher forcing: prefill this many tokens of each prompt, then feed its next tokens


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
    from mbolt.engine import load_model

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


# ---- summaries ----


def per_round_ratios(rounds: list[RoundResult], base: str, arm: str, metric: str) -> dict[int, float]:
    """Per round: baseline time per token / arm time per token (valid rounds of both only)."""
    by = {(r.arm, r.round): r for r in rounds if not r.rejected and r.tokens}
    out = {}
    for (name, k), x in by.items():
        b = by.get((base, k))
        if name == arm and b is not None and getattr(x, metric) > 0:
            out[k] = (getattr(b, metric) / b.tokens) / (getattr(x, metric) / x.tokens)
    return dict(sorted(out.items()))


def summarise(arms: list[Arm], rounds: list[RoundResult], metric: str, seed: int = 0) -> list[dict]:
    base = arms[0].name
    ok = [r for r in rounds if not r.rejected]
    out = []
    base_rs = [r for r in ok if r.arm == base and r.tokens]
    base_med = float(np.median([getattr(r, metric) / r.tokens for r in base_rs])) if base_rs else None
    for a in arms:
        rs = [r for r in ok if r.arm == a.name and r.tokens]
        if not rs:
            out.append({"arm": a.name, "rounds": 0, "speedup_vs_baseline_median": None, "speedup_ci95": None,
                        "median_of_ratios": None, "ratio_of_medians": None})
            continue
        tok = np.array([r.tokens for r in rs], float)
        val = np.array([getattr(r, metric) for r in rs]) / tok
        ratios = np.array(list(per_round_ratios(rounds, base, a.name, metric).values()))
        io = np.array([r.io_s for r in rs])
        by_ = np.array([r.bytes for r in rs], float)
        dev = [r.device_bytes for r in rs if r.device_bytes is not None]
        ci = median_ci(ratios)
        med_ratio = float(np.median(ratios)) if ratios.size else None
        out.append({
            "arm": a.name,
            "rounds": len(rs),
            f"{metric}_per_token_ms_median": float(np.median(val) * 1e3),
            "io_ms_per_token_median": float(np.median(io / tok) * 1e3),
            "wall_ms_per_token_median": float(np.median([r.wall_s / r.tokens for r in rs]) * 1e3),
            "non_io_ms_per_token_median": float(np.median([(r.wall_s - r.io_s) / r.tokens for r in rs]) * 1e3),
            "drop_ms_per_token_median": float(np.median([r.drop_s / r.tokens for r in rs]) * 1e3),
            "reads_per_token": float(np.median([r.reads / r.tokens for r in rs])),
            "mb_per_token": float(np.median(by_ / tok) / 1e6),
            "device_mb_per_token": float(np.median(np.array(dev) / tok[: len(dev)]) / 1e6) if dev else None,
            "mb_per_s": float(np.median(by_ / np.maximum(io, 1e-12)) / 1e6),
            "tokens_per_s": float(np.median([r.tokens / r.wall_s for r in rs])),
            "ttft_ms_median": float(np.median([r.ttft_s for r in rs]) * 1e3),
            "hit_rate": float(np.median([r.hits / max(r.hits + r.misses, 1) for r in rs])),
            "resident_max": float(max(r.resident_after for r in rs)),
            "median_of_ratios": med_ratio,
            "ratio_of_medians": base_med / float(np.median(val)) if base_med and np.median(val) > 0 else None,
            "speedup_vs_baseline_median": med_ratio,  # = median_of_ratios, the speedup of every table
            "speedup_ci95": list(ci) if ci else None,
            "ci_method": CI_METHOD,
            "ci_note": ci_note(ratios.size),
            "per_round_speedup": ratios.tolist(),
        })
    return out


def _deviation_columns(values: list, levels: list) -> np.ndarray:
    """Sum-to-zero (deviation) coding: one column per level but the last, which gets -1 everywhere;
    each coefficient is then that level's difference from the mean over levels."""
    X = np.zeros((len(values), max(len(levels) - 1, 0)))
    pos = {v: i for i, v in enumerate(levels)}
    for i, v in enumerate(values):
        j = pos[v]
        if j == len(levels) - 1:
            X[i, :] = -1.0
        else:
            X[i, j] = 1.0
    return X


def order_effects(rounds: list[RoundResult], metric: str) -> dict:
    """Position and carry-over effects, fitted together with arm and round (token slice) effects:

        log(time per token) = mean + arm + round + position + previous arm + noise

    (deviation coding: each effect is a level's difference from the mean over its levels, in %).
    A well-balanced design has effects near zero; a large one names what to suspect."""
    ok = [r for r in rounds if not r.rejected and r.tokens and getattr(r, metric) > 0 and r.prev_arm is not None]
    if len(ok) < 4:
        return {"estimable": False, "note": f"{len(ok)} usable arm-rounds: too few to estimate order effects"}
    y = np.log([getattr(r, metric) / r.tokens for r in ok])
    factors = {k: [getattr(r, attr) for r in ok] for k, attr in
               (("arm", "arm"), ("round", "round"), ("position", "position"), ("prev_arm", "prev_arm"))}
    levels = {k: sorted(set(v), key=str) for k, v in factors.items()}
    blocks = [np.ones((len(ok), 1))] + [_deviation_columns(factors[k], levels[k]) for k in factors]
    X = np.hstack(blocks)
    rank = np.linalg.matrix_rank(X)
    if rank < X.shape[1] or len(ok) <= X.shape[1]:
        return {"estimable": False, "n": len(ok), "parameters": int(X.shape[1]), "rank": int(rank),
                "note": "position and carry-over are confounded with the arms in this design (too few arms or "
                        "rounds): not estimable"}
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    dof = len(ok) - X.shape[1]
    sigma2 = float(resid @ resid / dof)
    cov = sigma2 * np.linalg.inv(X.T @ X)
    out = {"estimable": True, "n": len(ok), "parameters": int(X.shape[1]),
           "residual_sd_pct": float(100 * np.sqrt(sigma2)),
           "model": "log(time/token) = mean + arm + round + position + previous arm (deviation coding); "
                    "*_se_pct: standard errors"}
    col = 1
    for k in factors:
        L = levels[k]
        m = len(L) - 1
        if k in ("position", "prev_arm"):
            # each level's effect as a contrast of the coefficients (the last level: minus their sum)
            C = np.zeros((len(L), X.shape[1]))
            C[:m, col:col + m] = np.eye(m)
            C[m, col:col + m] = -1.0
            eff = C @ beta
            se = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", C, cov, C), 0.0))
            name = "carryover" if k == "prev_arm" else k
            out[f"{name}_pct"] = {str(lv): float(100 * (np.exp(e) - 1)) for lv, e in zip(L, eff)}
            out[f"{name}_se_pct"] = {str(lv): float(100 * v) for lv, v in zip(L, se)}
            out[f"{name}_log"] = {str(lv): (float(e), float(v)) for lv, e, v in zip(L, eff, se)}
        col += m
    big = [(k, lv, e, v) for k in ("position", "carryover") for lv, (e, v) in out.pop(f"{k}_log").items()]
    out["largest_pct"] = float(max(100 * abs(np.exp(e) - 1) for _, _, e, _ in big))
    # "significant": more than twice its standard error away from zero
    out["significant"] = [f"{k} {lv}: {100 * (np.exp(e) - 1):+.1f}% (se {100 * v:.1f}%)"
                          for k, lv, e, v in sorted(big, key=lambda t: -abs(t[2])) if abs(e) > 2 * v]
    return out


def non_io_per_read(rounds: list[RoundResult]) -> dict:
    """Time outside the timed reads, per token, against reads per token over every valid
    arm-round: (wall - io)/token = fixed + per_read * reads/token, least squares. In replay the
    store's bookkeeping around the reads (merging, job lists, dropping pages) is what is left
    outside io_s; a per-read slope is what a layout with fewer reads also saves outside I/O (the
    non-I/O term of `predict.decode_law`)."""
    ok = [r for r in rounds if not r.rejected and r.tokens]
    x = np.array([r.reads / r.tokens for r in ok], float)
    y = np.array([(r.wall_s - r.io_s) / r.tokens for r in ok], float)
    if len(ok) < 3 or np.ptp(x) == 0:
        return {"estimable": False, "note": "needs arms that differ in reads per token"}
    X = np.stack([np.ones_like(x), x], axis=1)
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    cov = float(resid @ resid / max(len(ok) - 2, 1)) * np.linalg.inv(X.T @ X)
    return {"estimable": True, "per_read_us": float(beta[1] * 1e6), "per_read_se_us": float(np.sqrt(cov[1, 1]) * 1e6),
            "fixed_ms_per_token": float(beta[0] * 1e3), "n": len(ok),
            "model": "(wall_s - io_s)/token = fixed + per_read * reads/token"}


def flag_identical(arms: list[Arm], rounds: list[RoundResult], layouts: dict[str, str], perms: dict[str, bytes]) -> list[str]:
    """Arms that should differ in what they read but report identical counters."""
    flags = []
    counters = {}
    for a in arms:
        rs = sorted((r for r in rounds if r.arm == a.name), key=lambda r: r.round)
        counters[a.name] = tuple((r.reads, r.bytes, r.hits) for r in rs)
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            if a.control_of == b.name or b.control_of == a.name:
                if counters[a.name] != counters[b.name] and a.mode != "os":
                    flags.append(f"A/A control {a.name} vs {b.name}: counters differ (the same arm is not deterministic)")
                continue
            same_file_pattern = perms.get(a.path) == perms.get(b.path) and layouts.get(a.path) == layouts.get(b.path)
            same_reader = (a.gap, a.direct, a.mode, a.cache_slots, a.resident_frac) == \
                (b.gap, b.direct, b.mode, b.cache_slots, b.resident_frac)
            if counters[a.name] == counters[b.name] and not (same_file_pattern and same_reader) and a.mode != "os":
                flags.append(f"{a.name} and {b.name} should read differently but report identical counters "
                             f"(same code ran twice?)")
            if a.path == b.path and a.options() == b.options() and (a.warm, a.callback) == (b.warm, b.callback):
                flags.append(f"{a.name} and {b.name} are the same arm (same file, same options)")
    return flags


AA_TOLERANCE = 0.03  # DESIGN.md: an A/A control (same file, same options) lands within +-3%


def aa_row(summary: list[dict]) -> dict | None:
    """The A/A control's summary row (None when the run had none or it has no valid rounds)."""
    return next((s for s in summary if s["arm"].endswith("(A/A)")
                 and s.get("speedup_vs_baseline_median") is not None), None)


def aa_ok(summary: list[dict], tolerance: float = AA_TOLERANCE) -> bool | None:
    """Whether the A/A control's median landed within the tolerance (None: no A/A control)."""
    aa = aa_row(summary)
    return None if aa is None else abs(aa["speedup_vs_baseline_median"] - 1.0) <= tolerance


def converged(summary: list[dict], baseline: str, precision: float, aa_tolerance: float = AA_TOLERANCE) -> str | None:
    """Why the run may stop (None: not yet): the A/A interval lies inside 1 +- tolerance and every
    treated arm's interval half-width is at most `precision` of its median."""
    why = []
    aa = next((s for s in summary if s["arm"].endswith("(A/A)")), None)
    if aa is not None:
        ci = aa.get("speedup_ci95")
        if ci is None or ci[0] < 1 - aa_tolerance or ci[1] > 1 + aa_tolerance:
            return None
        why.append(f"A/A interval {ci[0]:.3f}-{ci[1]:.3f} inside 1+-{aa_tolerance:g}")
    for s in summary:
        if s["arm"] == baseline or s is aa:
            continue
        ci, med = s.get("speedup_ci95"), s.get("median_of_ratios")
        if ci is None or not med or (ci[1] - ci[0]) / 2 > precision * med:
            return None
    why.append(f"every treated arm's interval half-width <= {100 * precision:g}% of its median")
    return "; ".join(why)


def stop_check(summary: list[dict], baseline: str, rounds_done: int, elapsed_s: float, rule: StopRule,
               block: int, aa_tolerance: float = AA_TOLERANCE) -> tuple[str, str] | None:
    """(reason, detail) when the run should stop after `rounds_done` rounds, else None.

    Fixed: after `rule.rounds`. Adaptive: the time budget after any round (with
    `budget_at_checks`: at a check point, when one more check interval would overrun it); at a
    check point (every `check_every` rounds, default one balanced block, from `min_rounds` on)
    convergence (`converged`); `max_rounds`."""
    if rule.rounds is not None:
        return ("fixed rounds", f"{rule.rounds} rounds as asked") if rounds_done >= rule.rounds else None
    budget = ("time budget", f"time budget of {rule.time_budget_s:.0f} s spent after {rounds_done} rounds "
                             "without converging")
    if elapsed_s >= rule.time_budget_s and not rule.budget_at_checks:
        return budget
    every = rule.check_every or block
    if rounds_done < rule.min_rounds or rounds_done % every:
        return None if rule.budget_at_checks or rounds_done < rule.max_rounds else \
            ("max rounds", f"{rule.max_rounds} rounds without converging")
    why = converged(summary, baseline, rule.precision, aa_tolerance)
    if why:
        return ("converged", f"after {rounds_done} rounds: {why}")
    if rounds_done >= rule.max_rounds:
        return ("max rounds", f"{rule.max_rounds} rounds without converging")
    if rule.budget_at_checks and elapsed_s + elapsed_s / rounds_done * every > rule.time_budget_s:
        return budget
    return None


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


def run_ab(arms: list[Arm], *, trace: Trace | None = None, mode: str = "replay", rounds: int | None = None,
           threshold: float = 0.01, aa: bool = True, name: str = "ab", prompts=None, n_new: int = 16,
           seed: int = 0, progress=None, prereg: dict | None = None, trace_path: str = "",
           tokens_per_round: int = 0, aa_tolerance: float = AA_TOLERANCE, stop: StopRule | None = None,
           host_cache: dict | None = None, engine: str = "reference", ram: int = 0, forced: int = 0) -> AbResult:
    """Run every arm once per round, in the orders of `arm_orders(seed)`, until the stop rule says
    so (see the module docstring). `rounds` is a shortcut for StopRule(rounds=rounds).

    `tokens_per_round` > 0 (replay): round r replays the next slice of that many held-out tokens
    (cycling), so many short rounds spread the neighbours' bursts of I/O over all arms; every
    arm of a round reads the same tokens. 0: every round replays the whole trace.
    `host_cache`: a `probe.host_cache` result to record in the environment (measured when None).
    `engine` "llama.cpp" (decode only): each arm runs in llama.cpp (bench.ab_llama.run_llama_arm).
    `ram` > 0 (llama.cpp): each arm-round is a fresh process inside a memory cgroup of that many
    bytes; `forced` > 0: teacher forcing after that many prompt tokens (llama.cpp).
    """
    if len(arms) < 1:
        raise MboltError("ab needs at least one arm")
    if mode not in ARM_RUNNERS:
        raise MboltError(f"mode must be one of {', '.join(ARM_RUNNERS)}, not {mode!r}")
    if mode == "replay" and trace is None:
        raise MboltError("replay mode needs --replay held.mbtrace")
    if mode == "decode" and not prompts:
        raise MboltError("decode mode needs prompts")
    rule = stop or StopRule()
    if rounds is not None:
        rule = replace(rule, rounds=int(rounds))
    if rule.rounds is not None and rule.rounds < 1:
        raise MboltError(f"--rounds must be at least 1, got {rule.rounds}")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        # make names unique
        for i, a in enumerate(arms):
            a.name = default_arm_name(a) if names.count(a.name) > 1 else a.name
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            arms = [replace(a, name=f"{a.name}#{i}") for i, a in enumerate(arms)]
    if aa:
        arms = list(arms) + [replace(arms[0], name=f"{arms[0].name} (A/A)", control_of=arms[0].name)]
    info = check_same_model(arms)
    mm0 = info[arms[0].path][0]
    runner = ARM_RUNNERS[mode]
    if engine == "llama.cpp":
        from mbolt.bench.ab_llama import check_llama_arms, run_llama_arm

        check_llama_arms(arms, info, mode)
        runner = run_llama_arm
    elif engine != "reference":
        raise MboltError(f"engine must be reference or llama.cpp, not {engine!r}")
    elif ram or forced:
        raise MboltError("--ram and --forced run arms in llama.cpp: add --engine llama.cpp")
    elif any(a.warm or a.callback or a.asynchronous or a.pins for a in arms):
        raise MboltError("arm options warm, callback, async and pins are for --engine llama.cpp")
    if trace is not None:
        check_compatible(trace, mm0, trace_path or "trace")
    layouts = {p: lay for p, (m, lay) in info.items()}
    perms = {p: m.route_map.perm.tobytes() for p, (m, _) in info.items()}
    env = environment(arms[0].path)
    env["host_cache"] = host_cache if host_cache is not None else host_cache_of(arms[0].path)
    env["readahead_kb"] = env["block"].get("read_ahead_kb")
    env["memory_limit_bytes"] = int(ram) if ram else None
    env["teacher_forced"] = int(forced)
    results: list[RoundResult] = []
    metric = MODE_METRIC.get(mode, "wall_s")
    block = design_block(len(arms))
    total = rule.rounds * len(arms) if rule.rounds is not None else None
    blocks = order_blocks(len(arms), seed)
    orders: list[list[int]] = []
    prev = None
    done = 0
    t_start = time.perf_counter()
    stopped = None
    r = 0
    while stopped is None:
        if r >= len(orders):
            orders += next(blocks)
        order = orders[r]
        tr_r = round_tokens(trace, r, tokens_per_round) if trace is not None else None
        for pos, i in enumerate(order):
            a = arms[i]
            job = ArmJob(r, pos, threshold, tr_r, prompts, n_new, prev, ram, forced)
            res = runner(a, info[a.path][0], job)
            results.append(res)
            prev = a.name
            done += 1
            if progress:
                progress(done, total, res)
        r += 1
        summary = summarise(arms, results, metric, seed) if rule.rounds is None else []
        stopped = stop_check(summary, arms[0].name, r, time.perf_counter() - t_start, rule, block, aa_tolerance)
    elapsed = time.perf_counter() - t_start
    flags = flag_identical(arms, results, layouts, perms)
    rejected = [x for x in results if x.rejected]
    if rejected:
        flags.append(f"{len(rejected)} arm-rounds rejected: resident share above {100 * threshold:.1f}% after eviction")
    cold = all(x.cold_proven for x in results)
    notes = []
    if not cold:
        bad = next(x for x in results if not x.cold_proven)
        notes.append(f"eviction could not be proven ({bad.note}): this run is NOT cold")
    summary = summarise(arms, results, metric, seed)
    if engine == "llama.cpp":
        from mbolt.bench.ab_llama import llama_summary

        summary = llama_summary(arms, results, summary)  # refuses arms that generated other tokens
    if r < MIN_CI_ROUNDS:
        notes.append(f"{r} rounds: no confidence intervals (they need at least {MIN_CI_ROUNDS} rounds)")
    if r % block:
        notes.append(f"{r} rounds is not a whole number of balanced blocks ({block} rounds each): positions and "
                     "neighbours are balanced only approximately")
    aa_s = aa_row(summary)
    if aa_s is not None:
        dev = aa_s["speedup_vs_baseline_median"] - 1.0
        if abs(dev) > aa_tolerance:
            flags.append(f"A/A control off by {100 * dev:+.1f}% (tolerance {100 * aa_tolerance:.0f}%): differences "
                         f"between arms of this run smaller than the noise are not evidence")
    effects = order_effects(results, metric)
    if effects.get("estimable"):
        big = [x for x in effects["significant"] if abs(float(x.split(": ")[1].split("%")[0])) > 100 * aa_tolerance]
        if big:
            notes.append(f"order effects beyond twice their standard error: {'; '.join(big)} (the balanced design "
                         "cancels them in the speedups, but they add noise to every arm)")
    arm_dicts = []
    for a in arms:
        mm, lay = info[a.path]
        rm = mm.route_map
        arm_dicts.append({**asdict(a), "layout": lay, "plan_method": rm.method, "fingerprint": mm.fingerprint,
                          "file_size": mm.header.file_size, "read_pattern": read_pattern(mm, a, lay)})
    tinfo = {}
    if trace is not None:
        tinfo = {"path": trace_path, "tokens": trace.n_tokens, "n_layers": trace.n_layers,
                 "n_experts": trace.n_experts, "k": trace.k, "fingerprint": trace.fingerprint}
    if tokens_per_round:
        tinfo["tokens_per_round"] = int(tokens_per_round)
    design = {"kind": "williams" if len(arms) >= 3 else "alternating" if len(arms) == 2 else "single arm",
              "seed": int(seed), "block_rounds": block,
              "orders": [[arms[i].name for i in o] for o in orders[:r]],
              "note": ("blocks of a Williams square (every arm once per position, every ordered pair of arms "
                       "adjacent equally often), arms relabelled and rows shuffled per block, no arm twice in a row")
              if len(arms) >= 3 else "two arms: A B A B ... (no repeats; positions cannot also be balanced)"}
    stop_d = {"reason": stopped[0], "detail": stopped[1], "rounds": r, "elapsed_s": round(elapsed, 2),
              "rule": asdict(rule)}
    return AbResult(name, mode, arm_dicts, results, summary, flags, cold, env, tinfo,
                    metric, arms[0].name, prereg, None, notes, design, stop_d, effects, SPEEDUP_DEFINITION,
                    non_io_per_read(results), engine)


# ---- pre-registration ----


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_result(path: str | os.PathLike, result: AbResult) -> Path:
    from mbolt.core.atomic import json_default, stored_path, write_text_atomic

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    d = result.to_dict()
    # file paths relative to the result file: it reads the same from any directory
    for a in d["arms"]:
        a["path"] = stored_path(a["path"], p)
    if d["trace"].get("path"):
        d["trace"]["path"] = stored_path(d["trace"]["path"], p)
    write_text_atomic(p, json.dumps(d, indent=1, default=json_default) + "\n")
    return p


def load_prompt_ids(model_path: str, prompts_path=None, n: int = 2, engine: str = "reference",
                    forced: int = 0, n_new: int = 0) -> list[list[int]]:
    """Token ids of the first `n` prompts (the tracer's prompt files: jsonl or text lines).

    engine "llama.cpp": llama.cpp's own tokenizer (every vocabulary it loads; any shard of a set),
    whole prompts. The reference engine: mbolt's tokenizer, prompts cut to 64 tokens (its decode
    A/B prefills them; the cut is said in the result's notes by the caller).
    forced > 0 (teacher forcing): without a prompt file, the built-in text (mbolt/data/kl_text.txt)
    cut into `n` passages; every prompt must hold forced + n_new tokens."""
    from mbolt.core.prompts import forced_texts, prompt_texts

    texts = forced_texts(prompts_path, n) if forced else prompt_texts(prompts_path, n)
    if engine == "llama.cpp":
        from mbolt.engine.llama.runner import LlamaRunner

        with LlamaRunner(model_path, vocab_only=True) as r:
            out = [r.tokenize(t, add_special=True) for t in texts[:n]]
    else:
        from mbolt.core.header import read_header
        from mbolt.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_header(read_header(model_path))
        out = [tok.encode(t)[:64] for t in texts[:n]]
    if not out or not all(out):
        raise MboltError("decode: no usable prompts")
    for i, ids in enumerate(out):
        if forced and len(ids) < forced + n_new:
            raise MboltError(f"prompt {i} has {len(ids)} tokens; teacher forcing needs {forced} + --new-tokens "
                             f"{n_new}: give longer texts (--prompts) or fewer --new-tokens")
    return out
