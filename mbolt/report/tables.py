"""Rich renderings of stage results (the CLI prints them; stages never print)."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from mbolt.core.moe_map import MoeMap


def data_table(title: str, columns: list[str], *, left: tuple[str, ...] = ("arm",)) -> Table:
    """A table of numbers that stays readable in 80 columns: light borders, headers may break at
    "\n" but are never truncated, cells never wrap."""
    t = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", no_wrap=True,
                     min_width=max(len(line) for line in col.split("\n")))
    return t


def human_bytes(n: int) -> str:
    """Every size mbolt prints: decimal units (kB, MB, GB), as its MB/token and MB/s columns."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def layer_spans(layers) -> str:
    """'0-2, 5, 7-9' for a sorted list of layer indices."""
    out, run = [], []
    for i in layers:
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def moe_structure(m: MoeMap) -> list[str]:
    """One line per structural feature of the model: dense layers, shared experts, fused
    gate_up, attention kinds, expert weight types (mixes per projection and per layer)."""
    names = {t.name for t in m.header.tensors}

    def layers_with(suffix: str) -> list[int]:
        return [i for i in range(m.n_layers) if f"blk.{i}.{suffix}" in names]

    lines = []
    dense = [layer.index for layer in m.layers if layer.dense]
    if dense:
        lines.append(f"dense FFN layers (no routed experts): {layer_spans(dense)}")
    shared = [layer.index for layer in m.layers if layer.shared]
    if shared:
        gated = layers_with("ffn_gate_inp_shexp.weight")
        lines.append(f"shared expert (ffn_*_shexp, never permuted) in {len(shared)} layers"
                     + (", sigmoid-gated (ffn_gate_inp_shexp)" if gated else ", ungated"))
    fused = [layer.index for layer in m.layers if layer.role("gate_up")]
    if fused:
        lines.append(f"fused gate_up (ffn_gate_up_exps) in layers {layer_spans(fused)}")
    extras = {"probs_bias": "exp_probs_b", "router_bias": "router bias", "gate_bias": "per-expert biases"}
    found = [what for role, what in extras.items() if any(layer.role(role) for layer in m.layers)]
    if found:
        lines.append("expert-indexed extras (permuted with the experts): " + ", ".join(found))
    attn = []
    ssm = layers_with("ssm_a")
    if ssm:
        attn.append(f"linear attention (gated delta net, ssm_*) in layers {layer_spans(ssm)}")
    if layers_with("attn_kv_a_mqa.weight"):
        attn.append("MLA (attn_kv_a_mqa, attn_k_b/v_b)")
    if layers_with("attn_sinks.weight"):
        attn.append("attention sinks")
    if attn:
        lines.append("attention: " + "; ".join(attn))
    by_role: dict[str, dict[str, list[int]]] = {}
    for layer in m.moe_layers:
        for t in layer.weights:
            by_role.setdefault(t.role, {}).setdefault(t.type, []).append(layer.index)
    if by_role:
        parts = []
        for role, types in by_role.items():
            if len(types) == 1:
                parts.append(f"{role} {next(iter(types))}")
            else:
                parts.append(f"{role} " + " / ".join(f"{t} (layer{'s' if len(ls) > 1 else ''} {layer_spans(ls)})"
                                                     for t, ls in types.items()))
        lines.append("expert weights: " + ", ".join(parts))
    return lines


def moe_map_table(m: MoeMap) -> Group:
    head = Text.assemble(
        (f"{m.path}\n", "bold"),
        f"arch {m.arch}, {m.n_layers} layers ({len(m.moe_layers)} MoE), "
        f"{m.n_experts} experts, {m.n_used} used per token, layout "
        f"{m.header.get('mbolt.layout', 'stock')}, fingerprint {m.fingerprint[:12]}",
        *([f"\nsplit set of {len(m.paths)} shards (fingerprint of the set): "
           + ", ".join(f"{i + 1}: {s.path.name} ({len(s.tensors)} tensors, {human_bytes(s.file_size)})"
                       for i, s in enumerate(m.header.shards))] if m.header.shards else []),
        *(f"\n  {line}" for line in moe_structure(m)),
    )
    t = Table(show_lines=False, header_style="bold")
    for col in ("blk", "tensor", "role", "type", "slice", "expert 0 at", "4K"):
        t.add_column(col, justify="right" if col in ("blk", "slice", "expert 0 at") else "left",
                     no_wrap=True)
    for layer in m.layers:
        p = f"blk.{layer.index}."
        if layer.dense:
            t.add_row(str(layer.index), "[dim]dense FFN (no routed experts)[/]", "", "", "", "", "")
            continue
        for x in layer.experts:
            role = f"[red]{x.role}[/] ({x.why})" if x.role == "unknown" else x.role
            at = f"{x.data_offset:,}" + (f" (shard {x.file + 1})" if m.header.shards else "")
            t.add_row(str(layer.index), x.name.removeprefix(p), role, x.type, human_bytes(x.slice_bytes),
                      at, "yes" if x.aligned else "no")
        for name in layer.shared:
            info = m.header.tensor(name)
            t.add_row(str(layer.index), f"[dim]{name.removeprefix(p)}[/]", "[dim]shared[/]",
                      f"[dim]{info.type_name}[/]" if info else "", f"[dim]{human_bytes(info.nbytes)}[/]" if info else "",
                      "", "")
    return Group(head, t)


def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def demo_table(s: dict) -> Group:
    """The one summary `mbolt demo` ends with (every number from demo.json)."""
    g, tr = s["geometry"], s["trace"]
    head = Text.assemble(
        ("mbolt demo", "bold"), f" ({s['size']}): {g['n_layers']} layers x {g['n_experts']} experts, k={g['k']}, "
        f"{human_bytes(g['slice_bytes'])} expert slices; traced {tr['prompts']} prompts "
        f"({tr['prefill_tokens']} prefill + {tr['decode_tokens']} decode tokens); planned on "
        f"{tr['train_decode_tokens']} training decode tokens, replayed {tr['heldout_decode_tokens']} held-out ones.",
    )
    t = data_table(f"cold replay of held-out tokens: explicit reads, QD1 buffered, "
                   f"{_fmt(s['ab']['arms'][0]['mb_per_token'], '.2f')} MB/token in every arm; medians over rounds "
                   "with swapped arm order",
                   ["arm", "reads\n/token", "I/O ms\n/token", "cold\ntok/s", "x stock", "95% CI", "pred.\nx stock"])
    for a in s["ab"]["arms"]:
        ci = a.get("speedup_ci95") or [None, None]
        t.add_row(a["arm"], _fmt(a["reads_per_token"]),
                  _fmt(a["io_ms_per_token"], ".1f"), _fmt(a["cold_tokens_per_s"], ".0f"),
                  _fmt(a["speedup_vs_stock"], ".2f"), f"{_fmt(ci[0], '.2f')}-{_fmt(ci[1], '.2f')}",
                  _fmt(a["pred_speedup"], ".2f"))
    v = data_table("verification: every tensor byte-identical through the route map; routing parity on the "
                   "reference engine", ["file", "verdict", "checks"], left=("file", "verdict", "checks"))
    v.columns[2].no_wrap = False
    for name, rep in s["verify"].items():
        v.add_row(name, "[green]PASS[/]" if rep["ok"] else "[red]FAIL[/]",
                  ", ".join(c["name"] for c in rep["checks"] if c["ok"] is not None))
    notes = []
    ab = s["ab"]
    off = [a["arm"] for a in ab["arms"] if a["pred_reads_per_token"] is not None
           and abs(a["pred_reads_per_token"] - a["reads_per_token"]) > 0.01 * a["reads_per_token"]]
    notes.append("predicted reads/token (planner's evaluator) match the measured counts in every arm" if not off
                 else f"[yellow]predicted reads/token differ from measured by > 1% in: {', '.join(off)}[/]")
    notes.append("cold: page cache evicted and proven empty (mincore) before every arm" if ab["cold"]
                 else "[red]NOT cold: eviction could not be proven[/]")
    notes += [f"[yellow]flag:[/] {f}" for f in ab["flags"]] + list(ab["notes"])
    aa = ab.get("aa_deviation")
    if aa is not None:
        tol = ab.get("aa_tolerance", 0.03)
        verdict = "within" if abs(aa) <= tol else "[yellow]outside[/]"
        notes.append(f"A/A control: {100 * aa:+.1f}% ({verdict} +-{100 * tol:.0f}%); differences smaller than "
                     "that are noise" + ("" if abs(aa) <= tol else " on this machine right now"))
    notes.append(f"files in {s['workdir']}; A/B result {s['workdir']}/{ab['result']}; summary {s['workdir']}/demo.json; "
                 f"{s['seconds']:.0f} s")
    return Group(head, t, v, Text.from_markup("\n".join(notes)))


def demo_next_steps(s: dict) -> Text:
    """What to run after the demo: the same pipeline on the user's own MoE GGUF (printed with
    soft wrap, so every command stays one line to copy)."""
    lines = [
        f"mbolt report {s['workdir']}/demo.json -o demo.png   (this run as a picture)",
        "on your own model, MODEL.gguf (llama.cpp's bindings first: pip install -e \".[llama]\"):",
        "  mbolt inspect MODEL.gguf",
        "  mbolt serve MODEL.gguf   (a model larger than RAM behind the OpenAI API, a chat page at :8080)",
        "  mbolt generate MODEL.gguf \"Hello\" --engine llama.cpp --stream   (the same runtime, one prompt)",
        "  mbolt trace MODEL.gguf --engine llama.cpp -o run.mbtrace",
        "  mbolt plan run.mbtrace --model MODEL.gguf -o plan.json --heldout held.mbtrace",
        "  mbolt reorder MODEL.gguf MODEL.reorder.gguf --plan plan.json",
        "  mbolt verify MODEL.gguf MODEL.reorder.gguf --llama",
        "  mbolt ab MODEL.gguf:os,name=plain MODEL.reorder.gguf:name=mbolt,async --decode --engine llama.cpp "
        "--ram 8G --forced   (as root)",
    ]
    return Text.assemble(("next:\n", "bold"), "\n".join(lines))
