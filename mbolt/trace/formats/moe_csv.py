"""llama.cpp's ``examples/moe-trace`` CSV (ggml-org/llama.cpp PR #28544; read from the copy in
savoflux-spec/AI.local ``examples/moe-trace/moe-trace.cpp`` at f830d47, whose comments match the
PR).

The example's eval callback writes, for every ``ffn_moe_topk-<layer>`` tensor it sees,
``fprintf(out, "%d,%d\\n", layer, id)`` for each of the tensor's n_tokens x k ids in memory
order: no header, no token, rank or weight column. So a run of lines with one layer is one
layer of one micro-batch, k lines per token; a layer lower than the previous run's starts a new
forward. k is not written: it is the greatest common divisor of the run lengths (a decode step,
or the last layer of a prefill, which llama.cpp evaluates for the output token only, has one
token). Prefill micro-batches carry llama.cpp's strided-view bug (the ids after the first
token's are a full ranking, not top-k); it is detected and the corrupt rows dropped as for the
other llama.cpp exports.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS
from mbolt.core.errors import MboltError
from mbolt.core.trace import Trace
from mbolt.trace.formats.common import assemble, infer_n_experts, infer_n_layers

_LINE = re.compile(rb"^(\d+),(\d+)\r?$")


def looks_like_moe_csv(first_line: str) -> bool:
    return _LINE.match(first_line.strip().encode()) is not None


def read_moe_csv(path: Path, data: bytes, n_layers=None, n_experts=None) -> Trace:
    where = str(path)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    vals = np.zeros((len(lines), 2), np.int64)
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        if m is None:
            raise MboltError(f"{where}: line {i + 1}: expected '<layer>,<expert>', got "
                             f"{line[:60].decode('ascii', 'replace')!r}")
        layer, expert = int(m.group(1)), int(m.group(2))
        if layer >= MAX_LAYERS or expert >= MAX_EXPERTS:
            raise MboltError(f"{where}: line {i + 1}: layer {layer} or expert id {expert} out of range (at most "
                             f"{MAX_LAYERS - 1} and {MAX_EXPERTS - 1})")
        vals[i] = layer, expert
    if not len(vals):
        raise MboltError(f"{where}: no routing lines")
    layer_l, expert = vals[:, 0], vals[:, 1]
    E = infer_n_experts(where, expert, n_experts, lambda i: f"line {i + 1}")
    new_run = np.ones(len(vals), bool)
    new_run[1:] = layer_l[1:] != layer_l[:-1]
    rstart = np.flatnonzero(new_run)
    run_len = np.diff(np.append(rstart, len(vals)))
    K = math.gcd(*(int(x) for x in np.unique(run_len)))
    if K > E:
        raise MboltError(f"{where}: the runs of one layer are multiples of {K} lines, more than the {E} experts: "
                         "lines lost or reordered")
    layer = layer_l[rstart]
    ntok = run_len // K

    def loc(r):
        return f"line {int(rstart[r]) + 1}"

    def span(lo, hi):
        return f"lines {int(rstart[lo]) + 1}-{int(rstart[hi - 1] + run_len[hi - 1])}"

    L = infer_n_layers(where, layer, n_layers, loc)
    tr = assemble(where, expert, rstart, layer, np.full(len(rstart), K, np.int64), ntok, L, E, K, loc, span)
    tr.notes.insert(0, f"{path.name}: k={K} inferred (the CSV does not record it: the common divisor of the "
                       "lines per layer run)")
    return tr
