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


def plot(src: str | Path, out: str | Path, **opts) -> Path:
    src = Path(src)
    try:
        d = json.loads(src.read_text(encoding="utf-8"))
    except OSError as e:
        raise MboltError(f"{src}: {e.strerror}") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MboltError(f"{src}: not JSON (for a trace, give --plan to draw the co-activation heatmap)") from None
    try:
        kind = kind_of(d) if isinstance(d, dict) else kind_of({})
        if kind == "demo":
            d = json.loads(Path(d["ab"]["result"]).read_text())
            kind = "ab"
        return {"ab": plot_ab, "layout": plot_layout, "cache": plot_cache}[kind](d, out, title=src.name)
    except MboltError as e:
        raise MboltError(f"{src}: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OSError) as e:
        # a results file is user input: a field missing or of the wrong type is its fault
        raise MboltError(f"{src}: malformed results file ({type(e).__name__}: {e})") from None


def plot_ab(d: dict, out, title: str = "") -> Path:
    rows = [s for s in d["summary"] if s.get("rounds")]
    names = [s["arm"] for s in rows]
    sp = np.array([s["speedup_vs_baseline_median"] or np.nan for s in rows])
    ci = np.array([s.get("speedup_ci95") or [np.nan, np.nan] for s in rows], float)
    reads = np.array([s["reads_per_token"] for s in rows])
    y = np.arange(len(rows))[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 0.5 * len(rows) + 1.8), sharey=True)
    err = np.abs(np.vstack([sp - ci[:, 0], ci[:, 1] - sp]))
    a1.barh(y, sp, xerr=err, color=["#888" if "(A/A)" in n else "#3a7" for n in names], capsize=3)
    a1.axvline(1.0, color="k", lw=0.8)
    a1.set_yticks(y, names)
    a1.set_xlabel(f"I/O speedup vs {d.get('baseline', names[0])} (median, 95% CI)")
    a2.barh(y, reads, color="#47a")
    a2.set_xlabel("reads / token")
    pat = (d["arms"][0].get("read_pattern") or {}).get("description", "")
    fig.suptitle(f"{d.get('name', title)}: cold {d.get('mode', '')}" + ("" if d.get("cold", True) else " (NOT cold)"),
                 fontsize=11)
    if pat:
        fig.text(0.01, 0.005, f"baseline read pattern: {pat}", fontsize=7)
    return _save(fig, out)


def plot_layout(d: dict, out, title: str = "") -> Path:
    datasets = [k for k, v in d.items() if isinstance(v, dict) and "reorder" in v]
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.8), squeeze=False)
    for ax, name in zip(axes[0], datasets):
        for j, layout in enumerate(("reorder", "packed")):
            block = d[name].get(layout)
            if not block:
                continue
            rows = [r for r in block["rows"] if "heldout" in r and r.get("heldout")]
            methods = [r["method"] for r in rows]
            vals = [r["heldout"]["reads_per_token"] for r in rows]
            x = np.arange(len(rows)) + (j - 0.5) * 0.4
            ax.bar(x, vals, width=0.4, label=layout)
            bound = ((block.get("bound") or {}).get("heldout") or {}).get("reads_per_token")
            if bound:  # the LP bound on the held-out tokens themselves: no order can do better
                ax.axhline(bound, ls="--", lw=0.8, color=f"C{j}")
        ax.set_xticks(np.arange(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("held-out reads / token")
        ax.legend(fontsize=8)
    fig.suptitle("held-out reads per token by ordering method and layout (dashed: LP bound)", fontsize=11)
    return _save(fig, out)


CACHE_POLICIES = ("learned-pin", "lru", "os", "belady")


def plot_cache(d: dict, out, title: str = "") -> Path:
    """Hit rate per budget for each policy of an `mbolt cache` sweep; Belady dashed (the bound)."""
    budgets = [r["budget"] for r in d["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in CACHE_POLICIES:
        if policy not in d["rows"][0]:
            continue
        style = dict(ls="--", color="k") if policy == "belady" else {}
        ax.plot(budgets, [100 * r[policy] for r in d["rows"]], marker="o", label=policy, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("expert slots per layer")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(f"{title}: {d.get('mode', '')}, {d.get('test_tokens', '?')} {d.get('phase', '')} tokens", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_heatmap(trace_path, plan_path, out, layer: int | None = None) -> Path:
    """One layer's co-activation counts in stock order and in the plan's order."""
    from mbolt.layout.coact import coactivation
    from mbolt.core.plan import load_plan
    from mbolt.core.trace_import import load_trace

    trace = load_trace(trace_path)
    plan = load_plan(plan_path, n_layers=trace.n_layers, n_experts=trace.n_experts)
    co = coactivation(trace)
    layers = co.layers.tolist()
    if layer is None:
        layer = layers[0]
    if layer not in layers:
        raise MboltError(f"{trace_path}: layer {layer} has no routed tokens (MoE layers: {layers[0]}..{layers[-1]})")
    C = np.asarray(co.counts[layer], float)
    perm = plan.perm[layer]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.6))
    vmax = np.percentile(C[C > 0], 99) if (C > 0).any() else 1
    a1.imshow(C, cmap="magma", vmax=vmax)
    a1.set_title(f"layer {layer}: stock expert order")
    a2.imshow(C[np.ix_(perm, perm)], cmap="magma", vmax=vmax)
    a2.set_title(f"layer {layer}: {plan.method} order")
    for a in (a1, a2):
        a.set_xlabel("expert position")
    a1.set_ylabel("expert position")
    fig.suptitle(f"co-activation counts ({trace.n_tokens} tokens)", fontsize=11)
    return _save(fig, out)
