"""A real memory limit (core.memlimit): memory cgroups, the budget, the readahead setting.

The cgroup tests need root and a memory hierarchy: CI runs as root on a machine that has one, so
they run there; elsewhere they skip (said why). What they check comes from the kernel's own
counters: the group's peak charge, /proc/<pid>/cgroup, the device's read_ahead_kb.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mbolt.core.errors import MboltError
from mbolt.core import memlimit
from mbolt.core.memlimit import MemoryGroup, budget, parse_size, readahead, readahead_file, readahead_kb


def _can_group() -> str | None:
    try:
        memlimit.hierarchy()
    except MboltError as e:
        return str(e)
    return None


needs_cgroup = pytest.mark.skipif(_can_group() is not None and os.environ.get("CI") != "true",
                                  reason=f"no usable memory cgroup here: {_can_group()}")


@pytest.mark.parametrize("text, n", [("4G", 4 << 30), ("500M", 500 << 20), ("1.5GiB", 3 << 29), ("4096", 4096),
                                     ("64k", 64 << 10), ("2gb", 2 << 30)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["lots", "-1G", "0", "G"])
def test_parse_size_refuses(text):
    with pytest.raises(MboltError, match="--ram"):
        parse_size(text)


def test_budget_prefers_ram_then_group_then_available(monkeypatch):
    assert budget("3G") == (3 << 30, "--ram")
    monkeypatch.setattr(memlimit, "own_limit", lambda: 123 << 20)
    assert budget(None) == (123 << 20, "cgroup limit")
    monkeypatch.setattr(memlimit, "own_limit", lambda: None)
    n, how = budget(None)
    assert how == "available memory"
    meminfo = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/meminfo")}
    assert abs(n - meminfo["MemAvailable"]) < 512 << 20  # the same counter, read a moment apart


def test_no_hierarchy_is_one_error(monkeypatch, tmp_path):
    monkeypatch.setattr(memlimit, "V1_ROOT", tmp_path / "absent")
    monkeypatch.setattr(memlimit, "_v2_root", lambda: None)
    with pytest.raises(MboltError, match="no memory cgroup hierarchy"):
        memlimit.hierarchy()


@needs_cgroup
def test_group_limits_page_cache_and_is_removed(tmp_path):
    """A process that reads a file three times the limit stays under the limit (its page cache
    is charged to the group and reclaimed), sees the limit as its budget, and the group is gone
    afterwards."""
    limit = 64 << 20
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(192):
            f.write(os.urandom(1 << 20))
    code = ("import sys; from mbolt.core.memlimit import budget\n"
            "f = open(sys.argv[1], 'rb')\n"
            "while f.read(1 << 20): pass\n"
            "print(budget(None)[0], budget(None)[1])\n")
    with MemoryGroup(limit) as g:
        where = g.path
        p = g.popen([sys.executable, "-c", code, str(big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        peak = g.peak()
        assert g.oom_kills() == 0
    n, how = out.split(maxsplit=1)
    assert int(n) == limit and how.strip() == "cgroup limit"
    assert peak is not None and 8 << 20 < peak <= limit  # it filled its cache, and no further
    assert not where.exists()


@needs_cgroup
def test_group_oom_kill_is_counted():
    limit = 48 << 20
    code = "x = bytearray(200 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\n"
    with MemoryGroup(limit) as g:
        p = g.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.communicate(timeout=120)
        assert p.returncode != 0
        assert g.oom_kills() >= 1


def _root_readahead(tmp_path):
    f = readahead_file(tmp_path)
    if f is None or not os.access(f, os.W_OK):
        pytest.skip(f"{tmp_path}: no writable read_ahead_kb here (not a block device, or not root)")
    return f


def test_readahead_set_and_restored_even_on_error(tmp_path):
    _root_readahead(tmp_path)
    before = readahead_kb(tmp_path)
    want = 128 if before != 128 else 256
    with readahead(tmp_path, want) as kb:
        assert kb == want and readahead_kb(tmp_path) == want
    assert readahead_kb(tmp_path) == before
    with pytest.raises(RuntimeError):
        with readahead(tmp_path, want):
            raise RuntimeError("boom")
    assert readahead_kb(tmp_path) == before


def test_readahead_restored_on_sigterm(tmp_path):
    _root_readahead(tmp_path)
    before = readahead_kb(tmp_path)
    want = 128 if before != 128 else 256
    code = ("import os, signal, sys, time; from mbolt.core.memlimit import readahead\n"
            f"with readahead(sys.argv[1], {want}):\n"
            "    print('set', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "set" in p.stdout and p.returncode == 128 + 15
    assert readahead_kb(tmp_path) == before


def test_readahead_none_leaves_it(tmp_path):
    before = readahead_kb(tmp_path)
    with readahead(tmp_path, None) as kb:
        assert kb == before


def test_willneed_reads_a_long_range_only_in_pieces(tmp_path):
    """The kernel cuts one WILLNEED to max(readahead, largest request) and drops the rest without a
    word; advised in pieces of `willneed_bytes`, the whole range comes in (mincore)."""
    import time

    from mbolt.core.pagecache import evict, resident_share, willneed, willneed_bytes

    cap = willneed_bytes(tmp_path)
    assert cap >= 128 << 10
    f = tmp_path / "long.bin"
    n = 3 * cap + (1 << 20)
    with open(f, "wb") as out:
        for _ in range(n >> 20):
            out.write(os.urandom(1 << 20))
        out.write(os.urandom(n % (1 << 20)))

    def resident_after_reads():
        for _ in range(300):  # the reads were started, not finished: wait for them (3 s at most)
            share = resident_share(f)
            if share == 1.0:
                break
            time.sleep(0.01)
        return share

    assert evict(f).proven
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)  # one call: the kernel stops at the cap
        one_call = resident_after_reads()
        assert evict(f).proven
        willneed(fd, 0, n, cap)
        pieces = resident_after_reads()
    finally:
        os.close(fd)
    assert one_call < 0.6 and pieces == 1.0


def _bench_memlimit():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_memlimit.py"
    spec = importlib.util.spec_from_file_location("bench_memlimit_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _round(arm, k, tokens, wall, ttft=1.0, rejected=False):
    return {"arm": arm, "round": k, "tokens": tokens, "wall_s": wall, "ttft_s": ttft, "rejected": rejected}


def test_session_ratio_is_the_median_of_same_round_ratios():
    """Per round mbolt / plain of the same round, then the median: rounds 0-2 decode mbolt at
    10, 4, 9 tok/s and plain at 5, 1, 6 -> ratios 2.0, 4.0, 1.5, median 2.0. The ratio of the
    medians would be 9 / 5 = 1.8: not what the pre-registration defines. A rejected round pairs
    with nothing. TTFT pairs the same way: 3/6, 2/2, 4/2 -> median 1.0."""
    from mbolt.bench.paired import pair_stats, ttft_of

    d = {"rounds": [_round("mbolt", 0, 100, 10.0, 3.0), _round("plain-512", 0, 100, 20.0, 6.0),
                    _round("mbolt", 1, 100, 25.0, 2.0), _round("plain-512", 1, 100, 100.0, 2.0),
                    _round("mbolt", 2, 90, 10.0, 4.0), _round("plain-512", 2, 60, 10.0, 2.0),
                    _round("mbolt", 3, 100, 1.0), _round("plain-512", 3, 100, 1.0, rejected=True)]}
    st = pair_stats(d, "mbolt", "plain-512")
    assert st["rounds"] == pytest.approx([2.0, 4.0, 1.5])
    assert st["median"] == pytest.approx(2.0)
    assert st["ci95"] is None and "3 rounds" in st["ci_note"]  # too few rounds for an interval
    assert pair_stats(d, "mbolt", "plain-512", key=ttft_of)["median"] == pytest.approx(1.0)


def test_plain_sweep_brackets_4k_to_1m_and_picks_inside():
    bm = _bench_memlimit()
    assert sorted(bm.READAHEADS) == [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    swept = {ra: {"arms": {"plain-512": {"decode_tokens_per_s": 1.0, "ttft_s": 30.0},
                           "plain-2048": {"decode_tokens_per_s": 1.0, "ttft_s": 30.0}}} for ra in bm.READAHEADS}
    swept[32]["arms"]["plain-2048"]["decode_tokens_per_s"] = 1.6  # the best decode: 32 KiB, via the 2048 arm
    swept[256]["arms"]["plain-512"]["ttft_s"] = 21.0  # the best TTFT (lowest): 256 KiB
    from mbolt.bench.paired import best_window

    assert best_window(swept) == 32
    assert best_window(swept, "ttft_s") == 256


def test_every_stage_reads_its_goals_from_the_prereg(tmp_path):
    """A pre-registration without one of a stage's goals is refused before anything is measured."""
    from mbolt.bench.prereg import load_bench_prereg

    bm = _bench_memlimit()
    p = tmp_path / "s.toml"
    p.write_text("[goals]\nttft_over_warm_max = 1.15\n[predictions]\nx = 1\n")
    pr = load_bench_prereg(p)
    with pytest.raises(MboltError, match="lacks decode_over_best_plain_min, followup_over_bound_max"):
        pr.require_goals(bm.STAGE_GOALS["session"])
    assert "q72_over_plain_tuned_min" in bm.goal_keys("decode", ["q864", "q72"])  # what the gate requires
    assert "share_of_bound_min" in bm.STAGE_GOALS["drives"]  # drives() reads it: refused before, not mid-run


@pytest.mark.skipif(os.geteuid() != 0 or not __import__("shutil").which("runuser"), reason="runuser needs root")
def test_user_arm_is_refused_in_one_line_where_uid_nobody_cannot_read_or_see_its_file():
    """The ordinary-user arm runs as uid nobody. Before it runs, the model must be readable by
    nobody and its page-cache residency visible to it (the kernel shows mincore's answer only to
    the owner or to whom may write: anyone else sees every page resident, and the arm's cold start
    could not be proven): refused in one line naming the uid and the file; accepted once the file
    is nobody's, as a user's downloaded model is theirs."""
    import pwd
    import shutil
    import tempfile
    from pathlib import Path

    from mbolt.bench.ab_llama import check_ordinary_user

    base = Path(tempfile.mkdtemp(prefix="mbolt-user-", dir="/tmp"))  # pytest's tmp_path is root's alone (0700)
    try:
        base.chmod(0o755)
        model = base / "m.gguf"
        model.write_bytes(b"GGUF")
        model.chmod(0o600)
        with pytest.raises(MboltError) as e:
            check_ordinary_user([str(model)])
        assert "uid nobody cannot read" in str(e.value) and str(model) in str(e.value) and "\n" not in str(e.value)
        model.chmod(0o644)  # readable, but root's: mincore would lie to nobody
        with pytest.raises(MboltError) as e:
            check_ordinary_user([str(model)])
        assert "neither owns nor may write" in str(e.value) and str(model) in str(e.value)
        nobody = pwd.getpwnam("nobody")
        os.chown(model, nobody.pw_uid, nobody.pw_gid)
        check_ordinary_user([str(model)])
    finally:
        shutil.rmtree(base)
