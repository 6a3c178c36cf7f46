"""Thin typer layer: parse arguments, call one stage function, render with rich.

Every command catches MboltError, prints its message on one line and exits 2.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path

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


@user_errors
def inspect_cmd(
    model: Path = typer.Argument(..., help="A llama.cpp MoE GGUF file."),
    as_json: bool = typer.Option(False, "--json", help="Print the MoE map as JSON."),
):
    """Show the MoE map of a GGUF: layers, experts, and every expert-indexed tensor."""
    from mbolt.core.moe_map import moe_map
    from mbolt.report.tables import moe_map_table

    m = moe_map(model)
    show(as_json, m.to_dict(), lambda: moe_map_table(m))


@user_errors
def expert_map_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF (stock, reorder or packed), or any shard of a set."),
    out: Path = typer.Option(None, "-o", "--out", help="Where the expert map goes (JSON; docs/expert_map.md)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier expert map."),
    as_json: bool = typer.Option(False, "--json", help="Print the expert map as JSON."),
):
    """Write the expert map for engines: every original expert's byte ranges in the file (per
    projection, shard named), tensor types, alignment and route map, for reading experts with
    plain pread without parsing GGUF metadata."""
    import json as _json

    from mbolt.core.atomic import write_text_atomic
    from mbolt.core.moe_map import moe_map
    from mbolt.core.routemap import expert_map_dict

    if out is None and not as_json:
        raise MboltError("expert-map: give -o map.json, or --json to print it")
    m = moe_map(model)
    if out is not None:
        output(out, "json", inputs=[model, *m.paths], force=force, what="expert map", make_parent=True)
    d = expert_map_dict(m)
    if out is not None:
        write_text_atomic(out, _json.dumps(d) + "\n")
    if as_json:
        print_json(d)
        return
    console.print(f"wrote {out}: {len(d['layers'])} MoE layers x {d['n_experts']} experts, layout {d['layout']}, "
                  f"{len(d['files'])} file(s)", highlight=False)


@user_errors
def export_coact_cmd(
    trace: list[Path] = typer.Argument(..., help="A .mbtrace or any importable trace (several of one model are merged)."),
    out: Path = typer.Option(..., "-o", "--out", help="Where the profile goes (coactivation JSON)."),
    model: Path = typer.Option(None, "--model", help="The GGUF the trace was made on: checked, and its name and "
                               "quantisation fill the profile's model and quant fields."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier profile."),
    as_json: bool = typer.Option(False, "--json", help="Print a summary as JSON."),
):
    """Write the trace's decode co-activation in the original mbolt's exchange format
    (coactivation_*.json: heat, strong pairs with lift, clusters, chain order per layer), the
    profiles colibri's community builds expert maps from."""
    import json as _json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from mbolt.core.atomic import write_text_atomic
    from mbolt.layout.profile import export_profile
    from mbolt.trace.formats import load_traces

    tr = load_traces(trace)
    name = quant = ""
    if model is not None:
        from mbolt.core.compat import check_compatible
        from mbolt.core.moe_map import moe_map
        from mbolt.layout.profile import model_labels

        mm = moe_map(model)
        check_compatible(tr, mm, ", ".join(map(str, trace)))
        name, quant = model_labels(mm)
    output(out, "json", inputs=[*trace, model], force=force, what="co-activation profile")
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("grouping layers", total=len(tr.moe_layers()))
        d = export_profile(tr, model=str(name), quant=quant, progress=lambda l: bar.advance(task))
    write_text_atomic(out, _json.dumps(d) + "\n")
    info = {"out": str(out), "n_layers": d["n_layers"], "moe_layers": len(d["layers"]),
            "n_expert_per_layer": d["n_expert_per_layer"], "k": d["k"], "n_decode_tokens": d["n_decode_tokens"],
            "pairs": sum(len(r["pairs"]) for r in d["layers"])}
    if as_json:
        print_json(info)
        return
    console.print(f"wrote {out}: {info['moe_layers']} MoE layers x {info['n_expert_per_layer']} experts, k={info['k']}, "
                  f"{info['n_decode_tokens']:,} decode tokens, {info['pairs']:,} strong pairs", highlight=False)


@user_errors
def export_heat_cmd(
    trace: list[Path] = typer.Argument(..., help="A .mbtrace or any importable trace (several of one model are merged)."),
    out: Path = typer.Option(..., "-o", "--out", help="Where the heat goes (.coli_usage text)."),
    engine: str = typer.Option(None, "--engine", help="colibri's engine name (e.g. qwen3_moe, glm_moe_dsa, olmoe): "
                               "its id goes in the header; without it colibri takes the file only as PIN=<path>."),
    phase: str = typer.Option("decode", "--phase", help="decode, prefill or all: which tokens count."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier export."),
    as_json: bool = typer.Option(False, "--json", help="Print a summary as JSON."),
):
    """Write the trace's heat (tokens that selected each expert, per layer) as colibri's
    .coli_usage, so colibri pins from an mbolt trace."""
    import numpy as np

    from mbolt.core.atomic import write_text_atomic
    from mbolt.core.trace import select_phase
    from mbolt.layout.coact import coactivation
    from mbolt.trace.formats import load_traces
    from mbolt.trace.formats.colibri import engine_id, usage_text

    tr = select_phase(load_traces(trace), phase)
    output(out, "coli-usage", inputs=trace, force=force, what=".coli_usage")
    heat = coactivation(tr).heat
    write_text_atomic(out, usage_text(heat, engine))
    info = {"out": str(out), "n_layers": tr.n_layers, "n_experts": tr.n_experts, "tokens": tr.n_tokens,
            "phase": phase, "nonzero": int(np.count_nonzero(heat)), "engine_id": engine_id(engine) if engine else 0}
    if as_json:
        print_json(info)
        return
    console.print(f"wrote {out}: {info['nonzero']:,} non-zero counts over {tr.n_layers} layers x {tr.n_experts} experts "
                  f"from {tr.n_tokens:,} {phase} tokens; engine id {info['engine_id']}", highlight=False)


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
    as_json: bool = typer.Option(False, "--json", help="Print the sweep as JSON."),
):
    """Replay cache policies (learned-pin, per-layer LRU, OS global LRU, Belady) over a trace."""
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
    sweep = cache_sweep(t, bs, in_sample=in_sample, pin_share=pin_share, train_share=train_share,
                        phase="all" if nuthatch_lines else phase, per_access=nuthatch_lines)
    if plot is not None:
        from mbolt.report.plots import plot_cache

        plot_cache(sweep.to_dict(), plot, title=Path(trace).name)
    show(as_json, sweep.to_dict(), lambda: cache_table(sweep))


@user_errors
def synth_cmd(
    out: Path = typer.Argument(..., help="Output GGUF path."),
    arch: str = typer.Option(None, "--arch", help="qwen3moe (default), olmoe, mixtral, qwen2moe, glm4moe, "
                             "deepseek2, gpt-oss or qwen3next (docs/families.md)."),
    preset: str = typer.Option(None, "--preset", help="Real model geometry: qwen3-30b-a3b, qwen3-next-80b-a3b, "
                               "olmoe-1b-7b, granite-moe-1b, glm-4.5-air, deepseek-v3, gpt-oss-20b, glm-5.2 "
                               "(other options override it)."),
    layers: int = typer.Option(None, "--layers", help="Number of layers (scales a preset down)."),
    experts: int = typer.Option(None, "--experts", help="Routed experts per layer."),
    k: int = typer.Option(None, "--k", help="Experts used per token."),
    hidden: int = typer.Option(None, "--hidden", help="Hidden size."),
    expert_ff: int = typer.Option(None, "--expert-ff", help="Expert FFN size."),
    heads: int = typer.Option(None, "--heads", help="Attention heads."),
    kv_heads: int = typer.Option(None, "--kv-heads", help="KV heads."),
    head_dim: int = typer.Option(None, "--head-dim", help="Head dimension."),
    shared_ff: int = typer.Option(None, "--shared-ff", help="Shared expert FFN size (qwen2moe)."),
    expert_type: str = typer.Option(None, "--type", help="Expert tensor type: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 "
                                    "MXFP4, and with --fast-random Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_XS IQ4_NL IQ3_XXS "
                                    "IQ3_S IQ2_XXS IQ2_XS IQ1_S."),
    down_type: str = typer.Option(None, "--down-type", help="Type of ffn_down_exps (default: --type); Q4_K_M "
                                  "files keep down in Q6_K."),
    layer_types: str = typer.Option(None, "--layer-types", help="Per-layer expert types over --type, "
                                    "e.g. '0-3:Q6_K,10:Q5_K'."),
    fused_gate_up: bool = typer.Option(False, "--fused-gate-up", help="One ffn_gate_up_exps tensor per layer "
                                       "(llama.cpp loads it for deepseek2 and qwen3next only)."),
    dense_type: str = typer.Option(None, "--dense-type", help="Attention/output matrices: F32 or F16."),
    seed: int = typer.Option(None, "--seed", help="Random seed (same seed, same bytes)."),
    structure: str = typer.Option(None, "--structure", help="planted (default) or none (null control)."),
    groups: int = typer.Option(None, "--groups", help="Planted expert groups (default experts / (2k))."),
    strength: float = typer.Option(None, "--strength", help="Planted structure strength in [0, 1] (default 0.5)."),
    heat_skew: float = typer.Option(None, "--heat-skew", help="Per-expert heat skew >= 0 (default 0.5)."),
    context: float = typer.Option(None, "--context", help="Context-dependent routing >= 0 (default 0: routing "
                                  "follows the token; ~1: recent tokens move it too)."),
    fast_random: bool = typer.Option(False, "--fast-random", help="Random valid expert/matrix blocks: disk speed, "
                                     "routing still planted, forward pass not meaningful."),
    probs_bias: bool = typer.Option(False, "--probs-bias", help="Add blk.N.exp_probs_b.bias (glm4moe and deepseek2 "
                                    "have it; llama.cpp refuses it elsewhere)."),
    expert_bias: bool = typer.Option(False, "--expert-bias", help="Add ffn_*_exps.bias (gpt-oss has them; llama.cpp "
                                     "refuses them elsewhere)."),
    dense_layers: int = typer.Option(None, "--dense-layers", help="Leading dense-FFN layers (glm4moe, deepseek2; "
                                     "llama.cpp refuses them elsewhere)."),
    vocab: Path = typer.Option(None, "--vocab", help="Take the tokenizer of this GGUF (every tokenizer.* key, e.g. "
                               "llama.cpp's models/ggml-vocab-*.gguf): the model tokenizes as the real one does."),
    force: bool = typer.Option(False, "--force", help="Overwrite the output."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
):
    """Write a synthetic MoE GGUF (llama.cpp-loadable) with planted co-activation structure."""
    import dataclasses

    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from mbolt.gguf.synth import SynthConfig, synth_size, write_synth_info

    given = dict(arch=arch, n_layers=layers, n_experts=experts, n_used=k, hidden=hidden, expert_ff=expert_ff,
                 n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, shared_ff=shared_ff,
                 expert_type=expert_type.upper() if expert_type else None, dense_type=dense_type, seed=seed,
                 down_type=down_type, layer_types=layer_types, fused_gate_up=fused_gate_up or None,
                 structure=structure, n_groups=groups, strength=strength, heat_skew=heat_skew, context=context,
                 dense_layers=dense_layers, fast_random=fast_random or None, probs_bias=probs_bias or None,
                 expert_bias=expert_bias or None, vocab=str(vocab) if vocab else None)
    given = {key: v for key, v in given.items() if v is not None}
    if not preset and head_dim is None and (hidden or heads):  # keep heads x head_dim == hidden
        given["head_dim"] = (hidden or SynthConfig.hidden) // (heads or SynthConfig.n_heads)
    if not preset and arch == "olmoe" and kv_heads is None:  # olmoe has no GQA
        given["n_kv_heads"] = heads or SynthConfig.n_heads
    if not preset and arch == "deepseek2" and kv_heads is None:  # MLA: one latent kv head
        given["n_kv_heads"] = 1
    cfg = SynthConfig.from_preset(preset, **given) if preset else SynthConfig(**given)
    output(out, "gguf-mbolt", force=force, what="synthetic model")
    cfg.validate()  # before the progress bar: an error is then the only output
    total = synth_size(cfg)
    if total > 64 << 20 and not as_json:
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=err_console) as bar:
            task = bar.add_task(f"writing {out.name}", total=total)
            info = write_synth_info(out, cfg, force=force, progress=lambda d, t: bar.update(task, completed=d))
    else:
        info = write_synth_info(out, cfg, force=force)
    if as_json:
        print_json(dataclasses.asdict(info))
    else:
        g = info.geometry
        console.print(
            f"wrote [bold]{info.path}[/] ({info.bytes / 1e6:,.1f} MB): {info.arch}"
            f"{' (' + info.preset + ')' if info.preset else ''}, {g['n_layers']} layers x {g['n_experts']} experts, "
            f"k={g['n_used']}, hidden {g['hidden']}, expert ff {g['expert_ff']}, experts {info.expert_type}, "
            f"structure {info.structure} ({g['n_groups']} groups){', fast-random' if info.fast_random else ''}",
            highlight=False,
        )


@user_errors
def ab_cmd(
    arms: list[str] = typer.Argument(None, help="Arms: FILE[:name=N,qd=4,direct,gap=B,os,cache=S] (llama.cpp also: "
                                     "warm, callback). The first is the baseline."),
    replay_trace: Path = typer.Option(None, "--replay", help="Held-out trace: read exactly what each token needs (I/O only)."),
    decode: bool = typer.Option(False, "--decode", help="Generate with the engine (compute + I/O)."),
    engine: str = typer.Option("reference", "--engine", help="Decode engine: 'reference' (numpy engine + store) or "
                               "'llama.cpp' (explicit expert reads from llama.cpp's eval callback; os arms: page faults)."),
    prompts: Path = typer.Option(None, "--prompts", help="Decode: prompts file (.jsonl with a prompt field, or text lines)."),
    n_prompts: int = typer.Option(2, "--n-prompts", min=1, help="Decode: prompts used."),
    new_tokens: int = typer.Option(8, "--new-tokens", "-n", min=1, help="Decode: tokens generated per prompt."),
    forced: bool = typer.Option(False, "--forced", help="Decode: teacher forcing. Prefill each prompt's first 8 "
                                "tokens, then feed its next tokens one at a time (routing follows real text, every "
                                "arm decodes the same tokens). Without --prompts: the built-in text."),
    ram: str = typer.Option(None, "--ram", help="llama.cpp: run every arm-round as a fresh process inside a memory "
                            "cgroup of this size (e.g. 2G; v1 or v2, needs root): a real memory limit. os arms are "
                            "then plain llama.cpp, arms with reads mbolt's runtime with this budget."),
    readahead_kb: int = typer.Option(None, "--readahead", min=0, help="Set the model's block device read_ahead_kb "
                                  "(KiB) for the run, restored afterwards (even on error or Ctrl-C). The value in "
                                  "force is recorded either way."),
    rounds: int = typer.Option(None, "--rounds", min=1, help="Run exactly this many rounds (default: adaptive, see "
                               "--time-budget). Each round runs every arm once, in a seeded balanced order."),
    min_rounds: int = typer.Option(12, "--min-rounds", min=1, help="Adaptive: never stop before this many rounds."),
    max_rounds: int = typer.Option(400, "--max-rounds", min=1, help="Adaptive: stop after this many rounds at most."),
    time_budget: float = typer.Option(600.0, "--time-budget", min=0.0, help="Adaptive: seconds to spend at most; the "
                                      "run stops at the end of a balanced block of rounds once another block would "
                                      "overrun it."),
    precision: float = typer.Option(0.05, "--precision", min=0.0, help="Adaptive: stop once the A/A interval is inside "
                                    "the tolerance and every treated arm's 95%% interval half-width is at most this "
                                    "share of its speedup."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the arm orders (recorded in the result)."),
    qd: int = typer.Option(1, "--qd", min=1, max=1024, help="Default queue depth (reads in flight) for arms."),
    direct: bool = typer.Option(False, "--direct", help="Default: O_DIRECT reads for arms."),
    gap: int = typer.Option(0, "--gap", min=0, help="Default merge gap (bytes)."),
    cache_slots: int = typer.Option(0, "--cache-slots", min=0, help="Default per-layer slot cache."),
    resident_frac: float = typer.Option(None, "--resident-frac", min=0.0, max=1.0,
                                        help="Default slot cache as a share of each layer's experts."),
    no_aa: bool = typer.Option(False, "--no-aa", help="Drop the A/A control arm."),
    threshold: float = typer.Option(0.01, "--threshold", min=0.0, max=1.0,
                                    help="Reject a round whose resident share exceeds this."),
    max_tokens: int = typer.Option(0, "--max-tokens", min=0, help="Replay at most this many held-out tokens (0 = all)."),
    tokens_per_round: int = typer.Option(0, "--tokens-per-round", min=0,
                                         help="Replay: each round reads the next slice of this many tokens (0 = all)."),
    name: str = typer.Option("", "--name", help="Result name: results/<name>.json."),
    out_dir: Path = typer.Option(Path("results"), "--out-dir", help="Where the result JSON goes."),
    prereg: Path = typer.Option(None, "--prereg", help="Run a pre-registration (prereg/x.toml): arms and rule from the file."),
    probe_json: Path = typer.Option(None, "--probe", help="Probe figures (mbolt probe): print each arm's predicted "
                                    "speedup (from its own route map) next to the measured one."),
    plot: Path = typer.Option(None, "--plot", help="Also draw speedups with CIs and reads/token into this PNG."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier result JSON (and --plot PNG)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Controlled cold A/B of arms (files + reader options): balanced seeded arm orders, eviction proven, A/A
    control, adaptive number of rounds."""
    from rich.progress import Progress

    from mbolt.bench.ab_command import AbRequest, run_ab_request
    from mbolt.report.bench_tables import ab_table

    req = AbRequest(arms=list(arms or []), replay_trace=replay_trace, decode=decode, engine=engine, prompts=prompts,
                    n_prompts=n_prompts, new_tokens=new_tokens, forced=forced, ram=ram, readahead_kb=readahead_kb,
                    rounds=rounds, min_rounds=min_rounds, max_rounds=max_rounds, time_budget=time_budget,
                    precision=precision, seed=seed, qd=qd, direct=direct, gap=gap, cache_slots=cache_slots,
                    resident_frac=resident_frac, no_aa=no_aa, threshold=threshold, max_tokens=max_tokens,
                    tokens_per_round=tokens_per_round, name=name, out_dir=out_dir, prereg=prereg,
                    probe_json=probe_json, plot=plot, force=force)
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("cold rounds", total=None)
        res, out, pr = run_ab_request(
            req, announce=lambda text: console.print(text, highlight=False),
            progress=lambda d, t, r: bar.update(task, completed=d, total=t, description=f"{r.arm} r{r.round}"))
    if as_json:
        print_json(res.to_dict())
        return
    console.print(ab_table(res))
    console.print(f"stopped: {res.stop['reason']} ({res.stop['detail']})", highlight=False)
    for f in res.flags:
        console.print(f"[yellow]flag:[/] {f}")
    for n in res.notes:
        console.print(f"[red]note:[/] {n}")
    if res.prediction:
        from mbolt.report.bench_tables import prediction_table

        console.print(prediction_table(res.prediction))
    if pr is not None:
        v = res.prereg["result"]
        colour = {"PASS": "green", "FAIL": "red"}.get(v["verdict"], "yellow")
        ci = v.get("ci95")
        ci_s = f"95% CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else "no CI: fewer than 10 rounds"
        console.print(f"[bold {colour}]{v['verdict']}[/]: {pr.treatment} vs {pr.baseline} "
                      f"{v.get('measured_speedup', float('nan')):.3f}x ({ci_s}), "
                      f"threshold {pr.pass_threshold}, predicted {pr.predicted_speedup}")
    console.print(f"wrote {out}")


@user_errors
def reorder_cmd(
    src: Path = typer.Argument(..., help="Source MoE GGUF (stock, or a file mbolt already rewrote), or any shard "
                               "of a split set (NAME-0000I-of-0000N.gguf: the whole set is read)."),
    dst: Path = typer.Argument(..., help="Output GGUF (a new path; the source is never modified). A set is written "
                               "as DST-00001-of-0000N.gguf ..."),
    plan: Path = typer.Option(None, "--plan", help="plan.json from `mbolt plan` (perms name original expert ids)."),
    layout: str = typer.Option("reorder", "--layout", help="reorder: standard tensor names, loads in unmodified "
                               "llama.cpp. packed: each expert's gate|up|down adjacent in one blob per layer "
                               "(blk.N.ffn_exps_packed) for explicit-read engines; the reference engine and "
                               "the store read it, llama.cpp does NOT load this layout."),
    identity: bool = typer.Option(False, "--identity", help="Identity plan: stock order plus a route map "
                                  "(a control for the whole pipeline; restores stock order of a rewritten file)."),
    trace: list[Path] = typer.Option(None, "--trace", help="Plan inline from this .mbtrace with the default method "
                                     "(repeat to merge traces of the same model)."),
    split_max_tensors: int = typer.Option(0, "--split-max-tensors", help="Write a set: at most this many tensors "
                                          "per shard (default: the input's shards, one file for one file)."),
    split_max_size: str = typer.Option(None, "--split-max-size", help="Write a set: at most this much tensor data "
                                       "per shard (e.g. 4G, 500M)."),
    no_split: bool = typer.Option(False, "--no-split", help="Write one file, even from a split set."),
    align: str = typer.Option(None, "--align", help="Alignment in bytes (a power of two, e.g. 4096, 64K): every tensor "
                              "starts aligned (general.alignment) and packed slots are padded to it (64K for Windows "
                              "unbuffered reads). Default: 4 KiB tensors, slots padded to 4 KiB where it costs <= 12.5%."),
    force: bool = typer.Option(False, "--force", help="Replace a previous mbolt output (never an input, nor the "
                               "model an input was made from, nor any other file)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Rewrite a MoE GGUF bit-exactly with experts in plan order (+ route map and JSON sidecar).

    Streams with bounded memory (os.copy_file_range); writes temp files beside the output,
    fsyncs and renames, so an interrupted run never leaves a partial output (a set is
    renamed into place as a whole: readers refuse a mix of shards of two runs)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from mbolt.report.rewrite_tables import reorder_table
    from mbolt.core.memlimit import parse_size
    from mbolt.core.packed import check_align
    from mbolt.rewrite.outplan import SplitSpec
    from mbolt.rewrite.reorder import reorder_file

    split = SplitSpec(no_split, split_max_tensors, parse_size(split_max_size, "--split-max-size"))
    split.check()
    align_bytes = None if align is None else check_align(parse_size(align, "--align"))
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task(f"writing {dst.name}", total=None)
        r = reorder_file(src, dst, plan=plan, trace=trace or None, identity=identity, layout=layout, force=force,
                         progress=lambda d, t: bar.update(task, completed=d, total=t), split=split,
                         align=align_bytes)
    show(as_json, r.to_dict(), lambda: reorder_table(r))


@user_errors
def verify_cmd(
    src: Path = typer.Argument(..., help="The source GGUF (one file or any shard of a split set)."),
    out: Path = typer.Argument(..., help="The file or set `mbolt reorder` wrote from it (any shard, or the "
                               "path given to reorder)."),
    prompts: Path = typer.Option(None, "--prompts", help="Prompts for routing parity: .jsonl (prompt/text field) "
                                 "or one per line (default: a built-in set)."),
    n_prompts: int = typer.Option(8, "--n-prompts", min=1, help="Use at most this many prompts."),
    tokens: int = typer.Option(8, "--new-tokens", "-n", min=1, help="Greedy tokens generated per prompt."),
    no_parity: bool = typer.Option(False, "--no-parity", help="Skip the reference-engine routing parity "
                                   "(bit-identity only)."),
    llama: bool = typer.Option(False, "--llama", help="Also load both in llama.cpp (reorder layout): same "
                               "greedy tokens, logits within tolerance."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Check a rewritten GGUF: every tensor byte-identical through the route map, metadata
    identical apart from mbolt.* and alignment, routing parity.

    Exit 0: OUT is SRC rewritten, nothing but the order changed. Exit 1: OUT is a rewrite of SRC
    and differs (a byte, a key, the padding, routing). Exit 2: the two files are not one model and
    its rewrite (other geometry, no route map, made from another file), or a file is unreadable."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from mbolt.report.rewrite_tables import verify_table
    from mbolt.report.tables import human_bytes
    from mbolt.core.prompts import prompt_texts
    from mbolt.rewrite.verify import verify

    texts = prompt_texts(prompts, n_prompts)
    # one bar per long phase: the byte comparison, then the engine runs (forwards of both files)
    with Progress("[progress.description]{task.description}", BarColumn(), TextColumn("{task.fields[amount]}"),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        data = bar.add_task(f"comparing {out.name}", total=None, amount="")
        engines = None

        def on_bytes(d, t):
            bar.update(data, completed=d, total=t, amount=f"{human_bytes(d)} / {human_bytes(t)}")

        def on_forwards(d, t):
            nonlocal engines
            if engines is None:
                bar.stop_task(data)
                runs = [name for name, on in (("routing", not no_parity), ("llama.cpp", llama)) if on]
                engines = bar.add_task(" + ".join(runs) + " parity", total=t, amount="")
            bar.update(engines, completed=d, total=t, amount=f"{d}/{t} forwards")

        rep = verify(src, out, parity=not no_parity, prompts=texts, n_tokens=tokens, llama=llama,
                     progress=on_bytes, parity_progress=on_forwards)
    show(as_json, rep.to_dict(), lambda: verify_table(rep))
    if not rep.ok:
        raise typer.Exit(1)


@user_errors
def trace_stats_cmd(
    trace: Path = typer.Argument(..., help="A .mbtrace, or MBOLT_TRACE / nuthatch text / NUTHTRC1 (auto-detected)."),
    fmt: str = typer.Option("auto", "--format", help="auto, mbtrace, mbolt, nuthatch-text or nuthatch-bin."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
):
    """Tokens, sequences, per-layer heat entropy, pair lift percentiles and token-to-token overlap."""
    from mbolt.layout.stats import trace_stats
    from mbolt.report.layout_tables import trace_stats_renderables

    s = trace_stats(trace, fmt)
    show(as_json, s, lambda: trace_stats_renderables(s))


@user_errors
def import_trace_cmd(
    src: Path = typer.Argument(..., help="A routing trace: the original mbolt's MBOLT_TRACE, nuthatch text or NUTHTRC1, "
                               "colibri ROUTE_TRACE, iliria FAROUTE1 or llama.cpp moe-trace CSV (auto-detected)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace path."),
    fmt: str = typer.Option("auto", "--format", help="auto, mbtrace, mbolt, nuthatch-text, nuthatch-bin, "
                            "colibri-route, faroute or moe-csv."),
    n_layers: int = typer.Option(None, "--layers", min=1, max=4096, help="Model layers (when the file implies fewer)."),
    n_experts: int = typer.Option(None, "--experts", min=1, max=32767, help="Experts per layer (when the file implies fewer)."),
    prefill_tokens: int = typer.Option(0, "--prefill-tokens", min=0, help="NUTHTRC1: leading positions that were the prompt."),
    force: bool = typer.Option(False, "--force", help="Overwrite the output."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
):
    """Convert a routing trace from another tool into .mbtrace (flags and drops corrupt rows)."""
    from mbolt.core.mbtrace import write_trace
    from mbolt.trace.formats import detect_format, load_trace

    output(out, "mbtrace", inputs=[src], force=force, what="trace")
    kind = detect_format(src) if fmt == "auto" else fmt
    tr = load_trace(src, kind, n_layers=n_layers, n_experts=n_experts, prefill_tokens=prefill_tokens)
    write_trace(out, tr, force=force)
    info = {"source": str(src), "format": kind, "out": str(out), "n_layers": tr.n_layers,
            "n_experts": tr.n_experts, "k": tr.k, "tokens": tr.n_tokens,
            "prefill": int((tr.phase == 0).sum()), "decode": int((tr.phase == 1).sum()),
            "sequences": int(len(set(tr.seq.tolist()))), "notes": tr.notes}
    if as_json:
        print_json(info)
    else:
        console.print(f"wrote [bold]{out}[/]: {kind} -> {tr.n_tokens:,} tokens ({info['prefill']:,} prefill, "
                      f"{info['decode']:,} decode, {info['sequences']} sequences), {tr.n_layers} layers x "
                      f"{tr.n_experts} experts, k={tr.k}", highlight=False)
        for note in tr.notes:
            console.print(f"[yellow]note:[/] {note}", highlight=False)


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
def generate_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF (reference engine: qwen3moe, olmoe, mixtral, qwen2moe; "
                                 "llama.cpp: any MoE arch it runs)."),
    prompt: str = typer.Argument(..., help="Prompt text."),
    n: int = typer.Option(32, "--new-tokens", "-n", min=1, help="Tokens to generate (greedy)."),
    route: str = typer.Option("file", help="Reference engine, reordered files: 'file' (router rows permuted in the "
                              "file) or 'map'."),
    engine: str = typer.Option("reference", "--engine", help="'reference' (numpy engine) or 'llama.cpp'."),
    stream: bool = typer.Option(False, "--stream", help="llama.cpp: mbolt's streaming runtime. The selected experts "
                                "are read explicitly from the eval callback into an expert cache sized from the memory "
                                "budget (--ram, else the cgroup limit, else available memory); dense weights stay "
                                "resident."),
    ram: str = typer.Option(None, "--ram", help="--stream: the memory budget (e.g. 8G). Default: the memory cgroup's "
                            "limit, else the available memory."),
    cache_slots: int = typer.Option(0, "--cache-slots", min=0, help="--stream: experts per layer kept (LRU) instead of "
                                    "sizing the cache from the budget."),
    drop_every_token: bool = typer.Option(False, "--drop-every-token", help="--stream: drop every expert page after "
                                          "every token (the s = 1 bound of a model far larger than RAM; an "
                                          "emulation, not a budget)."),
    qd: int = typer.Option(1, "--qd", min=1, max=1024, help="--stream with blocking reads: queue depth."),
    blocking: bool = typer.Option(False, "--blocking-reads", help="--stream: wait for every read before llama.cpp "
                                  "computes (default: submit the reads and let its page faults wait, which overlaps "
                                  "them with compute)."),
    gap: int = typer.Option(0, "--gap", min=0, help="--stream: merge gap (bytes)."),
    pins: bool = typer.Option(False, "--pins", help="--stream: keep each layer's hottest experts (by the training "
                              "heat a reorder file's route map carries) in 3/4 of the cache; the rest is LRU."),
    as_json: bool = typer.Option(False, "--json", help="Print prompt ids, generated ids, text and timings as JSON."),
):
    """Greedy decode with tokens/s: the numpy reference engine, or llama.cpp (with --stream: mbolt's expert reads)."""
    if engine == "llama.cpp":
        return _generate_llama(model, prompt, n, stream, ram, cache_slots, drop_every_token, qd, blocking, gap,
                               pins, as_json)
    if engine != "reference":
        raise MboltError(f"--engine must be reference or llama.cpp, not {engine!r}")
    if stream or cache_slots or ram or drop_every_token or pins:
        raise MboltError("--stream, --ram, --cache-slots, --drop-every-token and --pins need --engine llama.cpp")
    from mbolt.engine import load_model
    from mbolt.engine.generate import generate

    if route not in ("file", "map"):
        raise MboltError(f"--route {route!r}: choose file or map")
    m = load_model(model, route=route)
    if as_json:
        print_json(generate(m, prompt, n))
        return
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("generating", total=n)
        res = generate(m, prompt, n, on_token=lambda i, t: bar.update(task, completed=i + 1))
    console.print(prompt, end="", highlight=False, markup=False)
    console.print(res["text"], style="bold", highlight=False, markup=False)
    console.print(f"[dim]prompt {len(res['prompt_ids'])} tokens at {res['prefill_tokens_per_s']:.1f} tok/s, "
                  f"generated {len(res['ids'])} at {res['decode_tokens_per_s']:.1f} tok/s[/]")


REPACK_NOTE = ("repacking off: the weights stay pages of the mapped file (llama.cpp's default load copies "
               "Q4_0/Q4_K experts into anonymous memory, which a model larger than RAM cannot hold)")


def _generate_llama(model, prompt, n, stream, ram, cache_slots, drop_every_token, qd, blocking, gap, pins, as_json):
    from rich.progress import Progress

    from mbolt.core.memlimit import budget
    from mbolt.engine.llama.stream import LlamaStream

    if (cache_slots or ram or drop_every_token or blocking or pins) and not stream:
        raise MboltError("--ram, --cache-slots, --drop-every-token, --blocking-reads and --pins need --stream")
    if drop_every_token and (ram or cache_slots):
        raise MboltError("--drop-every-token drops everything after each token: it takes no --ram or --cache-slots")
    limit, where = budget(ram) if (stream and not drop_every_token and not cache_slots) else (None, "")
    with LlamaStream(model, reads=stream, evict=stream, cache_slots=cache_slots, qd=qd, gap=gap, budget=limit,
                     asynchronous=stream and not blocking, pins=pins) as s:
        ids = s.runner.tokenize(prompt, add_special=True)
        if not ids:
            raise MboltError("the prompt has no tokens")
        if stream:
            s.make_cold()
        if not as_json:
            err_console.print(f"[dim]llama.cpp: {REPACK_NOTE}[/]")
            if limit:
                err_console.print(f"[dim]budget {limit / 2**30:.2f} GiB ({where}): {s.locked_bytes / 1e6:.0f} MB of "
                                  f"dense weights locked, {s.cache_slots} expert slots per layer "
                                  f"({s.pinned_per_layer} pinned)[/]")
        with Progress(console=err_console, transient=True, disable=as_json) as bar:
            task = bar.add_task("generating", total=n)
            run = s.generate([ids], n, on_token=lambda i, t: bar.update(task, completed=i + 1))
        text = s.detokenize(run.generated[0])
    tok = max(run.decode_tokens, 1)
    res = {"engine": "llama.cpp", "stream": stream, "cache_slots": s.cache_slots, "budget_bytes": limit,
           "budget_from": where or None, "repacking": "off", "qd": qd, "gap": gap, "async_reads": stream and not blocking,
           "drop_every_token": drop_every_token, "pinned_per_layer": s.pinned_per_layer,
           "prompt_ids": ids, "ids": run.generated[0], "text": text,
           "ttft_s": run.prefill_s, "decode_tokens_per_s": run.decode_tokens / run.decode_s if run.decode_s else None,
           "reads_per_token": run.reads / tok, "bytes_per_token": run.bytes / tok,
           "device_bytes_per_token": None if run.device_bytes is None else run.device_bytes / tok,
           "read_share_s": run.io_s / run.decode_s if (stream and run.decode_s) else None,
           "hits": run.hits, "misses": run.misses}
    if as_json:
        print_json(res)
        return
    console.print(prompt, end="", highlight=False, markup=False)
    console.print(text, style="bold", highlight=False, markup=False)
    how = (f"mbolt streaming ({'blocking reads QD%d' % qd if blocking else 'async reads'}, gap {gap} B, "
           f"{s.cache_slots} cache slots/layer{', every expert dropped after every token' if drop_every_token else ''})"
           if stream else "plain llama.cpp (the file mapped, nothing dropped)")
    line = (f"[dim]llama.cpp, {how}: prompt {len(ids)} tokens in {1e3 * run.prefill_s:.0f} ms, generated "
            f"{len(run.generated[0])} at {res['decode_tokens_per_s'] or 0:.1f} tok/s")
    if stream:
        line += (f", {res['reads_per_token']:.1f} reads/token, {res['bytes_per_token'] / 1e6:.2f} MB/token, "
                 f"s = {res['read_share_s'] or 0:.2f}")
    console.print(line + "[/]")


@user_errors
def trace_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF file."),
    prompts: Path = typer.Option(None, "--prompts", "-p", help="Prompts: .jsonl ({\"prompt\", \"source\"} per line) or text "
                                 "(one per line). Default: the 200 Dolly + CodeAlpaca prompts shipped with mbolt."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace file."),
    max_new_tokens: int = typer.Option(16, "--new-tokens", "-n", min=0, help="Greedy decode tokens per prompt."),
    engine: str = typer.Option("reference", "--engine", help="'reference' (numpy engine) or 'llama.cpp' (eval callback, any llama.cpp arch)."),
    limit: int = typer.Option(0, "--n-prompts", min=0, help="Use at most this many prompts (0 = all)."),
    threads: int = typer.Option(0, "--threads", min=0, help="llama.cpp threads (0 = all cores)."),
    route: str = typer.Option("file", help="Reference engine on reordered files: 'file' or 'map'."),
    shard: str = typer.Option(None, "--shard", help="I/N: trace only the I-th of N deterministic shares of the "
                              "prompts (prompts I, I+N, ...), e.g. on N machines; join with `mbolt trace-merge`."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing trace."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Run prompts and record every token's routing (prefill and decode) into an .mbtrace.
    MODEL may be any shard of a split set."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mbolt.core.moe_map import moe_map
    from mbolt.core.prompts import read_prompts
    from mbolt.trace.tracer import ENGINES, check_part, trace_prompts

    # everything checked before the progress bar starts (an error is then the only output)
    if engine not in ENGINES:
        raise MboltError(f"--engine {engine!r}: choose from {', '.join(ENGINES)}")
    if route not in ("file", "map"):
        raise MboltError(f"--route {route!r}: choose file or map")
    share = parse_share(shard) if shard else None
    mm = moe_map(model)
    output(out, "mbtrace", inputs=[model, prompts], force=force, what="trace",
           protected=(mm.fingerprint, mm.source_fingerprint))
    check_part(out, force)
    if prompts is None:
        from mbolt.data import PROMPTS, path

        prompts = path(PROMPTS)
    items = read_prompts(prompts, limit or None)
    if engine == "llama.cpp" and not as_json:
        from mbolt.core.memlimit import budget

        ram, where = budget(None)
        err_console.print(f"[dim]llama.cpp: the file mapped, repacking off (llama.cpp's default load copies Q4_0/Q4_K "
                          f"experts into anonymous memory): the weights stay reclaimable pages of the file, within "
                          f"the memory budget of {ram / 2**30:.1f} GiB ({where})[/]")
    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err_console, transient=as_json)
    tasks = []

    def progress(done, total, toks, secs):
        if not tasks:  # the bar appears once the model has loaded: a load error is the only output
            bar.start()
            tasks.append(bar.add_task(f"tracing ({engine})", total=len(items), rate=""))
        bar.update(tasks[0], completed=done, rate=f"{toks} tok, {toks / secs if secs > 0 else 0:.1f} tok/s")

    try:
        res = trace_prompts(model, items, out, max_new_tokens=max_new_tokens, engine=engine,
                            route=route, threads=threads or None, on_progress=progress, shard=share,
                            force=force)
    finally:
        bar.stop()
    if as_json:
        print_json(res)
    else:
        console.print(f"wrote [bold]{res['out']}[/]: {res['prompts']} prompts, {res['prefill_tokens']} prefill + "
                      f"{res['decode_tokens']} decode tokens in {res['seconds']:.1f} s "
                      f"({res['tokens_per_s']:.1f} tok/s, {engine})")


def parse_share(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4) for `trace --shard`."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise MboltError(f"--shard {text!r}: expected I/N, e.g. 2/4") from None
    if not 1 <= i <= n:
        raise MboltError(f"--shard {text}: expected I/N with 1 <= I <= N")
    return i, n


@user_errors
def trace_merge_cmd(
    traces: list[Path] = typer.Argument(..., help="Traces of the same model (e.g. from `mbolt trace --shard I/N`)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace."),
    force: bool = typer.Option(False, "--force", help="Replace a previous trace at --out (never an input)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Join traces of one model into one .mbtrace: refuses other models (fingerprint) or
    geometry, renumbers sequences, keeps domains."""
    from mbolt.core.atomic import check_output
    from mbolt.core.mbtrace import write_trace
    from mbolt.trace.formats import load_traces

    check_output(out, kind="mbtrace", inputs=traces, force=force, what="merged trace")
    tr = load_traces(traces)
    write_trace(out, tr, force=True)
    res = {"out": str(out), "inputs": [str(t) for t in traces], "tokens": tr.n_tokens,
           "sequences": int(len(set(tr.seq.tolist()))), "n_layers": tr.n_layers, "n_experts": tr.n_experts,
           "k": tr.k, "fingerprint": tr.fingerprint, "domains": len(tr.domains)}
    if as_json:
        print_json(res)
    else:
        console.print(f"wrote [bold]{out}[/]: {res['tokens']} tokens, {res['sequences']} sequences from "
                      f"{len(traces)} traces")


@user_errors
def plan_cmd(
    trace: list[Path] = typer.Argument(..., help="A .mbtrace or any importable trace (see `mbolt import-trace`); "
                                       "several traces of the same model are merged (as `mbolt trace-merge`). "
                                       "A colibri .coli_usage (heat only) gives a --method heat plan."),
    out: Path = typer.Option(None, "-o", "--out", help="Write the plan JSON here."),
    fmt: str = typer.Option("mbolt", "--format", help="mbolt (plan.json) or perms (the original mbolt's perms.json: "
                            "clique/chain/heat perms and heat, plus this plan's perm; `reorder --plan` reads both)."),
    method: str = typer.Option("tsp", "--method", help="stock, heat, heat-tsp, mbolt-chain or tsp."),
    train_frac: float = typer.Option(0.5, "--train-frac", min=0.0, max=1.0,
                                     help="Leading share of tokens to train on, in (0, 1] (rest held out)."),
    holdout_domain: str = typer.Option(None, "--holdout-domain", help="Hold out the sequences of this domain instead."),
    phase: str = typer.Option("decode", "--phase", help="decode or all."),
    model: Path = typer.Option(None, "--model", help="GGUF: slice sizes and a trace/model consistency check."),
    geometry: str = typer.Option(None, "--geometry", help="Slice-size preset when no --model (see mbolt.layout.evaluate.PRESETS)."),
    layout: str = typer.Option("reorder", "--layout", help="reorder (three tensors) or packed (gate|up|down per expert)."),
    gap: int = typer.Option(0, "--gap", min=0, help="Merge gap in bytes (the reader reads through holes this small)."),
    cache: int = typer.Option(0, "--cache-slots", min=0, help="Per-layer LRU cache slots when scoring."),
    compare: bool = typer.Option(False, "--compare", help="Score every method and the bound."),
    bound: str = typer.Option("auto", "--bound", help="auto, subtour, lp, top2 or none (with --compare)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output (plan and held-out trace)."),
    heldout: Path = typer.Option(None, "--heldout", help="Also write the held-out tokens here (.mbtrace, for `mbolt ab --replay`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Co-activation -> expert order per layer (plan.json), scored on held-out tokens."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from mbolt.layout.plan import plan_file
    from mbolt.report.layout_tables import compare_table, plan_summary

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(f"planning ({method})")
        res = plan_file(trace if len(trace) > 1 else trace[0], out, method=method, train_frac=train_frac, holdout_domain=holdout_domain,
                        phase=phase, model=model, geometry=geometry, layout=layout, gap=gap, cache_slots=cache,
                        compare=compare, bound=bound, force=force, heldout_out=heldout, fmt=fmt,
                        progress=lambda m: bar.update(task, description=f"planned {m}"))
    if as_json:
        print_json(res)
        return
    console.print(plan_summary(res), highlight=False)
    if "compare" in res:
        console.print(compare_table(res["compare"]))


@user_errors
def synth_trace_cmd(
    like: Path = typer.Option(..., "--like", help="A published co-activation profile (coactivation_*.json)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace path."),
    tokens: int = typer.Option(0, "--tokens", min=0, help="Tokens to sample (default: the profile's count)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite the output."),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration report as JSON."),
):
    """Sample a decode trace whose per-layer heat and strong pairs match a published profile."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from mbolt.layout.calibrate import load_profile, synth_trace_like
    from mbolt.report.layout_tables import match_table
    from mbolt.core.mbtrace import write_trace

    output(out, "mbtrace", inputs=[like], force=force, what="trace")
    prof = load_profile(like)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("fitting layers", total=prof.n_layers)
        tr, rep = synth_trace_like(prof, tokens or None, seed=seed, progress=lambda l: bar.update(task, completed=l + 1))
    write_trace(out, tr, force=force)
    rep["out"] = str(out)
    if as_json:
        print_json(rep)
    else:
        console.print(match_table(rep))
        console.print(f"wrote [bold]{out}[/]: {tr.n_tokens:,} decode tokens, {tr.n_layers} layers x "
                      f"{tr.n_experts} experts, k={tr.k}", highlight=False)


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


# One table registers every command: the order and panels of `mbolt --help` (pipeline order).
COMMANDS = [
    ("demo", demo_cmd, "Start here"),
    ("report", report_cmd, "Start here"),
    ("trace", trace_cmd, "Pipeline"),
    ("trace-merge", trace_merge_cmd, "Pipeline"),
    ("plan", plan_cmd, "Pipeline"),
    ("reorder", reorder_cmd, "Pipeline"),
    ("verify", verify_cmd, "Pipeline"),
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
