"""The prompt cache: KV states of prompt prefixes on disk (`--prompt-cache DIR`), restored into any
slot whose prompt starts with one, across requests, slots and restarts; and in memory, a prefix
another slot holds copied into the slot that needs it (docs/serve.md, "The prompt cache").

What is kept: the KV state (`llama_state_seq_get_data`) of a prompt up to the start of its last
user turn (an agent's system prompt and tools, a chat's history), or of the whole prompt when there
are no turns (/v1/completions): the scheduler ends a prompt pass there and saves the slot.

A file (`<hash of its model and tokens>-<n>.kv`): magic (8) | header length (u32) | the header's
crc32 (u32) | header (JSON) | tokens (int32) | state. The header names the model (the GGUF
fingerprint of the file llama.cpp computes with: a kernel-layout file's own, not its source's,
whose kernels sum in another order) and what shapes the state (architecture, layers, KV type, flash
attention: V transposed or not, the streams, llama.cpp's version), the tokens' and the state's
crc32 (zlib's: 5.8 GB/s here, above a drive's rate). A plain KV cache's state of one sequence is
one stream's block between empty ones: the file keeps that block, framed again in place for the
slot and stream count it loads into. A file that does not match (another model, another layout, a
flipped byte, a truncated write) is skipped with one line in the log, counted by reason; its prefix
is evaluated. Files are written under a unique temporary name, fsynced and renamed (two servers on
one directory see whole files or none), their space taken by posix_fallocate first (a full disk
fails there, not as a SIGBUS on a mapped page; the save is dropped, the request answered). The
directory stays within its size, least recently used first (a restore touches the file's mtime).

Memory: a state goes through a mapping of its file (page cache the kernel can reclaim) straight
into or out of the KV cache the budget already counts; the pages are dropped after use.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mbolt.core.atomic import pid_alive
from mbolt.runtime.driver import common_prefix

MAGIC = b"MBOLTKV\x01"
SUFFIX = ".kv"
MIN_TOKENS = 16  # a shorter prefix is not worth a file, a restore or a copy
MAX_DEFAULT_SIZE = 32 << 30  # the default size: 10% of the free space, at most this
_FIXED = struct.Struct("<8sII")  # magic, header length, header crc32
MAX_STREAMS = 256  # llama.cpp's LLAMA_MAX_SEQ: the most streams (sequences) a context has
_ROOM = 12 + 4 * MAX_STREAMS  # before one stream's state: magic, sequence id, stream count, empty streams
log = logging.getLogger("mbolt.serve.prompt_cache")


class CacheFileError(Exception):
    """A cache file this server cannot use; `reason` is its /metrics label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def default_size(directory: Path) -> int:
    return min(MAX_DEFAULT_SIZE, shutil.disk_usage(directory).free // 10)


def layout_of(driver) -> dict:
    """What a state must have been saved under to be loaded into this context."""
    import llama_cpp

    return {"model": driver.model_fingerprint, "arch": driver.arch, "n_layer": driver.n_layer,
            "kv_type": "f32" if driver.f32_kv else "f16", "flash_attn": bool(driver.flash_attn),
            "streams": "any" if one_stream(driver) else int(driver.n_seq), "llama_cpp": llama_cpp.__version__}


def one_stream(driver) -> bool:
    """A sequence's state is one stream's block between empty ones (a KV cache alone: not recurrent,
    hybrid or with a sliding window), so the file keeps the block alone and it loads into a context
    of any number of slots; else the state is kept whole, for a context of as many slots."""
    return driver.n_seq <= MAX_STREAMS and driver.kv_cache_only


def _name(tokens, model: str) -> str:
    """A file's name: its tokens' and its model's hash (two models' states of one prompt, a stock file
    and its kernel layout served on one directory, do not take each other's name), and its length."""
    arr = np.asarray(tokens, dtype="<i4")
    return f"{hashlib.sha256(model.encode() + arr.tobytes()).hexdigest()[:24]}-{len(arr)}{SUFFIX}"


@dataclass
class Entry:
    path: Path
    header: dict
    tokens: np.ndarray
    offset: int  # where the state starts
    size: int  # bytes of the file
    ident: tuple  # (inode, size, mtime_ns) when read: a rewrite is a new file


def read_entry(path: Path) -> Entry:
    """A cache file's header and tokens, checked (its state is checked when it is restored)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        fixed = f.read(_FIXED.size)
        if len(fixed) < _FIXED.size:
            raise CacheFileError("truncated", f"{path}: truncated ({st.st_size} bytes)")
        magic, n_head, crc = _FIXED.unpack(fixed)
        if magic != MAGIC:
            raise CacheFileError("format", f"{path}: not an mbolt prompt cache file")
        raw = f.read(n_head)
        if len(raw) < n_head:
            raise CacheFileError("truncated", f"{path}: truncated in its header")
        if zlib.crc32(raw) != crc:
            raise CacheFileError("checksum", f"{path}: the header's checksum does not match")
        head = json.loads(raw)
        n = int(head["n_tokens"])
        tok = f.read(4 * n)
        if len(tok) < 4 * n:
            raise CacheFileError("truncated", f"{path}: truncated in its tokens")
        if f"{zlib.crc32(tok):08x}" != head["tokens_crc32"]:
            raise CacheFileError("checksum", f"{path}: the tokens' checksum does not match")
    offset = _FIXED.size + n_head + 4 * n
    if st.st_size != offset + int(head["payload_bytes"]):
        raise CacheFileError("truncated", f"{path}: {st.st_size} bytes, its header says "
                                          f"{offset + int(head['payload_bytes'])}")
    return Entry(path, head, np.frombuffer(tok, dtype="<i4").copy(), offset, st.st_size,
                 (st.st_ino, st.st_size, st.st_mtime_ns))


@dataclass
class _Pending:
    mm: mmap.mmap
    fd: int
    tmp: str
    final: Path
    head: dict
    offset: int


@dataclass
class PromptCache:
    directory: Path
    size: int  # bytes the directory may hold
    layout: dict
    say: object = None  # say(line): the log (default: this module's logger, warning level)
    counts: dict = field(default_factory=lambda: {"restores": 0, "restored_tokens": 0, "restore_bytes": 0,
                                                  "restore_s": 0.0, "saves": 0, "save_bytes": 0,
                                                  "save_failures": 0, "evicted": 0})
    skipped: dict = field(default_factory=dict)  # reason -> files skipped

    def __post_init__(self):
        self.directory = Path(self.directory)
        self.say = self.say or log.warning
        self._index: dict[str, Entry] = {}
        self._bad: dict[str, tuple] = {}  # name -> ident of a file already skipped (said once)
        self._lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue(maxsize=2)
        self._writer = threading.Thread(target=self._write_loop, name="mbolt-prompt-cache", daemon=True)
        self._writer.start()
        for part in self.directory.glob(".*.part"):  # what a killed writer left (its pid is in the name)
            pid = part.name.split(".")[3]
            if pid.isdigit() and not pid_alive(int(pid)):
                _unlink(str(part))

    # ---- the directory ----

    def _skip(self, name: str, ident: tuple, err: CacheFileError) -> None:
        with self._lock:
            self._index.pop(name, None)
            if self._bad.get(name) == ident:
                return
            self._bad[name] = ident
            self.skipped[err.reason] = self.skipped.get(err.reason, 0) + 1
        self.say(f"prompt cache: skipped {err} ({err.reason})")

    def scan(self) -> list[Entry]:
        """The files of this server's layout (new or rewritten files read, vanished ones dropped)."""
        seen = set()
        for de in os.scandir(self.directory):
            if not de.name.endswith(SUFFIX) or de.name.startswith("."):
                continue
            try:
                st = de.stat()
            except FileNotFoundError:
                continue
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            seen.add(de.name)
            old = self._index.get(de.name)
            if (old is not None and old.ident[:2] == ident[:2]) or self._bad.get(de.name, (None,))[:2] == ident[:2]:
                continue
            try:
                e = read_entry(Path(de.path))
            except FileNotFoundError:
                continue
            except (CacheFileError, ValueError, KeyError, OSError) as err:
                if not isinstance(err, CacheFileError):
                    err = CacheFileError("format", f"{de.path}: unreadable header ({err})")
                self._skip(de.name, ident, err)
                continue
            theirs = e.header.get("layout") or {}
            diff = sorted(k for k in set(self.layout) | set(theirs) if self.layout.get(k) != theirs.get(k))
            if diff:
                why = "model" if "model" in diff else ", ".join(diff)
                self._skip(de.name, ident, CacheFileError("model" if "model" in diff else "layout",
                                                          f"{de.path}: saved under another {why}"))
                continue
            with self._lock:
                self._index[de.name] = e
        with self._lock:
            for name in set(self._index) - seen:
                del self._index[name]
            return list(self._index.values())

    def best(self, tokens: list[int], limit: int, exclude=()) -> tuple[Entry, int] | None:
        """The file sharing the longest prefix with `tokens` (at most `limit` tokens of it used, at
        least half of its tokens: a restore reads the whole file), None when none has MIN_TOKENS."""
        t = np.asarray(tokens, dtype=np.int32)
        found = None
        for e in self.scan():
            if e.path in exclude:
                continue
            n = min(common_prefix(e.tokens, t), limit)
            if n >= MIN_TOKENS and 2 * n >= len(e.tokens) and (found is None or (n, -len(e.tokens)) >
                                                               (found[1], -len(found[0].tokens))):
                found = (e, n)
        return found

    def covers(self, tokens: list[int]) -> bool:
        """A file already holds these tokens (or starts with them and is at most twice as long)."""
        t = np.asarray(tokens, dtype=np.int32)
        return any(common_prefix(e.tokens, t) == len(t) and len(e.tokens) <= 2 * len(t) for e in self.scan())

    # ---- restore ----

    def restore(self, driver, seq: int, e: Entry, n: int) -> bool:
        """Load a file's state into sequence `seq` and keep its first `n` tokens; False (the
        sequence empty, the file skipped) when it does not load."""
        t0 = time.perf_counter()
        driver.forget(seq)
        try:
            fd = os.open(e.path, os.O_RDONLY)
        except FileNotFoundError:  # evicted by another server since the scan
            return False
        try:
            st = os.fstat(fd)
            if (st.st_ino, st.st_size) != e.ident[:2]:
                return False  # replaced since the scan: read again at the next request
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)  # the whole file read ahead while the checksum runs
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)  # private: the framing is written in
            try:
                nbytes = int(e.header["payload_bytes"])
                with memoryview(mm) as view:
                    crc = zlib.crc32(view[e.offset:])
                if f"{crc:08x}" != e.header["payload_crc32"]:
                    self._skip(e.path.name, e.ident, CacheFileError("checksum", f"{e.path}: the state's checksum "
                                                                                "does not match"))
                    return False
                start, nbytes = _frame(mm, e.offset, e.header.get("state"), seq, driver.n_seq, nbytes)
                buf = (ctypes.c_uint8 * nbytes).from_buffer(mm, start)
                got = driver.load_state(seq, buf)
                del buf
            finally:
                mm.close()
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if not got:
            driver.forget(seq)
            self._skip(e.path.name, e.ident, CacheFileError("llama", f"{e.path}: llama.cpp refused the state"))
            return False
        if not driver.hold(seq, [int(x) for x in e.tokens], n):
            return False
        with contextlib.suppress(OSError):  # evicted by another server meanwhile: nothing to touch
            os.utime(e.path)  # recently used: the last to be evicted
        c = self.counts
        c["restores"] += 1
        c["restored_tokens"] += n
        c["restore_bytes"] += nbytes
        c["restore_s"] += time.perf_counter() - t0
        return True

    # ---- save ----

    def save(self, driver, seq: int) -> None:
        """Save what sequence `seq` holds (in the worker: the state copied into the file's mapping;
        the checksum, fsync and rename in the writer thread)."""
        tokens = list(driver.tokens[seq])
        if len(tokens) < MIN_TOKENS or self.covers(tokens):
            return
        final = self.directory / _name(tokens, str(self.layout.get("model")))
        nbytes = driver.state_size(seq)
        if not nbytes:
            self._failed(f"{final}: llama.cpp gave no state for sequence {seq}")
            return
        n, one = int(driver.n_seq), self.layout["streams"] == "any"
        block = nbytes - 12 - 4 * (n - 1)  # one stream's: its cell count, cells' metadata, K and V rows
        stored = _ROOM + block + 4 * MAX_STREAMS if one else nbytes
        head = {"layout": self.layout, "n_ctx": int(driver.n_ctx_seq), "n_tokens": len(tokens),
                "tokens_crc32": f"{zlib.crc32(np.asarray(tokens, dtype='<i4').tobytes()):08x}",
                "payload_bytes": stored, "payload_crc32": "00000000", "saved": time.time(),
                "state": {"head": "0" * 16, "block": block} if one else None}
        raw = json.dumps(head).encode()
        offset = _FIXED.size + len(raw) + 4 * len(tokens)
        if offset + stored > self.size:
            self._failed(f"{final}: {offset + stored} bytes do not fit --prompt-cache-size {self.size}")
            return
        if self._writes.full():
            self._failed(f"{final}: two writes are still under way")
            return
        fd, tmp = -1, ""
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".part", dir=self.directory)
            os.posix_fallocate(fd, 0, offset + stored)  # ENOSPC now, not a SIGBUS on a mapped page
            mm = mmap.mmap(fd, offset + stored)
            mm[offset - 4 * len(tokens):offset] = np.asarray(tokens, dtype="<i4").tobytes()
            at = offset + _ROOM - 12 - 4 * seq if one else offset  # one stream's block lands at offset + _ROOM
            buf = (ctypes.c_uint8 * nbytes).from_buffer(mm, at)
            got = driver.save_state(seq, buf)
            del buf
            why = f"llama.cpp wrote {got} of {nbytes} state bytes" if got != nbytes else None
            if one and why is None:
                head["state"]["head"] = mm[at:at + 8].hex()
                framing = mm[at + 8:at + 12 + 4 * seq] + mm[offset + _ROOM + block:at + nbytes]
                cells = mm[offset + _ROOM:offset + _ROOM + 4]
                if framing != struct.pack("<I", n) + bytes(4 * (n - 1)) or cells == bytes(4):
                    why = "llama.cpp's state is not one stream's between empty ones"
            if why:
                mm.close()
                raise OSError(0, why)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
                _unlink(tmp)
            self._failed(f"{final}: {e.strerror or e}")
            return
        self._writes.put(_Pending(mm, fd, tmp, final, head, offset))

    def _failed(self, why: str) -> None:
        with self._lock:  # the worker and the writer both count here
            self.counts["save_failures"] += 1
        self.say(f"prompt cache: not saved: {why}")

    def _write_loop(self) -> None:
        while True:
            p = self._writes.get()
            if p is None:
                self._writes.task_done()
                return
            try:
                self._finish_write(p)
            except Exception as e:  # the writer goes on: a dropped save loses nothing but time
                _unlink(p.tmp)
                self._failed(f"{p.final}: {getattr(e, 'strerror', None) or e}")
            finally:
                self._writes.task_done()

    def _finish_write(self, p: _Pending) -> None:
        try:
            with memoryview(p.mm) as view:
                p.head["payload_crc32"] = f"{zlib.crc32(view[p.offset:]):08x}"
            raw = json.dumps(p.head).encode()
            tok = bytes(p.mm[p.offset - 4 * p.head["n_tokens"]:p.offset])
            p.mm[:_FIXED.size + len(raw)] = _FIXED.pack(MAGIC, len(raw), zlib.crc32(raw)) + raw
            assert _FIXED.size + len(raw) + len(tok) == p.offset  # the crc's width is fixed
            p.mm.flush()
            p.mm.close()
            os.fsync(p.fd)
            os.posix_fadvise(p.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(p.fd)
        os.replace(p.tmp, p.final)
        self.counts["saves"] += 1
        self.counts["save_bytes"] += p.offset + p.head["payload_bytes"]
        self.evict(keep=p.final)

    def evict(self, keep: Path | None = None) -> None:
        """Remove the least recently used files (by mtime) until the directory fits its size."""
        files = []
        for de in os.scandir(self.directory):
            if de.name.endswith(SUFFIX) and not de.name.startswith("."):
                try:
                    st = de.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, Path(de.path)))
        total = sum(f[1] for f in files)
        for _, size, path in sorted(files):
            if total <= self.size:
                break
            if path == keep:
                continue
            if _unlink(str(path)):
                self.counts["evicted"] += 1
            total -= size

    def flush(self) -> None:
        """Wait for the writes under way."""
        self._writes.join()

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=120)

    def stats(self) -> dict:
        with self._lock:
            files = list(self._index.values())
        return {**{f"prompt_cache_{k}": v for k, v in self.counts.items()},
                "prompt_cache_files": len(files), "prompt_cache_bytes": sum(e.size for e in files),
                "prompt_cache_size": self.size, "prompt_cache_skipped": dict(self.skipped)}


# ---- the scheduler's side ----


def _frame(mm, offset: int, state: dict | None, seq: int, n: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the state to load into sequence `seq` of a context of `n` streams: a whole
    state as stored, or one stream's block framed in place (in a private mapping) as llama.cpp
    writes it for that sequence: magic and sequence id, `n`, empty streams before and after it."""
    if state is None:
        return offset, nbytes
    start, end = offset + _ROOM - 12 - 4 * seq, offset + _ROOM + int(state["block"])
    mm[start:offset + _ROOM] = bytes.fromhex(state["head"]) + struct.pack("<I", n) + bytes(4 * seq)
    mm[end:end + 4 * (n - seq - 1)] = bytes(4 * (n - seq - 1))
    return start, end + 4 * (n - seq - 1) - start


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
