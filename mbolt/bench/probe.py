"""`mbolt probe`: cold random-read cost of the drive holding a file (t_op and bandwidth).

Also: bursts of scattered reads back to back (the stock file's read pattern, `burst_fits`), and
whether a cache below the guest serves data the guest evicted (`host_cache`).

For every read size x queue depth x (buffered | O_DIRECT): evict the probe file, then issue
random aligned reads (distinct offsets, never the same page twice in a config) with that many
threads. Per config: median latency per read and throughput. Per (mode, QD): a least-squares fit
of time per read = t_op + size / BW over the sizes, the two numbers the slice-size law uses.
Buffered reads run with POSIX_FADV_RANDOM (no readahead) and drop what they read right after each
read (a burst: after the burst), outside the timed part, as the store does after each layer: pages
freed and reused at once make the next read 8-14% faster than reads into a page cache that
keeps growing (results/probe_conditions.json), and that is the condition the A/B reads under.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mbolt.bench.env import environment
from mbolt.core.pagecache import evict
from mbolt.core.errors import MboltError
from mbolt.core.pagecache import drop_cached

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20)
QDS = (1, 4)
MODES = ("buffered", "direct")
ALIGN = 4096


def _make_file(dirpath: Path, size: int, progress=None) -> Path:
    fd, name = tempfile.mkstemp(prefix=".mbolt-probe-", dir=dirpath)
    chunk = 8 << 20
    rng = np.random.default_rng(0)
    try:
        written = 0
        while written < size:
            n = min(chunk, size - written)
            os.write(fd, rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            written += n
            if progress:
                progress(written / size)
        os.fsync(fd)
    except BaseException as e:
        os.unlink(name)  # never leave the probe file behind
        if isinstance(e, OSError):
            raise MboltError(f"{dirpath}: cannot write the {size >> 20} MB probe file: {e.strerror}") from None
        raise
    finally:
        os.close(fd)
    return Path(name)


def _open_for_random_reads(path, size: int) -> tuple[int, mmap.mmap]:
    """A buffered descriptor without kernel readahead and one read buffer, touched before any
    timing (no first-touch page faults inside a timed read)."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    buf = mmap.mmap(-1, size)
    buf.write(bytes(size))
    return fd, buf


def _run_config(path: str, size: int, qd: int, direct: bool, n_reads: int, seed: int,
                drop_each: bool = True) -> dict:
    """One config's cold random reads. drop_each=False (buffered QD1): leave the pages in the cache
    until the end, as the probe did before issue 14 (scripts/bench_probe_conditions.py compares)."""
    fsize = os.path.getsize(path)
    slots = (fsize - size) // ALIGN
    if slots < n_reads:
        raise MboltError(f"{path}: too small for {n_reads} reads of {size} B")
    rng = np.random.default_rng(seed)
    # distinct, non-overlapping offsets: sample slots on a size-sized grid
    grid = np.arange(0, fsize - size, max(size, ALIGN) + ALIGN, dtype=np.int64)
    offs = rng.choice(grid, size=min(n_reads, len(grid)), replace=False)
    ev = evict(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    bufs = [mmap.mmap(-1, size) for _ in range(qd)]
    lat = np.zeros(len(offs))

    def one(i, buf):
        t = time.perf_counter()
        n = os.preadv(fd, [buf], int(offs[i]))
        lat[i] = time.perf_counter() - t
        if n != size:
            raise MboltError(f"{path}: short read ({n} of {size} B)")
        if drop_each and not direct and qd == 1:
            # as the store: what was read leaves the page cache before the next read (at QD > 1 a
            # 2 MiB drop could hit a neighbour's read in flight: dropped at the end)
            drop_cached(fd, int(offs[i]), int(offs[i]) + size)

    try:
        t0 = time.perf_counter()
        if qd == 1:
            for i in range(len(offs)):
                one(i, bufs[0])
        else:
            with ThreadPoolExecutor(qd) as pool:
                def worker(w):
                    for i in range(w, len(offs), qd):
                        one(i, bufs[w])
                list(pool.map(worker, range(qd)))
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    if not direct:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return {"mode": "direct" if direct else "buffered", "qd": qd, "size": size, "reads": len(offs),
            "t_op_us": float(np.median(lat) * 1e6), "wall_per_read_us": wall / len(offs) * 1e6,
            "lat_mean_us": float(lat.mean() * 1e6), "lat_p90_us": float(np.percentile(lat, 90) * 1e6),
            "mb_per_s": len(offs) * size / wall / 1e6, "resident_before": ev.resident_after,
            "cold_proven": ev.proven}


def _burst_config(path: str, size: int, k: int, n_bursts: int, span: int, seed: int) -> dict:
    """Bursts of `k` scattered reads of `size` bytes issued back to back at QD1, buffered, in
    ascending offset order inside a window of `span` bytes: what the store does for one layer of a
    stock file (k experts' slices of one tensor, sorted, each its own read). Per burst the wall
    time is divided by k: the per-read cost of scattered reads in a burst."""
    fsize = os.path.getsize(path)
    stride = size + ALIGN  # never two reads in the same page or adjacent: each is its own I/O
    # the window grows with the read size (a stock tensor of 64 experts spans 64 slices): k reads
    # among at least 4k slots stay scattered, whatever `span` says
    span = int(min(max(span, 4 * k * stride), fsize - size))
    if span // stride < k:
        raise MboltError(f"{path}: window of {span} B too small for {k} reads of {size} B")
    rng = np.random.default_rng(seed)
    # bursts in disjoint windows, so no burst reads a page another burst brought in
    windows = rng.permutation(max(1, (fsize - size) // span))[:n_bursts]
    ev = evict(path)
    fd, buf = _open_for_random_reads(path, size)
    per_read = []
    try:
        for w in windows:
            slots = np.sort(rng.choice(span // stride, size=k, replace=False))
            offs = int(w) * span + slots * stride
            t = time.perf_counter()
            for off in offs:
                if os.preadv(fd, [buf], int(off)) != size:
                    raise MboltError(f"{path}: short read at byte {int(off)}")
            per_read.append((time.perf_counter() - t) / k)
            drop_cached(fd, int(offs[0]), int(offs[-1]) + size)  # as the store after a layer
    finally:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        buf.close()
    return {"mode": "buffered", "qd": 1, "size": size, "k": k, "bursts": len(per_read),
            "t_op_us": float(np.median(per_read) * 1e6), "mb_per_s": size / float(np.median(per_read)) / 1e6,
            "resident_before": ev.resident_after, "cold_proven": ev.proven}


def fit_law(rows: list[dict]) -> dict:
    """Per (mode, QD): cost of one read = t_op + size / BW, least squares on relative error.

    The cost of a read is its median latency divided by the queue depth (reads in flight
    overlap): medians, because on a shared machine a few reads stall for milliseconds behind
    the neighbours' I/O and would otherwise decide the fit. The A/B harness measures wall time
    with the stalls, so on a busy machine measured times sit above these predictions.
    """
    fits = {}
    for mode in MODES:
        for qd in sorted({r["qd"] for r in rows}):
            rs = [r for r in rows if r["mode"] == mode and r["qd"] == qd]
            if len(rs) < 2:
                continue
            x = np.array([r["size"] for r in rs], float)
            y = np.array([r["t_op_us"] * 1e-6 / qd for r in rs])
            slope, icpt = np.polyfit(x, y, 1, w=1.0 / y)
            bw = 1.0 / slope if slope > 0 else float(max(r["mb_per_s"] for r in rs) * 1e6)
            fits[f"{mode}_qd{qd}"] = {"mode": mode, "qd": qd, "t_op_s": float(max(icpt, 0.0)), "bw_bytes_s": float(bw),
                                     "best_mb_per_s": float(max(r["mb_per_s"] for r in rs)),
                                     "median_mb_per_s": float(max(r["size"] * qd / (r["t_op_us"] * 1e-6) for r in rs) / 1e6)}
    return fits


def fit_bursts(rows: list[dict]) -> dict:
    """The same law (t_op + size/BW) fitted over burst rows of one burst length (buffered QD1)."""
    rows = [r for r in rows if r["t_op_us"] > 0]
    if len({r["size"] for r in rows}) < 2:
        return {}
    x = np.array([r["size"] for r in rows], float)
    y = np.array([r["t_op_us"] * 1e-6 for r in rows])
    slope, icpt = np.polyfit(x, y, 1, w=1.0 / y)
    bw = 1.0 / slope if slope > 0 else float(max(r["mb_per_s"] for r in rows) * 1e6)
    return {"buffered_qd1": {"mode": "buffered", "qd": 1, "k": rows[0]["k"], "t_op_s": float(max(icpt, 0.0)),
                             "bw_bytes_s": float(bw), "best_mb_per_s": float(max(r["mb_per_s"] for r in rows))}}


def host_cache_probe(dirpath: str | os.PathLike, size_mb: int = 32, size: int = 64 << 10, n_reads: int = 64,
                     seed: int = 0, existing: str | os.PathLike | None = None) -> dict:
    """Is there a cache below the guest (a VM's host page cache)? Write a new file, evict it from
    the guest's page cache (mincore-proven), read `n_reads` random `size`-byte slices (first read),
    evict again, read the same slices again (re-read). A re-read much faster than the first read
    means evicted data is still served from memory below the guest: "cold" there is warm below.

    A just-written file may already sit in the host's cache (written data passes through it), so
    equal times do not prove there is none; the verdict says so. `existing`: a file the guest has
    not cached (resident share 0, e.g. a model not read since boot) to use instead of a new file.
    """
    from mbolt.core.pagecache import resident_share

    d = Path(dirpath) if Path(dirpath).is_dir() else Path.cwd()
    made = False
    if existing is not None and os.path.getsize(existing) >= 2 * size * n_reads and resident_share(existing) == 0.0:
        path, source = Path(existing), "an existing file with no page resident in the guest"
    else:
        try:
            path, source, made = _make_file(d, size_mb << 20), "a file written just before (fsync'ed)", True
        except OSError as e:
            return {"measured": False, "note": f"no probe file in {d}: {e.strerror}"}
    try:
        rng = np.random.default_rng(seed)
        grid = np.arange(0, os.path.getsize(path) - size, size + ALIGN, dtype=np.int64)
        offs = rng.choice(grid, size=min(n_reads, len(grid)), replace=False)
        fd, buf = _open_for_random_reads(path, size)
        passes = []
        try:
            for _ in range(2):
                ev = evict(path)
                lat = []
                for off in offs:
                    t = time.perf_counter()
                    os.preadv(fd, [buf], int(off))
                    lat.append(time.perf_counter() - t)
                passes.append((float(np.median(lat) * 1e6), ev))
        finally:
            os.close(fd)
            buf.close()
    finally:
        if made:
            path.unlink(missing_ok=True)
    (first, ev1), (again, ev2) = passes
    ratio = first / again if again > 0 else float("nan")
    proven = ev1.proven and ev2.proven
    if not proven:
        verdict = "unknown: guest eviction could not be proven"
    elif ratio >= 1.5:
        verdict = (f"yes: a re-read after guest eviction is {ratio:.1f}x faster than the first read; data the guest "
                   "evicted is served from a cache below it (cold in the guest is partly warm below)")
    else:
        verdict = ("not seen: re-read after guest eviction about as fast as the first read (either no cache below "
                   "the guest, or the freshly written file was already in it)")
    return {"measured": True, "first_read_of": source, "size": size, "reads": len(offs), "first_read_us": first,
            "reread_us": again,
            "first_over_reread": ratio, "guest_eviction_proven": proven, "verdict": verdict,
            "faster_below_guest": bool(proven and ratio >= 1.5)}


def min_file_bytes(sizes=SIZES, burst_k: int = 8, min_reads: int = 16) -> int:
    """The smallest probe file every config fits in: `min_reads` reads of the largest size on
    their own grid, and a burst of `burst_k` scattered reads of it (`_burst_config`)."""
    s = max(sizes)
    return max(s + min_reads * (s + 2 * ALIGN), s + max(burst_k, 1) * (s + ALIGN) + ALIGN)


def probe(file: str | os.PathLike | None = None, *, sizes=SIZES, qds=QDS, modes=MODES, size_mb: int = 256,
          reads_mb: int = 16, max_reads: int = 128, min_reads: int = 16, repeats: int = 3, progress=None,
          burst_k: int = 8, burst_sizes=None, n_bursts: int = 16, burst_span: int = 8 << 20,
          host_cache: bool = True) -> dict:
    """Measure cold random reads on the drive holding `file` (a temp file beside it when `file`
    is a directory, missing or under 64 MiB). `reads_mb` caps the bytes read per config.

    With `burst_k` > 0 also bursts of `burst_k` scattered reads back to back (`_burst_config`, the
    read pattern of a stock file) for each of `burst_sizes` (default: `sizes`), fitted as
    `burst_fits`; the predictor uses them for QD1 buffered readers when present. `host_cache`:
    also run `host_cache_probe` beside the file."""
    tmp = None
    target = Path(file) if file is not None else Path.cwd()
    need = min_file_bytes(sizes, burst_k, min_reads)
    if target.is_file() and target.stat().st_size >= max(64 << 20, need):
        path = target
    else:
        if size_mb << 20 < need:
            raise MboltError(f"--size-mb {size_mb}: the probe file must hold {min_reads} reads of "
                             f"{max(sizes) >> 10} KiB and a burst of {burst_k}: give --size-mb "
                             f"{-(-need // (1 << 20))} or more")
        d = target if target.is_dir() else target.parent if target.parent.exists() else Path.cwd()
        path = tmp = _make_file(d, size_mb << 20)
    try:
        # first, while `path` may still be unread since boot (the configs below read it)
        hc = (host_cache_probe(path.parent, existing=None if tmp is not None else path) if host_cache
              else {"measured": False, "note": "not asked"})
        configs = [(m, q, s) for m in modes for q in qds for s in sizes]
        bsizes = tuple(burst_sizes or sizes) if burst_k > 0 and "buffered" in modes else ()
        configs += [("burst", 1, s) for s in bsizes]
        runs: dict = {c: [] for c in configs}
        total = len(configs) * repeats
        done = 0
        for rep in range(repeats):  # interleaved repeats: drift and neighbours' load hit every config
            for i, (m, q, s) in enumerate(configs if rep % 2 == 0 else configs[::-1]):
                n = int(max(min_reads, min(max_reads, (reads_mb << 20) // s)))
                if m == "burst":
                    runs[(m, q, s)].append(_burst_config(str(path), s, burst_k, n_bursts, burst_span,
                                                         seed=1000 * rep + i))
                else:
                    runs[(m, q, s)].append(_run_config(str(path), s, q, m == "direct", n, seed=1000 * rep + i))
                done += 1
                if progress:
                    progress(done, total)
        rows, burst_rows = [], []
        for c in configs:
            rs = runs[c]
            row = dict(rs[0])
            if c[0] == "burst":
                for k in ("t_op_us", "mb_per_s", "resident_before"):
                    row[k] = float(np.median([r[k] for r in rs]))
                row["bursts"] = sum(r["bursts"] for r in rs)
                row["repeats"] = len(rs)
                row["cold_proven"] = all(r["cold_proven"] for r in rs)
                burst_rows.append(row)
                continue
            for k in ("t_op_us", "wall_per_read_us", "mb_per_s", "resident_before", "lat_mean_us", "lat_p90_us"):
                row[k] = float(np.median([r[k] for r in rs]))
            row["reads"] = sum(r["reads"] for r in rs)
            row["repeats"] = len(rs)
            row["cold_proven"] = all(r["cold_proven"] for r in rs)
            row["wall_per_read_us_all"] = [r["wall_per_read_us"] for r in rs]
            rows.append(row)
        env = environment(path)
        env["host_cache"] = hc
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return {"file": str(path), "temp_file": tmp is not None, "device": env["device"], "filesystem": env["filesystem"],
            "rows": rows, "fits": fit_law(rows), "burst_rows": burst_rows, "burst_fits": fit_bursts(burst_rows),
            "host_cache": hc, "environment": env,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "note": "t_op_us = median latency of one read; fits use wall time per read (queue depth included); "
                    "each config is the median of interleaved repeats"}


def load_probe(path: str | os.PathLike) -> dict:
    """Probe figures written by `mbolt probe`, validated (every fit has a mode, qd, t_op, BW)."""
    from mbolt.core.checks import read_json

    p = Path(path)
    if not p.exists():
        raise MboltError(f"{p}: no probe figures (run `mbolt probe -o {p}` first)")
    d = read_json(p, "probe JSON")
    if not isinstance(d, dict) or not isinstance(d.get("fits"), dict) or not d["fits"]:
        raise MboltError(f"{p}: not a probe JSON (no fits)")
    for name, f in d["fits"].items():
        ok = (isinstance(f, dict) and f.get("mode") in MODES
              and all(isinstance(f.get(k), (int, float)) and not isinstance(f.get(k), bool)
                      for k in ("qd", "t_op_s", "bw_bytes_s"))
              and f["t_op_s"] >= 0 and f["bw_bytes_s"] > 0)
        if not ok:
            raise MboltError(f"{p}: fit {name!r} is not mode (buffered|direct), qd, t_op_s >= 0, bw_bytes_s > 0")
    return d


def cost(probe_d: dict, direct: bool, qd: int, bursts: bool = True) -> tuple[float, float]:
    """(t_op seconds, bandwidth bytes/s) for a reader; nearest measured QD. A buffered QD1 reader
    uses the burst figures when the probe has them (the store issues a layer's reads back to back,
    which is what they measure)."""
    mode = "direct" if direct else "buffered"
    bf = (probe_d.get("burst_fits") or {}).get("buffered_qd1")
    if bursts and bf and not direct and qd <= 1:
        return bf["t_op_s"], bf["bw_bytes_s"]
    fits = [f for f in probe_d["fits"].values() if f["mode"] == mode]
    if not fits:
        raise MboltError(f"probe has no {mode} figures")
    f = min(fits, key=lambda f: abs(f["qd"] - qd))
    return f["t_op_s"], f["bw_bytes_s"]


def sequential_read(path: Path, nbytes: int = 1 << 30) -> dict:
    """The drive's sequential read bandwidth on the model file's first `nbytes`, cold: (a) as the
    runtime's reader reads (posix_fadvise WILLNEED in the pieces the kernel takes whole, then each
    piece's last byte awaited), (b) one thread of 4 MiB preadv (what dd does). Bytes per second of
    each, and the better of the two."""
    from mbolt.core.pagecache import evict, willneed_bytes

    size = path.stat().st_size
    n = min(nbytes, size)
    out = {"bytes": n}
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        evict(path)
        step = willneed_bytes(path)
        t = time.perf_counter()
        for off in range(0, n, step):
            os.posix_fadvise(fd, off, min(step, n - off), os.POSIX_FADV_WILLNEED)
        for off in range(0, n, step):
            os.pread(fd, 1, min(off + step, n) - 1)
        out["willneed_bytes_per_s"] = n / (time.perf_counter() - t)
        evict(path)
        buf = bytearray(4 << 20)
        t = time.perf_counter()
        for off in range(0, n, len(buf)):
            os.preadv(fd, [memoryview(buf)[:min(len(buf), n - off)]], off)
        out["pread_4m_bytes_per_s"] = n / (time.perf_counter() - t)
    finally:
        os.close(fd)
        evict(path)
    out["bytes_per_s"] = max(out["willneed_bytes_per_s"], out["pread_4m_bytes_per_s"])
    return out
