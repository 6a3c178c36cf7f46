"""Can a layer's misses be known a layer ahead from routing alone? (issue 54, item 3) -> results/cross_layer.json.

Reads behind the compute need a layer's misses before its selection: its reads would then run while
the layer before it computes. A predictor that needs no model weights guesses layer L+1's experts
from the experts layer L just selected. This replays real per-token routing through the runtime's
cache rule (core.lru.SlotLru, one LRU of `--slots` experts a layer, as the runtime holds under the
40% limit: 33 of 128 on q4km, 36 at full depth) and, at each decode token and layer L+1, asks two
predictors for the p uncached experts most likely to be selected:

  co-activation  counts of (expert at L, expert at L+1) over every earlier token of the trace
                 (learned online: no token is scored by counts that include it)
  heat           counts of the experts at L+1 over every earlier token (no cross-layer link: the
                 baseline the link must beat)

and counts, over the misses the cache rule makes without prefetch:
  recall     the share of misses the p guesses cover (what a read a layer ahead could hide);
  precision  the share of guesses that were selected (1 - precision is read for nothing);
  extra      bytes read for nothing per miss, in experts (p x (1 - precision) / misses): what the
             drive pays beside the misses it already reads.

The routing: mbolt/data/bigmoeonedge (Qwen3-30B-A3B, Gemma-4-26B-A4B and gpt-oss-120b, all Q4_K_M,
from BigMoeOnEdge's route traces: Apache-2.0, see its README) and any trace given with --trace
(e.g. a synthetic benchmark model's train.mbtrace, to compare).

    python scripts/probe_cross_layer.py [--slots 33] [--trace PATH ...] [--out results/cross_layer.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402
from mbolt.core.lru import SlotLru  # noqa: E402
from mbolt.core.trace import DECODE  # noqa: E402
from mbolt.trace.formats import load_trace  # noqa: E402

DATA = ROOT / "mbolt" / "data" / "bigmoeonedge"
REAL = {"qwen3-30b-a3b (top-6)": DATA / "qwen.route.csv", "gemma-4-26b-a4b (top-6)": DATA / "gemma.route.csv",
        "gpt-oss-120b (top-2)": DATA / "gptoss.route.csv"}
PREFETCH = (1, 2, 4, 8)
WARMUP = 16  # decode tokens a predictor learns from before it is scored


def replay(trace, slots: int) -> dict:
    """The cache rule over `trace`, scoring both predictors at every decode token after WARMUP."""
    layers = [int(l) for l in trace.moe_layers()]
    E = trace.n_experts
    if len(layers) < 2:
        raise MboltError(f"{trace.n_layers}-layer trace: fewer than two MoE layers, nothing to predict across")
    caches = {l: SlotLru(slots) for l in layers}
    link = np.zeros((len(layers) - 1, E, E))  # link[i, a, b]: a at layers[i], b at layers[i + 1]
    heat = np.zeros((len(layers), E))
    score = {m: {p: [0, 0] for p in PREFETCH} for m in ("co-activation", "heat")}  # [covered, guessed]
    misses = scored = decode_seen = 0
    for t in range(trace.n_tokens):
        sel = [[int(e) for e in trace.experts[t, l] if e >= 0] for l in layers]
        decode = trace.phase[t] == DECODE
        decode_seen += decode
        for i, l in enumerate(layers):
            miss = {e for e in sel[i] if e not in caches[l]}
            if decode and decode_seen > WARMUP and i > 0:
                uncached = np.array([e not in caches[l] for e in range(E)])
                for name, s in (("co-activation", link[i - 1][sel[i - 1]].sum(0)), ("heat", heat[i].copy())):
                    s[~uncached] = -np.inf
                    order = np.argsort(-s, kind="stable")
                    for p in PREFETCH:
                        guess = set(int(e) for e in order[:p] if uncached[e])
                        score[name][p][0] += len(guess & miss)
                        score[name][p][1] += len(guess)
                misses += len(miss)
                scored += 1
            caches[l].step(sel[i])
        for i in range(len(layers)):  # learned after the token is scored
            heat[i, sel[i]] += 1
            if i + 1 < len(layers):
                link[i][np.ix_(sel[i], sel[i + 1])] += 1
    out = {"layers": len(layers), "experts": E, "k": trace.k, "tokens": trace.n_tokens,
           "decode_tokens": int(decode_seen), "scored_layer_tokens": scored, "slots": slots,
           "misses_per_layer_token": misses / max(scored, 1), "predictors": {}}
    for name, by_p in score.items():
        out["predictors"][name] = {str(p): {"recall": c / max(misses, 1), "precision": c / max(g, 1),
                                            "extra_per_miss": (g - c) / max(misses, 1)}
                                   for p, (c, g) in by_p.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=33, help="cache slots per layer (default 33: q4km at 40%%)")
    ap.add_argument("--trace", action="append", default=[], help="another trace to replay beside the real ones")
    ap.add_argument("--out", default=str(ROOT / "results" / "cross_layer.json"))
    a = ap.parse_args(argv)
    import json

    rows = {}
    try:
        for name, path in list(REAL.items()) + [(f"{Path(p).parent.name}/{Path(p).name}", Path(p)) for p in a.trace]:
            trace = load_trace(path)
            rows[name] = {"trace": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
                          **replay(trace, min(a.slots, trace.n_experts))}
    except MboltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'routing':34} {'misses':>6}  {'p':>2}  {'co-activation recall/precision/extra':>36}  {'heat recall/precision/extra':>28}")
    for name, r in rows.items():
        for p in PREFETCH:
            c, h = r["predictors"]["co-activation"][str(p)], r["predictors"]["heat"][str(p)]
            print(f"{name:34} {r['misses_per_layer_token']:6.2f}  {p:2d}  "
                  f"{c['recall']:>18.2f} {c['precision']:8.2f} {c['extra_per_miss']:8.2f}  "
                  f"{h['recall']:>10.2f} {h['precision']:8.2f} {h['extra_per_miss']:8.2f}")
    out = {"probe": "routing alone, a layer ahead (issue 54)", "script": "scripts/probe_cross_layer.py",
           "warmup_decode_tokens": WARMUP, "prefetch": list(PREFETCH), "routing": rows}
    write_text_atomic(Path(a.out), json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
