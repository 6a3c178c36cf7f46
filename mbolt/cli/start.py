"""Start here: demo, report."""

from __future__ import annotations

from pathlib import Path

import typer

from mbolt.cli.common import console, err_console, output, print_json, user_errors
from mbolt.core.errors import MboltError


@user_errors
def demo_cmd(
    workdir: Path = typer.Option(Path("mbolt-demo"), "--workdir", help="Where the model, traces, plans and results go."),
    size: str = typer.Option("tiny", "--size", help="tiny (8x32 experts, 64 KiB slices: ~30 s on 2 cores), small "
                             "(16x64, 64 KiB: ~2 min) or medium (16x128, 256 KiB slices, 7.6 GB of files: ~8 min)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic model."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Run the whole pipeline on a built-in synthetic model: synth, trace, plan, reorder,
    verify, cold A/B with an A/A control. No downloads."""
    import time

    from mbolt.demo import check_workdir, run_demo
    from mbolt.report.tables import demo_next_steps, demo_table

    check_workdir(workdir)
    t0 = time.perf_counter()

    def progress(step, detail=""):
        # plain progress lines on stderr, with the time since the demo started
        err_console.print(f"[dim]{time.perf_counter() - t0:6.1f} s[/] [bold]{step}[/] {detail}", highlight=False,
                          soft_wrap=True)

    summary = run_demo(workdir, size, seed=seed, progress=progress)
    if as_json:
        print_json(summary)
    else:
        console.print(demo_table(summary))
        console.print(demo_next_steps(summary), highlight=False, soft_wrap=True)
    if not all(v["ok"] for v in summary["verify"].values()):
        raise typer.Exit(1)


@user_errors
def report_cmd(
    src: Path = typer.Argument(..., help="A results JSON (ab, demo, layout, cache) or, with --plan, a trace."),
    out: Path = typer.Option(None, "-o", "--out", help="PNG to write (optional with --json)."),
    plan: Path = typer.Option(None, "--plan", help="Draw SRC's co-activation heatmap before/after this plan."),
    layer: int = typer.Option(None, "--layer", min=0, help="Layer for the heatmap (default: the first MoE layer)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print what the picture shows (the plotted numbers) as JSON."),
):
    """Plot a results file: A/B speedups with CIs, reads/token per method, cache hit-rate curves,
    or (with --plan) a layer's co-activation heatmap before and after the permutation."""
    from mbolt.report.plots import heatmap_series, plot, plot_heatmap, series

    if out is None and not as_json:
        raise MboltError("report: give -o PNG to draw the picture, or --json to print its numbers")
    if out is not None:
        output(out, "png", inputs=[src, plan], force=force, what="plot")
        path = plot_heatmap(src, plan, out, layer) if plan is not None else plot(src, out)
        if not as_json:
            console.print(f"wrote {path}")
    if as_json:
        print_json(heatmap_series(src, plan, layer) if plan is not None else series(src))
