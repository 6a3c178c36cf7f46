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

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mbolt.bench.arms import Arm, ArmJob, RoundResult, check_same_model, default_arm_name, read_pattern
from mbolt.bench.design import design_block, order_blocks
from mbolt.bench.env import environment
from mbolt.bench.runners import ARM_RUNNERS, MODE_METRIC, host_cache_of, round_tokens
from mbolt.bench.stats import (AA_TOLERANCE, MIN_CI_ROUNDS, StopRule, aa_row, flag_identical, non_io_per_read,
                               order_effects, stop_check, summarise)
from mbolt.core.compat import check_compatible
from mbolt.core.errors import MboltError
from mbolt.core.trace import Trace


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


def run_ab(arms: list[Arm], *, trace: Trace | None = None, mode: str = "replay", rounds: int | None = None,
           threshold: float = 0.01, aa: bool = True, name: str = "ab", prompts=None, n_new: int = 16,
           seed: int = 0, progress=None, prereg: dict | None = None, trace_path: str = "",
           tokens_per_round: int = 0, aa_tolerance: float = AA_TOLERANCE, stop: StopRule | None = None,
           host_cache: dict | None = None, engine: str = "reference", ram: int = 0, forced: int = 0,
           followup: int = 0, n_ctx: int | None = None, n_ubatch: int = 0, drive: str = "") -> AbResult:
    """Run every arm once per round, in the orders of `arm_orders(seed)`, until the stop rule says
    so (see the module docstring). `rounds` is a shortcut for StopRule(rounds=rounds).

    `tokens_per_round` > 0 (replay): round r replays the next slice of that many held-out tokens
    (cycling), so many short rounds spread the neighbours' bursts of I/O over all arms; every
    arm of a round reads the same tokens. 0: every round replays the whole trace.
    `host_cache`: a `probe.host_cache` result to record in the environment (measured when None).
    `engine` "llama.cpp" (decode only): each arm runs in llama.cpp (bench.ab_llama.run_llama_arm).
    `ram` > 0 (llama.cpp): each arm-round is a fresh process inside a memory cgroup of that many
    bytes; `forced` > 0: teacher forcing after that many prompt tokens (llama.cpp); `followup` > 0: a
    session, the next that many tokens of the text fed as one more turn after the decode steps (its
    time to first token recorded); `n_ctx`, `n_ubatch`: llama.cpp's context size and prompt pass;
    `drive` (with `ram`): a drive profile (core.blkio) capping each arm's reads once its model has loaded.
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

        check_llama_arms(arms, info, mode, ram, drive)
        for a in arms:
            if a.parallel < 1 or len(prompts) % a.parallel:
                raise MboltError(f"arm {a.name}: parallel={a.parallel} decodes the prompts that many at a time: "
                                 f"give --n-prompts a multiple of it (now {len(prompts)})")
        runner = run_llama_arm
    elif engine != "reference":
        raise MboltError(f"engine must be reference or llama.cpp, not {engine!r}")
    elif ram or forced or followup:
        raise MboltError("--ram, --forced and --followup-tokens run arms in llama.cpp: add --engine llama.cpp")
    elif any(a.warm or a.callback or a.asynchronous or a.pins or a.n_ubatch or a.user or a.parallel != 1 for a in arms):
        raise MboltError("arm options warm, callback, async, pins, ubatch, user and parallel are for --engine llama.cpp")
    if trace is not None:
        check_compatible(trace, mm0, trace_path or "trace")
    layouts = {p: lay for p, (m, lay) in info.items()}
    perms = {p: m.route_map.perm.tobytes() for p, (m, _) in info.items()}
    env = environment(arms[0].path)
    env["host_cache"] = host_cache if host_cache is not None else host_cache_of(arms[0].path)
    env["readahead_kb"] = env["block"].get("read_ahead_kb")
    env["memory_limit_bytes"] = int(ram) if ram else None
    env["teacher_forced"] = int(forced)
    if engine == "llama.cpp":
        from mbolt.runtime.memory import DEFAULT_UBATCH, STREAM_UBATCH

        default = f"each arm's default ({STREAM_UBATCH} with reads, else {DEFAULT_UBATCH})"
        env["llama"] = {"n_ctx": n_ctx, "n_ubatch": int(n_ubatch) or default, "flash_attn": "on (every arm)",
                        "followup_tokens": int(followup), "repacking": "off (every arm)"}
        env["drive"] = drive or "this VM's disk as it is"
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
            job = ArmJob(r, pos, threshold, tr_r, prompts, n_new, prev, ram, forced, followup=followup, n_ctx=n_ctx,
                         n_ubatch=n_ubatch, drive=drive)
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


def _tokenize(model_path: str, texts: list[str], engine: str) -> list[list[int]]:
    if engine == "llama.cpp":
        from mbolt.runtime.runner import LlamaRunner

        with LlamaRunner(model_path, vocab_only=True) as r:
            return [r.tokenize(t, add_special=True) for t in texts]
    from mbolt.core.header import read_header
    from mbolt.reference.tokenizer import Tokenizer

    tok = Tokenizer.from_header(read_header(model_path))
    return [tok.encode(t)[:64] for t in texts]


def load_prompt_ids(model_path: str, prompts_path=None, n: int = 2, engine: str = "reference",
                    forced: int = 0, n_new: int = 0, followup: int = 0) -> list[list[int]]:
    """Token ids of the first `n` prompts (the tracer's prompt files: jsonl or text lines).

    engine "llama.cpp": llama.cpp's own tokenizer (every vocabulary it loads; any shard of a set),
    whole prompts. The reference engine: mbolt's tokenizer, prompts cut to 64 tokens (its decode
    A/B prefills them; the cut is said in the result's notes by the caller).
    forced > 0 (teacher forcing): without a prompt file, the built-in text (mbolt/data/kl_text.txt)
    cut into `n` passages, or for passages longer than it holds (sessions) the held-out prompts of
    mbolt/data/prompts.jsonl joined (`session_texts`); every prompt must hold forced + n_new +
    followup tokens."""
    from mbolt.core.prompts import forced_texts, prompt_texts, session_texts

    need = forced + n_new + followup
    texts = forced_texts(prompts_path, n) if forced else prompt_texts(prompts_path, n)
    out = _tokenize(model_path, texts[:n], engine)
    if forced and prompts_path is None and any(len(ids) < need for ids in out):
        out = _tokenize(model_path, session_texts(n), engine)  # passages longer than the built-in text
    if not out or not all(out):
        raise MboltError("decode: no usable prompts")
    for i, ids in enumerate(out):
        if forced and len(ids) < need:
            raise MboltError(f"prompt {i} has {len(ids)} tokens; teacher forcing needs {forced} + --new-tokens "
                             f"{n_new}{f' + --followup-tokens {followup}' if followup else ''}: give longer texts "
                             "(--prompts) or fewer tokens")
    return out
