"""The benchmark scripts' pre-registration gate (bench.prereg): committed, locked, a clean tree,
goals read from the file, a re-run only as an addendum, earlier runs kept. On a git repository
written in a temporary directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mbolt.bench.prereg import (check_rerun, finish_record, gate_run, keep_earlier, load_bench_prereg, lock_bench,
                                lock_path, open_bench_prereg, run_record, write_result)
from mbolt.core.errors import MboltError

PREREG = """script = "scripts/bench_x.py --rounds 3"
rounds = 3

[goals]
decode_over_best_plain_min = 1.5
ttft_over_warm_max = 1.15

[predictions]
decode_over_best_plain = 2.0
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "prereg").mkdir(parents=True)
    (r / "results").mkdir()
    (r / "code.py").write_text("x = 1\n")
    (r / "prereg" / "x.toml").write_text(PREREG)
    git(r, "init", "-q")
    git(r, "config", "user.email", "t@example.invalid")
    git(r, "config", "user.name", "t")
    return r


def commit(repo: Path, msg: str = "c") -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)


def test_uncommitted_prereg_is_refused(repo):
    git(repo, "add", "code.py")
    git(repo, "commit", "-q", "-m", "code only")
    with pytest.raises(MboltError, match="x.toml: not committed"):
        open_bench_prereg(repo / "prereg" / "x.toml", repo)


def test_committed_but_unlocked_is_refused(repo):
    commit(repo)
    with pytest.raises(MboltError, match="not locked: run `python -m mbolt.bench.prereg lock"):
        open_bench_prereg(repo / "prereg" / "x.toml", repo)


def test_lock_not_committed_is_refused(repo):
    commit(repo)
    lock_bench(repo / "prereg" / "x.toml")
    with pytest.raises(MboltError, match=r"x.toml.lock: not committed"):
        open_bench_prereg(repo / "prereg" / "x.toml", repo)


def test_committed_locked_clean_passes_and_counts_the_run(repo):
    lock = lock_bench(repo / "prereg" / "x.toml")
    assert lock["runs"] == 0
    commit(repo)
    (repo / "results" / "old.json").write_text("{}")  # what a benchmark writes does not make the tree dirty
    pr, lock = open_bench_prereg(repo / "prereg" / "x.toml", repo)
    assert lock["runs"] == 1
    assert pr.goal("decode_over_best_plain_min") == 1.5 and pr.predictions == {"decode_over_best_plain": 2.0}
    _, lock = open_bench_prereg(repo / "prereg" / "x.toml", repo)  # the lock's run count changed: prereg/ excepted
    assert lock["runs"] == 2


def test_edited_after_commit_is_refused(repo):
    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    (repo / "prereg" / "x.toml").write_text(PREREG.replace("1.5", "1.2"))
    with pytest.raises(MboltError, match="changed since it was committed"):
        open_bench_prereg(repo / "prereg" / "x.toml", repo)


def test_edited_and_committed_again_is_refused_by_the_lock(repo):
    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    (repo / "prereg" / "x.toml").write_text(PREREG.replace("1.5", "1.2"))
    commit(repo, "moved the goal")
    with pytest.raises(MboltError, match="edited after its first run"):
        open_bench_prereg(repo / "prereg" / "x.toml", repo)


@pytest.mark.parametrize("change", ["modified", "untracked"])
def test_dirty_tree_outside_results_and_prereg_is_refused(repo, change):
    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    if change == "modified":
        (repo / "code.py").write_text("x = 2\n")
    else:
        (repo / "new.py").write_text("")
    with pytest.raises(MboltError, match=r"uncommitted changes outside results/ and prereg/ \((code|new)\.py\)"):
        open_bench_prereg(repo / "prereg" / "x.toml", repo)


def test_goals_come_from_the_file(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(PREREG)
    pr = load_bench_prereg(p)
    with pytest.raises(MboltError, match=r"\[goals\] has no user_over_root_min"):
        pr.goal("user_over_root_min")
    with pytest.raises(MboltError, match=r"\[goals\] lacks user_over_root_min, q72_x"):
        pr.require_goals(["ttft_over_warm_max", "user_over_root_min", "q72_x"])
    p.write_text(PREREG.split("[goals]")[0] + "[predictions]\na = 1\n")
    with pytest.raises(MboltError, match=r"no \[goals\] table"):
        load_bench_prereg(p)


def test_addendum_must_name_the_miss(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(PREREG + '\n[addendum]\nto = "prereg/memlimit_session.toml"\n')
    with pytest.raises(MboltError, match=r"\[addendum\] needs `to`.*and `miss`"):
        load_bench_prereg(p)
    p.write_text(PREREG + '\n[addendum]\nto = "prereg/memlimit_session.toml"\n'
                 'miss = "results/session_q72.json: decode >= 1.5x the better plain: 1.31"\n')
    assert load_bench_prereg(p).addendum["miss"].endswith("1.31")


def test_a_rerun_under_the_same_prereg_is_refused_and_earlier_runs_stay(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(PREREG)
    pr = load_bench_prereg(p)
    res = tmp_path / "session_q72.json"
    check_rerun(pr, res)  # nothing measured yet
    first = {"prereg": {"sha256": "0" * 64}, "git": "abc", "goals": [{"goal": "g", "value": 1.3, "met": False}]}
    res.write_text(json.dumps(first))
    check_rerun(pr, res)  # measured under another pre-registration: this one may run
    second = keep_earlier(pr, res, {"prereg": pr.to_dict(), "goals": []})
    assert not res.exists()  # moved aside, the new result is written by the caller
    assert json.loads((tmp_path / "session_q72.run1.json").read_text()) == first
    assert second["earlier_runs"] == [{"file": "session_q72.run1.json", "prereg": {"sha256": "0" * 64},
                                       "git": "abc", "goals": first["goals"]}]
    res.write_text(json.dumps(second))
    with pytest.raises(MboltError, match=r"measured under .*x.toml already: a re-run is a new pre-registration"):
        check_rerun(pr, res)
    third = keep_earlier(pr, res, {"goals": []})
    assert [e["file"] for e in third["earlier_runs"]] == ["session_q72.run1.json", "session_q72.run2.json"]


def test_run_record_names_revision_machine_and_load(repo):
    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    pr, lock = open_bench_prereg(repo / "prereg" / "x.toml", repo)
    rec = finish_record(run_record(pr, lock, repo, repo / "code.py"))
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert rec["git"] == head
    assert rec["prereg"]["sha256"] == pr.sha256 and rec["prereg"]["run"] == 1
    m = rec["machine"]
    assert m["cores"] >= 1 and m["memory_bytes"] > 0 and m["kernel"] and m["cpu"]
    assert "read_ahead_kb" in m and m["device"]
    assert len(rec["loadavg_before"]) == 3 and len(rec["loadavg_after"]) == 3


def test_write_result_finishes_the_record_and_keeps_the_run_it_replaces(repo):
    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    pr, lock = open_bench_prereg(repo / "prereg" / "x.toml", repo)
    res = repo / "results" / "x.json"
    res.write_text(json.dumps({"prereg": {"sha256": "0" * 64}, "goals": []}))  # an earlier run's
    written = write_result(pr, run_record(pr, lock, repo, repo / "code.py"), res, {"goals": [], "v": 1.5})
    on_disk = json.loads(res.read_text())
    assert on_disk == json.loads(json.dumps(written)) and on_disk["v"] == 1.5  # tuples come back as lists and on_disk["git"] and on_disk["finished"]
    assert len(on_disk["loadavg_after"]) == 3
    assert [e["file"] for e in on_disk["earlier_runs"]] == ["x.run1.json"]
    assert json.loads((repo / "results" / "x.run1.json").read_text())["prereg"] == {"sha256": "0" * 64}
    with pytest.raises(MboltError, match="measured under .* already"):
        check_rerun(pr, res)


def test_lock_command(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(PREREG)
    r = subprocess.run([sys.executable, "-m", "mbolt.bench.prereg", "lock", str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(lock_path(p).read_text())["runs"] == 0
    r = subprocess.run([sys.executable, "-m", "mbolt.bench.prereg", "lock", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "already locked" in r.stderr


def test_gate_run_refuses_a_missing_goal_and_a_rerun(repo):
    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    res = repo / "results" / "x.json"
    with pytest.raises(MboltError, match=r"\[goals\] lacks q72_x"):
        gate_run(repo / "prereg" / "x.toml", repo, ["ttft_over_warm_max", "q72_x"], res)
    pr, lock = gate_run(repo / "prereg" / "x.toml", repo, ["ttft_over_warm_max"], res)
    assert lock["runs"] == 1  # the refused start above was not counted
    res.write_text(json.dumps({"prereg": pr.to_dict()}))
    with pytest.raises(MboltError, match="measured under .* already"):
        gate_run(repo / "prereg" / "x.toml", repo, ["ttft_over_warm_max"], res)
    with pytest.raises(MboltError, match="measured under .* already"):  # one result per model: any of them
        gate_run(repo / "prereg" / "x.toml", repo, ["ttft_over_warm_max"], [repo / "results" / "y.json", res])
    assert json.loads(lock_path(repo / "prereg" / "x.toml").read_text())["runs"] == 1
    # the result replaced by a later run's: its pre-registration is still spent (kept as x.run1.json)
    res.write_text(json.dumps({"prereg": {"sha256": "another"},
                               "earlier_runs": [{"file": "x.run1.json", "prereg": pr.to_dict()}]}))
    with pytest.raises(MboltError, match=r"x\.run1\.json was measured under .* already"):
        gate_run(repo / "prereg" / "x.toml", repo, ["ttft_over_warm_max"], res)


def test_begin_run_parses_gates_and_records(repo):
    """The start the single-result scripts share (bench_hotpath, bench_repack): --prereg required,
    --out defaulted or given, the gate, the run counted and its record begun."""
    from mbolt.bench.prereg import begin_run

    lock_bench(repo / "prereg" / "x.toml")
    commit(repo)
    default = repo / "results" / "x.json"
    with pytest.raises(SystemExit) as e:  # argparse: --prereg is required
        begin_run("doc", repo, default, ["ttft_over_warm_max"], repo / "code.py", argv=[])
    assert e.value.code == 2
    with pytest.raises(MboltError, match=r"\[goals\] lacks q72_x"):
        begin_run("doc", repo, default, ["q72_x"], repo / "code.py", argv=["--prereg", str(repo / "prereg" / "x.toml")])
    out, pr, rec = begin_run("doc", repo, default, ["ttft_over_warm_max"], repo / "code.py",
                             argv=["--prereg", str(repo / "prereg" / "x.toml")])
    assert out == default and pr.goal("ttft_over_warm_max") == 1.15
    assert rec["prereg"]["run"] == 1 and json.loads(lock_path(repo / "prereg" / "x.toml").read_text())["runs"] == 1
    other = repo / "results" / "other.json"
    out, _, rec = begin_run("doc", repo, default, ["ttft_over_warm_max"], repo / "code.py",
                            argv=["--prereg", str(repo / "prereg" / "x.toml"), "--out", str(other)])
    assert out == other and rec["prereg"]["run"] == 2
