"""`mbolt report`: pictures of results files (matplotlib, headless).

One entry point, `plot(src, out)`, recognises what `src` is by its content:
- an `mbolt ab` result (or demo.json): speedup vs baseline per arm with its bootstrap 95% CI,
  next to reads/token;
- `results/layout.json` (scripts/bench_layout.py): held-out reads/token per method and layout
  for each dataset, with the lower bound on reads;
- an `mbolt cache --json` result: hit rate per budget for each policy, Belady as the bound;
- a trace plus a plan (`co-activation heatmap`): one layer's co-activation counts in stock
  order and in the plan's order, so the blocks the planner found are visible.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mbolt.core.errors import MboltError  # noqa: E402


def _save(fig, out: str | Path) -> Path:
    from mbolt.core.atomic import atomic_output

    out = Path(out)
    fig.tight_layout()
    with atomic_output(out) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return out


def kind_of(d: dict) -> str:
    if "summary" in d and "rounds" in d and "arms" in d:
        return "ab"
    if "ab" in d and "verify" in d and "geometry" in d:
        return "demo"
    if "goals" in d and any(isinstance(v, dict) and "reorder" in v for v in d.values()):
        return "layout"
    if "rows" in d and d["rows"] and "belady" in d["rows"][0]:
        return "cache"
    raise MboltError("unrecognised results file: expected an `mbolt ab`/`demo` result, results/layout.json "
                     "or an `mbolt cache --json` result")


def read_result(src: str | Path) -> tuple[str, dict]:
    """(kind, content) of a results file; a demo.json stands for its A/B result, found relative
    to the demo.json itself (result files store paths relative to themselves)."""
    from mbolt.core.atomic import resolve_stored_path

    src = Path(src)
    try:
        d = json.loads(src.read_text(encoding="utf-8"))
    except OSError as e:
        raise MboltError(f"{src}: {e.strerror}") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MboltError(f"{src}: not JSON (for a trace, give --plan to draw the co-activation heatmap)") from None
    try:
        kind = kind_of(d) if isinstance(d, dict) else kind_of({})
    except (MboltError, TypeError, KeyError, IndexError) as e:
        raise MboltError(f"{src}: {e if isinstance(e, MboltError) else 'unrecognised results file'}") from None
    if kind == "demo":
        try:
            ab = resolve_stored_path(d["ab"]["result"], src)
            d = json.loads(ab.read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MboltError(f"{src}: its A/B result is not readable ({e})") from None
        kind = "ab"
    return kind, d


def _malformed(src, fn, *args, **kw):
    """Run a drawing/series function on a results file's content: a results file is user input,
    so a field missing or of the wrong type is one error naming the file."""
    try:
        return fn(*args, **kw)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise MboltError(f"{src}: malformed results file ({type(e).__name__}: {e})") from None


def series(src: str | Path) -> dict:
    """What `plot(src, ...)` draws, as data (`mbolt report --json`)."""
    kind, d = read_result(src)
    return {"kind": kind, "source": str(src), **_malformed(src, SERIES[kind], d)}


def plot(src: str | Path, out: str | Path, **opts) -> Path:
    kind, d = read_result(src)
    return _malformed(src, {"ab": plot_ab, "layout": plot_layout, "cache": plot_cache}[kind], d, out,
                      title=Path(src).name)


def ab_series(d: dict) -> dict:
    rows = [s for s in d["summary"] if s.get("rounds")]
    return {"name": d.get("name"), "mode": d.get("mode"), "cold": d.get("cold", True),
            "baseline": d.get("baseline", rows[0]["arm"] if rows else None),
            "arms": [{"arm": s["arm"], "speedup_vs_baseline_median": s["speedup_vs_baseline_median"],
                      "speedup_ci95": s.get("speedup_ci95"), "reads_per_token": s["reads_per_token"]}
                     for s in rows]}


def plot_ab(d: dict, out, title: str = "") -> Path:
    a = ab_series(d)
    rows = a["arms"]
    names = [s["arm"] for s in rows]
    sp = np.array([s["speedup_vs_baseline_median"] or np.nan for s in rows])
    ci = np.array([s["speedup_ci95"] or [np.nan, np.nan] for s in rows], float)
    reads = np.array([s["reads_per_token"] for s in rows])
    y = np.arange(len(rows))[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 0.5 * len(rows) + 1.8), sharey=True)
    err = np.abs(np.vstack([sp - ci[:, 0], ci[:, 1] - sp]))
    a1.barh(y, sp, xerr=err, color=["#888" if "(A/A)" in n else "#3a7" for n in names], capsize=3)
    a1.axvline(1.0, color="k", lw=0.8)
    a1.set_yticks(y, names)
    a1.set_xlabel(f"I/O speedup vs {a['baseline']} (median, 95% CI)")
    a2.barh(y, reads, color="#47a")
    a2.set_xlabel("reads / token")
    pat = (d["arms"][0].get("read_pattern") or {}).get("description", "")
    fig.suptitle(f"{a['name'] or title}: cold {a['mode'] or ''}" + ("" if a["cold"] else " (NOT cold)"),
                 fontsize=11)
    if pat:
        fig.text(0.01, 0.005, f"baseline read pattern: {pat}", fontsize=7)
    return _save(fig, out)


def layout_series(d: dict) -> dict:
    out = {}
    for name in (k for k, v in d.items() if isinstance(v, dict) and "reorder" in v):
        out[name] = {}
        for layout in ("reorder", "packed"):
            block = d[name].get(layout)
            if not block:
                continue
            rows = [r for r in block["rows"] if "heldout" in r and r.get("heldout")]
            out[name][layout] = {
                "methods": [r["method"] for r in rows],
                "heldout_reads_per_token": [r["heldout"]["reads_per_token"] for r in rows],
                # the LP bound on the held-out tokens themselves: no order can do better
                "bound": ((block.get("bound") or {}).get("heldout") or {}).get("reads_per_token")}
    return {"datasets": out}


def plot_layout(d: dict, out, title: str = "") -> Path:
    datasets = layout_series(d)["datasets"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.8), squeeze=False)
    for ax, (name, layouts) in zip(axes[0], datasets.items()):
        methods = []
        for j, layout in enumerate(("reorder", "packed")):
            block = layouts.get(layout)
            if not block:
                continue
            methods = block["methods"]
            x = np.arange(len(methods)) + (j - 0.5) * 0.4
            ax.bar(x, block["heldout_reads_per_token"], width=0.4, label=layout)
            if block["bound"]:
                ax.axhline(block["bound"], ls="--", lw=0.8, color=f"C{j}")
        ax.set_xticks(np.arange(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("held-out reads / token")
        ax.legend(fontsize=8)
    fig.suptitle("held-out reads per token by ordering method and layout (dashed: LP bound)", fontsize=11)
    return _save(fig, out)


CACHE_POLICIES = ("learned-pin", "lru", "os", "belady", "opt")


def cache_series(d: dict) -> dict:
    return {"mode": d.get("mode"), "phase": d.get("phase"), "test_tokens": d.get("test_tokens"),
            "budgets": [r["budget"] for r in d["rows"]],
            "hit_rate": {p: [r[p] for r in d["rows"]] for p in CACHE_POLICIES if p in d["rows"][0]}}


def plot_cache(d: dict, out, title: str = "") -> Path:
    """Hit rate per budget for each policy of an `mbolt cache` sweep; Belady dashed (the bound)."""
    c = cache_series(d)
    budgets = c["budgets"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, rates in c["hit_rate"].items():
        style = dict(ls="--", color="k") if policy == "belady" else {}
        ax.plot(budgets, [100 * r for r in rates], marker="o", label=policy, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("expert slots per layer")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(f"{title}: {c['mode'] or ''}, {c['test_tokens'] or '?'} {c['phase'] or ''} tokens", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out)


SERIES = {"ab": ab_series, "layout": layout_series, "cache": cache_series}


def heatmap_series(trace_path, plan_path, layer: int | None = None) -> dict:
    """One layer's co-activation counts (stock order) and the plan's order of that layer."""
    from mbolt.layout.coact import coactivation
    from mbolt.core.plan import load_plan
    from mbolt.trace.formats import load_trace

    trace = load_trace(trace_path)
    plan = load_plan(plan_path, n_layers=trace.n_layers, n_experts=trace.n_experts)
    co = coactivation(trace)
    layers = co.layers.tolist()
    if layer is None:
        layer = layers[0]
    if layer not in layers:
        raise MboltError(f"{trace_path}: layer {layer} has no routed tokens (MoE layers: {layers[0]}..{layers[-1]})")
    return {"kind": "heatmap", "source": str(trace_path), "plan": str(plan_path), "layer": int(layer),
            "method": plan.method, "n_tokens": trace.n_tokens, "perm": plan.perm[layer].tolist(),
            "counts": np.asarray(co.counts[layer], float).tolist()}


def plot_heatmap(trace_path, plan_path, out, layer: int | None = None) -> Path:
    """One layer's co-activation counts in stock order and in the plan's order."""
    h = heatmap_series(trace_path, plan_path, layer)
    C = np.asarray(h["counts"])
    perm = np.asarray(h["perm"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.6))
    vmax = np.percentile(C[C > 0], 99) if (C > 0).any() else 1
    a1.imshow(C, cmap="magma", vmax=vmax)
    a1.set_title(f"layer {h['layer']}: stock expert order")
    a2.imshow(C[np.ix_(perm, perm)], cmap="magma", vmax=vmax)
    a2.set_title(f"layer {h['layer']}: {h['method']} order")
    for a in (a1, a2):
        a.set_xlabel("expert position")
    a1.set_ylabel("expert position")
    fig.suptitle(f"co-activation counts ({h['n_tokens']} tokens)", fontsize=11)
    return _save(fig, out)
