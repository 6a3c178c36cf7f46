"""Rich renderings for the bench stage: cache sweep, A/B rounds, probe, prediction."""

from __future__ import annotations

from rich.table import Table


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def cache_table(sweep, title: str = "") -> Table:
    d = sweep.to_dict()
    t = Table(title=title or (
        f"cache hit rate, {d['mode']} ({d['phase']} tokens: train {d['train_tokens']}, "
        f"measured {d['test_tokens']}; pin share {d['pin_share']:.2f})"), header_style="bold")
    for col in ("slots", "pin+lru", "learned-pin", "lru", "os (global)", "belady", "pin - lru"):
        t.add_column(col, justify="right")
    for r in d["rows"]:
        t.add_row(str(r["budget"]), f"{r['pin']}+{r['lru_slots']}", pct(r["learned-pin"]), pct(r["lru"]),
                  pct(r["os"]), pct(r["belady"]), f"{100 * (r['learned-pin'] - r['lru']):+.1f} pp")
    return t


def ab_table(result) -> Table:
    d = result if isinstance(result, dict) else result.to_dict()
    metric = d["metric"]
    cold = "cold (mincore-proven)" if d["cold"] else "NOT COLD (eviction unproven)"
    t = Table(title=f"{d['name']}: {d['mode']}, {len({r['round'] for r in d['rounds']})} rounds, {cold}; "
                    f"speedup = {d['baseline']} {metric}/token over arm's, per round", header_style="bold")
    cols = ("arm", "ms/token", "speedup", "95% CI", "reads/tok", "MB/tok", "MB/s", "tok/s", "TTFT ms", "hit",
            "resident")
    for c in cols:
        t.add_column(c, justify="left" if c == "arm" else "right", no_wrap=c in ("arm", "95% CI"))
    for s in d["summary"]:
        if not s.get("rounds"):
            t.add_row(s["arm"], *["-"] * (len(cols) - 1))
            continue
        sp = s["speedup_vs_baseline_median"]
        lo, hi = s["speedup_ci95"]
        t.add_row(s["arm"], f"{s[f'{metric}_per_token_ms_median']:.3f}", "-" if sp is None else f"{sp:.3f}x",
                  f"{lo:.3f}-{hi:.3f}", f"{s['reads_per_token']:.1f}", f"{s['mb_per_token']:.3f}",
                  f"{s['mb_per_s']:.0f}", f"{s['tokens_per_s']:.1f}", f"{s['ttft_ms_median']:.2f}",
                  pct(s["hit_rate"]), pct(s["resident_max"]))
    return t


def prediction_table(rows: list[dict]) -> Table:
    t = Table(title="prediction (probe figures + evaluator) vs measurement", header_style="bold")
    for c in ("arm", "reads/tok pred", "meas", "ms/tok pred", "meas", "speedup pred", "meas", "error"):
        t.add_column(c, justify="left" if c == "arm" else "right")
    for r in rows:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        t.add_row(r["arm"], f(r.get("pred_reads_per_token"), ".1f"), f(r.get("meas_reads_per_token"), ".1f"),
                  f(r.get("pred_ms_per_token"), ".3f"), f(r.get("meas_ms_per_token"), ".3f"),
                  f(r.get("pred_speedup"), ".3f"), f(r.get("meas_speedup"), ".3f"),
                  "-" if r.get("speedup_error") is None else f"{100 * r['speedup_error']:+.1f}%")
    return t


def probe_table(probe: dict) -> Table:
    t = Table(title=f"cold random reads on {probe.get('device', '?')} ({probe.get('filesystem', '?')}), "
                    f"file {probe.get('file', '?')}", header_style="bold")
    for c in ("mode", "QD", "size", "t_op us (median)", "MB/s", "resident before"):
        t.add_column(c, justify="right")
    for r in probe["rows"]:
        t.add_row(r["mode"], str(r["qd"]), f"{r['size'] // 1024} KiB", f"{r['t_op_us']:.0f}", f"{r['mb_per_s']:.0f}",
                  pct(r.get("resident_before")))
    return t
