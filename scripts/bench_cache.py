"""Cache-policy replay on nuthatch's granite3-moe trace -> results/cache_granite.json.

Views of the same routing (DESIGN.md reference table):
- nuthatch's own reading and counting (every line of the text export a record, including the 93
  prompt lines the export bug corrupted; a hit checked per access), pin set in-sample: must give
  22.4 / 4.7 / 0.0 at 4 slots.
- held-out, nuthatch's counting: pin set from the first 32 decode tokens, measured on the last 32
  (reference: learned-pin 20.0%, LRU 4.8% at 4 slots; 69.6% vs 64.2% at 16).
- the same two decode views with mbolt's one cache rule (`mbolt.core.lru`: a hit is an expert
  cached as of the previous token, what `plan --cache-slots` and the streaming store count).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.bench.replay import cache_sweep, nuthatch_lines_trace  # noqa: E402
from mbolt.trace.formats import load_trace  # noqa: E402

DATA = ROOT / "mbolt" / "data" / "granite3moe.trace.txt"
BUDGETS = [4, 8, 12, 16, 24]
REFERENCE = {
    "in_sample_budget4": {"learned-pin": 0.224, "lru": 0.047, "os": 0.0},
    "held_out_budget4": {"learned-pin": 0.200, "lru": 0.048},
    "held_out_budget16": {"learned-pin": 0.696, "lru": 0.642},
}


def main() -> None:
    t0 = time.perf_counter()
    lines = nuthatch_lines_trace(DATA)
    imported = load_trace(DATA)
    views = {
        "nuthatch_lines_in_sample": cache_sweep(lines, BUDGETS, in_sample=True, phase="all", per_access=True),
        "decode_held_out_per_access": cache_sweep(imported, BUDGETS, in_sample=False, phase="decode",
                                                  per_access=True),
        "decode_in_sample": cache_sweep(imported, BUDGETS, in_sample=True, phase="decode"),
        "decode_held_out": cache_sweep(imported, BUDGETS, in_sample=False, phase="decode"),
    }
    out = {v: s.to_dict() for v, s in views.items()}

    def row(view, b):
        return next(r for r in out[view]["rows"] if r["budget"] == b)

    checks = {
        "in_sample_budget4": {p: round(row("nuthatch_lines_in_sample", 4)[p], 3) for p in ("learned-pin", "lru", "os")},
        "held_out_budget4": {p: round(row("decode_held_out_per_access", 4)[p], 3) for p in ("learned-pin", "lru")},
        "held_out_budget16": {p: round(row("decode_held_out_per_access", 16)[p], 3) for p in ("learned-pin", "lru")},
    }
    result = {
        "trace": str(DATA.relative_to(ROOT.parent)),
        "how_counted": "views *_per_access and nuthatch_lines: nuthatch Replay(), every access of every record in "
                       "order, no warm-up, hit = in cache at that access; the other views: mbolt's one cache rule, "
                       "hit = cached as of the previous token, then the token's experts become most recent. "
                       "learned-pin: pinned or in its LRU part; pin = ceil(0.75 * budget), ties lowest id; "
                       "OS = one global LRU of budget * 24 slots; Belady = clairvoyant per-layer optimum with a "
                       "free initial fill (upper bound for every policy with that many slots per layer)",
        "views": out,
        "reference": REFERENCE,
        "reproduced": checks,
        "match": all(abs(checks[k][p] - v) < 0.0005 for k, d in REFERENCE.items() for p, v in d.items()),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    dst = ROOT / "results" / "cache_granite.json"
    dst.parent.mkdir(exist_ok=True)
    write_text_atomic(dst, json.dumps(result, indent=1) + "\n")
    print(json.dumps(checks, indent=1), "match:", result["match"], "->", dst)


if __name__ == "__main__":
    main()
