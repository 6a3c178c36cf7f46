"""A/A deviation and wall time of repeated `mbolt demo` runs -> results/demo_aa.json.

Issue 14's numbers: 10 `mbolt demo --size tiny` and 5 `--size small` runs on a quiet machine
(goals: every A/A control within +-3%; tiny <= 60 s, small <= 180 s of wall time each). Each run
is a fresh process (`python -m mbolt demo`, this checkout's code) in a fresh work directory, with
a new model seed, so nothing of one run is cached for the next.

  python scripts/bench_demo.py                   # 10 tiny + 5 small
  python scripts/bench_demo.py --tiny 2 --small 0 --out results/demo_aa_try.json

Run it on a quiet machine (nothing else running); the result records the load average before and
after every run so a reader can tell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.core.atomic import write_text_atomic  # noqa: E402

GOALS = {"tiny": 60.0, "small": 180.0}  # seconds of wall time per run
AA_GOAL = 0.03


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def one_run(size: str, seed: int, base: Path) -> dict:
    wd = base / f"demo-{size}-{seed}"
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mbolt", "demo", "--workdir", str(wd), "--size", size,
                        "--seed", str(seed), "--json"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    row = {"size": size, "seed": seed, "wall_s": round(wall, 1), "exit_code": p.returncode,
           "loadavg_before": load0, "loadavg_after": os.getloadavg()}
    if p.returncode != 0:
        row["error"] = (p.stderr or p.stdout)[-2000:]
        return row
    s = json.loads((wd / "demo.json").read_text())
    ab = json.loads((wd / "ab.json").read_text())
    aa = next((x for x in ab["summary"] if x["arm"].endswith("(A/A)")), {})
    row.update({
        "aa_deviation": s["ab"]["aa_deviation"],
        "aa_ci95": aa.get("speedup_ci95"),
        "aa_within_3pct": s["ab"]["aa_deviation"] is not None and abs(s["ab"]["aa_deviation"]) <= AA_GOAL,
        "too_noisy": s["ab"]["too_noisy"],
        "ab_rounds": ab["stop"]["rounds"], "ab_stop": ab["stop"]["reason"], "ab_s": ab["stop"]["elapsed_s"],
        "demo_seconds": s["seconds"],
        "speedups": {a["arm"]: a["speedup_vs_stock"] for a in s["ab"]["arms"]},
        "order_effects": {k: ab["effects"].get(k) for k in ("largest_pct", "significant", "residual_sd_pct")},
        "host_cache": ab["environment"].get("host_cache", {}).get("verdict"),
    })
    shutil.rmtree(wd, ignore_errors=True)  # the model files are large; the row keeps the numbers
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", type=int, default=10, help="tiny runs")
    ap.add_argument("--small", type=int, default=5, help="small runs")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "demo_aa.json")
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs' files go (default: a temp dir)")
    ap.add_argument("--note", default="", help="what the machine was doing (e.g. 'quiet: nothing else running')")
    args = ap.parse_args()
    base = args.workdir or Path(tempfile.mkdtemp(prefix="mbolt-demo-aa-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    plan = [("tiny", i) for i in range(args.tiny)] + [("small", i) for i in range(args.small)]
    for size, seed in plan:
        row = one_run(size, seed, base)
        rows.append(row)
        log(size, seed, f"{row['wall_s']:.0f} s", "A/A", row.get("aa_deviation"), row.get("ab_stop"),
            row.get("ab_rounds"), row.get("error", "")[:200])
    summary = {}
    for size in ("tiny", "small"):
        rs = [r for r in rows if r["size"] == size and r["exit_code"] == 0]
        if not rs:
            continue
        summary[size] = {
            "runs": len(rs),
            "aa_deviation": [r["aa_deviation"] for r in rs],
            "aa_within_3pct": sum(bool(r["aa_within_3pct"]) for r in rs),
            "goal_all_aa_within_3pct": all(r["aa_within_3pct"] for r in rs),
            "wall_s": [r["wall_s"] for r in rs],
            "wall_goal_s": GOALS[size],
            "goal_wall_met": all(r["wall_s"] <= GOALS[size] for r in rs),
        }
    out = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "note": args.note,
           "cpus": os.cpu_count(), "summary": summary, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(out, indent=1) + "\n")
    log("wrote", args.out, json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
