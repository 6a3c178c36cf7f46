"""Drive profiles (core.blkio): a block-I/O cgroup throttling a group's reads from one disk.

The group tests need root and a blkio hierarchy (v1 blkio or v2 io): CI runs as root on a machine
that has one, so they run there; elsewhere they skip (said why). What they check comes from the
kernel's own files: the throttle files read back, the group's served counters, /proc/<pid>/cgroup.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mbolt.core import blkio
from mbolt.core.blkio import (
    MB, PROFILES, IoGroup, Limits, Served, disk_of, parse_io_max, parse_io_stat, parse_v1_limit,
    parse_v1_reads, profile, whole_disk,
)
from mbolt.core.errors import MboltError


def _can_blkio() -> str | None:
    try:
        blkio.io_hierarchy()
        whole_disk(tempfile.gettempdir())
    except MboltError as e:
        return str(e)
    return None


needs_blkio = pytest.mark.skipif(_can_blkio() is not None and os.environ.get("CI") != "true",
                                 reason=f"no usable block-I/O cgroup here: {_can_blkio()}")


def _can_memory() -> bool:
    from mbolt.core import memlimit

    try:
        memlimit.hierarchy()
    except MboltError:
        return False
    return True


# ---- plain data, anywhere ----


def test_profiles_table():
    assert PROFILES["cloud"] == Limits(iops=3000, bps=125_000_000)
    assert PROFILES["sata"] == Limits(iops=None, bps=550_000_000)
    assert PROFILES["none"] == Limits()
    assert profile("sata").bps == 550 * MB


def test_unknown_profile_is_one_error():
    with pytest.raises(MboltError, match="'nvme' is unknown.*cloud, sata, none"):
        profile("nvme")


def test_partition_resolves_to_its_disk(tmp_path, monkeypatch):
    """A sysfs tree as the kernel lays it out: /sys/dev/block/MAJ:MIN links to the device; a
    partition is a child directory of its disk with a `partition` file."""
    disk = tmp_path / "devices" / "vdb"
    part = disk / "vdb1"
    part.mkdir(parents=True)
    (disk / "dev").write_text("252:16\n")
    (part / "dev").write_text("252:17\n")
    (part / "partition").write_text("1\n")
    links = tmp_path / "dev-block"
    links.mkdir()
    (links / "252:16").symlink_to(disk)
    (links / "252:17").symlink_to(part)
    monkeypatch.setattr(blkio, "SYS_DEV_BLOCK", links)
    assert disk_of(os.makedev(252, 17)) == "252:16"
    assert disk_of(os.makedev(252, 16)) == "252:16"
    with pytest.raises(MboltError, match="252:99 is not a block device"):
        disk_of(os.makedev(252, 99))


def test_not_on_a_block_device():
    with pytest.raises(MboltError, match="/proc/self/status: device 0:.* not a block device"):
        whole_disk("/proc/self/status")


def test_whole_disk_is_not_a_partition(tmp_path):
    try:
        dev = whole_disk(tmp_path)
    except MboltError as e:
        pytest.skip(str(e))
    base = Path(f"/sys/dev/block/{dev}").resolve()
    assert not (base / "partition").exists()
    st = os.stat(tmp_path).st_dev
    mine = Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}").resolve()
    assert mine == base or mine.parent == base  # the disk itself, or the disk of its partition


def test_parse_kernel_files():
    """The formats as the kernel prints them (v1 rwstat and conf files; v2 io.max and io.stat)."""
    v1 = "254:0 Read 4194304\n254:0 Write 8192\n254:0 Total 4202496\n8:0 Read 7\nTotal 4202503\n"
    assert parse_v1_reads(v1, "254:0") == 4194304 and parse_v1_reads(v1, "8:0") == 7
    assert parse_v1_reads("Total 0\n", "254:0") == 0
    assert parse_v1_limit("254:0 3000\n8:0 5\n", "254:0") == 3000 and parse_v1_limit("", "254:0") is None
    io_max = "8:0 rbps=max wbps=max riops=9 wiops=max\n254:0 rbps=125000000 wbps=max riops=3000 wiops=max\n"
    assert parse_io_max(io_max, "254:0") == Limits(3000, 125_000_000)
    assert parse_io_max("254:0 rbps=550000000 wbps=max riops=max wiops=max\n", "254:0") == Limits(None, 550 * MB)
    assert parse_io_max("", "254:0") == Limits()
    stat = "254:0 rbytes=4194304 wbytes=0 rios=4 wios=0 dbytes=0 dios=0\n"
    assert parse_io_stat(stat, "254:0") == Served(4194304, 4) and parse_io_stat(stat, "8:0") == Served()


# ---- a real group ----


def _file(tmp_path, mib=4) -> Path:
    f = tmp_path / "data.bin"
    with open(f, "wb") as out:
        out.write(os.urandom(mib << 20))
        out.flush()
        os.fsync(out.fileno())  # on the disk: O_DIRECT reads below come from the device
    return f


# A child that waits for a line on stdin, then reads the file with O_DIRECT in 1 MiB reads.
DIRECT_READER = ("import mmap, os, sys\n"
                 "print('ready', flush=True)\n"
                 "sys.stdin.readline()\n"
                 "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n"
                 "buf = mmap.mmap(-1, 1 << 20)\n"
                 "n = 0\n"
                 "while True:\n"
                 "    r = os.preadv(fd, [buf], n)\n"
                 "    if r <= 0: break\n"
                 "    n += r\n"
                 "print(n, flush=True)\n")


def _direct_read(path: Path) -> int:
    import mmap

    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf, n = mmap.mmap(-1, 1 << 20), 0
    try:
        while (r := os.preadv(fd, [buf], n)) > 0:
            n += r
    finally:
        os.close(fd)
    return n


@needs_blkio
def test_throttle_read_back_as_the_kernel_holds_it(tmp_path):
    with IoGroup(tmp_path, PROFILES["cloud"]) as g:
        where, dev = g.path, g.device
        assert g.held() == Limits(3000, 125_000_000)
        if g.kind == "v1":
            assert f"{dev} 3000" in (where / "blkio.throttle.read_iops_device").read_text().splitlines()
            assert f"{dev} 125000000" in (where / "blkio.throttle.read_bps_device").read_text().splitlines()
        else:
            assert "riops=3000" in (where / "io.max").read_text()
        assert g.set_profile("sata") == Limits(None, 550_000_000)
        if g.kind == "v1":  # the kernel keeps no line for "no limit"
            assert dev not in (where / "blkio.throttle.read_iops_device").read_text()
        assert g.set_profile("none") == Limits() == g.held()
        with pytest.raises(MboltError, match="positive integer"):
            g.set(iops=0)
    assert not where.exists()


@needs_blkio
def test_group_meters_its_processes_reads_of_that_disk_and_throttles_after_start(tmp_path):
    """A child started in the memory group and the I/O group (MemoryGroup.popen(also=...)) is in
    both; the throttle set after it started is what the kernel holds; its O_DIRECT reads show in
    the group's served counters for that disk, and this process's own reads do not."""
    from mbolt.core.memlimit import MemoryGroup

    if not _can_memory() and os.environ.get("CI") != "true":
        pytest.skip("no usable memory cgroup here")
    f = _file(tmp_path)
    size = f.stat().st_size
    with MemoryGroup(256 << 20) as mem, IoGroup(f) as io:
        p = mem.popen([sys.executable, "-c", DIRECT_READER, str(f)], also=io.path, stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            groups = Path(f"/proc/{p.pid}/cgroup").read_text()
            if io.kind == "v1":
                assert f"blkio:/{io.name}\n" in groups and f"memory:/{mem.name}\n" in groups
            assert io.set(iops=3000, bps=125 * MB) == Limits(3000, 125 * MB) == io.held()
            before = io.served()
            assert _direct_read(f) == size  # outside the group: not its reads
            assert io.served() == before
            out, err = p.communicate("go\n", timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, err
        assert int(out) == size
        after = io.served()
        assert after.bytes - before.bytes >= size
        assert after.ios - before.ios >= size // (1 << 20)  # one 1 MiB read is at least one request


@needs_blkio
def test_group_removed_and_throttle_gone_after_an_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with IoGroup(tmp_path) as g:
            where = g.path
            g.set(iops=100)
            raise RuntimeError("boom")
    assert not where.exists()


@needs_blkio
def test_group_removed_with_a_process_still_inside(tmp_path):
    """A child still running at exit is moved to the parent group (unthrottled) and the group goes."""
    with IoGroup(tmp_path, Limits(iops=100)) as g:
        where, name = g.path, g.name
        p = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec sleep 60', str(g.procs)])
        try:
            for _ in range(100):
                if str(p.pid) in g.procs.read_text().split():
                    break
                time.sleep(0.01)
            assert str(p.pid) in g.procs.read_text().split()
        except BaseException:
            p.kill()
            raise
    try:
        assert not where.exists()
        groups = Path(f"/proc/{p.pid}/cgroup").read_text()
        assert name not in groups
    finally:
        p.kill()
        p.wait()


@needs_blkio
def test_group_removed_on_sigterm(tmp_path):
    code = ("import os, signal, sys, time; from mbolt.core.blkio import IoGroup, PROFILES\n"
            "with IoGroup(sys.argv[1], PROFILES['cloud']) as g:\n"
            "    print(g.path, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + 15, p.stderr
    where = Path(p.stdout.strip())
    assert where.name.startswith("mbolt-io-") and not where.exists()
