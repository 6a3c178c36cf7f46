"""Cold replay A/B on synthetic models -> results/ab_*.json (+ results/ab_summary_<tag>.json).

Two stages, so that predictions can be pre-registered before anything is measured:

  python scripts/bench_ab.py prepare   # probe the drive, write models, trace, plan, rewrite, predict
  (write prereg/*.toml from the printed predictions)
  python scripts/bench_ab.py run       # the cold A/B rounds; configs with a prereg file run through it

Re-run of earlier models under new pre-registrations (issue 14: the fixed harness):
  python scripts/bench_ab.py probe --tag seed1fix                        # new probe (bursts, host cache)
  python scripts/bench_ab.py predict --models s64k --model-tag seed1 --tag seed1fix
  (copy each printed "speedup" into prereg/ab_s64k_*_seed1fix.toml's predicted_speedup)
  python scripts/bench_ab.py run --models s64k --seed 1 --model-tag seed1 --tag seed1fix --quiet-machine

Models (big files live in $MBOLT_BENCH, default /tmp/mbolt-bench; only JSON goes to results/):
- s64k: 16 layers x 64 experts, k=8, 64 KiB F32 slices, planted co-activation (4 groups),
        traced with the reference engine over prompts from ../shared/data/mbolt/prompts.jsonl.
- q30b: Qwen3-30B-A3B expert shapes (hidden 2048, expert ff 768, Q4_0: 864 KiB slices,
        128 experts, k=8) scaled to 4 layers, fast-random expert bytes, traced with llama.cpp.
Arms: stock, reorder(tsp), packed(tsp), packed(identity: coalescing alone), os (mmap faults),
plus the A/A control; configs: QD 1 and 4, buffered and O_DIRECT.
Plan: tsp on the first half of the tokens; replay on held-out tokens of the second half.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.probe import probe  # noqa: E402
from mbolt.bench.replay_ab import (BENCH, MODELS, PROBE_ARGS, RESULTS, ReplayRun, log, log_predictions,  # noqa: E402,F401
                                   prepare, run_configs, run_decode, run_explore, summarise_stored)
from mbolt.core.atomic import write_text_atomic  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["prepare", "probe", "predict", "run", "decode", "explore", "summary"])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reprobe", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic models (a fresh model per seed)")
    ap.add_argument("--tag", default="", help="suffix of result/prereg names and of the probe file")
    ap.add_argument("--model-tag", default=None, help="the models' directory suffix when it differs from --tag "
                    "(a re-run of earlier models under new pre-registrations: --model-tag seed1 --tag seed1fix)")
    ap.add_argument("--tokens-per-round", type=int, default=8,
                    help="predict: the protocol's tokens per round (the pre-registrations use 8)")
    ap.add_argument("--configs", default="", help="run: only these configs (e.g. qd4_buffered,qd4_direct); "
                    "the others' earlier results stay in the summary")
    ap.add_argument("--quiet-machine", action="store_true",
                    help="record that nothing else ran on the machine (default note: shared and noisy)")
    args = ap.parse_args()
    run = ReplayRun(seed=args.seed, tag=args.tag, model_tag=args.tag if args.model_tag is None else args.model_tag,
                    quiet_machine=args.quiet_machine)
    names = [m for m in args.models.split(",") if m]
    RESULTS.mkdir(exist_ok=True)
    if args.stage == "probe":  # a new probe only (burst and host-cache figures included), models untouched
        BENCH.mkdir(parents=True, exist_ok=True)
        d = probe(BENCH, **PROBE_ARGS)
        write_text_atomic(run.probe, json.dumps(d, indent=1) + "\n")
        log("probe", run.probe.name, {k: (round(f["t_op_s"] * 1e6), round(f["bw_bytes_s"] / 1e6))
                                      for k, f in {**d["fits"], **{"burst_" + k: v for k, v in d["burst_fits"].items()}}.items()},
            "host cache:", d["host_cache"].get("verdict"))
        return
    if args.stage == "prepare":
        BENCH.mkdir(parents=True, exist_ok=True)
        if args.reprobe or not run.probe.exists():
            d = probe(BENCH, **PROBE_ARGS)
            write_text_atomic(run.probe, json.dumps(d, indent=1) + "\n")
            log("probe", {k: (round(f["t_op_s"] * 1e6), round(f["bw_bytes_s"] / 1e6)) for k, f in d["fits"].items()})
        meta = {n: prepare(run, n, MODELS[n]) for n in names}
        write_text_atomic(BENCH / "prepare.json", json.dumps(meta, indent=1, default=str) + "\n")
        args.stage = "predict"
    if args.stage == "predict":
        log_predictions(run, names, args.tokens_per_round)
    elif args.stage == "decode":
        run_decode(run)
    elif args.stage == "explore":
        run_explore(run, names)
    elif args.stage == "summary":  # re-derive the goal tables from the stored results (no measuring)
        summarise_stored(run, names)
    else:
        run_configs(run, names, {c for c in args.configs.split(",") if c})


if __name__ == "__main__":
    main()
