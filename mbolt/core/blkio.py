"""Drive profiles: a block-I/O cgroup that throttles a group's reads from one disk.

One machine can measure several drive classes (DESIGN.md, "Drives"): the block-I/O cgroup caps
the reads of the processes in a group, on one block device, in operations and/or bytes per
second. A throttle caps; it adds no latency, so "sata" is this disk held to 550 MB/s, not a
SATA SSD's access time.

- v1 (`/sys/fs/cgroup/blkio`): `blkio.throttle.read_iops_device` / `read_bps_device`, one
  "MAJ:MIN LIMIT" line each; 0 means no limit. The memory and blkio hierarchies are separate,
  so a process joins both groups (`MemoryGroup.popen(argv, also=io.path)`).
- v2 (a cgroup2 mount with the io controller): `io.max`, "MAJ:MIN riops=N rbps=N" ("max": no
  limit). A process is in one v2 group, so with a v2 memory group pass `within=` its
  directory and the settings go there.

The limit names the whole disk (a partition's MAJ:MIN is refused by the kernel). A group is
created with no limit and `set()` changes it while its processes run (benchmarks throttle once
the model has loaded); on exit, error, Ctrl-C or SIGTERM the limits are cleared and the group
removed. `served()` reads what the kernel metered for the group on that disk.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mbolt.core.errors import MboltError, warn

MB = 1000 * 1000  # drive makers and cloud providers quote decimal megabytes
SYS_DEV_BLOCK = Path("/sys/dev/block")
V1_DEFAULT = Path("/sys/fs/cgroup/blkio")


@dataclass(frozen=True)
class Limits:
    """Read limits of one group on one disk; None is no limit."""

    iops: int | None = None
    bps: int | None = None


# The drive classes a benchmark can emulate (DESIGN.md, "Drives"). Only the binding limits are
# set: a SATA SSD's ~90k IOPS never bind before its 550 MB/s on expert-sized reads.
PROFILES: dict[str, Limits] = {
    "cloud": Limits(iops=3000, bps=125 * MB),  # a cloud block volume's baseline
    "sata": Limits(bps=550 * MB),  # a SATA SSD's bandwidth
    "none": Limits(),  # this disk as it is
}


def profile(name: str) -> Limits:
    try:
        return PROFILES[name]
    except KeyError:
        raise MboltError(f"drive profile {name!r} is unknown (one of: {', '.join(PROFILES)})") from None


@dataclass(frozen=True)
class Served:
    """Reads the kernel served to a group from one disk since the group was made."""

    bytes: int = 0
    ios: int = 0


# ---- where ----


def disk_of(dev: int) -> str:
    """"MAJ:MIN" of the whole disk holding device number `dev` (a partition's parent)."""
    base = SYS_DEV_BLOCK / f"{os.major(dev)}:{os.minor(dev)}"
    if not base.exists():
        raise MboltError(f"device {os.major(dev)}:{os.minor(dev)} is not a block device: its reads cannot be throttled")
    base = base.resolve()
    if (base / "partition").exists():
        base = base.parent  # the throttle is per disk: the kernel refuses a partition
    try:
        return (base / "dev").read_text().strip()
    except OSError as e:
        raise MboltError(f"{base / 'dev'}: cannot read the disk's device number: {e.strerror}") from None


def whole_disk(path: str | os.PathLike) -> str:
    """"MAJ:MIN" of the whole disk holding `path`."""
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        raise MboltError(f"{path}: {e.strerror}") from None
    try:
        return disk_of(dev)
    except MboltError as e:
        raise MboltError(f"{path}: {e}") from None


def _mounts() -> list[list[str]]:
    try:
        return [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return []


def io_hierarchy() -> tuple[str, Path]:
    """("v1", blkio root) or ("v2", cgroup2 root with the io controller), or one error saying why
    neither can be used. A controller lives on one hierarchy, so at most one of them has it."""
    roots = []
    for parts in _mounts():
        if len(parts) >= 4 and parts[2] == "cgroup" and "blkio" in parts[3].split(","):
            roots.append(("v1", Path(parts[1])))
        elif len(parts) >= 3 and parts[2] == "cgroup2":
            try:
                if "io" in (Path(parts[1]) / "cgroup.controllers").read_text().split():
                    roots.append(("v2", Path(parts[1])))
            except OSError:
                continue
    if not roots and (V1_DEFAULT / "blkio.throttle.read_bps_device").exists():
        roots.append(("v1", V1_DEFAULT))
    for kind, root in roots:
        if os.access(root, os.W_OK):
            return kind, root
    if roots:
        raise MboltError(f"{roots[0][1]}: block-I/O cgroups need root (or a writable hierarchy) to create a group")
    raise MboltError("no block-I/O cgroup hierarchy is mounted (neither v1 blkio nor a cgroup2 mount with the io "
                     "controller): reads cannot be throttled here")


# ---- the kernel's files ----


def _v2_fields(text: str, device: str) -> dict[str, str]:
    """The key=value fields of `device`'s line of io.max or io.stat ({} when it has none)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == device:
            return dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    return {}


def parse_io_max(text: str, device: str) -> Limits:
    f = _v2_fields(text, device)
    num = lambda v: int(v) if v and v.isdigit() else None  # noqa: E731 ("max" or absent: no limit)
    return Limits(num(f.get("riops")), num(f.get("rbps")))


def parse_io_stat(text: str, device: str) -> Served:
    f = _v2_fields(text, device)
    return Served(int(f.get("rbytes", 0)), int(f.get("rios", 0)))


def parse_v1_limit(text: str, device: str) -> int | None:
    """A "MAJ:MIN LIMIT" file: the device's limit, None when it has no line (no limit)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == device:
            return int(parts[1])
    return None


def parse_v1_reads(text: str, device: str) -> int:
    """A v1 rwstat file ("MAJ:MIN Read N" lines and a Total): the device's reads."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == device and parts[1] == "Read":
            return int(parts[2])
    return 0


def _check(name: str, v: int | None) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer() or v <= 0:
        raise MboltError(f"read {name} limit must be a positive integer or none, got {v!r}")
    return int(v)


# ---- one group ----


@dataclass
class IoGroup:
    """A block-I/O cgroup throttling reads from the disk that holds `target`.

    A context manager: made on entry with `limits` (default none), changed with `set` while its
    processes run, cleared and removed on exit, error, Ctrl-C or SIGTERM. Start processes in it
    with `MemoryGroup.popen(argv, also=group.path)` or by writing a pid to `procs`. `within`: a
    v2 memory group's directory, used instead of a new group on a v2 hierarchy (a process is in
    one v2 group); ignored on v1."""

    target: str | os.PathLike
    limits: Limits = field(default_factory=Limits)
    within: Path | None = None
    name: str = ""
    kind: str = ""
    path: Path | None = None
    device: str = ""
    owned: bool = True  # False: the directory is `within`'s, only the settings are ours
    _term: list = field(default_factory=list, init=False, repr=False)  # the SIGTERM handler ours replaced

    def __enter__(self) -> "IoGroup":
        self.device = whole_disk(self.target)
        self.kind, root = io_hierarchy()
        self._catch_sigterm()
        try:
            self._make(root)
            self.set(self.limits.iops, self.limits.bps)
        except BaseException:
            self._remove()
            self._release_sigterm()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._remove()
        finally:
            self._release_sigterm()

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def set(self, iops: int | None = None, bps: int | None = None) -> Limits:
        """Cap the group's reads from the disk (None: no cap); returns what the kernel holds."""
        want = Limits(_check("iops", iops), _check("bytes/s", bps))
        if self.kind == "v1":
            # Writing 0 (no limit) still turns the kernel's throttling on for the disk, and only
            # then does it meter the group's I/O: so the group counts from its first read.
            self._write("blkio.throttle.read_iops_device", f"{self.device} {want.iops or 0}")
            self._write("blkio.throttle.read_bps_device", f"{self.device} {want.bps or 0}")
        else:
            self._write("io.max", f"{self.device} riops={want.iops or 'max'} rbps={want.bps or 'max'}")
        self.limits = self.held()
        if self.limits != want:
            raise MboltError(f"{self.path}: the kernel holds {self.limits} for {self.device}, not {want}")
        return self.limits

    def set_profile(self, name: str) -> Limits:
        p = profile(name)
        return self.set(p.iops, p.bps)

    def held(self) -> Limits:
        """The read limits the kernel holds for the group on the disk."""
        if self.kind == "v1":
            return Limits(parse_v1_limit(self._read("blkio.throttle.read_iops_device"), self.device),
                          parse_v1_limit(self._read("blkio.throttle.read_bps_device"), self.device))
        return parse_io_max(self._read("io.max"), self.device)

    def served(self) -> Served:
        """Reads served to the group's processes from the disk (throttled or not)."""
        if self.kind == "v1":
            return Served(parse_v1_reads(self._read("blkio.throttle.io_service_bytes"), self.device),
                          parse_v1_reads(self._read("blkio.throttle.io_serviced"), self.device))
        return parse_io_stat(self._read("io.stat"), self.device)

    # ---- making and removing ----

    def _make(self, root: Path) -> None:
        within = Path(self.within) if self.within is not None else None
        if self.kind == "v2" and within is not None and root in within.parents:
            self.path, self.owned = within, False
        else:
            self.name = self.name or f"mbolt-io-{os.getpid()}-{time.monotonic_ns() % 10**9}"
            self.path = root / self.name
        if self.kind == "v2":
            try:
                (self.path.parent / "cgroup.subtree_control").write_text("+io")
            except OSError:
                pass  # already enabled, or refused: io.max missing below says so
        if self.owned:
            try:
                self.path.mkdir()
            except OSError as e:
                self.path = None
                raise MboltError(f"{root}: cannot create a block-I/O cgroup: {e.strerror}") from None

    def _write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError as e:
            raise MboltError(f"{self.path / name}: cannot write {value!r}: {e.strerror}") from None

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError as e:
            raise MboltError(f"{self.path / name}: {e.strerror}") from None

    def _remove(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            self.set()  # the limits go first: a group that cannot be removed then caps nothing
        except MboltError:
            pass
        if not self.owned:
            return
        for attempt in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt == 5:
                    self._move_out()  # still running: leave them unthrottled in the parent
                time.sleep(0.05)  # a process that just exited may still be leaving the group
        warn(f"{self.path}: block-I/O cgroup could not be removed (its limits were cleared)")

    def _move_out(self) -> None:
        try:
            pids = self.procs.read_text().split()
        except OSError:
            return
        for pid in pids:
            try:
                (self.path.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it ended meanwhile

    def _catch_sigterm(self) -> None:
        # SIGTERM becomes SystemExit, so the with-block unwinds and __exit__ clears the throttle;
        # only the main thread may set a handler.
        if threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):
                raise SystemExit(128 + signum)

            prev = signal.signal(signal.SIGTERM, on_term)
            self._term.append(signal.SIG_DFL if prev is None else prev)  # None: set outside Python

    def _release_sigterm(self) -> None:
        if self._term:
            signal.signal(signal.SIGTERM, self._term.pop())


def own_group() -> Path | None:
    """This process's block-I/O cgroup directory (v1 blkio, or its v2 group), None when unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        kind, root = io_hierarchy()
    except (OSError, MboltError):
        return None
    for line in lines:
        _, ctrls, rel = line.split(":", 2)
        if (kind == "v1" and "blkio" in ctrls.split(",")) or (kind == "v2" and ctrls == ""):
            d = root / rel.lstrip("/")
            return d if d != root else None
    return None


def own_io_group(target: str | os.PathLike) -> IoGroup:
    """This process's block-I/O group (made by a parent's IoGroup, which clears and removes it) on
    the disk holding `target`: to throttle once the model has loaded, and to read what it served."""
    d = own_group()
    if d is None:
        raise MboltError("this process is in no block-I/O cgroup of its own: start it with MemoryGroup.popen(also=)")
    g = IoGroup(target)
    g.device = whole_disk(target)
    g.kind, _ = io_hierarchy()
    g.path, g.owned = d, False
    return g
