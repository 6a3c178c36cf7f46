"""`mbolt demo`: the whole pipeline on a built-in synthetic model, no downloads.

synth (planted co-activation groups) -> trace built-in prompts with the reference engine ->
split by prompt (held-out prompts never seen by the planner) -> plan (tsp and mbolt-chain) ->
rewrite (reorder and packed layouts) -> verify (bit-identity + routing parity) -> probe the
drive -> cold replay A/B of the held-out tokens with an A/A control -> one summary. When the A/A
control lands outside its tolerance the summary shows no speedups: it says the machine was too
noisy and which longer `mbolt ab` to run instead.

Every number the summary shows is read back from `demo.json`, the file the run writes, so what
a user sees and what a script reads cannot disagree.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mbolt.core.atomic import json_default, stored_path, write_text_atomic
from mbolt.bench.stats import aa_ok, aa_row, AA_TOLERANCE
from mbolt.core.errors import MboltError


@dataclass(frozen=True)
class DemoSize:
    n_layers: int
    n_experts: int
    k: int
    hidden: int
    expert_ff: int
    n_prompts: int
    new_tokens: int
    tokens_per_round: int  # each A/B round replays the next slice of this many held-out tokens
    pass_rounds: int = 12  # rounds per pass over the replayed tokens (a multiple of the 6-arm design block)
    ab_time_budget: float = 30.0  # seconds; the A/B stops at a whole pass once another would overrun it


# Expert slices are hidden * expert_ff * 4 bytes (F32): 64 KiB for tiny and small, the
# fine-grained regime where coalescing reads pays (DESIGN.md: the slice-size law).
# Many short rounds: the A/B replays pass_rounds x tokens_per_round held-out tokens per pass,
# each token once per pass, and runs whole passes until its A/A control and speedups have
# converged or its time budget is spent.
SIZES = {
    "tiny": DemoSize(n_layers=8, n_experts=32, k=4, hidden=128, expert_ff=128, n_prompts=24, new_tokens=24,
                     tokens_per_round=16, ab_time_budget=45.0),  # up to three 12-round passes
    "small": DemoSize(n_layers=16, n_experts=64, k=8, hidden=128, expert_ff=128, n_prompts=48, new_tokens=32,
                      tokens_per_round=24, ab_time_budget=130.0),  # two 12-round passes (~60 s each)
    "medium": DemoSize(n_layers=16, n_experts=128, k=8, hidden=256, expert_ff=256, n_prompts=64, new_tokens=32,
                       tokens_per_round=16, ab_time_budget=300.0),
}

# Two domains of short prompts; every third prompt is held out (never seen by the planner).
_CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "import numpy as np\nx = np.linspace(0, 1, 100)\n",
    "fn main() { let v: Vec<u32> = (0..10).collect(); }",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "git rebase -i HEAD~3 && git push --force-with-lease",
    "const total = items.reduce((acc, x) => acc + x.price, 0);",
    "while read line; do echo \"$line\" | cut -d, -f2; done < data.csv",
    "try:\n    f = open(path)\nexcept OSError as e:\n    log(e)\n",
    "template <typename T> T max(T a, T b) { return a > b ? a : b; }",
    "df.groupby('city')['sales'].sum().sort_values()",
]
_PROSE = [
    "The river wound slowly through the valley, past fields of barley and old stone walls.",
    "Write a short letter thanking a colleague for their help with the quarterly report.",
    "What are the main causes of the French Revolution? Answer in three sentences.",
    "Describe the smell of rain on a hot summer afternoon in the city.",
    "Summarise the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "Give three tips for a beginner who wants to start running in the winter.",
    "Explain to a child why the sky looks blue during the day and red at sunset.",
    "Once upon a time, in a kingdom by the sea, there lived a baker with a secret.",
    "List the planets of the solar system in order of their distance from the sun.",
    "Why do cats purr? Give the scientific explanation in simple words.",
    "Compose a haiku about the first snow falling on a quiet mountain village.",
    "Recommend a weekend itinerary for a first visit to Lisbon on a small budget.",
]


def demo_prompts(n: int) -> list[dict]:
    """n prompts alternating code and prose (cycled with a numbered suffix when n > 24)."""
    out = []
    for i in range(n):
        pool, tag = (_CODE, "code") if i % 2 == 0 else (_PROSE, "prose")
        j = i // 2
        text = pool[j % len(pool)] + ("" if j < len(pool) else f" ({j // len(pool) + 1})")
        out.append({"prompt": text, "source": tag})
    return out


def check_workdir(workdir: str | Path) -> Path:
    """The demo writes (and rewrites) its files in `workdir`: a new or empty directory, or one an
    earlier demo made (it has demo.json). Anything else could hold a user's model.gguf."""
    wd = Path(workdir)
    if wd.exists() and not wd.is_dir():
        raise MboltError(f"{wd}: --workdir is a file, not a directory")
    if wd.is_dir() and any(wd.iterdir()) and not (wd / "demo.json").is_file():
        raise MboltError(f"{wd}: --workdir is not empty and not an earlier demo's (no demo.json): "
                         f"give a new directory")
    parent = wd.parent if not wd.exists() else wd
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise MboltError(f"{parent}: not writable")
    return wd


def run_demo(workdir: str | Path, size: str = "tiny", *, seed: int = 0, progress=None) -> dict:
    """Run the pipeline in `workdir`; returns the summary (also written to workdir/demo.json).

    `progress(step, detail)` is called as each stage starts.
    """
    from mbolt.bench.ab import run_ab, write_result
    from mbolt.bench.arms import Arm
    from mbolt.bench.stats import StopRule
    from mbolt.bench.predict import predict_vs_measured
    from mbolt.bench.probe import probe
    from mbolt.synth.synth import SynthConfig, write_synth
    from mbolt.layout.evaluate import geometry_from_model
    from mbolt.core.plan import save_plan
    from mbolt.layout.plan import make_plan
    from mbolt.rewrite.reorder import reorder_file
    from mbolt.rewrite.verify import verify
    from mbolt.core.mbtrace import read_trace, write_trace
    from mbolt.core.trace import DECODE
    from mbolt.trace.tracer import trace_prompts

    if size not in SIZES:
        raise MboltError(f"unknown demo size {size!r} (choose from {', '.join(SIZES)})")
    sz = SIZES[size]
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda step, detail="": None)
    t_start = time.perf_counter()
    timings = {}

    def step(name, detail=""):
        timings[name] = time.perf_counter()
        say(name, detail)

    # 1. model
    step("synth", f"{sz.n_layers} layers x {sz.n_experts} experts, k={sz.k}, planted groups")
    model = wd / "model.gguf"
    cfg = SynthConfig(arch="qwen3moe", n_layers=sz.n_layers, n_experts=sz.n_experts, n_used=sz.k,
                      hidden=sz.hidden, expert_ff=sz.expert_ff, n_heads=4, n_kv_heads=2,
                      head_dim=sz.hidden // 4, expert_type="F32", seed=seed, structure="planted",
                      context=1)
    write_synth(model, cfg)

    # 2. trace every prompt; held-out = every third prompt (split by prompt, not by token)
    prompts = demo_prompts(sz.n_prompts)
    step("trace", f"{len(prompts)} prompts x {sz.new_tokens} new tokens, reference engine")
    run_path = wd / "run.mbtrace"
    trace_info = trace_prompts(model, [_as_prompt(p) for p in prompts], run_path, max_new_tokens=sz.new_tokens,
                               force=True)  # the demo owns its workdir (check_workdir)
    trace = read_trace(run_path)
    held_seqs = np.array([s for s in range(len(prompts)) if s % 3 == 2])
    is_held = np.isin(trace.seq, held_seqs)
    # Replay the held-out decode tokens: decode is where an engine streams experts one token at a time.
    train, held = trace.select(~is_held), trace.select(is_held & (trace.phase == DECODE))
    # One pass = pass_rounds slices of held-out tokens, every token replayed once per pass; the A/B
    # stops only after whole passes, so the reads counted over all rounds are the planner's
    # prediction for this very trace.
    tpr = min(sz.tokens_per_round, max(1, held.n_tokens // sz.pass_rounds))
    held = held.select(np.arange(held.n_tokens) < sz.pass_rounds * tpr)
    held_path = wd / "held.mbtrace"
    write_trace(held_path, held)

    # 3. plans on the training prompts only
    step("plan", "tsp and mbolt-chain on the training prompts")
    from mbolt.core.moe_map import moe_map

    mm = moe_map(model)
    plans = {}
    for method in ("tsp", "mbolt-chain"):
        plan = make_plan(train, method, train_frac=1.0, geometry=geometry_from_model(mm, "packed"))
        plans[method] = save_plan(wd / f"plan-{method}.json", plan)

    # 4. rewrite: tsp in both layouts, mbolt-chain packed, and identity-packed (coalescing alone)
    step("reorder", "reorder tsp, packed tsp, packed chain (mbolt-chain order), packed identity (coalescing alone)")
    files = {
        "stock": model,
        "reorder tsp": wd / "model.reorder-tsp.gguf",
        "packed tsp": wd / "model.packed-tsp.gguf",
        "packed chain": wd / "model.packed-chain.gguf",
        "packed identity": wd / "model.packed-identity.gguf",
    }
    reorder_file(model, files["reorder tsp"], plan=plans["tsp"], layout="reorder", force=True)
    reorder_file(model, files["packed tsp"], plan=plans["tsp"], layout="packed", force=True)
    reorder_file(model, files["packed chain"], plan=plans["mbolt-chain"], layout="packed", force=True)
    reorder_file(model, files["packed identity"], identity=True, layout="packed", force=True)

    # 5. verify: bit-identity of every tensor, and routing parity through the reference engine
    step("verify", "bit-identity of every tensor + routing parity")
    verdicts = {}
    for name, path in files.items():
        if name == "stock":
            continue
        rep = verify(model, path, parity=name in ("reorder tsp", "packed tsp"))
        verdicts[name] = {"ok": rep.ok, "checks": [c.__dict__ for c in rep.checks],
                          "bytes_compared": rep.bytes_compared}

    # 6. probe the drive (t_op and bandwidth for the prediction), then the cold A/B
    step("probe", "cold random reads, buffered QD1")
    probe_d = probe(wd, sizes=(16 << 10, 64 << 10, 256 << 10), qds=(1,), modes=("buffered",), size_mb=64,
                    reads_mb=4, max_reads=64, repeats=2)
    probe_path = wd / "probe.json"
    write_text_atomic(probe_path, json.dumps(probe_d, indent=2))
    step("ab", f"cold replay of {held.n_tokens} held-out tokens ({tpr} per round, {sz.pass_rounds} rounds per "
               f"pass), balanced arm orders, A/A control, whole passes until converged or {sz.ab_time_budget:.0f} s")
    arms = [Arm(name=name, path=str(path)) for name, path in files.items()]
    rule = StopRule(min_rounds=sz.pass_rounds, check_every=sz.pass_rounds, time_budget_s=sz.ab_time_budget,
                    budget_at_checks=True)
    ab = run_ab(arms, trace=held, mode="replay", stop=rule, name="demo", trace_path=str(held_path),
                tokens_per_round=tpr, seed=seed)
    ab.prediction = predict_vs_measured(ab, held, probe_path)
    write_result(wd / "ab.json", ab)

    total_s = time.perf_counter() - t_start
    summary_path = wd / "demo.json"
    summary = _summary(sz, size, summary_path, trace_info, train, held, ab, verdicts, files, total_s)
    write_text_atomic(summary_path, json.dumps(summary, indent=2, default=json_default))
    # paths in demo.json are relative to it; the caller is told where the folder is
    return {**json.loads(summary_path.read_text()), "workdir": str(wd)}


def _as_prompt(p: dict):
    from mbolt.core.prompts import Prompt

    return Prompt(text=p["prompt"], domain=p["source"], line=0)


def _aa_deviation(summary: list[dict]) -> float | None:
    """How far the A/A control landed from the baseline: the noise floor of this run."""
    aa = aa_row(summary)
    return None if aa is None else aa["speedup_vs_baseline_median"] - 1.0


def too_noisy(ab, aa_tolerance: float = AA_TOLERANCE) -> bool:
    """The A/A control landed outside the tolerance: this run's speedups are not results."""
    return aa_ok(ab.summary, aa_tolerance) is False


def instead_command(files: dict, held_path, tokens_per_round: int) -> str:
    """The longer `mbolt ab` of the same files to run when the demo's machine was too noisy."""
    import shlex

    arms = " ".join(shlex.quote(f"{Path(p).resolve()}:name={n}") for n, p in files.items())
    return (f"mbolt ab {arms} --replay {shlex.quote(str(held_path))} --tokens-per-round {tokens_per_round} "
            "--time-budget 900 --min-rounds 24")


def _summary(sz, size, summary_path, trace_info, train, held, ab, verdicts, files, total_s) -> dict:
    held_path = Path(summary_path).resolve().parent / "held.mbtrace"
    pred = {p["arm"]: p for p in (ab.prediction or [])}
    noisy = too_noisy(ab)
    arms = []
    for s in ab.summary:
        p = pred.get(s["arm"], {})
        done = [r for r in ab.rounds if r.arm == s["arm"] and not r.rejected]
        arms.append({
            "arm": s["arm"],
            # over all rounds (whole passes: each held-out token equally often): comparable with the prediction
            "reads_per_token": sum(r.reads for r in done) / max(sum(r.tokens for r in done), 1),
            "mb_per_token": s.get("mb_per_token"),
            "io_ms_per_token": s.get("io_ms_per_token_median"),
            "cold_tokens_per_s": 1e3 / s["io_ms_per_token_median"] if s.get("io_ms_per_token_median") else None,
            # an out-of-tolerance A/A control: the speedups of this run are noise, not results
            "speedup_vs_stock": None if noisy else s.get("median_of_ratios"),
            "speedup_ci95": None if noisy else s.get("speedup_ci95"),
            "measured_speedup_noisy": s.get("median_of_ratios") if noisy else None,
            "ratio_of_medians": None if noisy else s.get("ratio_of_medians"),
            "pred_reads_per_token": p.get("pred_reads_per_token_all"),
            "pred_speedup": p.get("pred_speedup"),
        })
    notes = list(ab.notes)
    if noisy:
        dev = _aa_deviation(ab.summary)
        notes.insert(0, f"[bold yellow]the machine was too noisy for this A/B[/]: the A/A control (stock against itself) "
                        f"landed {100 * dev:+.1f}% off (tolerance +-{100 * AA_TOLERANCE:.0f}%), so no speedups are "
                        f"shown. Run a longer A/B of the same files on a quieter machine instead:\n  "
                        f"{instead_command(files, held_path, ab.trace.get('tokens_per_round', 0))}")
    notes.append(f"A/B: {ab.stop['rounds']} rounds in {ab.stop['elapsed_s']:.0f} s, stopped: {ab.stop['reason']} "
                 f"({ab.stop['detail']}); speedup = {ab.speedup_definition}")
    return {
        "size": size,
        "geometry": {"n_layers": sz.n_layers, "n_experts": sz.n_experts, "k": sz.k,
                     "slice_bytes": sz.hidden * sz.expert_ff * 4},
        "files": {k: stored_path(v, summary_path) for k, v in files.items()},
        "trace": {"prompts": trace_info["prompts"], "prefill_tokens": trace_info["prefill_tokens"],
                  "decode_tokens": trace_info["decode_tokens"],
                  "train_decode_tokens": int((train.phase == 1).sum()), "heldout_decode_tokens": held.n_tokens},
        "verify": verdicts,
        "ab": {"cold": ab.cold, "flags": ab.flags, "aa_deviation": _aa_deviation(ab.summary),
               "aa_tolerance": AA_TOLERANCE, "too_noisy": noisy, "notes": notes, "baseline": ab.baseline,
               "rounds": ab.stop["rounds"], "stop": ab.stop, "speedup_definition": ab.speedup_definition,
               "instead": instead_command(files, held_path, ab.trace.get("tokens_per_round", 0)) if noisy else None,
               "result": stored_path(Path(summary_path).parent / "ab.json", summary_path), "arms": arms},
        "seconds": round(total_s, 1),
    }
