"""Thin typer layer: parse arguments, call one stage function, render with rich.

Every command catches MboltError, prints its message on one line and exits 2.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from mbolt.errors import MboltError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Profile-guided expert layout for MoE GGUF files: trace routing, plan an expert order, "
    "rewrite the GGUF bit-exactly, verify it and measure cold reads.",
)
console = Console()
err_console = Console(stderr=True)


def user_errors(fn):
    """Turn MboltError into one red line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MboltError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)

    return wrapper


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def _version(value: bool):
    if value:
        from mbolt import __version__

        console.print(f"mbolt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    """Keeps mbolt a command group even while it has one command."""


# ---- commands (one per pipeline stage; each calls one stage function) ----


@app.command("inspect")
@user_errors
def inspect_cmd(
    model: Path = typer.Argument(..., help="A llama.cpp MoE GGUF file."),
    as_json: bool = typer.Option(False, "--json", help="Print the MoE map as JSON."),
):
    """Show the MoE map of a GGUF: layers, experts, and every expert-indexed tensor."""
    from mbolt.gguf.moe_map import moe_map
    from mbolt.report.tables import moe_map_table

    m = moe_map(model)
    if as_json:
        print_json(m.to_dict())
    else:
        console.print(moe_map_table(m))


def main() -> None:
    app()
