"""Predictor error per arm, with and without the burst probe -> results/predictor_<tag>.json.

Issue 14: the predictor under-predicted every QD1 gain by 6-11%. Hypothesis: the probe's random
reads of one size at a time underestimate what a stock file's bursts of scattered reads cost per
read. `mbolt probe` now also measures bursts (k scattered reads back to back, as the store reads
a layer of a stock file) and the predictor uses them for QD1 buffered readers. This script
re-predicts finished A/B results both ways (burst figures, and the random-read figures alone) and
reports each arm's error, so the hypothesis stands or falls on the same measurements:

  python scripts/bench_ab.py probe --tag seed1fix
  python scripts/bench_ab.py run --models s64k --seed 1 --model-tag seed1 --tag seed1fix --quiet-machine
  python scripts/bench_predictor.py --tag seed1fix          # no measuring: reads the results

The goal (issue 14): every arm within 5%, no sign bias.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.stats import aa_ok  # noqa: E402
from mbolt.bench.predict import predict_vs_measured  # noqa: E402
from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.core.mbtrace import read_trace  # noqa: E402

RESULTS = ROOT / "results"


def errors(result: dict, held, probe_path: Path) -> dict:
    rows = predict_vs_measured(result, held, probe_path)
    return {r["arm"]: {"pred": r["pred_speedup"], "meas": r["meas_speedup"], "error": r["speedup_error"],
                       "pred_ratio_of_medians": r["pred_ratio_of_medians"],
                       "meas_ratio_of_medians": r["meas_ratio_of_medians"], "cost_source": r["cost_source"],
                       "t_op_us": r["t_op_us"], "bw_mb_s": r["bw_mb_s"]}
            for r in rows if r.get("pred_speedup") is not None}


def verdict(errs: dict) -> dict:
    e = [v["error"] for k, v in errs.items() if v["error"] is not None and not k.startswith("stock")]
    if not e:
        return {"arms": 0}
    return {"arms": len(e), "max_abs_error": max(abs(x) for x in e), "mean_error": sum(e) / len(e),
            "all_within_5pct": all(abs(x) <= 0.05 for x in e),
            "sign_bias": "all under-predicted" if all(x > 0 for x in e) else
                         "all over-predicted" if all(x < 0 for x in e) else "none"}


def implied_cost(result: dict) -> dict | None:
    """The A/B's own read cost: least squares over its arms (same tokens, same rounds) of measured
    I/O time per token = reads per token x t_op + device bytes per token / BW, next to the probe's
    figures that priced the prediction."""
    import numpy as np

    rows = [s for s in result["summary"] if s.get("rounds") and s.get("device_mb_per_token")]
    if len(rows) < 3 or len({round(s["reads_per_token"]) for s in rows}) < 2:
        return None
    A = np.array([[s["reads_per_token"], s["device_mb_per_token"] * 1e6] for s in rows])
    y = np.array([s["io_ms_per_token_median"] * 1e-3 for s in rows])
    (t_op, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    return {"t_op_us": float(t_op * 1e6), "bw_mb_s": float(1e-6 / inv_bw) if inv_bw > 0 else None,
            "arms": [s["arm"] for s in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", default="seed1fix", help="results/ab_*_<tag>.json and results/probe_<tag>.json")
    args = ap.parse_args()
    probe_path = RESULTS / f"probe_{args.tag}.json"
    probe = json.loads(probe_path.read_text())
    without = dict(probe, burst_fits={})
    out = {"probe": probe_path.name, "burst_fits": probe.get("burst_fits"), "host_cache": probe.get("host_cache"),
           "configs": {}}
    with tempfile.TemporaryDirectory() as td:
        plain = Path(td) / "probe_random_only.json"
        plain.write_text(json.dumps(without))
        for f in sorted(RESULTS.glob(f"ab_*_{args.tag}.json")):
            if f.stem.startswith("ab_summary"):
                continue
            res = json.loads(f.read_text())
            if res.get("mode") != "replay" or not res.get("trace", {}).get("path"):
                continue
            held = read_trace(res["trace"]["path"])
            with_b, without_b = errors(res, held, probe_path), errors(res, held, plain)
            out["configs"][f.stem] = {"with_bursts": with_b, "random_reads_only": without_b,
                                      "verdict_with_bursts": verdict(with_b),
                                      "verdict_random_reads_only": verdict(without_b),
                                      "aa_within_tolerance": aa_ok(res["summary"]),
                                      "implied_by_the_ab": implied_cost(res),
                                      "probe_cost": {k: next(iter(with_b.values()))[k] for k in ("t_op_us", "bw_mb_s")}}
            print(f.stem, json.dumps({k: out["configs"][f.stem][k] for k in
                                      ("verdict_with_bursts", "verdict_random_reads_only", "implied_by_the_ab")}),
                  flush=True)
    dst = RESULTS / f"predictor_{args.tag}.json"
    write_text_atomic(dst, json.dumps(out, indent=1) + "\n")
    print("wrote", dst)


if __name__ == "__main__":
    main()
