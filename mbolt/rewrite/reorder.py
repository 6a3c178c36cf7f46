"""Streaming bit-exact rewriter: permute the experts of a MoE GGUF, or pack them per expert.

Nothing but byte order changes. The header is rebuilt from the source's own bytes (every
metadata key/value pair is copied verbatim, old `mbolt.*` keys are replaced by the new route
map), then the data section is assembled from source byte ranges with `os.copy_file_range`
(bytes stay in the kernel; buffered pread/pwrite when the kernel refuses), one merged range at
a time, so memory stays flat whatever the model size.

Plans name ORIGINAL expert ids (traces record original ids through the route map), so the
output's route map is the plan itself; reordering an already rewritten file composes through
its route map, and the identity plan restores the stock order.

layouts
  reorder  standard tensor names; loads in unmodified llama.cpp. Every expert-indexed tensor
           (gate/up/down/gate_up exps, router weight and bias, exp_probs_b, per-expert biases)
           is permuted with the layer's perm; everything else is copied unchanged.
  packed   each MoE layer's routed weights become one I8 tensor `blk.N.ffn_exps_packed` where
           position p holds its expert's gate|up|down slices back to back (core/packed.py);
           for explicit-read engines (the reference engine reads it; llama.cpp does not).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, Keys

from mbolt.core.atomic import clean_stale_parts
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import SET_ID_KEY, combine_shards, is_set_key, set_paths, split_vaddr
from mbolt.core.header import parse_header, encode_kv
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.core.routemap import check_perm, identity_perm, is_route_map_key, sidecar_dict, sidecar_path
from mbolt.rewrite.copy import Copier, Progress, Readahead, Writeback, interrupt_on_terminate
from mbolt.rewrite.outplan import (ReorderResult, SplitSpec, assign_shards, copy_ops, out_alignment, plan_output,
                                   route_map_kvs, shard_headers, shard_sizes)
from mbolt.core.packed import check_align
from mbolt.rewrite.setwriter import JOURNAL_SUFFIX, check_outputs, fsync_dir, output_lock, recover_interrupted

# ---- the rewrite ----


def reorder(
    src: str | os.PathLike | MoeMap,
    dst: str | os.PathLike,
    perm: np.ndarray | None = None,
    *,
    heat: np.ndarray | None = None,
    method: str = "identity",
    layout: str = "reorder",
    force: bool = False,
    progress: Progress | None = None,
    sidecar: bool = True,
    split: SplitSpec | None = None,
    inputs: tuple = (),
    protect: tuple = (),
    align: int | None = None,
) -> ReorderResult:
    """Rewrite `src` (a path, or the model already opened) into `dst` with experts in `perm`
    order ([n_layers, E] original ids per position; None = identity) and the given layout.
    `heat` is per position ([n_layers, E]). A split set is written as a set named after `dst`
    (out.gguf -> out-00001-of-0000N.gguf ...), cut as `split` says. `inputs`: other input
    files of the command (plan, trace), never written over; `protect`: fingerprints of models
    they were made from (a plan's or trace's model), never replaced either."""
    t0 = time.perf_counter()
    m = src if isinstance(src, MoeMap) else moe_map(src)
    src = Path(m.path)
    dst = Path(dst)
    split = split or SplitSpec()
    split.check()
    if layout not in ("reorder", "packed"):
        raise MboltError(f"unknown layout {layout!r} (reorder or packed)")
    unknown = m.unknown()
    if unknown:
        u = unknown[0]
        raise MboltError(f"{src}: tensor {u.name} is expert-indexed but mbolt does not know how to permute it "
                         f"({u.why}); refusing to rewrite" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    E, L = m.n_experts, m.n_layers
    ident = identity_perm(L, E)
    perm = ident.copy() if perm is None else check_perm(perm, L, E, "plan")
    for layer in m.layers:
        if layer.dense:
            perm[layer.index] = ident[layer.index]
    heat = np.zeros((L, E), np.float32) if heat is None else np.asarray(heat, np.float32)
    if heat.shape != (L, E):
        raise MboltError(f"plan heat has shape {heat.shape}, expected ({L}, {E})")

    if align is not None:
        check_align(align)
    tensors, packed, notes = plan_output(m, perm, layout, align)
    n_shards = assign_shards(tensors, split, len(m.paths))
    out_paths = set_paths(dst, n_shards)
    side = sidecar_path(out_paths[0]) if sidecar else None
    in_paths = [Path(p) for p in m.paths]
    all_inputs = in_paths + [Path(x) for x in inputs if x is not None]
    protected = {m.source_fingerprint, m.fingerprint} | {s.fingerprint for s in m.header.shards} | {
        fp for fp in protect if fp}
    if dst.is_dir():
        raise MboltError(f"{dst}: is a directory (give a file path for the rewritten model)")
    if not dst.parent.is_dir():
        raise MboltError(f"{dst.parent}: output directory does not exist")
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(output_lock(dst))  # one writer per output, from the checks to the renames
        removed = recover_interrupted(dst)
        check_outputs(out_paths, side, all_inputs, force, protected)
        # another model already written under this name (a set of another shard count, or one
        # file where a set goes): replaced as a whole with --force, so `verify OUT` is unambiguous
        others = [p for p in other_outputs(dst) if p not in out_paths]
        check_outputs(others, None, all_inputs, force, protected)
        res = _write(m, dst, perm, ident, heat, method, layout, tensors, packed, notes, out_paths, side,
                     in_paths, removed, stack, progress, t0, out_alignment(m, align))
        for p in others:
            for q in (p, sidecar_path(p)):
                with contextlib.suppress(FileNotFoundError):
                    q.unlink()
                    res.removed_stale.append(str(q))
        return res


def other_outputs(dst: Path) -> list[Path]:
    """Model files named after `dst`: dst itself and the shards of any set named after it."""
    import glob

    stem = dst.name[:-5] if dst.name.endswith(".gguf") else dst.name
    found = sorted(dst.parent.glob(glob.escape(stem) + "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].gguf"))
    return ([dst] if dst.exists() else []) + found


def _write(m, dst, perm, ident, heat, method, layout, tensors, packed, notes, out_paths, side, in_paths,
           removed, stack, progress, t0, A) -> ReorderResult:
    in_rm = m.route_map
    src = Path(m.path)
    n_shards = len(out_paths)

    header = m.header
    with src.open("rb") as f:  # metadata is copied verbatim from shard 1's header bytes
        head_src = f.read(header.header_size)
    kv_bytes = []
    for k, kv in header.kv.items():
        if is_route_map_key(k) or is_set_key(k):
            continue
        if k == Keys.General.ALIGNMENT:
            kv_bytes.append(encode_kv(k, kv.type, A))
        elif kv.span[1] > kv.span[0]:
            kv_bytes.append(head_src[kv.span[0]:kv.span[1]])
        else:
            raise MboltError(f"{src}: header reader gave no byte span for {k} (mbolt.core.header too old?)")
    if Keys.General.ALIGNMENT not in header.kv:
        kv_bytes.append(encode_kv(Keys.General.ALIGNMENT, GGUFValueType.UINT32, A))
    kv_bytes += route_map_kvs(layout, perm, heat, method, in_rm.source_fingerprint, packed)
    heads, starts = shard_headers(m, tensors, n_shards, kv_bytes, A, header.version)
    sizes = shard_sizes(tensors, starts, A)
    total = sum(sizes)
    # the output's header, parsed from the bytes about to be written: fingerprint and sidecar
    # are known before anything is renamed into place
    out_shards = [parse_header(h, p, size) for h, p, size in zip(heads, out_paths, sizes)]
    out_header = combine_shards(out_shards) if n_shards > 1 else out_shards[0]
    out_map = moe_map(out_header)

    free = shutil.disk_usage(dst.parent).free
    if free < total:
        raise MboltError(f"{dst.parent}: {free / 2**30:.2f} GiB free, the output needs {total / 2**30:.2f} GiB")
    ops = copy_ops(tensors, starts)
    n_data = sum(n for _, _, n in ops)

    with interrupt_on_terminate():
        for p in out_paths + ([side] if side else []):
            removed += clean_stale_parts(p)
        fins = [stack.enter_context(open(p, "rb")) for p in in_paths]
        for f, s in zip(fins, m.header.shards or [m.header]):
            if os.fstat(f.fileno()).st_size != s.file_size:
                raise MboltError(f"{s.path}: file changed size while reading")
        temps: list[Path] = []
        renamed: list[Path] = []

        def cleanup():
            for t in temps:
                if t not in renamed:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(t)
        stack.callback(cleanup)
        fouts = []
        import tempfile

        for p in out_paths:
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}.", suffix=".part", dir=p.parent)
            temps.append(Path(tmp))
            fouts.append(fd)
            stack.callback(os.close, fd)
        umask = os.umask(0)
        os.umask(umask)
        try:
            for fd, head, size in zip(fouts, heads, sizes):
                os.fchmod(fd, 0o666 & ~umask)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise
                    os.ftruncate(fd, size)
                w = 0
                while w < len(head):
                    w += os.pwrite(fd, head[w:], w)
            copier = Copier([f.fileno() for f in fins], fouts, n_data, progress, [str(p) for p in in_paths])
            ahead = Readahead([f.fileno() for f in fins], ops)
            flush = [Writeback(fd) for fd in fouts]
            for i, (s, d, n) in enumerate(ops):
                ahead.advance(i)
                copier.copy(s, d, n)
                f_out, end = split_vaddr(d + n)
                flush[f_out].wrote(end)
            for fd, size in zip(fouts, sizes):
                os.ftruncate(fd, size)  # zero padding beyond the last tensor (fallocate already sized it)
                os.fsync(fd)
            side_tmp = None
            if side is not None:
                import json

                fd, tmp = tempfile.mkstemp(prefix=f".{side.name}.{os.getpid()}.", suffix=".part", dir=side.parent)
                temps.append(Path(tmp))
                side_tmp = Path(tmp)
                with os.fdopen(fd, "w") as f:
                    os.fchmod(f.fileno(), 0o666 & ~umask)
                    f.write(json.dumps(sidecar_dict(out_map)) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as e:
            raise MboltError(f"{dst}: cannot write the output: {e.strerror}") from None
        # Renames: the sidecar first (beside the old GGUF it is refused: its fingerprint is the
        # new one's), then the shards last to first. A kill in between leaves shards of two set
        # ids (every reader refuses the mix) and a journal: the next run removes them.
        journal = None
        if n_shards > 1:
            import json

            journal = dst.with_name(f".{dst.name}.{os.getpid()}{JOURNAL_SUFFIX}")
            journal.write_text(json.dumps({"set_id": out_header.get(SET_ID_KEY), "paths": [str(p) for p in out_paths],
                                           "sidecar": [str(side)] if side else []}))
        if side_tmp is not None:
            os.replace(side_tmp, side)
            renamed.append(side_tmp)
        for tmp, p in reversed(list(zip(temps, out_paths))):
            os.replace(tmp, p)
            renamed.append(tmp)
        fsync_dir(dst.parent)
        if journal is not None:
            journal.unlink()
    return ReorderResult(
        str(src), str(out_paths[0]), layout, method, total, time.perf_counter() - t0, len(ops), copier.mode,
        bool((perm == ident).all()), len(m.moe_layers), notes, [str(p) for p in removed], str(side or ""),
        out_header.fingerprint, in_rm.source_fingerprint, [str(p) for p in out_paths],
    )


def reorder_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    plan: str | os.PathLike | None = None,
    trace: str | os.PathLike | list | None = None,
    identity: bool = False,
    layout: str = "reorder",
    force: bool = False,
    progress: Progress | None = None,
    split: SplitSpec | None = None,
    align: int | None = None,
) -> ReorderResult:
    """`mbolt reorder`: the perm comes from a plan file, traces (merged, then planned inline
    with the default method) or the identity (a control for the whole pipeline). The model
    is opened once and handed down."""
    traces = [] if trace is None else ([trace] if isinstance(trace, (str, os.PathLike)) else list(trace))
    given = [name for name, v in (("--plan", plan), ("--trace", traces), ("--identity", identity)) if v]
    if len(given) != 1:
        raise MboltError("give exactly one of --plan, --trace or --identity" + (f" (got {' and '.join(given)})" if given else ""))
    m = moe_map(src)
    made_from: tuple = ()
    if identity:
        perm, heat, method = None, None, "identity"
    else:
        from mbolt.core.compat import check_compatible
        from mbolt.core.plan import load_plan

        if plan is not None:
            p = load_plan(plan)
            check_compatible(p, m, str(plan))
        else:
            from mbolt.trace.formats import load_traces
            from mbolt.layout.plan import make_plan

            tr = load_traces(traces)
            check_compatible(tr, m, ", ".join(map(str, traces)))
            p = make_plan(tr)
        made_from = (p.meta.get("fingerprint", ""),)  # the model the plan or trace was made on
        perm, method = p.perm, p.method
        rows = np.arange(p.n_layers)[:, None]
        heat = np.asarray(p.heat, np.float32)[rows, p.perm]  # plan heat is per original id; the map's per position
    return reorder(m, dst, perm, heat=heat, method=method, layout=layout, force=force, progress=progress,
                   split=split, inputs=(plan, *traces), protect=made_from, align=align)
