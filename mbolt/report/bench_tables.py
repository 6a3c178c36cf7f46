"""Rich renderings for the bench stage: cache sweep, A/B rounds, probe, prediction."""

from __future__ import annotations

from rich.table import Table

from mbolt.report.tables import data_table


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def cache_table(sweep, title: str = "") -> Table:
    d = sweep.to_dict()
    t = Table(title=title or (
        f"cache hit rate, {d['mode']} ({d['phase']} tokens: train {d['train_tokens']}, "
        f"measured {d['test_tokens']}; pin share {d['pin_share']:.2f})"), header_style="bold")
    for col in ("slots", "pin+lru", "learned-pin", "lru", "os (global)", "belady", "opt (MIN)", "pin - lru"):
        t.add_column(col, justify="right")
    for r in d["rows"]:
        t.add_row(str(r["budget"]), f"{r['pin']}+{r['lru_slots']}", pct(r["learned-pin"]), pct(r["lru"]),
                  pct(r["os"]), pct(r["belady"]), pct(r.get("opt")), f"{100 * (r['learned-pin'] - r['lru']):+.1f} pp")
    return t


def ab_table(result) -> Table:
    d = result if isinstance(result, dict) else result.to_dict()
    metric = d["metric"]
    cold = "cold (mincore-proven)" if d["cold"] else "NOT COLD (eviction unproven)"
    rows = [x for x in d["summary"] if x.get("rounds")]
    cached = any(x["hit_rate"] for x in rows)
    resident = max((x["resident_max"] for x in rows), default=0.0)
    decode = d["mode"] == "decode"  # time to first token means something only when the engine generates
    n_rounds = len({r["round"] for r in d["rounds"]})
    cols = ["arm", f"{metric[:-2]} ms\n/token", "speedup", "95% CI", "reads\n/token", "MB\n/token", "MB/s",
            "tok/s"] + (["TTFT\nms"] if decode else []) + (["hit\nrate"] if cached else [])
    llama = d.get("engine") == "llama.cpp"  # s = share of decode time in the explicit reads
    cols += ["s", "dev MB\n/token"] if llama else []
    ci_word = "exact 95% CI of that median" if n_rounds >= 10 else "no CI below 10 rounds"
    t = data_table(f"{d['name']}: {d['mode']}, {n_rounds} rounds, {cold}, resident after eviction <= "
                   f"{pct(resident)}; speedup = median over rounds of ({d['baseline']} {metric[:-2]}/token / the "
                   f"arm's) in the same round ({ci_word}); times are medians over rounds", cols)
    for x in d["summary"]:
        if not x.get("rounds"):
            t.add_row(x["arm"], *["-"] * (len(cols) - 1))
            continue
        sp = x["speedup_vs_baseline_median"]
        ci = x.get("speedup_ci95")
        t.add_row(x["arm"], f"{x[f'{metric}_per_token_ms_median']:.2f}", "-" if sp is None else f"{sp:.2f}",
                  f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-", f"{x['reads_per_token']:.1f}", f"{x['mb_per_token']:.2f}",
                  _opt(x['mb_per_s'], ".0f"), f"{x['tokens_per_s']:.1f}",
                  *([f"{x['ttft_ms_median']:.1f}"] if decode else []), *([pct(x["hit_rate"])] if cached else []),
                  *([_opt(x.get("read_share_s"), ".2f"), _opt(x.get("device_bytes_per_token", 0) / 1e6
                     if x.get("device_bytes_per_token") is not None else None, ".2f")] if llama else []))
    return t


def _opt(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def prediction_table(rows: list[dict]) -> Table:
    t = data_table("prediction (each arm's route map + probe figures) vs measurement; speedup = median of per-round "
                   "ratios, predicted on the same rounds' tokens",
                   ["arm", "reads/tok\npred.", "\nmeas.", "ms/tok\npred.", "\nmeas.", "speedup\npred.", "\nmeas.",
                    "\nerror"])
    for r in rows:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        t.add_row(r["arm"], f(r.get("pred_reads_per_token"), ".1f"), f(r.get("meas_reads_per_token"), ".1f"),
                  f(r.get("pred_ms_per_token"), ".2f"), f(r.get("meas_ms_per_token"), ".2f"),
                  f(r.get("pred_speedup"), ".2f"), f(r.get("meas_speedup"), ".2f"),
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
