"""Measure and predict: probe, predict, cache."""

from __future__ import annotations

from pathlib import Path

import typer

from mbolt.cli.common import console, err_console, output, print_json, show, user_errors
from mbolt.core.errors import MboltError


@user_errors
def probe_cmd(
    file: Path = typer.Argument(None, help="A model (or any file or directory) on the drive to measure; a temp "
                                "file is created beside it when it is small or missing (default: the current directory)."),
    size_mb: int = typer.Option(256, "--size-mb", min=1, help="Size of the temp probe file."),
    out: Path = typer.Option(Path("results/probe.json"), "-o", "--out", help="Where the figures go (predict reads them)."),
    force: bool = typer.Option(False, "--force", help="Overwrite earlier probe figures."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
):
    """Cold random-read cost of a drive: t_op and bandwidth per read size, queue depth, buffered/O_DIRECT."""
    import json

    from rich.progress import Progress

    from mbolt.core.atomic import write_text_atomic
    from mbolt.bench.probe import probe
    from mbolt.report.bench_tables import probe_table

    output(out, "json", inputs=[file], force=force, what="probe figures", make_parent=True)
    if file is not None and not Path(file).exists():
        raise MboltError(f"{file}: no such file or directory")
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("probing", total=1.0)
        d = probe(file, size_mb=size_mb, progress=lambda i, n: bar.update(task, completed=i / n))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(d, indent=1) + "\n")
    if as_json:
        print_json(d)
        return
    console.print(probe_table(d))
    for k, f in d["fits"].items():
        console.print(f"{k}: t_op {f['t_op_s'] * 1e6:.0f} us, BW {f['bw_bytes_s'] / 1e6:.0f} MB/s "
                      f"(best measured {f['best_mb_per_s']:.0f} MB/s)")
    console.print(f"wrote {out}")


@user_errors
def predict_cmd(
    model: Path = typer.Argument(..., help="The GGUF as it is now (usually stock)."),
    plan: Path = typer.Option(None, "--plan", help="plan.json: predict its reorder and packed layouts."),
    trace: Path = typer.Option(..., "--trace", help="Held-out trace."),
    probe_json: Path = typer.Option(Path("results/probe.json"), "--probe", help="Probe figures (mbolt probe)."),
    qd: int = typer.Option(1, "--qd", min=1, max=1024, help="Queue depth (reads in flight) of the reader."),
    direct: bool = typer.Option(False, "--direct", help="O_DIRECT reader."),
    gap: int = typer.Option(0, "--gap", min=0, help="Merge gap (bytes)."),
    cache_slots: int = typer.Option(0, "--cache-slots", min=0, help="Per-layer LRU slot cache."),
    s: float = typer.Option(1.0, "--s", min=0.0, max=1.0, help="Share of decode time spent on cold reads, in (0, 1] "
                            "(1 = I/O only)."),
    s_from: Path = typer.Option(None, "--s-from", help="Take s from an `ab --engine llama.cpp` result: the read "
                                "share measured on its first arm with explicit reads."),
    as_json: bool = typer.Option(False, "--json", help="Print the prediction as JSON."),
):
    """Predict reads/token, bytes/token, per-expert gain g and speedup of a plan before rewriting."""
    from rich.table import Table

    from mbolt.bench.predict import predict
    from mbolt.trace.formats import load_trace

    if s_from is not None:
        from mbolt.bench.predict import measured_s

        s = measured_s(s_from)
    if not 0 < s <= 1:
        raise MboltError(f"--s must be in (0, 1], got {s}")
    d = predict(str(model), str(plan) if plan else None, load_trace(trace), str(probe_json), qd=qd, direct=direct,
                gap=gap, cache_slots=cache_slots, s=s)
    if as_json:
        print_json(d)
        return
    t = Table(title=f"prediction: t_op {d['t_op_us']:.0f} us, BW {d['bw_mb_s']:.0f} MB/s, s = {s:g} "
                    f"(QD{qd}, {'O_DIRECT' if direct else 'buffered'}, gap {gap})", header_style="bold")
    # "device": whole pages, what the drive reads and the time is priced on
    for c in ("layout", "reads/tok", "MB/tok", "device MB/tok", "io ms/tok", "g", "g (law)", "speedup"):
        t.add_column(c, justify="left" if c == "layout" else "right")
    for r in d["rows"]:
        t.add_row(r["layout"], f"{r['reads_per_token']:.1f}", f"{r['bytes_per_token'] / 1e6:.3f}",
                  f"{r['device_bytes_per_token'] / 1e6:.3f}", f"{r['io_ms_per_token']:.3f}",
                  f"{r['g_measured_model']:.3f}", f"{r['g_law']:.3f}", f"{r['speedup']:.3f}x")
    console.print(t)


@user_errors
def cache_cmd(
    trace: Path = typer.Argument(..., help="A routing trace (.mbtrace, or a file the importers read)."),
    budgets: str = typer.Option("4,8,16", "--cache-slots", help="Expert slots per layer to replay, comma separated."),
    in_sample: bool = typer.Option(False, "--in-sample", help="Pin set from the measured tokens (optimistic)."),
    pin_share: float = typer.Option(0.75, "--pin-share", min=0.0, max=1.0, help="Share of each layer's slots that are pinned."),
    train_share: float = typer.Option(0.5, "--train-frac", min=0.0, max=1.0,
                                      help="Held-out mode: leading share of tokens that trains, in (0, 1]."),
    phase: str = typer.Option("decode", "--phase", help="Tokens replayed: decode, prefill or all."),
    nuthatch_lines: bool = typer.Option(False, "--nuthatch-lines",
                                        help="Read a nuthatch text export line by line and count hits per access, as "
                                        "nuthatch's trace_replay did (reproduces its table; otherwise a hit is an "
                                        "expert cached as of the previous token, as plan and the store count)."),
    plot: Path = typer.Option(None, "--plot", help="Also draw the hit-rate curves into this PNG."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier --plot PNG."),
    policies: str = typer.Option("", "--policies", help="Instead of the sweep, compare per-layer policies from an "
                                 "empty cache over the --phase tokens, comma separated: lru, crf (LRFU: recency "
                                 "and frequency), lfu, lru-2, arc, 2q; or 'all'. Each is shown against MIN."),
    lam: float = typer.Option(None, "--lam", min=0.0, help="crf's decay per token (default: mbolt's, chosen by "
                              "replay on real traces); 0 is LFU."),
    as_json: bool = typer.Option(False, "--json", help="Print the sweep as JSON."),
):
    """Replay cache policies (learned-pin, per-layer LRU, OS global LRU, Belady, opt) over a trace.

    opt: the fewest misses any cache of that size could have under LRU's rule (Belady's MIN)."""
    from mbolt.bench.replay import cache_sweep, nuthatch_lines_trace
    from mbolt.trace.formats import load_trace
    from mbolt.report.bench_tables import cache_table

    try:
        bs = [int(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        raise MboltError(f"--cache-slots: expected comma-separated integers, got {budgets!r}") from None
    if not bs or min(bs) < 1:
        raise MboltError(f"--cache-slots: expected integers >= 1, got {budgets!r}")
    if not 0.0 < train_share <= 1.0:
        raise MboltError(f"--train-frac must be in (0, 1], got {train_share}")
    if plot is not None:
        output(plot, "png", inputs=[trace], force=force, what="plot")
    t = nuthatch_lines_trace(trace) if nuthatch_lines else load_trace(trace)
    if policies:
        _compare_cmd(trace, t, bs, policies, lam, phase, as_json)
        return
    sweep = cache_sweep(t, bs, in_sample=in_sample, pin_share=pin_share, train_share=train_share,
                        phase="all" if nuthatch_lines else phase, per_access=nuthatch_lines)
    if plot is not None:
        from mbolt.report.plots import plot_cache

        plot_cache(sweep.to_dict(), plot, title=Path(trace).name)
    show(as_json, sweep.to_dict(), lambda: cache_table(sweep))


def _compare_cmd(path: Path, trace, budgets, policies: str, lam, phase: str, as_json: bool) -> None:
    """`mbolt cache --policies`: misses of each policy beside MIN's, per budget."""
    from rich.table import Table

    from mbolt.bench.replay import COMPARED, compare_policies
    from mbolt.core.cache_policy import DEFAULT_LAM
    from mbolt.core.trace import select_phase
    from mbolt.trace.formats.bigmoeonedge import expert_bytes_of

    names = [p for p in COMPARED if p != "opt"] if policies.strip() == "all" else \
        [p.strip() for p in policies.split(",") if p.strip()]
    lam = DEFAULT_LAM if lam is None else lam
    tr = select_phase(trace, phase, str(path))
    eb = expert_bytes_of(path)
    rows = compare_policies(tr, budgets, names, lam=lam, expert_bytes=eb)
    if as_json:
        print_json({"trace": str(path), "phase": phase, "tokens": tr.n_tokens, "lam": lam, "rows": rows})
        return
    t = Table(title=f"{path.name}: {tr.n_tokens} {phase} tokens, per-layer caches from empty (crf lam {lam:g}); "
                    "hit rate, misses, misses / MIN's", header_style="bold")
    t.add_column("slots", justify="right")
    for name in (*names, "opt"):
        t.add_column("opt (MIN)" if name == "opt" else name, justify="right")
    for r in rows:
        cells = [f"{r[n]['hit_rate']:.3f} {r[n]['misses']:,}" + (f" {r[n]['vs_min']:.2f}x" if n != "opt" else "")
                 for n in (*names, "opt")]
        t.add_row(str(r["budget"]), *cells)
    console.print(t)
