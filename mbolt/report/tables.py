"""Rich renderings of stage results (the CLI prints them; stages never print)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mbolt.gguf.moe_map import MoeMap


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def moe_map_table(m: MoeMap) -> Group:
    head = Text.assemble(
        (f"{m.path}\n", "bold"),
        f"arch {m.arch}, {m.n_layers} layers ({len(m.moe_layers)} MoE), "
        f"{m.n_experts} experts, {m.n_used} used per token, layout "
        f"{m.header.get('mbolt.layout', 'stock')}, fingerprint {m.fingerprint[:12]}",
    )
    t = Table(show_lines=False, header_style="bold")
    for col in ("blk", "tensor", "role", "type", "slice", "expert 0 at", "4K"):
        t.add_column(col, justify="right" if col in ("blk", "slice", "expert 0 at") else "left",
                     no_wrap=col in ("tensor", "slice", "expert 0 at"))
    for layer in m.layers:
        if layer.dense:
            t.add_row(str(layer.index), "[dim]dense FFN (no routed experts)[/]", "", "", "", "", "")
            continue
        for x in layer.experts:
            role = f"[red]{x.role}[/] ({x.why})" if x.role == "unknown" else x.role
            t.add_row(str(layer.index), x.name, role, x.type, human_bytes(x.slice_bytes),
                      f"{x.data_offset:,}", "yes" if x.aligned else "no")
        for name in layer.shared:
            t.add_row(str(layer.index), f"[dim]{name}[/]", "[dim]shared[/]", "", "", "", "")
    return Group(head, t)
