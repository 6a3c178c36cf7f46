"""The byte comparison of `verify`: every tensor of the output against the source through the
route map (expert slices by position), read with pread or a mapping that releases what it compared,
and the padding that must be zero; the report (`VerifyReport`) that verify fills and returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import split_vaddr
from mbolt.rewrite.copy import Readahead
from mbolt.rewrite.outplan import LTensor, split_ops
from mbolt.core.routemap import RouteMap

BUF = 4 << 20  # bytes compared per step
RELEASE = 16 << 20  # mmap reader: drop compared pages from the mapping every this many bytes
MARGIN = 2 << 20  # ... widened by this much: faults map whole (large) folios around what was read
PAGE = 4096
MAX_LISTED = 50  # mismatches kept in the report (all are counted)
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


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
class Check:
    name: str
    ok: bool | None  # None = not run (skipped / pending)
    detail: str = ""


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


# ---- data ----


@dataclass
class CompareJobs:
    """Compare jobs sorted by output offset: src[i] vs out[i], n[i] bytes; label index per job."""
    src: np.ndarray
    out: np.ndarray
    n: np.ndarray
    tensor: np.ndarray  # index into names
    pos: np.ndarray
    expert: np.ndarray
    names: list[str]
    layer_of: list[int]


def compare_jobs(src_t: list[LTensor], out_t: dict[str, LTensor], src_rm: RouteMap, out_rm: RouteMap) -> CompareJobs:
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
    j = CompareJobs(cat(s), cat(o), cat(n), cat(ti), cat(po), cat(ex), names, layers)
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


def compare_data(src_paths: list, out_paths: list, jobs: CompareJobs, report: VerifyReport, progress: Progress | None,
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
                        record_mismatch(jobs, j, int(bad_out - jobs.out[j]), report, out_paths)
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


def record_mismatch(jobs: CompareJobs, i: int, offset: int, report: VerifyReport, out_paths: list) -> None:
    report.n_mismatches += 1
    if len(report.mismatches) < MAX_LISTED:
        t = int(jobs.tensor[i])
        f, _ = split_vaddr(jobs.out[i])
        report.mismatches.append(Mismatch(jobs.names[t], jobs.layer_of[t], int(jobs.pos[i]), int(jobs.expert[i]), offset,
                                          str(out_paths[f])))
