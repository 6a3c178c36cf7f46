"""`mbolt ab` as one function: a request (the command's options) in, a result file out.

Resolves a pre-registration (its arms and protocol replace the options), checks the outputs
before any work, loads the replay trace or tokenizes the prompts, sets the readahead for the
run, runs the A/B (`bench.ab.run_ab`), judges the pre-registration, adds the law's prediction
when a probe file is given, and writes the result (and plot). The CLI parses and renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mbolt.bench.ab import FORCED_PREFILL, run_ab, write_result
from mbolt.bench.arms import parse_arm
from mbolt.bench.stats import StopRule
from mbolt.core.atomic import check_output
from mbolt.core.errors import MboltError
from mbolt.core.memlimit import parse_size, readahead


@dataclass
class AbRequest:
    """The options of `mbolt ab` (see its --help)."""
    arms: list[str] = field(default_factory=list)
    replay_trace: Path | None = None
    decode: bool = False
    engine: str = "reference"
    prompts: Path | None = None
    n_prompts: int = 2
    new_tokens: int = 8
    forced: bool = False
    prompt_tokens: int = FORCED_PREFILL
    followup_tokens: int = 0
    ctx_size: int | None = None
    ubatch: int | None = None  # None: each arm's default (runtime.memory.default_ubatch)
    ram: str | None = None
    readahead_kb: int | None = None
    rounds: int | None = None
    # the adaptive stop's defaults are the stop rule's own
    min_rounds: int = StopRule.min_rounds
    max_rounds: int = StopRule.max_rounds
    time_budget: float = StopRule.time_budget_s
    precision: float = StopRule.precision
    seed: int = 0
    qd: int = 1
    direct: bool = False
    gap: int = 0
    cache_slots: int = 0
    resident_frac: float | None = None
    no_aa: bool = False
    threshold: float = 0.01
    max_tokens: int = 0
    tokens_per_round: int = 0
    name: str = ""
    out_dir: Path = Path("results")
    prereg: Path | None = None
    probe_json: Path | None = None
    plot: Path | None = None
    force: bool = False


def run_ab_request(req: AbRequest, progress=None, announce=print):
    """Run the A/B a request describes; returns (AbResult, the result file, the pre-registration or None)."""
    # the options as local names: a pre-registration below replaces some of them
    arms, replay_trace, decode, engine, prompts = req.arms, req.replay_trace, req.decode, req.engine, req.prompts
    n_prompts, new_tokens, forced, ram = req.n_prompts, req.new_tokens, req.forced, req.ram
    readahead_kb = req.readahead_kb
    rounds, min_rounds, max_rounds, time_budget = req.rounds, req.min_rounds, req.max_rounds, req.time_budget
    precision, seed, threshold, no_aa, max_tokens = req.precision, req.seed, req.threshold, req.no_aa, req.max_tokens
    qd, direct, gap, cache_slots, resident_frac = req.qd, req.direct, req.gap, req.cache_slots, req.resident_frac
    tokens_per_round, name, out_dir, prereg = req.tokens_per_round, req.name, req.out_dir, req.prereg
    probe_json, plot, force = req.probe_json, req.plot, req.force
    if (req.followup_tokens or req.prompt_tokens != FORCED_PREFILL) and not forced:
        raise MboltError("--prompt-tokens and --followup-tokens are teacher forcing: add --forced")
    n_forced = req.prompt_tokens if forced else 0

    ram_bytes = parse_size(ram, "--ram") if ram else 0

    pr = None
    if prereg is not None:
        from mbolt.bench.prereg import check_and_lock, load_prereg

        if arms:
            raise MboltError("--prereg defines the arms: do not also pass arms")
        pr = load_prereg(prereg)
        arm_list = pr.arms
        if pr.trace and replay_trace is None and pr.mode == "replay":
            replay_trace = Path(pr.trace)
        decode = pr.mode == "decode"
        rounds = pr.rounds
        min_rounds, max_rounds = pr.min_rounds, pr.max_rounds
        time_budget, precision, seed = pr.time_budget, pr.precision, pr.seed
        name = name or pr.name
        if tokens_per_round:
            raise MboltError("--prereg defines the protocol: set tokens_per_round in the file, not on the command line")
        tokens_per_round = int(pr.raw.get("tokens_per_round", 0))
        engine = str(pr.raw.get("engine", engine))
    else:
        if not arms:
            raise MboltError("give at least one arm (or --prereg)")
        defaults = dict(io_threads=qd, direct=direct, gap=gap, cache_slots=cache_slots, resident_frac=resident_frac)
        arm_list = [parse_arm(a, i, defaults) for i, a in enumerate(arms)]
    if decode == (replay_trace is not None):
        raise MboltError("choose one mode: --replay TRACE or --decode")
    if "/" in (name or "") or (name or "").startswith("."):
        raise MboltError(f"--name {name!r}: a result name, not a path (the result goes to --out-dir)")
    if out_dir.exists() and not out_dir.is_dir():
        raise MboltError(f"{out_dir}: --out-dir is a file, not a directory")
    inputs = [i for i in [a.path for a in arm_list] + [replay_trace, prompts, probe_json, prereg] if i is not None]
    result_path = check_output(out_dir / f"{name or 'ab'}.json", kind="json", inputs=inputs, force=force,
                               what="result", make_parent=True)
    if plot is not None:
        check_output(plot, kind="png", inputs=inputs + [result_path], force=force, what="plot")
    trace = None
    prompt_ids = None
    if replay_trace is not None:
        from mbolt.trace.formats import load_trace

        trace = load_trace(replay_trace)
        if max_tokens and trace.n_tokens > max_tokens:
            import numpy as np

            trace = trace.select(np.arange(trace.n_tokens) < max_tokens)
    else:
        from mbolt.bench.ab import load_prompt_ids

        prompt_ids = load_prompt_ids(arm_list[0].path, prompts, n_prompts, engine=engine, forced=n_forced,
                                     n_new=new_tokens, followup=req.followup_tokens)
    if pr is not None:
        lock = check_and_lock(pr)
        announce(f"pre-registration {pr.path}: sha256 {pr.sha256[:16]}, run {lock['runs']} "
                 f"(locked {lock['locked_at']})")
    rule = StopRule(rounds=rounds, min_rounds=min_rounds, max_rounds=max_rounds, time_budget_s=time_budget,
                    precision=precision)
    with readahead(arm_list[0].path, readahead_kb):
        res = run_ab(arm_list, trace=trace, mode="decode" if decode else "replay", stop=rule,
                     threshold=threshold, aa=not no_aa, name=name or "ab", prompts=prompt_ids, n_new=new_tokens,
                     progress=progress,
                     prereg=pr.to_dict() if pr else None, trace_path=str(replay_trace or ""),
                     tokens_per_round=tokens_per_round, seed=seed, engine=engine, ram=ram_bytes,
                     forced=n_forced, followup=req.followup_tokens, n_ctx=req.ctx_size, n_ubatch=req.ubatch or 0)
    if pr is not None:
        from mbolt.bench.prereg import verdict

        res.prereg["result"] = verdict(pr, res.summary)
    if engine == "llama.cpp" and probe_json is not None:
        from mbolt.runtime.measured import record_routing
        from mbolt.bench.predict import predict_llama

        # the law with s measured in this run; counts on the routing llama.cpp computes
        ref = next((a for a in arm_list if a.mode != "os"), arm_list[0])
        routing = record_routing(ref.path, prompt_ids, new_tokens, forced=n_forced)
        res.prediction = predict_llama(res, routing, probe_json)
    elif probe_json is not None and trace is not None:
        from mbolt.bench.predict import predict_vs_measured

        res.prediction = predict_vs_measured(res, trace, probe_json)
    out = write_result(result_path, res)
    if plot is not None:
        from mbolt.report.plots import plot_ab

        plot_ab(res.to_dict(), plot)
    return res, out, pr
