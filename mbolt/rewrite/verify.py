"""Verify a rewritten GGUF against its source: every byte, through the route map.

Checks, each reported by name:
  header      both files parse (a truncated output fails here, naming the tensor)
  route map   the output's route map is valid, for this model, and names the source's fingerprint
  metadata    every key/value pair is byte-identical apart from the route map and general.alignment
  tensors     same tensor names, types and shapes (packed blobs expanded into their tensors)
  data        every byte of every tensor (no sampling): plain tensors whole, expert-indexed
              tensors slice by slice, source slice of original expert e against the output
              slice at pos[e]; read in bounded chunks and compared in place
  padding     every other byte of the output's data sections is zero: the alignment padding
              after each header, between tensors, inside packed slots and at each file's end
Together these cover every byte of the output: header bytes are the key/value pairs (compared
raw; the route map, general.alignment and the split keys are checked by "route map"/"header")
and the tensor infos (names, types, shapes compared; offsets are where the data is read).
Either side may be one file or a split set (given by any shard): a difference names the
output shard and the tensor.
  routing     (optional) the reference engine on both files: every routing decision maps
              through the permutation and the logits are bit-identical
  llama.cpp   (optional, reorder layout) both files in llama.cpp: same greedy tokens,
              logits within the float tolerance a permutation causes
The verifier derives everything from the two files (never from the plan used to write them).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.core.hparams import HparamError
from mbolt.core.gguf_set import is_set_key, resolve_model_path
from mbolt.core.header import GGUFHeader
from mbolt.core.moe_map import moe_map
from mbolt.core.prompts import BUILTIN_PROMPTS
from mbolt.rewrite.outplan import logical_tensors
from mbolt.core.routemap import RouteMap, is_route_map_key, read_sidecar, sidecar_path
from mbolt.rewrite.compare import VerifyReport, check_padding, compare_data, compare_jobs

IGNORED_KEYS = (Keys.General.ALIGNMENT,)  # besides mbolt.*

Progress = Callable[[int, int], None]


# ---- metadata ----


def _kv_raw(h: GGUFHeader) -> dict[str, bytes]:
    with open(h.path, "rb") as f:
        raw = f.read(h.header_size)
    return {k: raw[kv.span[0]:kv.span[1]] for k, kv in h.kv.items()}


def compare_metadata(a: GGUFHeader, b: GGUFHeader) -> list[str]:
    """Keys whose raw bytes differ (missing, extra or changed), ignoring mbolt.* and alignment."""
    def keep(k: str) -> bool:
        return not is_route_map_key(k) and not is_set_key(k) and k not in IGNORED_KEYS

    ra, rb = _kv_raw(a), _kv_raw(b)
    problems = []
    for k in ra:
        if keep(k) and k not in rb:
            problems.append(f"{k} missing in output")
        elif keep(k) and ra[k] != rb[k]:
            problems.append(f"{k} differs")
    problems += [f"{k} added in output" for k in rb if keep(k) and k not in ra]
    if [k for k in ra if keep(k)] != [k for k in rb if keep(k)] and not problems:
        problems.append("metadata keys in a different order")
    return problems



def check_sidecar(out: Path, oh: GGUFHeader, rm: RouteMap) -> tuple[bool | None, str]:
    """The JSON sidecar, when present, must describe this very file and route map."""
    import json

    sp = sidecar_path(out)
    if not sp.exists():
        return None, f"no {sp.name} (engines that read GGUF metadata do not need it)"
    try:
        d = json.loads(sp.read_text())
        side = read_sidecar(sp)
    except (MboltError, ValueError, OSError) as e:
        return False, str(e)
    problems = []
    if d.get("fingerprint") != oh.fingerprint:
        problems.append(f"written for another file (fingerprint {str(d.get('fingerprint'))[:12]}, this file "
                        f"{oh.fingerprint[:12]}): stale")
    elif not np.array_equal(side.perm, rm.perm) or side.layout != rm.layout or side.source_fingerprint != rm.source_fingerprint:
        problems.append("route map differs from the file's mbolt.* metadata")
    return (not problems), ("; ".join(problems) or f"{sp.name} matches the route map")



# ---- top level ----


def _engine_check(report: VerifyReport, name: str, load_source, compare, cannot: str) -> dict | None:
    """A parity check through an engine. A source the engine cannot run (architecture, type) is
    not the rewriter's fault: the check is skipped with the reason. Otherwise `compare()` decides."""
    try:
        load_source()
    except MboltError as e:
        report.add(name, None, f"skipped: {cannot} ({e})")
        return None
    try:
        result = compare()
    except MboltError as e:
        report.add(name, False, str(e))
        return None
    report.add(name, result["ok"], result["detail"])
    return result


def verify(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    parity: bool = False,
    prompts: list[str] | None = None,
    n_tokens: int = 8,
    llama: bool = False,
    progress: Progress | None = None,
    reader: str = "mmap",
    parity_progress: Progress | None = None,
    n_ctx: int | None = None,
) -> VerifyReport:
    """Verify `out` (written by `mbolt reorder`) against `src`, each one file or a split set
    (any shard); returns a report (never raises for a difference; raises MboltError when
    `src` is unreadable or either path does not exist).

    progress(bytes done, bytes total) during the byte comparison; parity_progress(forwards done,
    forwards total) during the engine parity runs (every prompt: prefill + n_tokens)."""
    t0 = time.perf_counter()
    src, out = resolve_model_path(src), resolve_model_path(out)
    for p in (src, out):
        if not p.exists():
            raise MboltError(f"{p}: no such file")
    report = VerifyReport(str(src), str(out))
    sm = moe_map(src)
    sh = sm.header
    src_rm = sm.route_map
    try:
        om = moe_map(out)
        oh = om.header
    except HparamError:
        raise  # not a usable model: one line naming the key and the tensor, exit 2
    except MboltError as e:
        report.add("header", False, str(e))
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report
    files = lambda h: f" in {len(h.shards)} shards" if h.shards else ""  # noqa: E731
    report.add("header", True, f"{len(sh.tensors)}{files(sh)} -> {len(oh.tensors)} tensors{files(oh)}")
    try:
        out_rm = om.route_map
    except MboltError as e:
        report.add("route map", False, str(e))
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report
    report.layout = out_rm.layout
    # not one model and its rewrite: a usage error (exit 2), not a rewrite that differs (exit 1)
    if (out_rm.n_layers, out_rm.n_experts) != (src_rm.n_layers, src_rm.n_experts):
        raise MboltError(f"{out}: not a rewrite of {src}: {out_rm.n_layers} layers x {out_rm.n_experts} experts, "
                         f"the source has {src_rm.n_layers} x {src_rm.n_experts}")
    if out_rm.layout == "stock":
        raise MboltError(f"{out}: has no route map (not written by mbolt reorder): nothing to verify against {src}")
    if out_rm.source_fingerprint != src_rm.source_fingerprint:
        raise MboltError(f"{out}: not a rewrite of {src}: it was made from a file with fingerprint "
                         f"{out_rm.source_fingerprint[:12]}, {src.name} has {src_rm.source_fingerprint[:12]}")
    problems = []
    dense_moved = [l.index for l in om.layers if l.dense and not (out_rm.perm[l.index] == np.arange(out_rm.n_experts)).all()]
    if dense_moved:
        problems.append(f"dense layer {dense_moved[0]} has a non-identity perm")
    moved = 0 if problems else int(sum((out_rm.perm[l.index] != src_rm.perm[l.index]).sum() for l in om.moe_layers))
    if report.add("route map", not problems, "; ".join(problems) or
                  f"{out_rm.layout}, method {out_rm.method or '?'}, {moved} expert positions differ from the source") is False:
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report

    report.add("sidecar", *check_sidecar(Path(om.path), oh, out_rm))
    meta = compare_metadata(sh, oh)
    report.add("metadata", not meta, "; ".join(meta[:5]) + (f" (+{len(meta) - 5} more)" if len(meta) > 5 else "")
               if meta else f"{sum(not is_route_map_key(k) for k in sh.kv)} keys identical")

    st, ot = logical_tensors(sm), logical_tensors(om)
    od = {t.name: t for t in ot}
    sd = {t.name: t for t in st}
    tp = [f"{n} missing in output" for n in sd if n not in od] + [f"{n} added in output" for n in od if n not in sd]
    for t in st:
        u = od.get(t.name)
        if u is None:
            continue
        if (t.type, t.ne) != (u.type, u.ne):
            tp.append(f"{t.name}: {t.type.name}{list(t.ne)} became {u.type.name}{list(u.ne)}")
        elif t.expert_indexed != u.expert_indexed or t.slice_bytes != u.slice_bytes or t.layer != u.layer:
            tp.append(f"{t.name}: expert indexing differs")
    report.add("tensors", not tp, "; ".join(tp[:5]) if tp else f"{len(st)} tensors, names/types/shapes identical")
    if tp:
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report

    jobs = compare_jobs(st, od, src_rm, out_rm)
    compare_data(sm.paths, om.paths, jobs, report, progress, reader)
    n_slices = int((jobs.pos >= 0).sum())
    report.add("data", report.n_mismatches == 0,
               f"{report.n_mismatches} slices/tensors differ" if report.n_mismatches else
               f"{report.bytes_compared:,} bytes identical ({n_slices:,} expert slices, "
               f"{int((jobs.pos < 0).sum()):,} plain tensors)")
    before = report.n_mismatches
    pad = check_padding(om, report)
    report.add("padding", report.n_mismatches == before,
               f"{report.n_mismatches - before} padding ranges not zero" if report.n_mismatches > before else
               f"{pad:,} padding bytes zero (alignment after headers and tensors, packed slots, file ends)")
    report.seconds = time.perf_counter() - t0  # the bit-identity part (what the benchmark times)

    n_forwards = len(prompts or BUILTIN_PROMPTS) * (n_tokens + 1)
    forwards_total = n_forwards * (int(parity) + int(llama and out_rm.layout == "reorder"))
    forwards = 0

    def step():
        nonlocal forwards
        forwards += 1
        if parity_progress is not None:
            parity_progress(forwards, forwards_total)

    if parity:
        from mbolt.reference import load_model
        from mbolt.rewrite.parity import routing_parity

        t = time.perf_counter()
        report.parity = _engine_check(
            report, "routing", lambda: load_model(src).close(),
            lambda: routing_parity(src, out, prompts=prompts, n_tokens=n_tokens, on_step=step),
            "the reference engine cannot run the source")
        report.phase_seconds["routing"] = time.perf_counter() - t
    if llama:
        from mbolt.rewrite.parity import llama_parity

        if out_rm.layout != "reorder":
            report.add("llama.cpp", None, f"skipped: llama.cpp does not load the {out_rm.layout} layout")
        else:
            from mbolt.runtime.runner import LlamaRunner

            t = time.perf_counter()
            report.llama = _engine_check(
                report, "llama.cpp", lambda: LlamaRunner(src, n_ctx=16, capture=False).close(),
                lambda: llama_parity(src, out, prompts=prompts, n_tokens=n_tokens, on_step=step, n_ctx=n_ctx),
                "llama.cpp cannot run the source")
            report.phase_seconds["llama.cpp"] = time.perf_counter() - t
    report.total_seconds = time.perf_counter() - t0
    return report
