"""Verify a rewritten GGUF against its source: every byte, through the route map.

Checks, each reported by name:
  header      both files parse (a truncated output fails here, naming the tensor)
  route map   the output's route map is valid, for this model, and names the source's fingerprint
  metadata    every key/value pair is byte-identical apart from the route map and general.alignment
  tensors     same tensor names, types and shapes (packed blobs expanded into their tensors)
  data        every byte of every tensor (no sampling): plain tensors whole, expert-indexed
              tensors slice by slice, source slice of original expert e against the output
              slice at pos[e]; read in bounded chunks and compared in place
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
from mbolt.core.header import GGUFHeader, read_header
from mbolt.core.moe_map import moe_map
from mbolt.core.prompts import BUILTIN_PROMPTS
from mbolt.rewrite.reorder import LTensor, _Readahead, logical_tensors, split_ops
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

    def __str__(self) -> str:
        if self.layer < 0:
            return f"{self.tensor}: bytes differ from byte {self.offset}"
        return (f"{self.tensor}: layer {self.layer}, expert {self.expert} at position {self.position}: "
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
        return not is_route_map_key(k) and k not in IGNORED_KEYS

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
    """Chunks of both files read into two reusable buffers (bounded memory, clean errors)."""

    def __init__(self, fa: int, fb: int, paths):
        self.fa, self.fb, self.paths = fa, fb, paths
        self.bufa, self.bufb = bytearray(BUF), bytearray(BUF)
        self.na, self.nb = np.frombuffer(self.bufa, np.uint8), np.frombuffer(self.bufb, np.uint8)
        self.mva, self.mvb = memoryview(self.bufa), memoryview(self.bufb)

    def get(self, s0: int, o0: int, k: int):
        ra = os.preadv(self.fa, [self.mva[:k]], s0)
        rb = os.preadv(self.fb, [self.mvb[:k]], o0)
        if ra != k or rb != k:
            raise MboltError(f"{self.paths[0] if ra != k else self.paths[1]}: short read at byte "
                             f"{(s0 if ra != k else o0) + min(ra, rb)} (file truncated while verifying?)")
        return self.na[:k], self.nb[:k]

    def done(self, s0: int, o0: int, k: int) -> None:
        pass

    def close(self) -> None:
        pass


class _MmapPair:
    """Both files mapped and compared in place (no copy: as fast as reading them once).

    Mapped pages count in RSS, so every RELEASE bytes the pages compared so far are dropped
    from the mapping (MADV_DONTNEED; they stay in the page cache): memory stays bounded."""

    def __init__(self, fa: int, fb: int, paths):
        import mmap

        self.mmap = mmap
        self.ma = mmap.mmap(fa, 0, access=mmap.ACCESS_READ)
        self.mb = mmap.mmap(fb, 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mb.madvise(mmap.MADV_SEQUENTIAL)  # the output is read in order
        self.A, self.B = np.frombuffer(self.ma, np.uint8), np.frombuffer(self.mb, np.uint8)
        self.paths = paths
        self._reset()

    def _reset(self):
        self.lo_a = self.lo_b = 1 << 62
        self.hi_a = self.hi_b = 0
        self.since = 0

    def get(self, s0: int, o0: int, k: int):
        if s0 + k > len(self.A) or o0 + k > len(self.B):
            bad = self.paths[0] if s0 + k > len(self.A) else self.paths[1]
            raise MboltError(f"{bad}: shorter than its header says (file truncated while verifying?)")
        return self.A[s0:s0 + k], self.B[o0:o0 + k]

    def done(self, s0: int, o0: int, k: int) -> None:
        self.lo_a, self.hi_a = min(self.lo_a, s0), max(self.hi_a, s0 + k)
        self.lo_b, self.hi_b = min(self.lo_b, o0), max(self.hi_b, o0 + k)
        self.since += k
        if self.since >= RELEASE:
            self.release()

    def release(self) -> None:
        if not hasattr(self.mmap, "MADV_DONTNEED") or self.since == 0:
            return
        for m, lo, hi in ((self.ma, self.lo_a, self.hi_a), (self.mb, self.lo_b, self.hi_b)):
            lo = max(0, lo - MARGIN)
            lo -= lo % PAGE
            hi = min(len(m), hi + MARGIN + (-hi) % PAGE)
            if hi > lo:
                m.madvise(self.mmap.MADV_DONTNEED, lo, hi - lo)
        self._reset()

    def close(self) -> None:
        self.A = self.B = None
        for m in (self.ma, self.mb):
            try:
                m.close()
            except BufferError:  # a view still alive (an exception in flight): the GC closes it
                pass


def compare_data(src_path, out_path, jobs: _Jobs, report: VerifyReport, progress: Progress | None,
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
    fa, fb = os.open(src_path, os.O_RDONLY), os.open(out_path, os.O_RDONLY)
    pair = None
    try:
        pair = (_MmapPair if reader == "mmap" else _PreadPair)(fa, fb, (src_path, out_path))
        # the output is read in order (kernel readahead works); source slices come permuted
        ahead = _Readahead(fa, chunks)
        ahead_out = _Readahead(fb, [(o, s, k) for s, o, k in chunks]) if reader == "mmap" else None
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
                        _record(jobs, j, int(bad_out - jobs.out[j]), report)
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
        os.close(fa)
        os.close(fb)
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


def check_packed_padding(om, out_rm: RouteMap, report: VerifyReport) -> int:
    """Packed slots may end in padding (to keep slots 4 KiB aligned): it must be zeros."""
    checked = 0
    with open(om.path, "rb") as f:
        for layer in om.moe_layers:
            ws = [w for w in layer.weights if w.container]
            if not ws:
                continue
            stride = ws[0].stride
            used = max(w.data_offset + w.slice_bytes for w in ws) - min(w.data_offset for w in ws)
            if stride <= used:
                continue
            first = min(w.data_offset for w in ws) + used
            for p in range(om.n_experts):
                f.seek(first + p * stride)
                buf = f.read(stride - used)
                checked += len(buf)
                if buf.count(0) != len(buf):
                    report.n_mismatches += 1
                    if len(report.mismatches) < MAX_LISTED:
                        at = next(i for i, b in enumerate(buf) if b)
                        report.mismatches.append(Mismatch(ws[0].container + " (slot padding)", layer.index, p,
                                                          int(out_rm.perm[layer.index, p]), used + at))
    return checked


def _record(jobs: _Jobs, i: int, offset: int, report: VerifyReport) -> None:
    report.n_mismatches += 1
    if len(report.mismatches) < MAX_LISTED:
        t = int(jobs.tensor[i])
        report.mismatches.append(Mismatch(jobs.names[t], jobs.layer_of[t], int(jobs.pos[i]), int(jobs.expert[i]), offset))


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
    """Verify `out` (written by `mbolt reorder`) against `src`; returns a report (never raises
    for a difference; raises MboltError only when `src` itself is unreadable).

    progress(bytes done, bytes total) during the byte comparison; parity_progress(forwards done,
    forwards total) during the engine parity runs (every prompt: prefill + n_tokens)."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    report = VerifyReport(str(src), str(out))
    sh = read_header(src)
    sm = moe_map(sh)
    src_rm = sm.route_map
    try:
        oh = read_header(out)
        om = moe_map(oh)
    except MboltError as e:
        report.add("header", False, str(e))
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report
    report.add("header", True, f"{len(sh.tensors)} -> {len(oh.tensors)} tensors")
    try:
        out_rm = om.route_map
    except MboltError as e:
        report.add("route map", False, str(e))
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report
    report.layout = out_rm.layout
    problems = []
    if (out_rm.n_layers, out_rm.n_experts) != (src_rm.n_layers, src_rm.n_experts):
        problems.append(f"shape {out_rm.n_layers}x{out_rm.n_experts} != source {src_rm.n_layers}x{src_rm.n_experts}")
    if out_rm.source_fingerprint != src_rm.source_fingerprint:
        problems.append(f"source fingerprint {out_rm.source_fingerprint} != {src_rm.source_fingerprint} (of {src.name})")
    if out_rm.layout == "stock":
        problems.append("output has no route map (not written by mbolt reorder)")
    dense_moved = [l.index for l in om.layers if l.dense and not (out_rm.perm[l.index] == np.arange(out_rm.n_experts)).all()]
    if dense_moved:
        problems.append(f"dense layer {dense_moved[0]} has a non-identity perm")
    moved = int(sum((out_rm.perm[l.index] != src_rm.perm[l.index]).sum() for l in om.moe_layers))
    if report.add("route map", not problems, "; ".join(problems) or
                  f"{out_rm.layout}, method {out_rm.method or '?'}, {moved} expert positions differ from the source") is False:
        report.seconds = report.total_seconds = time.perf_counter() - t0
        return report

    report.add("sidecar", *check_sidecar(out, oh, out_rm))
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
    compare_data(src, out, jobs, report, progress, reader)
    pad = check_packed_padding(om, out_rm, report)
    n_slices = int((jobs.pos >= 0).sum())
    report.add("data", report.n_mismatches == 0,
               f"{report.n_mismatches} slices/tensors differ" if report.n_mismatches else
               f"{report.bytes_compared:,} bytes identical ({n_slices:,} expert slices, "
               f"{int((jobs.pos < 0).sum()):,} plain tensors)" + (f"; {pad:,} packed padding bytes zero" if pad else ""))
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
            from mbolt.trace.llama_backend import LlamaRunner

            t = time.perf_counter()
            report.llama = _engine_check(
                report, "llama.cpp", lambda: LlamaRunner(src, n_ctx=16, capture=False).close(),
                lambda: llama_parity(src, out, prompts=prompts, n_tokens=n_tokens, on_step=step),
                "llama.cpp cannot run the source")
            report.phase_seconds["llama.cpp"] = time.perf_counter() - t
    report.total_seconds = time.perf_counter() - t0
    return report
