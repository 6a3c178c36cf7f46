"""Two facts about `mbolt probe` that the predictor's fixes rest on -> results/probe_conditions.json.

Issue 14 (the seed-1 re-run located the predictor's QD1 bias):
  1. drop: buffered QD1 random reads into a page cache left to grow (pages dropped once, at the
     end) against the same reads with each read's pages dropped right after it, as the store does
     after each layer. Same file, same sizes, fresh random offsets per arm, arms interleaved.
  2. repeatability: the probe's fits (t_op, BW per mode at QD1) of 3 default probes and of 3
     probes with twice the reads in 6 repeats (what scripts/bench_ab.py now uses), back to back.

  python scripts/bench_probe_conditions.py --quiet-machine

Nothing else may run on the machine meanwhile (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.env import environment  # noqa: E402
from mbolt.bench.probe import _make_file, _run_config, probe  # noqa: E402
from mbolt.core.atomic import write_text_atomic  # noqa: E402
from bench_ab import PROBE_ARGS  # noqa: E402 (the bench probe: one definition)

SIZES = (64 << 10, 512 << 10, 1 << 20)


def reads(path: Path, size: int, n: int, seed: int, drop_each: bool) -> float:
    """Median latency (us) of `n` cold random buffered reads of `size` bytes at QD1 (the probe's own)."""
    r = _run_config(str(path), size, 1, False, n, seed, drop_each=drop_each)
    if not r["cold_proven"]:
        raise SystemExit(f"{path}: eviction not proven ({r['resident_before']:.3f} resident)")
    return r["t_op_us"]


def fits(d: dict) -> dict:
    out = {k: {"t_op_us": v["t_op_s"] * 1e6, "bw_mb_s": v["bw_bytes_s"] / 1e6} for k, v in d["fits"].items()
           if v["qd"] == 1}
    for k, v in (d.get("burst_fits") or {}).items():
        out["burst_" + k] = {"t_op_us": v["t_op_s"] * 1e6, "bw_mb_s": v["bw_bytes_s"] / 1e6}
    return out


def spread(values: list[float]) -> dict:
    m = float(np.median(values))
    return {"values": values, "median": m, "half_range_pct": 100 * (max(values) - min(values)) / 2 / m}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "probe_conditions.json"))
    ap.add_argument("--quiet-machine", action="store_true", help="record that nothing else ran on the machine")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = _make_file(d, 256 << 20)
    try:
        drop: dict = {str(s): {"kept_us": [], "dropped_us": []} for s in SIZES}
        for rep in range(args.reps):
            for s in SIZES:
                for i, each in enumerate((False, True) if rep % 2 == 0 else (True, False)):
                    v = reads(path, s, 64, seed=100 * rep + 10 * i + s % 7, drop_each=each)
                    drop[str(s)]["dropped_us" if each else "kept_us"].append(v)
            print(time.strftime("%H:%M:%S"), "drop rep", rep, {k: [round(x) for x in v["kept_us"][-1:] + v["dropped_us"][-1:]]
                                                             for k, v in drop.items()}, flush=True)
        for v in drop.values():
            v["faster_when_dropped_pct"] = 100 * (np.median(v["kept_us"]) / np.median(v["dropped_us"]) - 1)
        env = environment(path)
    finally:
        path.unlink(missing_ok=True)
    rep_out = {}
    for name, kw in (("default", dict(size_mb=256)), ("bench", PROBE_ARGS)):
        runs = []
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory(dir=d) as td:
                runs.append(fits(probe(td, host_cache=False, **kw)))
        rep_out[name] = {"probe_args": kw, "fits": runs,
                         "spread": {k: {m: spread([r[k][m] for r in runs]) for m in ("t_op_us", "bw_mb_s")}
                                    for k in runs[0]}}
        print(time.strftime("%H:%M:%S"), name, {k: round(v["bw_mb_s"]["half_range_pct"], 1)
                                                for k, v in rep_out[name]["spread"].items()}, flush=True)
    out = {"benchmark": "probe_conditions", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "seconds": round(time.perf_counter() - t0, 1), "reps": args.reps,
           "note": "no other jobs on the machine during the run (2 cores)" if args.quiet_machine
           else "2 shared cores, other workers may have run",
           "drop_after_each_read": drop, "repeatability": rep_out, "environment": env}
    write_text_atomic(Path(args.out), json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
