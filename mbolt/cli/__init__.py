"""Thin typer layer: parse arguments, call one stage function, render with rich.

Every command catches MboltError, prints its message on one line and exits 2. One module per
panel of `mbolt --help` (start, serve, pipeline, measure, models, exchange); `common` holds what they
share; the table below registers them.
"""

from __future__ import annotations

from mbolt.cli.common import app, user_errors
from mbolt.cli.exchange import expert_map_cmd, export_coact_cmd, export_heat_cmd, import_trace_cmd
from mbolt.cli.measure import cache_cmd, predict_cmd, probe_cmd
from mbolt.cli.models import generate_cmd, inspect_cmd, synth_cmd, synth_trace_cmd, trace_stats_cmd
from mbolt.cli.pipeline import ab_cmd, plan_cmd, reorder_cmd, repack_cmd, trace_cmd, trace_merge_cmd, verify_cmd
from mbolt.cli.serve import chat_cmd, serve_cmd
from mbolt.cli.start import demo_cmd, report_cmd

__all__ = ["app", "main", "user_errors", "COMMANDS"]

# One table registers every command: the order and panels of `mbolt --help` (pipeline order).
COMMANDS = [
    ("demo", demo_cmd, "Start here"),
    ("report", report_cmd, "Start here"),
    ("serve", serve_cmd, "Run a model"),
    ("chat", chat_cmd, "Run a model"),
    ("trace", trace_cmd, "Pipeline"),
    ("trace-merge", trace_merge_cmd, "Pipeline"),
    ("plan", plan_cmd, "Pipeline"),
    ("reorder", reorder_cmd, "Pipeline"),
    ("verify", verify_cmd, "Pipeline"),
    ("repack", repack_cmd, "Pipeline"),
    ("ab", ab_cmd, "Pipeline"),
    ("probe", probe_cmd, "Measure and predict"),
    ("predict", predict_cmd, "Measure and predict"),
    ("cache", cache_cmd, "Measure and predict"),
    ("inspect", inspect_cmd, "Models and traces"),
    ("expert-map", expert_map_cmd, "Exchange with other engines"),
    ("export-coact", export_coact_cmd, "Exchange with other engines"),
    ("export-heat", export_heat_cmd, "Exchange with other engines"),
    ("synth", synth_cmd, "Models and traces"),
    ("generate", generate_cmd, "Models and traces"),
    ("trace-stats", trace_stats_cmd, "Models and traces"),
    ("import-trace", import_trace_cmd, "Exchange with other engines"),
    ("synth-trace", synth_trace_cmd, "Models and traces"),
]
for _name, _fn, _panel in COMMANDS:
    # the list in `mbolt --help`: a docstring's first paragraph as one line (rich keeps line breaks)
    _short = " ".join((_fn.__doc__ or "").strip().split("\n\n")[0].split())
    app.command(_name, rich_help_panel=_panel, short_help=_short)(_fn)


def main() -> None:
    app()
