"""What every command shares: the typer app, one-line errors (exit 2), the output rule, JSON and
rich rendering."""

from __future__ import annotations

import functools
import json
import sys
import warnings

import typer
import typer.core
from rich.console import Console
from rich.text import Text

from mbolt.core.atomic import json_default
from mbolt.core.errors import MboltError

class _OneLineUsageErrors(typer.core.TyperGroup):
    """Usage errors (a bad option value, a missing argument) are one line and exit 2, like every
    other user error, instead of click's usage box."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:  # typer >= 0.29 vendors click
            from typer._click import exceptions as click
        except ImportError:
            from click import exceptions as click

        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.NoArgsIsHelpError as e:
            from typer import rich_utils

            rich_utils.rich_format_error(e)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            err_console.print(Text.assemble(("error: ", "bold red"), " ".join((e.format_message() + hint).split())),
                              highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            err_console.print("Aborted.")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineUsageErrors,
    add_completion=False,
    no_args_is_help=True,
    help="Profile-guided expert layout for MoE GGUF files: trace routing, plan an expert order, "
    "rewrite the GGUF bit-exactly, verify it and measure cold reads.",
)
console = Console()
err_console = Console(stderr=True)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings (mbolt's and the readers') are one yellow line on stderr, not a source excerpt."""
    err_console.print(Text.assemble(("warning: ", "bold yellow"), str(message)), highlight=False, soft_wrap=True)


def user_errors(fn):
    """Turn MboltError into one red line and exit code 2; warnings into one yellow line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        warnings.showwarning = _show_warning
        try:
            return fn(*args, **kwargs)
        except MboltError as e:
            _error_line(str(e))
        except OSError as e:
            # no space left, permission denied, a directory where a file is expected...: the
            # user's problem, named by its file (an OSError without one is a bug: traceback)
            if e.filename is None:
                raise
            _error_line(f"{e.filename}: {e.strerror or e}")

    return wrapper


def _error_line(message: str):
    # The message is the user's file names and bytes: print it literally (no markup, no emoji),
    # on one line whatever the terminal width.
    err_console.print(Text.assemble(("error: ", "bold red"), " ".join(message.split())), highlight=False,
                      soft_wrap=True)
    raise typer.Exit(2)


def output(path, kind, *, inputs=(), force=False, protected=(), what="output", make_parent=False):
    """core.atomic.check_output for a command's output: the one output rule, before any work."""
    from mbolt.core.atomic import check_output

    return check_output(path, kind=kind, inputs=[i for i in inputs if i is not None], force=force,
                        protected_fingerprints=tuple(p for p in protected if p), what=what,
                        make_parent=make_parent)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=json_default) + "\n")


def show(as_json: bool, data, render) -> None:
    """--json: `data` as JSON on stdout; otherwise what `render()` returns (one rich renderable
    or a list of them), built only when printed."""
    if as_json:
        print_json(data)
        return
    out = render()
    for r in out if isinstance(out, list) else [out]:
        console.print(r, highlight=False)


# ---- options several commands share: one definition each ----


def ram_option(scope: str = ""):
    """--ram, the memory budget; `scope` names what it needs (generate: "--stream")."""
    return typer.Option(None, "--ram", help=f"{scope + ': the' if scope else 'The'} memory budget (e.g. 8G). Default: "
                        "the tightest memory cgroup limit of this process and its parents, else the available memory.")


def ctx_size_option(scope: str = "", then: str = "."):
    """--ctx-size/-c, llama.cpp's context; `then` ends the help with what it does in the command."""
    return typer.Option(None, "--ctx-size", "-c", min=1, help=f"{scope + ': c' if scope else 'C'}ontext size in tokens "
                        f"(default 4096, capped by the model's training context){then}")


def threads_option():
    return typer.Option(0, "--threads", "-t", min=0, help="llama.cpp threads (0 = all cores).")


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
