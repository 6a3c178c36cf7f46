"""Regenerate the README's figures in results/ from the results files (no measuring).

    python scripts/make_figures.py

The co-activation heatmap needs the seed-1 bench model's trace and plan, written by
`MBOLT_BENCH=/tmp/mbolt-bench python scripts/bench_ab.py prepare --models s64k --seed 1 --tag seed1`;
it is skipped (with a note) when they are not there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.replay import cache_sweep  # noqa: E402
from mbolt.trace.formats import load_trace  # noqa: E402
from mbolt.report.plots import plot, plot_cache, plot_heatmap  # noqa: E402

RESULTS = ROOT / "results"
BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench"))
GRANITE = ROOT / "mbolt" / "data" / "granite3moe.trace.txt"


def main() -> None:
    made = [
        plot(RESULTS / "layout.json", RESULTS / "layout.png"),
    ]
    sweep = cache_sweep(load_trace(GRANITE), [2, 4, 8, 16, 24])
    made.append(plot_cache(sweep.to_dict(), RESULTS / "cache_granite.png", title="granite-moe 1b"))
    trace, plan = BENCH / "s64k_seed1" / "full.mbtrace", BENCH / "s64k_seed1" / "plan.json"
    if trace.exists() and plan.exists():
        made.append(plot_heatmap(trace, plan, RESULTS / "heatmap_s64k_seed1.png", layer=8))
    else:
        print(f"skipped the heatmap: {trace} or {plan} missing (run bench_ab.py prepare first)")
    print(json.dumps([str(p.relative_to(ROOT)) for p in made], indent=1))


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
