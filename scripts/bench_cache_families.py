"""Expert-cache families beyond bench_cache.py's (`mbolt.bench.cache_families`: W-TinyLFU and LFU
with bypass; S3-FIFO, LIRS, inter-reference recency, least-stale, hyperbolic) replayed on the real
routing traces against two bounds -> results/cache_families.json, and a table on stdout:

- MIN-forced: `OptPolicy` (Belady under the one cache rule: every token's experts admitted);
- MIN-bypass: `BypassOptPolicy` (Belady that may drop what it just read; <= MIN-forced).

A policy that never bypassed (`bypasses` 0) obeys the one cache rule and is judged against
MIN-forced (`vs_its_bound`); one that bypassed, against MIN-bypass. Each family's parameters are
chosen leaving one trace out over bench_cache.py's three real traces (its REAL: traces and slot
counts, decode tokens): for each trace, the grid value whose mean misses / MIN-forced over the
*other* traces' slot counts is lowest (the first on ties), as bench_cache.py chooses crf's lam.
gpt-oss-120b, the extra check, is replayed at the value chosen on all three. `hindsight` (real
traces only, not held out): each family's best grid value on that very trace and slot count.
LRU, crf and LFU are there for reference. Replay only, deterministic counts; about 5 minutes.

    python scripts/bench_cache_families.py
"""

from __future__ import annotations

import itertools
import json
import time

# the real traces, their slot counts and crf's lam grid: one definition (importing it puts the
# repository on sys.path)
from bench_cache import GOAL_VS_MIN, LAMS, REAL, ROOT

from mbolt.bench import cache_families as cf
from mbolt.bench.replay import LayerCachePolicy, LruPolicy, OptPolicy, replay
from mbolt.core import cache_policy as cp
from mbolt.core.atomic import write_text_atomic
from mbolt.core.trace import select_phase
from mbolt.trace.formats import load_trace
from mbolt.trace.formats.bigmoeonedge import expert_bytes_of

EXTRA = {"gpt-oss-120b": (ROOT / "mbolt" / "data" / "bigmoeonedge" / "gptoss.route.csv", (8, 16, 27))}
BOUNDS = {"lru": LruPolicy, "opt": OptPolicy, "opt-bypass": cf.BypassOptPolicy}


def grid(**axes) -> list[dict]:
    return [dict(zip(axes, vals)) for vals in itertools.product(*axes.values())]


# name -> (make(slots, n_experts, **params), parameter grid, kind). "forced": obeys the one cache
# rule; "bypass": may drop a token's expert after use (judged against MIN-bypass whenever it did)
FAMILIES = {
    "crf": (lambda s, E, lam: cp.CrfCache(s, E, lam), grid(lam=LAMS), "forced"),
    "lfu": (lambda s, E: cp.CrfCache(s, E, 0.0), [{}], "forced"),
    "lfu-bypass": (lambda s, E, lam, tie: cf.LfuBypassCache(s, E, lam, tie),
                   grid(lam=LAMS, tie=(False, True)), "bypass"),
    "w-tinylfu": (lambda s, E, lam, window, main: cf.TinyLfuCache(s, E, lam, window, main),
                  grid(lam=LAMS, window=(0.0, 0.1, 0.2, 0.35, 0.5), main=("lru", "lfu")), "bypass"),
    "s3-fifo": (lambda s, E, small, thr: cf.S3FifoCache(s, E, small, thr),
                grid(small=(0.1, 0.2, 0.35), thr=(1, 2)), "forced"),
    "lirs": (lambda s, E, hir: cf.LirsCache(s, E, hir), grid(hir=(0.01, 0.05, 0.1, 0.2, 0.35)), "forced"),
    "irr": (lambda s, E, alpha: cf.IrrCache(s, E, alpha), grid(alpha=(1.0, 0.5, 0.25)), "forced"),
    "stale": (lambda s, E, alpha: cf.StaleCache(s, E, alpha), grid(alpha=(1.0, 0.5, 0.25)), "forced"),
    "hyperbolic": (lambda s, E, reset: cf.HyperbolicCache(s, E, reset), grid(reset=(True, False)), "forced"),
}
NEW = [f for f in FAMILIES if f not in ("crf", "lfu")]


def pkey(params: dict) -> str:
    return ",".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()) or "-"


class Runs:
    """Every replay once: (trace, slots, policy, params) -> misses, bytes, bypasses."""

    def __init__(self, traces: dict):
        self.traces = traces  # name -> (trace, slot counts, per-layer expert bytes or None)
        self.memo: dict = {}

    def get(self, name: str, slots: int, policy: str, params: dict | None = None) -> dict:
        params = params or {}
        key = (name, slots, policy, pkey(params))
        if key not in self.memo:
            tr, _, eb = self.traces[name]
            if policy in BOUNDS:
                pol = BOUNDS[policy](tr.n_layers, slots)
            else:
                make = FAMILIES[policy][0]
                pol = LayerCachePolicy(policy, tr.n_layers, lambda: make(slots, tr.n_experts, **params))
            st = replay(tr, pol)
            self.memo[key] = {"misses": st.misses, "bytes": st.bytes_missed(eb) if eb is not None else None,
                              "bypasses": sum(getattr(c, "nbypass", 0) for c in getattr(pol, "layers", ()))}
        return self.memo[key]

    def vs_min(self, name, slots, fam, params) -> float:
        return self.get(name, slots, fam, params)["misses"] / max(self.get(name, slots, "opt")["misses"], 1)

    def choose(self, fam: str, on: list[str]) -> dict:
        """The grid value whose mean misses / MIN-forced over `on`'s slot counts is lowest."""
        def mean(p):
            vals = [self.vs_min(n, s, fam, p) for n in on for s in self.traces[n][1]]
            return sum(vals) / len(vals)

        return min(FAMILIES[fam][1], key=mean)


def entry(st: dict, bounds: dict, params: dict | None) -> dict:
    """One policy at one slot count: its counts and its ratios to the bounds and to the LRU."""
    of, ob, lru = bounds["opt"], bounds["opt-bypass"], bounds["lru"]
    e = {"params": params, "misses": st["misses"], "bypasses": st["bypasses"],
         "vs_min_forced": st["misses"] / max(of["misses"], 1),
         "vs_min_bypass": st["misses"] / max(ob["misses"], 1),
         "vs_lru": st["misses"] / max(lru["misses"], 1)}
    e["vs_its_bound"] = e["vs_min_forced"] if st["bypasses"] == 0 else e["vs_min_bypass"]
    if st["bytes"] is not None:
        e["bytes"] = st["bytes"]
        e["bytes_vs_min_forced"] = st["bytes"] / max(of["bytes"], 1)
        e["bytes_vs_min_bypass"] = st["bytes"] / max(ob["bytes"], 1)
    return e


def run() -> dict:
    t0 = time.perf_counter()
    paths = {**REAL, **EXTRA}
    traces = {name: (select_phase(load_trace(p), "decode"), slots, expert_bytes_of(p))
              for name, (p, slots) in paths.items()}
    runs = Runs(traces)
    real = list(REAL)
    out = {}
    for name, (tr, slot_counts, _) in traces.items():
        on = [n for n in real if n != name]
        chosen = {fam: runs.choose(fam, on) for fam in FAMILIES}
        rows = []
        for s in slot_counts:
            bounds = {b: runs.get(name, s, b) for b in BOUNDS}
            row = {"slots": s, "min_forced": {k: bounds["opt"][k] for k in ("misses", "bytes")},
                   "min_bypass": {k: bounds["opt-bypass"][k] for k in ("misses", "bytes")},
                   "policies": {"lru": entry(bounds["lru"], bounds, None)}}
            for fam in FAMILIES:
                row["policies"][fam] = entry(runs.get(name, s, fam, chosen[fam]), bounds, chosen[fam])
            fewest = min(e["misses"] for e in row["policies"].values())
            row["best"] = [p for p, e in row["policies"].items() if e["misses"] == fewest]  # held out
            if name in REAL:
                row["hindsight"] = {}
                for fam in NEW:
                    best = min(FAMILIES[fam][1], key=lambda p: runs.vs_min(name, s, fam, p))
                    row["hindsight"][fam] = entry(runs.get(name, s, fam, best), bounds, best)
            rows.append(row)
        out[name] = {"path": str(paths[name][0].relative_to(ROOT)), "tokens": tr.n_tokens,
                     "layers": len(tr.moe_layers()), "experts": tr.n_experts, "k": tr.k,
                     "params_chosen_on": on, "rows": rows}
    return {
        "how": "decode tokens of each trace, every policy per layer from an empty cache (hit = cached as of the "
               "previous token); misses / MIN's at the same slots, MIN-forced = OptPolicy (the one cache rule), "
               "MIN-bypass = BypassOptPolicy (may drop what it read); vs_its_bound = against MIN-forced if the policy "
               "never bypassed, else MIN-bypass; parameters chosen leave one trace out on the three real traces "
               "(gpt-oss: on all three), the grid value with the lowest mean misses / MIN-forced; hindsight = the "
               "best grid value on that trace and slot count (not held out); bytes = misses x each layer's expert "
               "size from the route_trace header (BigMoeOnEdge traces only)",
        "goal_vs_min": GOAL_VS_MIN,
        "families": {f: {"kind": kind, "grid": g} for f, (_, g, kind) in FAMILIES.items()},
        "traces": out,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(res: dict) -> None:
    print("misses / MIN (forced: OptPolicy; bypass: Belady that may drop what it read); byp = the token's "
          "experts dropped after use (0: obeys the one cache rule); params chosen leave one trace out")
    for name, t in res["traces"].items():
        for r in t["rows"]:
            print(f"\n### {name}  {r['slots']} slots  ({t['tokens']} tokens; MIN-forced {r['min_forced']['misses']} "
                  f"misses, MIN-bypass {r['min_bypass']['misses']})")
            print("| policy | misses | /MIN-forced | /MIN-bypass | /LRU | bytes/MIN-f | bytes/MIN-b | byp | params |")
            print("|---|---|---|---|---|---|---|---|---|")
            rows = [(p, e) for p, e in r["policies"].items()]
            rows += [(f"{p} [hindsight]", e) for p, e in r.get("hindsight", {}).items()]
            for p, e in rows:
                print(f"| {p} | {e['misses']} | {e['vs_min_forced']:.3f} | {e['vs_min_bypass']:.3f} | "
                      f"{e['vs_lru']:.3f} | {fmt(e.get('bytes_vs_min_forced'))} | {fmt(e.get('bytes_vs_min_bypass'))} | "
                      f"{e['bypasses']} | {pkey(e['params'] or {})} |")
    print(f"\n## the best held-out policy (fewest misses) per trace and slot count; goal <= {res['goal_vs_min']}x "
          "its bound")
    for name, t in res["traces"].items():
        for r in t["rows"]:
            for p in r["best"]:
                e = r["policies"][p]
                print(f"{name:16s} {r['slots']:>3} slots: {p:11s} {e['misses']:>6} misses, "
                      f"{e['vs_min_forced']:.3f}x MIN-forced, {e['vs_min_bypass']:.3f}x MIN-bypass, "
                      f"{e['vs_its_bound']:.3f}x its bound ({pkey(e['params'] or {})})")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    res = run()
    dst = ROOT / "results" / "cache_families.json"
    write_text_atomic(dst, json.dumps(res, indent=1) + "\n")
    print_table(res)
    print(f"\n-> {dst} ({res['seconds']} s)")
