"""Import routing traces written by other tools into a `Trace`.

Formats (`fmt`; "auto" detects them from the first bytes):

``mbtrace``
    mbolt's own file (`mbolt.core.mbtrace`).
``mbolt``
    The original mbolt's llama.cpp ``MBOLT_TRACE`` dump: little-endian int32 words, header
    ``magic 0x544C424D ("MBLT"), version 1, n_expert``, then records
    ``layer, k, n_tokens, ids[n_tokens * k]`` (token-major). A record whose layer is <= the
    previous record's layer starts a new forward pass.
``nuthatch-text``
    chen3feng/nuthatch's text export: one line per (token, layer), ``layer e0 e1 ...``. The rows
    of one layer in one forward pass are consecutive lines with the same layer number; a line
    whose layer is lower than the previous line's starts a new pass.
``nuthatch-bin``
    nuthatch's ``NUTHTRC1`` binary (``src/trace/routing_trace.cc``): ``b"NUTHTRC1"``,
    u32 version=1, u32 n_layers, u32 n_expert, u64 n_records, then records
    ``u32 token, u32 layer, u32 n_sel, u32 ids[n_sel]`` (little-endian, as written on x86/ARM).
    nuthatch's generator (``GreedyGenerateCachedTrace``) writes ``token`` = absolute position,
    prompt tokens included, token-major; the file does not say where the prompt ends, so every
    token is imported as decode unless ``prefill_tokens`` says how many leading positions were
    the prompt. A file whose token field is a record counter (one layer per token, as nuthatch's
    own text reader numbers lines) is regrouped by layer order like the text format.

``colibri-route``
    colibri's ``ROUTE_TRACE`` log, with gates (`mbolt.trace.formats.colibri`).
``faroute``
    iliria's ``FAROUTE1`` binary route trace (`mbolt.trace.formats.iliria`).
``moe-csv``
    llama.cpp's ``examples/moe-trace`` CSV ``layer,expert`` (`mbolt.trace.formats.moe_csv`).
``bigmoeonedge``
    BigMoeOnEdge's ``route_trace v1`` CSV, with prefill/decode phases and routing weights
    (`mbolt.trace.formats.bigmoeonedge`).
``coli-usage``
    colibri's ``.coli_usage`` heat histogram: counts per expert, no tokens. It is read by
    `load_usage` (heat order, pins); `load_trace` refuses it, naming what it can drive.

Forward passes (``mbolt``, ``nuthatch-text`` and the three formats above): a pass where every layer routed one token is a
decode step; otherwise it is a prefill of T tokens (T = the most rows any layer has). During
prefill llama.cpp's last layer routes only the output token, so a layer with fewer rows covers
the *last* rows of the pass; its other tokens get -1 there. Each prefill pass starts a new
sequence (a prompt split over several micro-batches therefore becomes several sequences);
positions count tokens within a sequence. A one-token prompt is indistinguishable from a decode
step.

The strided-view export bug: llama.cpp's ``ffn_moe_topk-N`` tensor is a view of the first k
columns of an argsort over all E experts, so row j starts at ``j * E`` ids, not ``j * k``. An
exporter that reads the n_tokens * k ids of a prefill layer contiguously writes, instead of each
token's top-k, the *full ranking* of the pass's first tokens split over E/k rows. It is
detected per prefill pass, without knowing line numbers: every complete E-id chunk of a layer's
rows is a permutation of all E experts (real top-k rows of different tokens would repeat ids).
In such a pass only the leading k ids of each complete ranking are real (token r's top-k sits at
``r * E``), a layer with a single row is real, and everything else is dropped; tokens left with
no layer at all are removed. Positions are kept, so the decode tokens that follow keep their
true positions. What was dropped is listed in ``Trace.notes``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from mbolt.core.errors import MboltError
from mbolt.core.mbtrace import MAGIC as MBTRACE_MAGIC
from mbolt.core.mbtrace import read_trace
from mbolt.core.trace import Trace
from mbolt.trace.formats.bigmoeonedge import looks_like_bigmoeonedge, read_bigmoeonedge
from mbolt.trace.formats.colibri import (Usage, looks_like_route_trace, looks_like_usage, read_route_trace,
                                         read_usage)
from mbolt.trace.formats.common import check_override, read_bytes_of
from mbolt.trace.formats.iliria import FAROUTE_MAGIC, read_faroute
from mbolt.trace.formats.moe_csv import looks_like_moe_csv, read_moe_csv
from mbolt.trace.formats.mbolt_dump import MBOLT_MAGIC, import_mbolt
from mbolt.trace.formats.nuthatch import NUTH_MAGIC, import_nuthatch_bin, import_nuthatch_text

FORMATS = ("mbtrace", "mbolt", "nuthatch-text", "nuthatch-bin", "colibri-route", "faroute", "moe-csv", "bigmoeonedge",
           "coli-usage")
HEAT_ONLY = ("coli-usage",)
_READERS = {"colibri-route": read_route_trace, "faroute": read_faroute, "moe-csv": read_moe_csv,
            "bigmoeonedge": read_bigmoeonedge}


def detect_format(path: str | os.PathLike) -> str:
    """Which trace format a file is in, from its first bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise MboltError(f"{path}: trace file not found") from None
    except OSError as e:
        raise MboltError(f"{path}: cannot read: {e.strerror}") from None
    if head.startswith(MBTRACE_MAGIC):
        return "mbtrace"
    if head.startswith(NUTH_MAGIC):
        return "nuthatch-bin"
    if head.startswith(FAROUTE_MAGIC):
        return "faroute"
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == MBOLT_MAGIC:
        return "mbolt"
    text = head.decode("ascii", "replace")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    for fmt, looks in (("bigmoeonedge", looks_like_bigmoeonedge), ("coli-usage", looks_like_usage),
                       ("colibri-route", looks_like_route_trace), ("moe-csv", looks_like_moe_csv)):
        if looks(first):
            return fmt
    if first and all(tok.isdigit() for tok in first.split()) and len(first.split()) >= 2:
        return "nuthatch-text"
    if not head:
        raise MboltError(f"{path}: empty file")
    raise MboltError(f"{path}: unknown trace format (not .mbtrace, MBOLT_TRACE, NUTHTRC1, nuthatch text, colibri "
                     f"ROUTE_TRACE or .coli_usage, FAROUTE1, llama.cpp moe-trace CSV or BigMoeOnEdge route_trace; first bytes {head[:8]!r})")


def load_trace(path: str | os.PathLike, fmt: str = "auto", *, n_layers: int | None = None,
                 n_experts: int | None = None, prefill_tokens: int = 0) -> Trace:
    """Read any supported trace file into a `Trace`.

    `n_layers` / `n_experts` override what the file implies (formats that do not store them
    infer max+1, which misses trailing dense layers or never-used experts). `prefill_tokens`
    marks the first positions of a ``nuthatch-bin`` trace as prefill.
    """
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise MboltError(f"unknown trace format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt == "mbtrace":
        tr = read_trace(path)
        check_override(path, tr, n_layers, n_experts)
        return tr
    if fmt in HEAT_ONLY:
        raise MboltError(f"{path}: a .coli_usage file holds heat only (counts per expert, no tokens): it drives "
                         "`mbolt plan --method heat` and pins, not a co-activation order, a replay or an import")
    data = read_bytes_of(path)
    if fmt in _READERS:
        return _READERS[fmt](path, data, n_layers, n_experts)
    if fmt == "mbolt":
        return import_mbolt(path, data, n_layers, n_experts)
    if fmt == "nuthatch-bin":
        return import_nuthatch_bin(path, data, n_layers, n_experts, prefill_tokens)
    return import_nuthatch_text(path, data, n_layers, n_experts)


def load_usage(path: str | os.PathLike, *, n_layers: int | None = None, n_experts: int | None = None) -> Usage:
    """A heat-only file (colibri's .coli_usage) as per-layer counts."""
    path = Path(path)
    return read_usage(path, read_bytes_of(path), n_layers, n_experts)


def is_heat_only(path: str | os.PathLike) -> bool:
    return detect_format(path) in HEAT_ONLY


def load_traces(paths, fmt: str = "auto", **kw) -> Trace:
    """Several trace files (e.g. shares traced on different machines) as one trace: each read
    with `load_trace`, then joined by `core.trace.merge_traces` (same model, sequences renumbered)."""
    from mbolt.core.trace import merge_traces

    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    traces = [load_trace(p, fmt, **kw) for p in paths]
    return traces[0] if len(traces) == 1 else merge_traces(traces, [str(p) for p in paths])
