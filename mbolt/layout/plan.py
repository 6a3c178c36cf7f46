"""The plan: per layer, the expert order a rewritten file will use, plus what it was built from.

`make_plan(trace, method)` splits the trace into training and held-out tokens, counts
co-activation on the training tokens, orders every MoE layer with one method, and records the
split, heat, groups and the trace's model fingerprint. `save_plan` / `load_plan` mirror each
other; `load_plan` validates every layer (a permutation of 0..E-1) and, given a model's shape,
the layer and expert counts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mbolt.atomic import json_default, write_text_atomic
from mbolt.errors import MboltError
from mbolt.layout.coact import Coact, coactivation, groups as find_groups
from mbolt.layout.evaluate import Geometry, evaluate, geometry_preset
from mbolt.layout.methods import METHODS, order
from mbolt.trace.model import DECODE, Trace

FORMAT = "mbolt.plan"
VERSION = 1
MIN_TRAIN_TOKENS = 2


@dataclass
class Plan:
    method: str
    n_layers: int
    n_experts: int
    perm: np.ndarray  # int32 [n_layers, E]: perm[l, p] = original expert id at position p
    heat: np.ndarray  # float64 [n_layers, E]: training heat per ORIGINAL expert id
    meta: dict = field(default_factory=dict)  # split, phase, k, fingerprint, groups, timing...

    @property
    def pos(self) -> np.ndarray:
        """pos[l, e] = position of original expert e."""
        out = np.empty_like(self.perm)
        out[np.arange(self.n_layers)[:, None], self.perm] = np.arange(self.n_experts)[None, :]
        return out

    def to_dict(self) -> dict:
        groups = self.meta.get("groups") or [None] * self.n_layers
        meta = {k: v for k, v in self.meta.items() if k != "groups"}
        return {
            "format": FORMAT,
            "version": VERSION,
            "method": self.method,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "fingerprint": self.meta.get("fingerprint", ""),
            "meta": meta,
            "layers": [
                {"layer": l, "perm": self.perm[l].tolist(), "heat": self.heat[l].tolist(),
                 **({"groups": groups[l]} if groups[l] is not None else {})}
                for l in range(self.n_layers)
            ],
        }


def validate_plan(plan: Plan, where: str = "plan", n_layers: int | None = None, n_experts: int | None = None) -> None:
    if n_layers is not None and plan.n_layers != n_layers:
        raise MboltError(f"{where}: plan has {plan.n_layers} layers, model has {n_layers}")
    if n_experts is not None and plan.n_experts != n_experts:
        raise MboltError(f"{where}: plan has {plan.n_experts} experts per layer, model has {n_experts}")
    if plan.perm.shape != (plan.n_layers, plan.n_experts):
        raise MboltError(f"{where}: perm table is {plan.perm.shape}, expected "
                         f"({plan.n_layers}, {plan.n_experts})")
    ref = np.arange(plan.n_experts)
    for l in range(plan.n_layers):
        if not np.array_equal(np.sort(plan.perm[l]), ref):
            bad = sorted(set(ref) ^ set(plan.perm[l].tolist()))[:5]
            raise MboltError(f"{where}: layer {l}: perm is not a permutation of 0..{plan.n_experts - 1} "
                             f"(missing or repeated: {bad})")


def save_plan(path: str | os.PathLike, plan: Plan) -> Path:
    validate_plan(plan)
    write_text_atomic(path, json.dumps(plan.to_dict(), default=json_default) + "\n")
    return Path(path)


def load_plan(path: str | os.PathLike, n_layers: int | None = None, n_experts: int | None = None) -> Plan:
    where = str(path)
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MboltError(f"{where}: plan file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MboltError(f"{where}: not a readable plan file ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise MboltError(f"{where}: not an mbolt plan (format field missing)")
    if d.get("version") != VERSION:
        raise MboltError(f"{where}: unsupported plan version {d.get('version')}")
    try:
        L, E = int(d["n_layers"]), int(d["n_experts"])
        layers = d["layers"]
        if len(layers) != L:
            raise MboltError(f"{where}: header says {L} layers, file has {len(layers)}")
        perm = np.zeros((L, E), np.int32)
        heat = np.zeros((L, E))
        groups = []
        for l, rec in enumerate(layers):
            if int(rec.get("layer", l)) != l:
                raise MboltError(f"{where}: layer record {l} is labelled layer {rec.get('layer')}")
            p = np.asarray(rec["perm"])
            if p.shape != (E,) or (p.size and not np.issubdtype(p.dtype, np.integer)):
                raise MboltError(f"{where}: layer {l}: perm has {p.size} entries, expected {E} integers")
            perm[l] = p
            h = np.asarray(rec.get("heat", np.zeros(E)), dtype=np.float64)
            if h.shape != (E,):
                raise MboltError(f"{where}: layer {l}: heat has {h.size} entries, expected {E}")
            heat[l] = h
            groups.append(rec.get("groups"))
    except (KeyError, TypeError, ValueError) as e:
        raise MboltError(f"{where}: malformed plan ({e!r})") from None
    meta = dict(d.get("meta") or {})
    meta["fingerprint"] = d.get("fingerprint", meta.get("fingerprint", ""))
    if any(g is not None for g in groups):
        meta["groups"] = groups
    plan = Plan(str(d.get("method", "")), L, E, perm, heat, meta)
    validate_plan(plan, where, n_layers, n_experts)
    return plan


# ---------------------------------------------------------------- building


def split_trace(trace: Trace, *, train_frac: float = 0.5, holdout_domain: str | None = None,
                phase: str = "decode") -> tuple[Trace, Trace | None, dict]:
    """(training, held-out or None, description). Tokens in trace order; phase filter first."""
    if trace.n_tokens == 0:
        raise MboltError("trace has no tokens")
    if phase == "decode":
        sel = trace.phase == DECODE
        if not sel.any():
            raise MboltError("trace has no decode tokens (use --phase all to plan on prefill tokens)")
        trace = trace.select(sel)
    elif phase != "all":
        raise MboltError(f"unknown phase {phase!r} (decode, all)")
    N = trace.n_tokens
    if holdout_domain is not None:
        # a domain matches exactly or as a family prefix: "dolly" holds out "dolly/open_qa" too
        held_seqs = [s for s, tag in trace.domains.items()
                     if tag == holdout_domain or tag.startswith(holdout_domain.rstrip("/") + "/")]
        held = np.isin(trace.seq, held_seqs)
        if not held.any():
            known = sorted(set(trace.domains.values()))
            which = "decode tokens" if phase == "decode" else "tokens"
            raise MboltError(f"no {which} in domain {holdout_domain!r} (trace domains: {known or 'none'})")
        if held.all():
            raise MboltError(f"every token is in domain {holdout_domain!r}: nothing left to train on")
        info = {"by": "domain", "holdout_domain": holdout_domain}
    else:
        if not 0.0 < train_frac <= 1.0:
            raise MboltError(f"--train-frac must be in (0, 1], got {train_frac}")
        n_train = int(np.floor(N * train_frac + 1e-9))
        held = np.arange(N) >= n_train
        if train_frac < 1.0 and (n_train < MIN_TRAIN_TOKENS or not held.any()):
            raise MboltError(f"trace has {N} {phase} tokens: too few for a {train_frac:g} train/held-out split")
        info = {"by": "fraction", "train_frac": float(train_frac)}
    train = trace.select(~held)
    if train.n_tokens < MIN_TRAIN_TOKENS:
        raise MboltError(f"only {train.n_tokens} training token(s): too few to plan")
    info.update(phase=phase, n_train=train.n_tokens, n_heldout=int(held.sum()))
    return train, (trace.select(held) if held.any() else None), info


def plan_orders(co: Coact, method: str, *, geometry: Geometry | None = None, gap: int = 0,
                far_credit: float = 1.0, clusters=None, **opts) -> np.ndarray:
    """perm [n_layers, E] for every layer (identity where nothing was recorded)."""
    L, E = co.n_layers, co.n_experts
    perm = np.tile(np.arange(E, dtype=np.int32), (L, 1))
    if method == "tsp" and gap > 0 and geometry is not None and "far" not in opts:
        opts["far"] = geometry.far_weights(gap, far_credit)
    for l in co.layers:
        o = dict(opts)
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


def load_any_trace(path: str | os.PathLike) -> Trace:
    """A .mbtrace, or any format `mbolt.trace.importers` understands (auto-detected)."""
    from mbolt.trace.format import is_mbtrace, read_trace

    if not Path(path).exists():
        raise MboltError(f"{path}: trace file not found")
    if is_mbtrace(path):
        return read_trace(path)
    from mbolt.trace.importers import import_trace

    return import_trace(path)


def check_model(trace: Trace, moemap, where: str = "") -> None:
    """Trace and model must describe the same model: expert count, layers, fingerprint."""
    where = where or str(moemap.path)
    if moemap.n_experts != trace.n_experts:
        raise MboltError(f"{where}: model has {moemap.n_experts} experts per layer, trace has {trace.n_experts}")
    if moemap.n_layers != trace.n_layers:
        raise MboltError(f"{where}: model has {moemap.n_layers} layers, trace has {trace.n_layers}")
    moe = {l.index for l in moemap.layers if not l.dense}
    for l in trace.moe_layers().tolist():
        if l not in moe:
            raise MboltError(f"{where}: trace routes experts at layer {l}, which is not an MoE layer of the model")
    if trace.fingerprint and trace.fingerprint not in (moemap.fingerprint, moemap.source_fingerprint):
        raise MboltError(f"{where}: trace was recorded on a different model (fingerprint {trace.fingerprint[:12]} "
                         f"vs {moemap.source_fingerprint[:12]})")


def plan_file(trace_path, out=None, *, method: str = "tsp", train_frac: float = 0.5,
              holdout_domain: str | None = None, phase: str = "decode", model=None, geometry: str | None = None,
              layout: str = "reorder", gap: int = 0, cache_slots: int = 0, compare: bool = False,
              bound: str = "auto", force: bool = True, progress=None, heldout_out=None) -> dict:
    """What `mbolt plan` does: build (and save) a plan; with `compare`, score every method;
    with `heldout_out`, write the held-out tokens as an .mbtrace (what `mbolt ab --replay` reads)."""
    from mbolt.layout.evaluate import geometry_from_model

    if gap < 0 or cache_slots < 0:
        raise MboltError("--gap and --cache must be >= 0")
    trace = load_any_trace(trace_path)
    if model is not None:
        from mbolt.gguf.moe_map import moe_map

        mm = moe_map(model)
        check_model(trace, mm, str(model))
        geo = geometry_from_model(mm, layout)
        if not trace.fingerprint:
            trace.fingerprint = mm.source_fingerprint
    else:
        geo = geometry_preset(geometry or "unit", layout)
    if out is not None and Path(out).exists() and not force:
        raise MboltError(f"{out}: output exists (use --force to overwrite)")
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
        from mbolt.trace.format import write_trace

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
