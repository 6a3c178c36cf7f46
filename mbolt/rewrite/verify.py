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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.hparams import HparamError
from mbolt.core.gguf_set import is_set_key, resolve_model_path, split_vaddr
from mbolt.core.header import GGUFHeader
from mbolt.core.moe_map import moe_map
from mbolt.core.prompts import BUILTIN_PROMPTS
from mbolt.rewrite.copy import Readahead
from mbolt.rewrite.outplan import LTensor, logical_tensors, split_ops
from mbolt.core.routemap import RouteMap, is_route_map_key, read_sidecar, sidecar_path

BUF = 4 << 20  # bytes compared per step
RELEASE = 16 << 20  # mmap reader: drop compared pages from the mapping every this many bytes
MARGIN = 2 << 20  # ... widened by this much: faults map whole (large) folios around what was read
PAGE = 4096
MAX_LISTED = 50  # mismatches kept in the report (all are counted)
IGNORED_KEYS = ("general.alignment",)  # besides mbolt.*

Progress = Callable[[int, int], None]


@dataclass
class Check:
    name: str
    ok: bool | None  # None = not run (skipped / pending)
    detail: str = ""


@dataclass
class Mismatch:
    tensor: str
    layer: int  # -1 for a plain tensor
    position: int  # position in the output (-1 for a plain tensor)
    expert: int  # original expert id (-1 for a plain tensor)
    offset: int  # first differing byte inside the slice (or tensor)
    file: str = ""  # the output file (shard) holding it

    def __str__(self) -> str:
        where = f"{Path(self.file).name}: " if self.file else ""
        if self.layer < 0:
            return f"{where}{self.tensor}: bytes differ from byte {self.offset}"
        return (f"{where}{self.tensor}: layer {self.layer}, expert {self.expert} at position {self.position}: "
                f"bytes differ from byte {self.offset} of the slice")


@dataclass
class VerifyReport:
    src: str
    out: str
    layout: str = ""
    checks: list[Check] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    n_mismatches: int = 0
    bytes_compared: int = 0
    seconds: float = 0.0  # headers, metadata and the byte comparison (what the benchmark times)
    total_seconds: float = 0.0  # all of verify, engine parity included
    phase_seconds: dict = field(default_factory=dict)  # "routing", "llama.cpp": each parity run
    parity: dict | None = None
    llama: dict | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks) and self.n_mismatches == 0

    def add(self, name: str, ok: bool | None, detail: str = "") -> bool | None:
        self.checks.append(Check(name, ok, detail))
        return ok

    def to_dict(self) -> dict:
        return {
            "ok": self.ok, "src": self.src, "out": self.out, "layout": self.layout,
            "checks": [c.__dict__ for c in self.checks],
            "n_mismatches": self.n_mismatches, "mismatches": [m.__dict__ | {"message": str(m)} for m in self.mismatches],
            "bytes_compared": self.bytes_compared, "seconds": self.seconds,
            "total_seconds": self.total_seconds, "phase_seconds": self.phase_seconds,
            "throughput_bytes_s": 2 * self.bytes_compared / self.seconds if self.seconds else 0.0,
            "parity": self.parity, "llama": self.llama,
        }


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


# ---- data ----


@dataclass
class _Jobs:
    """Compare jobs sorted by output offset: src[i] vs out[i], n[i] bytes; label index per job."""
    src: np.ndarray
    out: np.ndarray
    n: np.ndarray
    tensor: np.ndarray  # index into names
    pos: np.ndarray
    expert: np.ndarray
    names: list[str]
    layer_of: list[int]


def _jobs(src_t: list[LTensor], out_t: dict[str, LTensor], src_rm: RouteMap, out_rm: RouteMap) -> _Jobs:
    s, o, n, ti, po, ex = [], [], [], [], [], []
    names, layers = [], []
    src_pos = src_rm.pos
    for t in src_t:
        u = out_t[t.name]
        k = len(names)
        names.append(t.name)
        layers.append(t.layer)
        if not t.expert_indexed:
            s.append(np.array([t.data_offset]))
            o.append(np.array([u.data_offset]))
            n.append(np.array([t.nbytes]))
            ti.append(np.array([k]))
            po.append(np.array([-1]))
            ex.append(np.array([-1]))
            continue
        E = out_rm.n_experts
        p = np.arange(E)
        e = out_rm.perm[u.layer].astype(np.int64)  # original expert at output position p
        q = src_pos[t.layer][e].astype(np.int64)  # its position in the source
        s.append(t.data_offset + q * t.stride)
        o.append(u.data_offset + p * u.stride)
        n.append(np.full(E, t.slice_bytes))
        ti.append(np.full(E, k))
        po.append(p)
        ex.append(e)
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    j = _Jobs(cat(s), cat(o), cat(n), cat(ti), cat(po), cat(ex), names, layers)
    order = np.argsort(j.out, kind="stable")
    for f in ("src", "out", "n", "tensor", "pos", "expert"):
        setattr(j, f, getattr(j, f)[order])
    return j


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    m = len(a) & ~7
    if m and not np.array_equal(a[:m].view(np.uint64), b[:m].view(np.uint64)):
        return False
    return bool(np.array_equal(a[m:], b[m:]))


class _PreadPair:
    """Chunks of both models read into two reusable buffers (bounded memory, clean errors).
    Offsets are virtual (core.gguf_set.vaddr) into the lists of files `fa` and `fb`."""

    def __init__(self, fa: list[int], fb: list[int], paths):
        self.fa, self.fb, self.paths = fa, fb, paths
        self.bufa, self.bufb = bytearray(BUF), bytearray(BUF)
        self.na, self.nb = np.frombuffer(self.bufa, np.uint8), np.frombuffer(self.bufb, np.uint8)
        self.mva, self.mvb = memoryview(self.bufa), memoryview(self.bufb)

    def get(self, s0: int, o0: int, k: int):
        (fa, s0), (fb, o0) = split_vaddr(s0), split_vaddr(o0)
        ra = os.preadv(self.fa[fa], [self.mva[:k]], s0)
        rb = os.preadv(self.fb[fb], [self.mvb[:k]], o0)
        if ra != k or rb != k:
            raise MboltError(f"{self.paths[0][fa] if ra != k else self.paths[1][fb]}: short read at byte "
                             f"{(s0 if ra != k else o0) + min(ra, rb)} (file truncated while verifying?)")
        return self.na[:k], self.nb[:k]

    def done(self, s0: int, o0: int, k: int) -> None:
        pass

    def close(self) -> None:
        pass


class _MmapPair:
    """Both models mapped (one map per file) and compared in place (no copy: as fast as reading
    them once). Offsets are virtual (core.gguf_set.vaddr).

    Mapped pages count in RSS, so every RELEASE bytes the pages compared so far are dropped
    from the mappings (MADV_DONTNEED; they stay in the page cache): memory stays bounded."""

    def __init__(self, fa: list[int], fb: list[int], paths):
        import mmap

        self.mmap = mmap
        self.ma = [mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for fd in fa]
        self.mb = [mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for fd in fb]
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            for m in self.mb:
                m.madvise(mmap.MADV_SEQUENTIAL)  # the output is read in order
        self.A = [np.frombuffer(m, np.uint8) for m in self.ma]
        self.B = [np.frombuffer(m, np.uint8) for m in self.mb]
        self.paths = paths
        self.spans: dict[tuple[int, int], list[int]] = {}  # (side, file) -> [lo, hi] compared since release
        self.since = 0

    def get(self, s0: int, o0: int, k: int):
        (fa, s0), (fb, o0) = split_vaddr(s0), split_vaddr(o0)
        if s0 + k > len(self.A[fa]) or o0 + k > len(self.B[fb]):
            bad = self.paths[0][fa] if s0 + k > len(self.A[fa]) else self.paths[1][fb]
            raise MboltError(f"{bad}: shorter than its header says (file truncated while verifying?)")
        return self.A[fa][s0:s0 + k], self.B[fb][o0:o0 + k]

    def done(self, s0: int, o0: int, k: int) -> None:
        for side, v in ((0, s0), (1, o0)):
            f, off = split_vaddr(v)
            span = self.spans.setdefault((side, f), [off, off + k])
            span[0], span[1] = min(span[0], off), max(span[1], off + k)
        self.since += k
        if self.since >= RELEASE:
            self.release()

    def release(self) -> None:
        if not hasattr(self.mmap, "MADV_DONTNEED") or self.since == 0:
            return
        for (side, f), (lo, hi) in self.spans.items():
            m = (self.ma, self.mb)[side][f]
            lo = max(0, lo - MARGIN)
            lo -= lo % PAGE
            hi = min(len(m), hi + MARGIN + (-hi) % PAGE)
            if hi > lo:
                m.madvise(self.mmap.MADV_DONTNEED, lo, hi - lo)
        self.spans = {}
        self.since = 0

    def close(self) -> None:
        self.A = self.B = None
        for m in self.ma + self.mb:
            try:
                m.close()
            except BufferError:  # a view still alive (an exception in flight): the GC closes it
                pass


def compare_data(src_paths: list, out_paths: list, jobs: _Jobs, report: VerifyReport, progress: Progress | None,
                 reader: str = "mmap") -> None:
    total = int(jobs.n.sum())
    done = last = 0
    last_bad = -1
    # Jobs contiguous on both sides are compared as one range, in chunks of at most BUF.
    cont = (jobs.src[1:] == jobs.src[:-1] + jobs.n[:-1]) & (jobs.out[1:] == jobs.out[:-1] + jobs.n[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~cont])) if len(jobs.n) else np.zeros(0, np.int64)
    ends = np.append(starts[1:], len(jobs.n))
    job_out_end = jobs.out + jobs.n
    groups = [(int(jobs.src[a]), int(jobs.out[a]), int(job_out_end[b - 1] - jobs.out[a])) for a, b in zip(starts, ends)]
    chunks = split_ops(groups, BUF)
    fa, fb = [], []
    pair = None
    try:
        for paths, fds in ((src_paths, fa), (out_paths, fb)):
            for p in paths:
                try:
                    fds.append(os.open(p, os.O_RDONLY))
                except OSError as e:
                    raise MboltError(f"{p}: cannot open: {e.strerror}") from None
        pair = (_MmapPair if reader == "mmap" else _PreadPair)(fa, fb, (src_paths, out_paths))
        # the output is read in order (kernel readahead works); source slices come permuted
        ahead = Readahead(fa, chunks)
        ahead_out = Readahead(fb, [(o, s, k) for s, o, k in chunks]) if reader == "mmap" else None
        for i, (s0, o0, k) in enumerate(chunks):
            ahead.advance(i)
            if ahead_out is not None:  # page faults read synchronously: ask for the output ahead too
                ahead_out.advance(i)
            a, b = pair.get(s0, o0, k)
            if not _equal(a, b):
                at = 0
                while at < k:
                    diff = np.flatnonzero(a[at:] != b[at:])
                    if not diff.size:
                        break
                    bad_out = o0 + at + int(diff[0])
                    j = int(np.searchsorted(job_out_end, bad_out, side="right"))
                    if j != last_bad:  # a slice spanning chunks is reported once
                        _record(jobs, j, int(bad_out - jobs.out[j]), report, out_paths)
                        last_bad = j
                    at = int(job_out_end[j] - o0)  # one report per slice: resume after this job
            del a, b
            pair.done(s0, o0, k)
            done += k
            if progress and (done - last >= 64 << 20):
                last = done
                progress(done, total)
    finally:
        if pair is not None:
            pair.close()
        for fd in fa + fb:
            os.close(fd)
    report.bytes_compared = total
    if progress:
        progress(total, total)


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


def padding_ranges(om) -> list[tuple]:
    """(file, start, length, what, layer, position, expert, offset of start in its slot) of every byte of the output that is neither header nor
    tensor data: alignment padding after each header, between tensors and at each file's end,
    and the padding inside packed slots. All of it must be zero."""
    out = []
    for f, h in enumerate(om.header.shards or [om.header]):
        spans = sorted((t.data_offset, t.data_offset + t.nbytes, t.name) for t in h.tensors)
        at, after = h.header_size, "the header"
        for a, b, name in spans:
            if a > at:
                out.append((f, at, a - at, f"padding after {after}", -1, -1, -1, 0))
            at, after = max(at, b), name
        if h.file_size > at:
            out.append((f, at, h.file_size - at, f"padding after {after}", -1, -1, -1, 0))
    for layer in om.moe_layers:
        ws = [w for w in layer.weights if w.container]
        if not ws:
            continue
        stride = ws[0].stride
        lo = min(w.data_offset for w in ws)
        used = max(w.data_offset + w.slice_bytes for w in ws) - lo
        if stride > used:
            perm = om.route_map.perm[layer.index]
            out += [(ws[0].file, lo + used + p * stride, stride - used, f"{ws[0].container} (slot padding)",
                     layer.index, p, int(perm[p]), used) for p in range(om.n_experts)]
    return out


def check_padding(om, report: VerifyReport) -> int:
    """Every padding byte of the output is zero; returns the bytes checked."""
    checked = 0
    for f, path in enumerate(om.paths):
        with open(path, "rb") as fh:
            for g, start, n, what, layer, position, expert, base in padding_ranges(om):
                if g != f:
                    continue
                done = 0
                while done < n:
                    buf = os.pread(fh.fileno(), min(BUF, n - done), start + done)
                    if not buf:
                        raise MboltError(f"{path}: shorter than its header says (truncated?)")
                    if buf.count(0) != len(buf):
                        at = done + next(i for i, b in enumerate(buf) if b)
                        report.n_mismatches += 1
                        if len(report.mismatches) < MAX_LISTED:
                            report.mismatches.append(Mismatch(what, layer, position, expert, base + at, str(path)))
                        break
                    done += len(buf)
                checked += n
    return checked


def _record(jobs: _Jobs, i: int, offset: int, report: VerifyReport, out_paths: list) -> None:
    report.n_mismatches += 1
    if len(report.mismatches) < MAX_LISTED:
        t = int(jobs.tensor[i])
        f, _ = split_vaddr(jobs.out[i])
        report.mismatches.append(Mismatch(jobs.names[t], jobs.layer_of[t], int(jobs.pos[i]), int(jobs.expert[i]), offset,
                                          str(out_paths[f])))


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

    jobs = _jobs(st, od, src_rm, out_rm)
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
        from mbolt.engine import load_model
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
            from mbolt.engine.llama.runner import LlamaRunner

            t = time.perf_counter()
            report.llama = _engine_check(
                report, "llama.cpp", lambda: LlamaRunner(src, n_ctx=16, capture=False).close(),
                lambda: llama_parity(src, out, prompts=prompts, n_tokens=n_tokens, on_step=step),
                "llama.cpp cannot run the source")
            report.phase_seconds["llama.cpp"] = time.perf_counter() - t
    report.total_seconds = time.perf_counter() - t0
    return report
