"""Exchange with other engines: expert-map, export-coact, export-heat, import-trace."""

from __future__ import annotations

from pathlib import Path

import typer

from mbolt.cli.common import console, err_console, output, print_json, show, user_errors
from mbolt.core.errors import MboltError


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
    show(as_json, d, lambda: f"wrote {out}: {len(d['layers'])} MoE layers x {d['n_experts']} experts, layout "
                             f"{d['layout']}, {len(d['files'])} file(s)")


_TRACES = typer.Argument(..., help="A .mbtrace or any importable trace (several of one model are merged).")
_FORCE = typer.Option(False, "--force", help="Overwrite the output.")
_SUMMARY_JSON = typer.Option(False, "--json", help="Print a summary as JSON.")


@user_errors
def export_coact_cmd(
    trace: list[Path] = _TRACES,
    out: Path = typer.Option(..., "-o", "--out", help="Where the profile goes (coactivation JSON)."),
    model: Path = typer.Option(None, "--model", help="The GGUF the trace was made on: checked, and its name and "
                               "quantisation fill the profile's model and quant fields."),
    force: bool = _FORCE,
    as_json: bool = _SUMMARY_JSON,
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
        d = export_profile(tr, model=str(name), quant=quant, progress=lambda l: bar.advance(task),
                           where=", ".join(map(str, trace)))
    write_text_atomic(out, _json.dumps(d) + "\n")
    info = {"out": str(out), "n_layers": d["n_layers"], "moe_layers": len(d["layers"]),
            "n_expert_per_layer": d["n_expert_per_layer"], "k": d["k"], "n_decode_tokens": d["n_decode_tokens"],
            "pairs": sum(len(r["pairs"]) for r in d["layers"])}
    show(as_json, info, lambda: f"wrote {out}: {info['moe_layers']} MoE layers x {info['n_expert_per_layer']} experts, "
                                f"k={info['k']}, {info['n_decode_tokens']:,} decode tokens, {info['pairs']:,} strong pairs")


@user_errors
def export_heat_cmd(
    trace: list[Path] = _TRACES,
    out: Path = typer.Option(..., "-o", "--out", help="Where the heat goes (.coli_usage text)."),
    engine: str = typer.Option(None, "--colibri-engine", help="colibri's engine name (e.g. qwen3_moe, glm_moe_dsa, olmoe): "
                               "its id goes in the header; without it colibri takes the file only as PIN=<path>."),
    phase: str = typer.Option("decode", "--phase", help="decode, prefill or all: which tokens count."),
    force: bool = _FORCE,
    as_json: bool = _SUMMARY_JSON,
):
    """Write the trace's heat (tokens that selected each expert, per layer) as colibri's
    .coli_usage, so colibri pins from an mbolt trace."""
    import numpy as np

    from mbolt.core.atomic import write_text_atomic
    from mbolt.core.trace import select_phase
    from mbolt.layout.coact import coactivation
    from mbolt.trace.formats import load_traces
    from mbolt.trace.formats.colibri import engine_id, usage_text

    tr = select_phase(load_traces(trace), phase, ", ".join(map(str, trace)))
    output(out, "coli-usage", inputs=trace, force=force, what=".coli_usage")
    heat = coactivation(tr).heat
    write_text_atomic(out, usage_text(heat, engine))
    info = {"out": str(out), "n_layers": tr.n_layers, "n_experts": tr.n_experts, "tokens": tr.n_tokens,
            "phase": phase, "nonzero": int(np.count_nonzero(heat)), "engine_id": engine_id(engine) if engine else 0}
    show(as_json, info, lambda: f"wrote {out}: {info['nonzero']:,} non-zero counts over {tr.n_layers} layers x "
                                f"{tr.n_experts} experts from {tr.n_tokens:,} {phase} tokens; engine id {info['engine_id']}")


@user_errors
def import_trace_cmd(
    src: Path = typer.Argument(..., help="A routing trace: the original mbolt's MBOLT_TRACE, nuthatch text or NUTHTRC1, "
                               "colibri ROUTE_TRACE, iliria FAROUTE1, llama.cpp moe-trace CSV or BigMoeOnEdge route_trace CSV "
                               "(auto-detected)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace path."),
    fmt: str = typer.Option("auto", "--format", help="auto, mbtrace, mbolt, nuthatch-text, nuthatch-bin, "
                            "colibri-route, faroute, moe-csv or bigmoeonedge."),
    n_layers: int = typer.Option(None, "--layers", min=1, max=4096, help="Model layers (when the file implies fewer)."),
    n_experts: int = typer.Option(None, "--experts", min=1, max=32767, help="Experts per layer (when the file implies fewer)."),
    prefill_tokens: int = typer.Option(0, "--prefill-tokens", min=0, help="NUTHTRC1: leading positions that were the prompt."),
    force: bool = _FORCE,
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
