"""Markdown tables from results/memlimit_*.json (scripts/bench_memlimit.py): README's headline and
docs/results.md's tables are this script's output, pasted.

    python scripts/report_memlimit.py [--headline]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
SLICE = {"q864": "864 KiB", "q72": "72 KiB"}
ARMS = ("plain-stock", "plain-reorder", "mbolt-stock", "mbolt-reorder", "mbolt-reorder-pins")


def load() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("memlimit_*.json"), reverse=True)]


def fmt(x, spec=".2f", unit=""):
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def headline(runs: list[dict]) -> str:
    """128 KiB readahead, 40% budget: decode tok/s of each arm and the best mbolt arm's speedup."""
    out = ["| model (expert slice) | budget | plain llama.cpp | plain llama.cpp, reorder file | mbolt runtime "
           "(best arm) | speedup | A/A |", "|---|---|---|---|---|---|---|"]
    for d in runs:
        for c in d["configs"]:
            if "error" in c or c["readahead_kb"] != 128 or abs(c["budget_frac"] - 0.4) > 1e-9:
                continue
            a, best = c["arms"], c["best_mbolt_arm"]
            out.append(f"| {d['model']} ({SLICE.get(d['model'], '?')}, {c['file_bytes'] / 1e9:.1f} GB) | "
                       f"{100 * c['budget_frac']:.0f}% ({c['budget_bytes'] / 2**30:.2f} GiB) | "
                       f"{fmt(a['plain-stock']['decode_tokens_per_s'])} | "
                       f"{fmt(a['plain-reorder']['decode_tokens_per_s'])} | "
                       f"**{fmt(a[best]['decode_tokens_per_s'])}** ({best}) | **{fmt(c['best_over_plain'])}x** | "
                       f"{fmt(c['aa'], '.3f')} |")
    return "\n".join(out)


def full(runs: list[dict]) -> str:
    out = []
    for d in runs:
        out.append(f"\n**{d['model']}** ({SLICE.get(d['model'], '?')} slices; `results/memlimit_{d['model']}.json`)\n")
        out.append("| readahead | budget | arm | tok/s (rounds) | vs plain-stock | device MB/token | major faults/token "
                   "| hit rate | time to first token | peak MB |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for c in d["configs"]:
            if "error" in c:
                out.append(f"| {c['readahead_kb']} KiB | {100 * c['budget_frac']:.0f}% | (failed: {c['error']}) "
                           "| | | | | | | |")
                continue
            for name in list(ARMS) + ["plain-stock (A/A)"]:
                r = c["arms"].get(name)
                if r is None:
                    continue
                rounds = ", ".join(f"{x:.2f}" for x in r["decode_tokens_per_s_rounds"])
                out.append(f"| {c['readahead_kb']} KiB | {100 * c['budget_frac']:.0f}% | {name} | "
                           f"{fmt(r['decode_tokens_per_s'])} ({rounds}) | {fmt(r['speedup_vs_plain_stock'])}x | "
                           f"{fmt(r['device_mb_per_token'], '.1f')} | {r['major_faults_per_token']:.0f} | "
                           f"{fmt(r['hit_rate'], '.2f')} | {fmt(r['ttft_s'])} s | {fmt(r['peak_mb'], '.0f')} |")
        cp = d.get("cache_policies", {})
        if cp.get("rows"):
            out.append(f"\nHeld-out cache replay ({cp['held_out_tokens']} bench tokens; pins from {cp['train']}; "
                       "counted with the one cache rule, `bench_memlimit.py policies`):\n")
            out.append("| slots/layer | LRU hit rate | learned pins hit rate | pinned |")
            out.append("|---|---|---|---|")
            for r in cp["rows"]:
                out.append(f"| {r['cache_slots']} | {r['lru']:.3f} | {r['learned_pin']:.3f} | {r['pinned']} |")
        for g in d.get("goals", []):
            out.append(f"\n- goal {g['readahead_kb']} KiB readahead, 40%: {g['best_arm']} {fmt(g['speedup'])}x "
                       f"(goal {g['goal']}x): {'met' if g['met'] else '**missed**'}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headline", action="store_true", help="only README's headline table")
    a = ap.parse_args()
    runs = load()
    if not runs:
        print("no results/memlimit_*.json: run scripts/bench_memlimit.py first", file=sys.stderr)
        return 2
    print(headline(runs) if a.headline else headline(runs) + "\n" + full(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
