"""A model larger than RAM, for real: memory cgroups, the memory budget and the readahead.

A memory cgroup charges the page cache a process fills to that process's group, so a group's
limit is a machine with that much RAM: the kernel reclaims file pages (experts, and dense
weights unless they are locked) when the group reaches it. Both hierarchies are supported:
v1 (`memory.limit_in_bytes`, `cgroup.procs`) and v2 (`memory.max`), whichever the machine
mounts with the memory controller; where neither can be used, one error says why.

The budget of a run (STYLE.md: dense weights, KV cache, expert cache): `--ram`, else the
limit of the group this process runs in, else the machine's available memory.

`read_ahead_kb` of the block device decides how much one page fault reads (DESIGN.md): every
result names it, and `readahead(path, kb)` sets it for a run and restores it on exit, error,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mbolt.core.errors import MboltError

V1_ROOT = Path("/sys/fs/cgroup/memory")
UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


def parse_size(text: str | int | None, option: str = "--ram") -> int:
    """'4G', '500M', '1.5GiB', '4096' -> bytes (binary units)."""
    if text is None or text == "":
        return 0
    if isinstance(text, int):
        n = text
    else:
        t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
        try:
            n = int(float(t[:-1] if t[-1:] in "KMGT" else t) * mult)
        except ValueError:
            raise MboltError(f"{option}: {text!r} is not a size (e.g. 4G, 500M)") from None
    if n <= 0:
        raise MboltError(f"{option} must be positive, got {text!r}")
    return n


# ---- which hierarchy ----


def _v2_root() -> Path | None:
    """The cgroup2 mount whose controllers include memory, if any."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            root = Path(parts[1])
            try:
                if "memory" in (root / "cgroup.controllers").read_text().split():
                    return root
            except OSError:
                continue
    return None


def hierarchy() -> tuple[str, Path]:
    """("v1", memory root) or ("v2", cgroup2 root), or one error saying why neither works."""
    if (V1_ROOT / "cgroup.procs").exists():
        if os.access(V1_ROOT, os.W_OK):
            return "v1", V1_ROOT
        raise MboltError(f"{V1_ROOT}: memory cgroups need root (or a writable hierarchy) to create a group")
    root = _v2_root()
    if root is not None:
        if os.access(root, os.W_OK):
            return "v2", root
        raise MboltError(f"{root}: memory cgroups need root (or a delegated, writable cgroup2 tree) to create a group")
    raise MboltError("no memory cgroup hierarchy is mounted (neither v1 /sys/fs/cgroup/memory nor a cgroup2 mount "
                     "with the memory controller): a real memory limit cannot be set here")


# ---- one group ----


@dataclass
class MemoryGroup:
    """A memory cgroup of `limit` bytes that processes are started in (`popen`).

    Use as a context manager: the group is removed on exit (its processes must have ended)."""

    limit: int
    name: str = ""
    kind: str = ""
    path: Path | None = None

    def __enter__(self) -> "MemoryGroup":
        self.kind, root = hierarchy()
        self.name = self.name or f"mbolt-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        if self.kind == "v2":
            try:
                (root / "cgroup.subtree_control").write_text("+memory")
            except OSError:
                pass  # already enabled, or the root refuses: the mkdir below tells
        self.path = root / self.name
        try:
            self.path.mkdir()
            self._write("memory.limit_in_bytes" if self.kind == "v1" else "memory.max", str(int(self.limit)))
            if self.kind == "v2":
                self._write("memory.swap.max", "0", missing_ok=True)
        except OSError as e:
            self._remove()
            raise MboltError(f"{root}: cannot create a memory cgroup of {self.limit} bytes: {e.strerror}") from None
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _write(self, name: str, value: str, missing_ok: bool = False) -> None:
        f = self.path / name
        if missing_ok and not f.exists():
            return
        f.write_text(value)

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def _remove(self) -> None:
        if self.path is None or not self.path.exists():
            return
        if self.kind == "v1":
            try:
                (self.path / "memory.force_empty").write_text("0")  # uncharge its page cache first
            except OSError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.05)  # a process that just exited may still be leaving the group

    def popen(self, argv: list[str], also: Path | None = None, **kw) -> subprocess.Popen:
        """Start `argv` inside the group: a shell joins the group, then execs the command, so no
        byte of the command is charged elsewhere. `also`: another cgroup directory it joins too
        (v1 keeps blkio apart from memory: core.blkio.IoGroup's path)."""
        procs = str(self.path / "cgroup.procs")
        if also is not None and Path(also) != self.path:
            return subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && echo $$ > "$1" && shift && exec "$@"',
                                     procs, str(Path(also) / "cgroup.procs"), *argv], **kw)
        return subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv], **kw)

    def reset_peak(self) -> bool:
        """Start the group's peak over (v1 memory.max_usage_in_bytes, v2 memory.peak since Linux 6.12)."""
        try:
            (self.path / ("memory.max_usage_in_bytes" if self.kind == "v1" else "memory.peak")).write_text(
                "0" if self.kind == "v1" else "reset")
            return True
        except OSError:
            return False

    def peak(self) -> int | None:
        v = self._read("memory.max_usage_in_bytes" if self.kind == "v1" else "memory.peak")
        return int(v) if v and v.strip().isdigit() else None

    def oom_kills(self) -> int:
        """How many processes of the group the kernel's OOM killer ended."""
        text = self._read("memory.oom_control" if self.kind == "v1" else "memory.events") or ""
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                return int(v)
        return 0


# ---- the budget ----


def _own_groups() -> list[tuple[str, Path]]:
    """This process's memory cgroup directories: ("v1", dir) and/or ("v2", dir)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    v2 = _v2_root()
    for line in lines:
        _, ctrls, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if "memory" in ctrls.split(","):
            out.append(("v1", V1_ROOT / rel))
        elif ctrls == "" and v2 is not None:
            out.append(("v2", v2 / rel))
    return out


def _read_int(f: Path) -> int | None:
    try:
        v = f.read_text().strip()
    except OSError:
        return None
    return int(v) if v.isdigit() else None


def _own_group_values(v1_name: str, v2_name: str) -> list[int]:
    """The integer values of a file of this process's memory cgroup(s), v1 or v2 ("max" and
    unreadable files left out)."""
    vals = (_read_int(d / (v1_name if kind == "v1" else v2_name)) for kind, d in _own_groups())
    return [v for v in vals if v is not None]


def own_limit() -> int | None:
    """The tightest memory limit of the cgroup this process runs in and of its parents (a systemd
    slice sets the limit on a parent), None when there is none or it cannot be read."""
    limits = []
    for kind, d in _own_groups():
        root = V1_ROOT if kind == "v1" else _v2_root()
        while True:
            v = _read_int(d / ("memory.limit_in_bytes" if kind == "v1" else "memory.max"))
            if v is not None and v < UNLIMITED:
                limits.append(v)
            if root is None or d == root or root not in d.parents:
                break
            d = d.parent
    return min(limits) if limits else None


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


CAP_IPC_LOCK = 14  # <linux/capability.h>: mlock without RLIMIT_MEMLOCK


def lockable_bytes() -> int | None:
    """Bytes this process may still mlock: None when unlimited (CAP_IPC_LOCK, as root, or an
    infinite RLIMIT_MEMLOCK); an ordinary user's default is 8 MiB."""
    import resource

    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        if int(fields.get("CapEff", "0").strip(), 16) >> CAP_IPC_LOCK & 1:
            return None
    except ValueError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    locked = int(fields.get("VmLck", "0 kB").split()[0]) * 1024
    return max(0, soft - locked)


def budget(ram: str | int | None = None) -> tuple[int, str]:
    """(bytes, where from): --ram, else this process's cgroup limit, else available memory."""
    if ram:
        return parse_size(ram), "--ram"
    lim = own_limit()
    if lim is not None:
        return lim, "cgroup limit"
    return available_memory(), "available memory"


def reset_own_peak() -> int | None:
    """Start this process's memory cgroup's peak over (after a model's load, which touches the
    whole group: the peak of what follows is then what a run kept). Returns the peak before the
    reset (None: no group, or the kernel cannot reset it)."""
    for kind, d in _own_groups():
        f = d / ("memory.max_usage_in_bytes" if kind == "v1" else "memory.peak")
        before = _read_int(f)
        try:
            f.write_text("0" if kind == "v1" else "reset")  # v2 resets memory.peak since Linux 6.12
        except OSError:
            continue
        return before
    return None


def group_usage() -> int | None:
    """Bytes charged to this process's memory cgroup now (page cache included), None if unknown."""
    usage = _own_group_values("memory.usage_in_bytes", "memory.current")
    return usage[0] if usage else None


# ---- readahead ----


def readahead_file(path: str | os.PathLike) -> Path | None:
    """/sys/block/<disk>/queue/read_ahead_kb of the device holding `path` (None: not a block device)."""
    from mbolt.core.pagecache import queue_file

    return queue_file(path, "read_ahead_kb")


def readahead_kb(path: str | os.PathLike) -> int | None:
    f = readahead_file(path)
    try:
        return int(f.read_text()) if f is not None else None
    except (OSError, ValueError):
        return None


@contextmanager
def readahead(path: str | os.PathLike, kb: int | None):
    """Set the readahead of `path`'s device to `kb` for the block, restore it after, on error,
    Ctrl-C and SIGTERM alike. `kb` None: leave it as it is. Yields the value in force."""
    old = readahead_kb(path)
    if kb is None or kb == old:
        yield old
        return
    f = readahead_file(path)
    if f is None or old is None:
        raise MboltError(f"{path}: not on a block device whose readahead can be read: --readahead cannot be set")
    try:
        f.write_text(str(int(kb)))
    except OSError as e:
        raise MboltError(f"{f}: cannot set readahead to {kb} KiB: {e.strerror} (it needs root)") from None

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()  # only it may set a handler
    prev = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        yield int(kb)
    finally:
        try:
            f.write_text(str(old))
        finally:
            if main:
                signal.signal(signal.SIGTERM, prev)
