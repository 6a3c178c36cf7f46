"""BigMoeOnEdge's ``route_trace v1`` CSV (Helldez/BigMoeOnEdge ``--route-trace``; samples in
``docs/bench-data/2026-07-15-route-trace/`` at 2d4f2b1, copied into ``mbolt/data/bigmoeonedge/``).

Header lines, then one row per routed expert::

    # route_trace v1
    # model=<path> arch=<arch> n_layer=<L> n_expert=<E> n_expert_used=<k>
    # layer=<N> expert_bytes=<bytes> dense_bytes=<bytes>      (one per layer)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes

``turn`` is the chat turn (a sequence), ``step`` the token's position in it (prompt tokens first),
``phase`` 0 = prefill, 1 = decode (mbolt's PREFILL / DECODE), ``slot`` the expert's rank in the
token's top-k, ``weight`` its routing weight, ``residency`` 1 when BigMoeOnEdge's own cache held
the expert, and ``expert_bytes`` what it read for it (0 on a hit, else the layer's expert size).
As in llama.cpp, the last layer of a prompt is routed for its last token only; the other prompt
tokens get -1 there. The residency and bytes columns describe BigMoeOnEdge's run, not the
routing: they are checked, and the layer sizes are kept (`expert_bytes_of`), but replay decides
hits itself.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_cells
from mbolt.core.errors import MboltError
from mbolt.core.trace import DECODE, PREFILL, Trace
from mbolt.trace.formats.common import MAX_CELLS_IMPORT, decode_ascii

MAGIC_LINE = "# route_trace v1"
COLUMNS = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"
_KV = re.compile(r"(\w+)=(\S+)")
MAX_WEIGHT = 1e6  # routing weights are of order 1; float32 holds them


def looks_like_bigmoeonedge(first_line: str) -> bool:
    return first_line.strip() == MAGIC_LINE


def _int_field(where: str, name: str, value: str, lo: int, hi: int | None = None) -> int:
    """`value` as an integer in [lo, hi) (hi None: unbounded), else one error naming the field."""
    try:
        v = int(value)
    except ValueError:
        raise MboltError(f"{where}: {name} {value!r} is not an integer") from None
    if v < lo or (hi is not None and v >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise MboltError(f"{where}: {name} {v} out of range (expected {bound})")
    return v


def _header(where: str, lines: list[str]) -> tuple[dict, dict, int]:
    """(model keys, {layer: (expert_bytes, dense_bytes)}, index of the column line)."""
    if not lines or lines[0].strip() != MAGIC_LINE:
        raise MboltError(f"{where}: line 1: expected {MAGIC_LINE!r}")
    model: dict = {}
    sizes: dict = {}
    for i in range(1, len(lines)):
        line = lines[i].strip()
        at = f"{where}: line {i + 1}"
        if not line.startswith("#"):
            if line != COLUMNS:
                raise MboltError(f"{at}: expected the column line {COLUMNS!r}, got {line[:80]!r}")
            break
        kv = dict(_KV.findall(line))
        if "model" in kv or "n_layer" in kv:
            for key, hi in (("n_layer", MAX_LAYERS + 1), ("n_expert", MAX_EXPERTS + 1), ("n_expert_used", None)):
                if key not in kv:
                    raise MboltError(f"{at}: model line without {key}=")
                model[key] = _int_field(at, key, kv[key], 1, hi)
            model["model"], model["arch"] = kv.get("model", ""), kv.get("arch", "")
        elif "layer" in kv:
            if not model:
                raise MboltError(f"{at}: a layer line before the model line")
            layer = _int_field(at, "layer", kv["layer"], 0, model["n_layer"])
            if layer in sizes:
                raise MboltError(f"{at}: layer {layer} described twice")
            sizes[layer] = tuple(_int_field(at, key, kv.get(key, "?"), 0) for key in ("expert_bytes", "dense_bytes"))
        # other comment lines (a summary, notes) carry nothing the trace needs
    else:
        raise MboltError(f"{where}: no column line {COLUMNS!r}")
    if not model:
        raise MboltError(f"{where}: no model line (n_layer=, n_expert=, n_expert_used=)")
    if model["n_expert_used"] > model["n_expert"]:
        raise MboltError(f"{where}: n_expert_used={model['n_expert_used']} exceeds n_expert={model['n_expert']}")
    return model, sizes, i


def read_bigmoeonedge(path: Path, data: bytes, n_layers=None, n_experts=None) -> Trace:
    where = str(path)
    lines = decode_ascii(where, data, "a route_trace CSV").splitlines()
    model, sizes, col = _header(where, lines)
    L, E, K = model["n_layer"], model["n_expert"], model["n_expert_used"]
    if n_layers is not None and n_layers != L:
        raise MboltError(f"{where}: trace has {L} layers, expected {n_layers}")
    if n_experts is not None and n_experts != E:
        raise MboltError(f"{where}: trace has {E} experts, expected {n_experts}")
    rows = [(i + 1, ln) for i, ln in enumerate(lines[col + 1:], col + 1) if ln.strip()]
    check_cells(f"{where}: rows", (len(rows), 1), MAX_CELLS_IMPORT)
    token_of: dict = {}  # (turn, step) -> token index, in file order
    tok_phase: list[int] = []
    cells: dict = {}  # (token, layer, slot) -> line, to refuse a repeated cell
    experts_at: dict = {}  # (token, layer) -> experts already routed, to refuse a repeated expert
    vals = np.zeros((len(rows), 4), np.int64)  # token, layer, slot, expert
    weight = np.zeros(len(rows), np.float32)
    for r, (lineno, line) in enumerate(rows):
        at = f"{where}: line {lineno}"
        parts = line.strip().split(",")
        if len(parts) != 9:
            raise MboltError(f"{at}: expected 9 comma-separated fields ({COLUMNS}), got {len(parts)}")
        turn = _int_field(at, "turn", parts[0], 0, 1 << 31)
        phase = _int_field(at, "phase", parts[1], 0, 2)
        step = _int_field(at, "step", parts[2], 0, 1 << 31)
        layer = _int_field(at, "layer", parts[3], 0, L)
        slot = _int_field(at, "slot", parts[4], 0, K)
        expert = _int_field(at, "expert", parts[5], 0, E)
        try:
            w = float(parts[6])
        except ValueError:
            raise MboltError(f"{at}: weight {parts[6]!r} is not a number") from None
        if not math.isfinite(w) or abs(w) > MAX_WEIGHT:
            raise MboltError(f"{at}: weight {parts[6]!r} is not a finite routing weight")
        resident = _int_field(at, "residency", parts[7], 0, 2)
        nbytes = _int_field(at, "expert_bytes", parts[8], 0)
        size = sizes.get(layer, (None,))[0]
        if nbytes and (resident or (size is not None and nbytes != size)):
            what = "a resident expert" if resident else f"layer {layer}'s experts are {size} bytes"
            raise MboltError(f"{at}: expert_bytes {nbytes} but {what}")
        key = (turn, step)
        tok = token_of.setdefault(key, len(token_of))
        if tok == len(tok_phase):
            tok_phase.append(phase)
        elif tok_phase[tok] != phase:
            raise MboltError(f"{at}: turn {turn} step {step} is phase {phase} here, {tok_phase[tok]} above")
        prev = cells.setdefault((tok, layer, slot), lineno)
        if prev != lineno:
            raise MboltError(f"{at}: turn {turn} step {step} layer {layer} slot {slot} repeats line {prev}")
        seen = experts_at.setdefault((tok, layer), set())
        if expert in seen:
            raise MboltError(f"{at}: expert {expert} routed twice at turn {turn} step {step} layer {layer}")
        seen.add(expert)
        vals[r] = tok, layer, slot, expert
        weight[r] = w
    if not rows:
        raise MboltError(f"{where}: no routing rows")
    N = len(token_of)
    check_cells(f"{where}: tokens x layers x k", (N, L, K), MAX_CELLS_IMPORT)
    experts = np.full((N, L, K), -1, np.int16)
    weights = np.zeros((N, L, K), np.float32)
    t, ly, s, e = vals.T
    experts[t, ly, s] = e
    weights[t, ly, s] = weight
    filled = experts >= 0
    gap = filled.any(axis=2) & ~filled.all(axis=2)
    if gap.any():
        ti, li = (int(x[0]) for x in np.nonzero(gap))
        turn, step = next(k for k, v in token_of.items() if v == ti)
        raise MboltError(f"{where}: turn {turn} step {step} layer {li} routes fewer than n_expert_used={K} experts")
    keys = list(token_of)
    phase_map = {0: PREFILL, 1: DECODE}
    return Trace(L, E, K, experts, np.array([phase_map[p] for p in tok_phase], np.uint8),
                 np.array([k[0] for k in keys], np.int32), np.array([k[1] for k in keys], np.int32), weights,
                 notes=[f"{path.name}: BigMoeOnEdge route_trace of {Path(model['model']).name or 'an unnamed model'}"
                        f"{' (' + model['arch'] + ')' if model['arch'] else ''}"])


def expert_bytes_of(path: str | Path) -> np.ndarray | None:
    """Per layer, one expert's bytes as the header records them (int64 [n_layer], 0 where a layer
    has no line); None for a file in another format."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16).decode("ascii", "replace").splitlines()
    except OSError as e:
        raise MboltError(f"{path}: cannot read: {e.strerror}") from None
    if not head or not looks_like_bigmoeonedge(head[0]):
        return None
    model, sizes, _ = _header(str(path), head)
    out = np.zeros(model["n_layer"], np.int64)
    for layer, (eb, _dense) in sizes.items():
        out[layer] = eb
    return out
