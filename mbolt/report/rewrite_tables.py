"""Rich renderings of `mbolt reorder` and `mbolt verify` results."""

from __future__ import annotations

from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mbolt.report.tables import human_bytes


def reorder_table(r) -> Group:
    t = Table(show_header=False, box=None, padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("source", r.src)
    t.add_row("output", f"{r.dst} ({human_bytes(r.bytes_written)}"
              + (f", set of {len(r.files)} shards: {Path(r.files[0]).name} ... {Path(r.files[-1]).name})"
                 if len(r.files) > 1 else ")"))
    t.add_row("layout", r.layout + ("  [dim](llama.cpp does not load this layout)[/]" if r.layout == "packed" else ""))
    t.add_row("plan", f"{r.method}{' (identity order)' if r.identity and r.method != 'identity' else ''}, {r.n_moe_layers} MoE layers")
    t.add_row("copy", f"{r.seconds:.2f} s, {r.throughput / 1e9:.2f} GB/s, {r.copy_ops:,} ranges via {r.copy_mode}")
    for i, note in enumerate(r.alignment):
        t.add_row("alignment" if i == 0 else "", note)
    t.add_row("route map", f"mbolt.* metadata + {r.sidecar or '(no sidecar)'}")
    t.add_row("fingerprint", f"{r.fingerprint[:16]} (source {r.source_fingerprint[:16]})")
    for p in r.removed_stale:
        t.add_row("cleaned", f"stale temp file {p}")
    parts = [Text.assemble(("reordered ", "bold green"), f"{r.src} -> {r.dst}"), t]
    return Group(*parts)


def verify_table(rep) -> Group:
    t = Table(header_style="bold")
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail", overflow="fold")
    for c in rep.checks:
        res = "[green]ok[/]" if c.ok else "[red]FAIL[/]" if c.ok is False else "[yellow]skipped[/]"
        t.add_row(c.name, res, c.detail)
    parts = [t]
    if rep.mismatches:
        m = Table(header_style="bold", title=f"{rep.n_mismatches} mismatching slices/tensors"
                  + (f" (first {len(rep.mismatches)})" if rep.n_mismatches > len(rep.mismatches) else ""))
        for col in ("tensor", "layer", "position", "expert", "first bad byte"):
            m.add_column(col, justify="left" if col == "tensor" else "right")
        for x in rep.mismatches:
            dash = lambda v: "-" if v < 0 else str(v)  # noqa: E731
            m.add_row(x.tensor, dash(x.layer), dash(x.position), dash(x.expert), str(x.offset))
        parts.append(m)
    # each time says what it covers: the byte comparison, each engine run, and the whole verify
    phases = "".join(f", {name} parity {sec:.1f} s" for name, sec in rep.phase_seconds.items())
    verdict = ("[bold green]verified[/]" if rep.ok else "[bold red]NOT identical[/]") + (
        f": {rep.out} against {rep.src}; {human_bytes(rep.bytes_compared)} compared byte for byte in "
        f"{rep.seconds:.2f} s{phases}; verify took {rep.total_seconds:.1f} s")
    parts.append(Text.from_markup(verdict))
    return Group(*parts)
