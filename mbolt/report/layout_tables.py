"""Rich tables for the layout planner (`mbolt plan`, `mbolt synth-trace`, `mbolt trace-stats`)."""

from __future__ import annotations

from rich import box
from rich.table import Table


def _f(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"


def plan_summary(res: dict) -> str:
    if res.get("heat_only"):
        line = (f"[bold]{res['method']}[/] plan from heat only: {res['n_layers']} layers x {res['n_experts']} experts, "
                f"{res['moe_layers']} layers with counts; not scored (no tokens)")
        for note in res.get("notes", []):
            line += f"\nnote: {note}"
        return line + (f"\nwrote [bold]{res['out']}[/]" if "out" in res else "")
    s = res["split"]
    g = res["geometry"]
    line = (f"[bold]{res['method']}[/] plan: {res['n_layers']} layers x {res['n_experts']} experts, k={res['k']}; "
            f"{s['n_train']:,} training / {s['n_heldout']:,} held-out {s['phase']} tokens; "
            f"layout {g['layout']}, slices {'/'.join(str(b) for b in g['slice_bytes'])} B, gap {res['gap']} B"
            f"{', cache ' + str(res['cache_slots']) if res['cache_slots'] else ''}; planned in {res['plan_seconds']:.2f} s")
    ev = res.get("heldout") or res["train"]
    which = "held-out" if "heldout" in res else "training"
    line += (f"\n{which}: {ev['reads_per_token']:,.1f} reads/token, {ev['bytes_per_token'] / 1e6:,.2f} MB/token, "
             f"{ev['runs_per_token_layer']:.3f} runs per token-layer")
    if "out" in res:
        line += f"\nwrote [bold]{res['out']}[/]"
    return line


def compare_table(cmp: dict) -> Table:
    t = Table(title=f"reads/token by expert order ({cmp['geometry']['layout']}, gap {cmp['gap']} B"
                    f"{', cache ' + str(cmp['cache_slots']) if cmp['cache_slots'] else ''})")
    # reads/token held-out and training, ratio to stock, runs per token-layer, training reads over the bound
    t.add_column("method", no_wrap=True, min_width=11)
    for col in ("held-out", "x stock", "runs/tl", "train", "x stock", "vs bound", "plan s"):
        t.add_column(col, justify="right")
    for r in cmp["rows"]:
        ho, tr = r["heldout"] or {}, r["train"]
        t.add_row(r["method"], _f(ho.get("reads_per_token")), _f(ho.get("ratio_to_stock"), 3),
                  _f(ho.get("runs_per_token_layer"), 3), _f(tr["reads_per_token"]), _f(tr.get("ratio_to_stock"), 3),
                  "-" if tr.get("over_bound") is None else f"{100 * tr['over_bound']:+.1f}%",
                  _f(r["plan_seconds"], 2))
    b = cmp.get("bound")
    if b:
        ho, tr = b.get("heldout", {}), b.get("train", {})
        stock = next((r for r in cmp["rows"] if r["method"] == "stock"), None)
        ratio = lambda part, v: (v / stock[part]["reads_per_token"]) if stock and stock[part] and v else None
        t.add_row(f"[italic]bound ({b['kind']}{'' if b['valid'] else ', gap/cache: not valid'})[/]",
                  _f(ho.get("reads_per_token")), _f(ratio("heldout", ho.get("reads_per_token")), 3),
                  _f(ho.get("runs_per_token_layer"), 3), _f(tr.get("reads_per_token")),
                  _f(ratio("train", tr.get("reads_per_token")), 3), "0.0%", "-")
        t.caption = ("runs/tl: gap-free runs per token-layer; vs bound: training reads over the bound. "
                     "bound: no order can read fewer (adjacency upper bound as reads, gap 0, no cache); "
                     "held-out bound uses the held-out tokens' own counts (an oracle)")
    return t


def match_table(rep: dict) -> Table:
    t = Table(title=f"calibration vs {rep['profile']} ({rep['n_tokens']:,} tokens)")
    t.add_column("statistic")
    t.add_column("published", justify="right")
    t.add_column("sampled", justify="right")
    he = rep["heat_entropy_bits"]
    t.add_row("heat entropy, mean over layers (bits)", f"{he['published_mean']:.3f}", f"{he['sampled_mean']:.3f}")
    t.add_row("heat entropy, worst layer |diff|", "", f"{he['max_abs_diff']:.3f}")
    t.add_row("heat correlation, worst layer", "", f"{rep['heat_corr_min']:.4f}")
    lp = rep["pair_lift_percentiles"]
    for q, a, b in zip(lp["q"], lp["published"], lp["sampled"]):
        t.add_row(f"lift of published pairs, p{q}", f"{a:.2f}", f"{b:.2f}")
    pc = rep["published_pairs_count_per_token"]
    t.add_row("published pairs co-selected per token", f"{pc['published']:.2f}", f"{pc['sampled']:.2f}")
    return t


def trace_stats_renderables(s: dict) -> list:
    """Rich renderables for `mbolt trace-stats` (a header table, the per-layer table, notes)."""
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    if s["source"]:
        head.add_row("trace", f"{s['source']} ({s['format']})")
    head.add_row("shape", f"{s['n_layers']} layers ({s['moe_layers']} routed) x "
                          f"{s['n_experts']} experts, k={s['k']}"
                          f"{', with routing weights' if s['weights'] else ''}")
    t = s["tokens"]
    head.add_row("tokens", f"{t['total']:,} ({t['prefill']:,} prefill, {t['decode']:,} decode)")
    tps = s["tokens_per_sequence"]
    head.add_row("sequences", f"{s['sequences']:,} (tokens each: min {tps['min']}, median "
                              f"{tps['median']:g}, max {tps['max']})")
    if s["domains"]:
        head.add_row("domains", ", ".join(f"{d}: {c}" for d, c in sorted(s["domains"].items())))
    if s["fingerprint"]:
        head.add_row("model", s["fingerprint"])
    sm = s["summary"]
    head.add_row("mean over layers",
                 f"entropy {f(sm['entropy_norm_mean'])} of max, lift p50/p90/p99 "
                 f"{f(sm['lift_p50_mean'], '{:.2f}')}/{f(sm['lift_p90_mean'], '{:.2f}')}/"
                 f"{f(sm['lift_p99_mean'], '{:.2f}')}, consecutive overlap "
                 f"{f(sm['overlap_mean'])}")

    tab = Table(title="per layer (H: heat entropy; pairs: co-activated >= 5 times; liftNN: "
                      "percentiles of their lift; H norm: H / log2 E; overlap: |S_t & S_t+1| / k, neighbours of one "
                      "sequence and phase)",
                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("layer", "tokens", "H bits", "H norm", "pairs", "lift50", "lift90", "lift99",
                "overlap"):
        tab.add_column(col, justify="right")
    for x in s["layers"]:
        tab.add_row(str(x["layer"]), f"{x['tokens']:,}", f(x["entropy_bits"]),
                    f(x["entropy_norm"]), str(x["pairs"]), f(x["lift_p50"], "{:.2f}"),
                    f(x["lift_p90"], "{:.2f}"), f(x["lift_p99"], "{:.2f}"), f(x["overlap"]))
    out = [head, tab, profile_cut_table([(f"this trace ({s['phase']} tokens)", s["profile_cut"])]
                                        + ([(s["compare"]["source"], s["compare"]["profile_cut"])]
                                           if s.get("compare") else []))]
    for note in s["notes"]:
        out.append(f"[yellow]note:[/] {note}")
    return out


CUT_ROWS = (("heat entropy / max", "entropy_norm", "{:.3f}"), ("hottest 10% share", "top10_share", "{:.3f}"),
            ("lift p50 (count >= 5, lift >= 1.5, top 2000)", "cut_lift_p50", "{:.2f}"),
            ("lift p90", "cut_lift_p90", "{:.2f}"), ("lift p99", "cut_lift_p99", "{:.1f}"),
            ("pairs in the cut", "cut_pairs", "{:,.0f}"), ("consecutive overlap", "overlap", "{:.3f}"),
            ("overlap / chance (k/E)", "overlap_vs_chance", "{:.2f}"),
            ("overlap / heat overlap", "overlap_vs_heat", "{:.2f}"))


def profile_cut_table(columns: list[tuple[str, dict]]) -> Table:
    """Means over layers in a co-activation profile's cut (layout/stats.py), one column per source."""
    t = Table(title="in the profile's cut (means over layers; heat overlap: two random tokens of the same "
                    "heat)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("statistic")
    for name, _ in columns:
        t.add_column(name, justify="right")
    for label, key, fmt in CUT_ROWS:
        t.add_row(label, *("-" if c.get(key) is None else fmt.format(c[key]) for _, c in columns))
    left = [f"{name}: layer{'s' if len(c['left_out']) > 1 else ''} {', '.join(map(str, c['left_out']))}"
            for name, c in columns if c.get("left_out")]
    if left:
        t.caption = "left out (routed for fewer than half the tokens): " + "; ".join(left)
    return t


def profile_stats_renderables(s: dict) -> list:
    """`mbolt trace-stats` on a co-activation profile: its shape and its cut."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("profile", f"{s['source']} ({s['model']})")
    head.add_row("shape", f"{s['n_layers']} layers ({s['profile_cut']['layers']} listed) x {s['n_experts']} experts, "
                          f"k={s['k']}, {s['tokens']:,} decode tokens")
    return [head, profile_cut_table([(s["model"] or "profile", s["profile_cut"])])]
