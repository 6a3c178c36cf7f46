"""The copy engine of a rewrite: source byte ranges into the output with copy_file_range (buffered
pread/pwrite where the kernel refuses), the source advised ahead and the output written back as it
goes, so memory stays flat whatever the model size; SIGTERM becomes an interrupt."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from typing import Callable
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import split_vaddr

CHUNK = 64 << 20  # bytes per copy_file_range call (progress granularity)
BUF = 8 << 20  # buffer of the fallback copy
READAHEAD = 64 << 20  # source bytes advised (WILLNEED) ahead of the copy
WRITEBACK = 32 << 20  # start writeback of the output every this many bytes

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

# ---- copying ----


class Copier:
    """Copies virtual ranges between lists of files (the shards of the input and the output)."""

    def __init__(self, fins: list[int], fouts: list[int], total: int, progress: Progress | None, src_names: list[str]):
        self.fins, self.fouts, self.total, self.progress, self.src_names = fins, fouts, total, progress, src_names
        self.mode = "copy_file_range" if hasattr(os, "copy_file_range") else "buffered"
        self.done = 0
        self._buf = None
        self._last = 0

    def copy(self, src: int, dst: int, n: int) -> None:
        fi, src = split_vaddr(src)
        fo, dst = split_vaddr(dst)
        self.fin, self.fout, self.src_name = self.fins[fi], self.fouts[fo], self.src_names[fi]
        while n > 0:
            step = min(n, CHUNK)
            k = self._cfr(src, dst, step) if self.mode == "copy_file_range" else None
            if k is None:
                k = self._buffered(src, dst, step)
            if k <= 0:
                raise MboltError(f"{self.src_name}: unexpected end of file at byte {src} (changed while reading?)")
            src, dst, n, self.done = src + k, dst + k, n - k, self.done + k
            if self.progress and (self.done - self._last >= CHUNK or self.done == self.total):
                self._last = self.done
                self.progress(self.done, self.total)

    def _cfr(self, src, dst, n):
        try:
            return os.copy_file_range(self.fin, self.fout, n, src, dst)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF):
                self.mode = "buffered"
                return None
            raise

    def _buffered(self, src, dst, n):
        if self._buf is None:
            self._buf = memoryview(bytearray(BUF))
        n = min(n, BUF)
        k = os.preadv(self.fin, [self._buf[:n]], src)
        w = 0
        while w < k:
            w += os.pwrite(self.fout, self._buf[w:k], dst + w)
        return k


class Readahead:
    """Ask the kernel to read the next READAHEAD bytes of source ranges asynchronously.

    A permuted tensor is read slice by slice in an order the kernel's readahead cannot guess;
    WILLNEED on the upcoming ranges keeps several reads in flight (page cache, not our memory)."""

    def __init__(self, fds: int | list[int], ops: list[tuple[int, int, int]], window: int = READAHEAD):
        self.fds = [fds] if isinstance(fds, int) else fds  # ops' first field is a virtual offset into these
        self.ops, self.window = ops, window
        self.next = 0  # first op not advised yet
        self.bytes = 0  # advised bytes not yet copied
        self.ok = hasattr(os, "posix_fadvise")

    def advance(self, i: int) -> None:
        if not self.ok:
            return
        if i:
            self.bytes -= self.ops[i - 1][2]
        while self.next < len(self.ops) and (self.next <= i or self.bytes < self.window):
            s, _, n = self.ops[self.next]
            f, s = split_vaddr(s)
            try:
                os.posix_fadvise(self.fds[f], s, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                self.ok = False
                return
            self.bytes += n
            self.next += 1


class Writeback:
    """Start writeback of every WRITEBACK bytes written (sync_file_range, Linux) so the final
    fsync has little left to do and disk writes overlap the reads."""

    def __init__(self, fd: int):
        self.fd, self.done = fd, 0
        self.fn = _sync_file_range()

    def wrote(self, end: int) -> None:
        if self.fn is None or end - self.done < WRITEBACK:
            return
        if self.fn(self.fd, self.done, end - self.done, 2) != 0:  # SYNC_FILE_RANGE_WRITE
            self.fn = None
        self.done = end


_SFR = []


def _sync_file_range():
    if not _SFR:
        import ctypes

        from mbolt.core.pagecache import libc

        try:
            fn = libc().sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _SFR.append(fn)
    return _SFR[0]


@contextlib.contextmanager
def interrupt_on_terminate():
    """SIGTERM/SIGHUP raise KeyboardInterrupt so temp files are removed (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
