"""The plan: per layer, the expert order a rewritten file will use, plus what it was built from.

`make_plan(trace, method)` splits the trace into training and held-out tokens, counts
co-activation on the training tokens, orders every MoE layer with one method, and records the
split, heat, groups and the trace's model fingerprint. The plan.json format itself is
`mbolt.core.plan`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.layout.coact import Coact, coactivation, groups as find_groups
from mbolt.layout.evaluate import Geometry, evaluate, geometry_preset
from mbolt.layout.methods import METHODS, order
from mbolt.core.plan import Plan, save_plan
from mbolt.core.routemap import identity_perm
from mbolt.core.trace import Trace, split_trace
from mbolt.trace.formats import load_traces

# ---------------------------------------------------------------- building


def plan_orders(co: Coact, method: str, *, geometry: Geometry | None = None, gap: int = 0,
                far_credit: float = 1.0, clusters=None, **opts) -> np.ndarray:
    """perm [n_layers, E] for every layer (identity where nothing was recorded)."""
    L, E = co.n_layers, co.n_experts
    perm = identity_perm(L, E)
    gap_aware = method == "tsp" and gap > 0 and geometry is not None and "far" not in opts
    for l in co.layers:
        o = dict(opts)
        if gap_aware:  # each layer's own slice sizes decide which neighbours a gap joins
            o["far"] = geometry.for_layer(l).far_weights(gap, far_credit)
        if clusters is not None and method == "mbolt-chain":
            o["clusters"] = clusters[l]
        perm[l] = order(co.counts[l], co.heat[l], method, **o)
    return perm


def make_plan(trace: Trace, method: str = "tsp", *, train_frac: float = 0.5, holdout_domain: str | None = None,
              phase: str = "decode", geometry: Geometry | None = None, gap: int = 0,
              groups: str | None = "auto", **opts) -> Plan:
    """Split, count co-activation on the training tokens and order every MoE layer."""
    if method not in METHODS:
        raise MboltError(f"unknown ordering method {method!r} (choose from {', '.join(METHODS)})")
    train, held, split = split_trace(trace, train_frac=train_frac, holdout_domain=holdout_domain, phase=phase)
    geometry = geometry or geometry_preset("unit")
    co = coactivation(train)
    t0 = time.perf_counter()
    perm = plan_orders(co, method, geometry=geometry, gap=gap, **opts)
    seconds = time.perf_counter() - t0
    meta = {
        "fingerprint": trace.fingerprint,
        "k": trace.k,
        "split": split,
        "phase": phase,
        "geometry": geometry.to_dict(),
        "gap": int(gap),
        "plan_seconds": round(seconds, 3),
        "moe_layers": co.layers.tolist(),
    }
    if groups:
        meta["groups"] = layer_groups(co, groups)
        meta["groups_method"] = _groups_method(co, groups)
    return Plan(method, trace.n_layers, trace.n_experts, perm, co.heat.copy(), meta)


def _groups_method(co: Coact, how: str) -> str:
    if how == "auto":  # networkx modularity costs ~2 s per 512-expert layer
        return "modularity" if co.n_experts <= 256 else "spectral"
    return how


def layer_groups(co: Coact, how: str = "auto") -> list:
    m = _groups_method(co, how)
    return [find_groups(co, l, method=m) if l in set(co.layers.tolist()) else None for l in range(co.n_layers)]


# ---------------------------------------------------------------- comparing methods


def compare_methods(train: Trace, held: Trace | None, geometry: Geometry, *, gap: int = 0, cache_slots: int = 0,
                    methods=METHODS, bound: str = "auto", extra_perms: dict | None = None,
                    progress=None, planned: dict | None = None, **opts) -> dict:
    """Every method's training and held-out reads/token (plus any `extra_perms` {name: perm}),
    ratio to stock, and the adjacency bound as a lower bound on reads (valid for gap 0, no cache).

    bound: "subtour" (2-matching LP with subtour cuts), "lp" (2-matching LP), "top2", "none", or
    "auto" (subtour up to 256 experts, where it takes well under a second per layer; lp above). The held-out bound is computed from the
    held-out tokens' own counts (the best any order could do on them: an oracle, not a plan).
    `planned` {method: (perm, seconds)} reuses orders already built from the same training
    tokens; the orders used are returned under "perms" when `planned` is given (filled in).
    """
    from mbolt.layout.bounds import adjacency_bounds, reads_lower_bound

    co = coactivation(train)
    rows = []
    perms = {}
    for m in methods:
        if planned is not None and m in planned:
            perms[m], perms[m + ":seconds"] = planned[m]
            continue
        t0 = time.perf_counter()
        perms[m] = plan_orders(co, m, geometry=geometry, gap=gap, **opts)
        perms[m + ":seconds"] = time.perf_counter() - t0
        if planned is not None:
            planned[m] = (perms[m], perms[m + ":seconds"])
        if progress:
            progress(m)
    for name, p in (extra_perms or {}).items():
        perms[name] = np.asarray(p)
        perms[name + ":seconds"] = None
    names = list(methods) + list(extra_perms or {})
    for name in names:
        tr = evaluate(train, perms[name], geometry, gap, cache_slots)
        ho = evaluate(held, perms[name], geometry, gap, cache_slots) if held is not None else None
        rows.append({"method": name, "plan_seconds": perms[name + ":seconds"], "train": tr, "heldout": ho})
    base = next((r for r in rows if r["method"] == "stock"), None)
    for r in rows:
        for part in ("train", "heldout"):
            if base and r[part] is not None and base[part]["reads_per_token"] > 0:
                r[part]["ratio_to_stock"] = r[part]["reads_per_token"] / base[part]["reads_per_token"]
    out = {"geometry": geometry.to_dict(), "gap": int(gap), "cache_slots": int(cache_slots),
           "n_train": train.n_tokens, "n_heldout": 0 if held is None else held.n_tokens, "rows": rows}
    if bound == "auto":
        bound = "subtour" if train.n_experts <= 256 else "lp"
    if bound != "none":
        n_regions = len(geometry.regions)
        out["bound"] = {"kind": bound, "valid": gap == 0 and cache_slots == 0}
        for part, tr in (("train", train), ("heldout", held)):
            if tr is None:
                continue
            c = co if part == "train" else coactivation(tr)
            adj = adjacency_bounds(c.counts, c.layers, bound)
            sel = c.heat.sum(axis=1)
            lb = reads_lower_bound(sel, adj, tr.n_tokens, n_regions)
            lb_runs = float((sel.sum() - adj.sum()) / max(int(c.n_tokens[c.layers].sum()), 1))
            out["bound"][part] = {"reads_per_token": lb, "runs_per_token_layer": lb_runs}
            for r in rows:
                if r[part] is not None and lb > 0:
                    r[part]["over_bound"] = r[part]["reads_per_token"] / lb - 1.0
    return out


# ---------------------------------------------------------------- the `mbolt plan` stage


def plan_file(trace_path, out=None, *, method: str = "tsp", train_frac: float = 0.5,
              holdout_domain: str | None = None, phase: str = "decode", model=None, geometry: str | None = None,
              layout: str = "reorder", gap: int = 0, cache_slots: int = 0, compare: bool = False,
              bound: str = "auto", force: bool = True, progress=None, heldout_out=None) -> dict:
    """What `mbolt plan` does: build (and save) a plan; with `compare`, score every method;
    with `heldout_out`, write the held-out tokens as an .mbtrace (what `mbolt ab --replay` reads)."""
    from mbolt.layout.evaluate import geometry_from_model

    if gap < 0 or cache_slots < 0:
        raise MboltError("--gap and --cache must be >= 0")
    trace = load_traces(trace_path)  # one path, or several traces of one model merged
    trace_path = ", ".join(map(str, trace_path)) if isinstance(trace_path, (list, tuple)) else trace_path
    if model is not None:
        from mbolt.core.compat import check_compatible
        from mbolt.core.moe_map import moe_map

        mm = moe_map(model)
        check_compatible(trace, mm, str(trace_path))
        geo = geometry_from_model(mm, layout)
        if not trace.fingerprint:
            trace.fingerprint = mm.source_fingerprint
    else:
        geo = geometry_preset(geometry or "unit", layout)
    # the one output rule, before any work: never the trace, the model, nor the model the
    # trace was recorded from; --force replaces only an earlier plan / held-out trace
    from mbolt.core.atomic import check_output

    if out is not None and heldout_out is not None and Path(out).resolve() == Path(heldout_out).resolve():
        raise MboltError(f"{out}: given both as the plan and as the held-out trace")
    for o, kind, what in ((out, "plan", "plan"), (heldout_out, "mbtrace", "held-out trace")):
        if o is not None:
            check_output(o, kind=kind, inputs=[i for i in (trace_path, model) if i is not None], force=force,
                         protected_fingerprints=tuple(f for f in (trace.fingerprint,) if f), what=what)
    plan = make_plan(trace, method, train_frac=train_frac, holdout_domain=holdout_domain, phase=phase,
                     geometry=geo, gap=gap)
    if progress:
        progress(method)
    train, held, split = split_trace(trace, train_frac=train_frac, holdout_domain=holdout_domain, phase=phase)
    result = {"trace": str(trace_path), "method": method, "split": split, "geometry": geo.to_dict(), "gap": gap,
              "cache_slots": cache_slots, "plan_seconds": plan.meta["plan_seconds"],
              "n_layers": plan.n_layers, "n_experts": plan.n_experts, "k": trace.k}
    result["train"] = evaluate(train, plan.perm, geo, gap, cache_slots)
    if held is not None:
        result["heldout"] = evaluate(held, plan.perm, geo, gap, cache_slots)
    if heldout_out is not None:
        if held is None:
            raise MboltError(f"{heldout_out}: nothing is held out (--train-frac 1): no held-out trace to write")
        from mbolt.core.mbtrace import write_trace

        write_trace(heldout_out, held, force=force)
        result["heldout_trace"] = str(heldout_out)
    if compare:
        result["compare"] = compare_methods(train, held, geo, gap=gap, cache_slots=cache_slots, bound=bound,
                                            progress=progress)
    if out is not None:
        plan.meta["evaluation"] = {k: result[k] for k in ("train", "heldout") if k in result}
        save_plan(out, plan)
        result["out"] = str(out)
    return result
