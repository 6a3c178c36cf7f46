"""The plan: per layer, the expert order a rewritten file will use, plus what it was built from.

`make_plan(trace, method)` splits the trace into training and held-out tokens, counts
co-activation on the training tokens, orders every MoE layer with one method, and records the
split, heat, groups and the trace's model fingerprint. The plan.json format itself is
`mbolt.core.plan`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.layout.coact import Coact, coactivation, groups as find_groups
from mbolt.layout.evaluate import Geometry, evaluate, geometry_preset, lru_hits
from mbolt.layout.methods import METHODS, heat_order, order
from mbolt.core.plan import PERMS_FORMAT, Plan, save_plan
from mbolt.core.routemap import identity_perm
from mbolt.core.trace import Trace, split_trace
from mbolt.trace.formats import Usage, load_traces

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
        meta["groups_method"] = groups_method(co, groups)
    return Plan(method, trace.n_layers, trace.n_experts, perm, co.heat.copy(), meta)


def groups_method(co: Coact, how: str) -> str:
    if how == "auto":  # networkx modularity costs ~2 s per 512-expert layer
        return "modularity" if co.n_experts <= 256 else "spectral"
    return how


def layer_groups(co: Coact, how: str = "auto", progress=None) -> list:
    """Each MoE layer's groups (None for layers without routing); `progress(layer)` after each."""
    m = groups_method(co, how)
    out: list = [None] * co.n_layers
    for l in co.layers:
        out[l] = find_groups(co, int(l), method=m)
        if progress:
            progress(int(l))
    return out


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
    hits = {part: lru_hits(t.experts, t.n_experts, cache_slots) if cache_slots > 0 and t is not None else None
            for part, t in (("train", train), ("heldout", held))}
    for name in names:
        tr = evaluate(train, perms[name], geometry, gap, cache_slots, hits=hits["train"])
        ho = evaluate(held, perms[name], geometry, gap, cache_slots, hits=hits["heldout"]) if held is not None else None
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


# ---------------------------------------------------------------- other formats


HEAT_METHODS = ("heat", "stock")


def plan_from_usage(usage: Usage, method: str, where: str, model=None) -> Plan:
    """A plan from heat alone (colibri's .coli_usage): hottest first, or stock. Co-activation
    orders need tokens, so every other method is refused."""
    if method not in HEAT_METHODS:
        raise MboltError(f"{where}: holds heat only (.coli_usage: counts per expert, no tokens); --method {method} "
                         "needs which experts route together: use --method heat (or a trace with tokens)")
    perm = identity_perm(usage.n_layers, usage.n_experts)
    layers = usage.moe_layers()
    if model is not None:
        moe = {layer.index for layer in model.moe_layers}
        stray = [int(l) for l in layers if int(l) not in moe]
        if stray:
            raise MboltError(f"{where}: counts at layer {stray[0]}, which is not an MoE layer of {model.path}")
    if method == "heat":  # stock: the identity as it is (no co-activation matrix either way)
        for l in layers:
            perm[l] = heat_order(usage.heat[l])
    meta = {"fingerprint": "", "heat_only": True, "source": where, "moe_layers": layers.tolist(),
            "notes": list(usage.notes)}
    return Plan(method, usage.n_layers, usage.n_experts, perm, usage.heat.copy(), meta)


def perms_dict(plan: Plan, train: Trace) -> dict:
    """The original mbolt's perms.json of a plan: per layer clique_perm (the groups, hottest
    first), chain_perm (its chain through them), heat_perm and the training heat; mbolt adds
    each layer's `perm` (the plan's own order, which `reorder` uses) and an "mbolt" object."""
    co = coactivation(train)
    groups = plan.meta.get("groups") or layer_groups(co)
    layers = []
    for l in range(plan.n_layers):
        heat = plan.heat[l]
        g = groups[l] if groups[l] is not None else [[e] for e in range(plan.n_experts)]
        layers.append({
            "layer": l,
            "clique_perm": [e for grp in g for e in grp],
            "chain_perm": order(co.counts[l], heat, "mbolt-chain", clusters=g).tolist(),
            "heat_perm": heat_order(heat).tolist(),
            "heat": [float(h) for h in heat],
            "perm": plan.perm[l].tolist(),
        })
    return {"format": PERMS_FORMAT, "n_layers": plan.n_layers, "n_expert": plan.n_experts, "n_tokens": train.n_tokens,
            "train_frac": plan.meta.get("split", {}).get("train_frac"), "train_tokens": train.n_tokens,
            "mbolt": {"method": plan.method, "fingerprint": plan.meta.get("fingerprint", ""),
                      "note": "reorder takes each layer's perm; tools of the original take chain_perm"},
            "layers": layers}


# ---------------------------------------------------------------- the `mbolt plan` stage

PLAN_FORMATS = ("mbolt", "perms")


def _check_plan_outputs(out, heldout_out, inputs, force, fingerprints) -> None:
    # the one output rule, before any work: never the trace, the model, nor the model the
    # trace was recorded from; --force replaces only an earlier plan / held-out trace
    from mbolt.core.atomic import check_output

    if out is not None and heldout_out is not None and Path(out).resolve() == Path(heldout_out).resolve():
        raise MboltError(f"{out}: given both as the plan and as the held-out trace")
    for o, kind, what in ((out, "plan", "plan"), (heldout_out, "mbtrace", "held-out trace")):
        if o is not None:
            check_output(o, kind=kind, inputs=inputs, force=force, protected_fingerprints=fingerprints, what=what)


def _usage_plan_file(path, out, method, model, fmt, force, compare, heldout_out) -> dict:
    from mbolt.trace.formats import load_usage

    if fmt != "mbolt":
        raise MboltError(f"{path}: holds heat only: --format {fmt} needs co-activation")
    if compare or heldout_out is not None:
        raise MboltError(f"{path}: holds heat only (no tokens): nothing to score or hold out (--compare, --heldout)")
    mm = None
    if model is not None:
        from mbolt.core.moe_map import moe_map

        mm = moe_map(model)
    usage = load_usage(path, n_layers=mm.n_layers if mm else None, n_experts=mm.n_experts if mm else None)
    _check_plan_outputs(out, None, [i for i in (path, model) if i is not None], force, ())
    plan = plan_from_usage(usage, method, str(path), mm)
    result = {"trace": str(path), "method": method, "heat_only": True, "n_layers": plan.n_layers,
              "n_experts": plan.n_experts, "moe_layers": len(plan.meta["moe_layers"]), "notes": usage.notes}
    if out is not None:
        save_plan(out, plan)
        result["out"] = str(out)
    return result


def plan_file(trace_path, out=None, *, method: str = "tsp", train_frac: float = 0.5,
              holdout_domain: str | None = None, phase: str = "decode", model=None, geometry: str | None = None,
              layout: str = "reorder", gap: int = 0, cache_slots: int = 0, compare: bool = False,
              bound: str = "auto", force: bool = True, progress=None, heldout_out=None, fmt: str = "mbolt") -> dict:
    """What `mbolt plan` does: build (and save) a plan; with `compare`, score every method;
    with `heldout_out`, write the held-out tokens as an .mbtrace (what `mbolt ab --replay` reads).
    `fmt` "perms" writes the original mbolt's perms.json instead of plan.json; a heat-only input
    (.coli_usage) gives a heat plan, unscored."""
    from mbolt.layout.evaluate import geometry_from_model
    from mbolt.trace.formats import is_heat_only

    if gap < 0 or cache_slots < 0:
        raise MboltError("--gap and --cache must be >= 0")
    if fmt not in PLAN_FORMATS:
        raise MboltError(f"unknown plan format {fmt!r} (choose from {', '.join(PLAN_FORMATS)})")
    paths = list(trace_path) if isinstance(trace_path, (list, tuple)) else [trace_path]
    heat_only = [p for p in paths if is_heat_only(p)]
    if heat_only:
        if len(paths) > 1:
            raise MboltError(f"{heat_only[0]}: a heat-only file cannot be merged with other traces")
        return _usage_plan_file(paths[0], out, method, model, fmt, force, compare, heldout_out)
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
    _check_plan_outputs(out, heldout_out, [i for i in (trace_path, model) if i is not None], force,
                        tuple(f for f in (trace.fingerprint,) if f))
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
        if fmt == "perms":
            from mbolt.core.atomic import json_default, write_text_atomic

            write_text_atomic(out, json.dumps(perms_dict(plan, train), default=json_default) + "\n")
        else:
            save_plan(out, plan)
        result["out"] = str(out)
        result["format"] = fmt
    return result
