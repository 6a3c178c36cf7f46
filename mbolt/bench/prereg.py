"""Pre-registration: write the prediction and the decision rule down before measuring.

`prereg/NAME.toml`:

    name = "packed_tsp_64k_qd1"
    question = "Does packing + co-activation order cut cold I/O time at QD1, buffered?"
    mode = "replay"                      # replay | decode
    engine = "reference"                 # optional, decode: reference | llama.cpp
    trace = "${MBOLT_BENCH}/held.mbtrace"  # environment variables are expanded
    rounds = 7                           # optional: exactly this many rounds; without it the run is
                                         # adaptive: min_rounds, max_rounds, time_budget (s), precision
    seed = 0                             # optional: seed of the arm orders
    tokens_per_round = 0                 # optional: replay slices of this many tokens per round
    metric = "io_s"                      # io_s (replay) or wall_s (decode), per token
    baseline = "stock"                   # arm names
    treatment = "packed-tsp"
    predicted_speedup = 1.45             # baseline time / treatment time
    pass_threshold = 1.30                # PASS if the median of per-round speedups >= this
    [[arm]]
    name = "stock"
    file = "${MBOLT_BENCH}/stock.gguf"
    qd = 1
    direct = false

Its SHA-256 is recorded in `NAME.toml.lock` before the first run; a later run of an edited
file is refused (delete the lock only to start a new pre-registration, and say so).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mbolt.core.atomic import write_text_atomic
from mbolt.bench.ab import file_sha256
from mbolt.bench.arms import Arm
from mbolt.bench.stats import aa_row, AA_TOLERANCE
from mbolt.core.errors import MboltError


@dataclass
class Prereg:
    path: str
    sha256: str
    name: str
    question: str
    mode: str
    trace: str | None
    rounds: int | None
    metric: str
    baseline: str
    treatment: str
    predicted_speedup: float
    pass_threshold: float
    arms: list[Arm]
    raw: dict
    min_rounds: int = 12
    max_rounds: int = 400
    time_budget: float = 600.0
    precision: float = 0.05
    seed: int = 0

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "name": self.name, "question": self.question,
                "metric": self.metric, "baseline": self.baseline, "treatment": self.treatment,
                "predicted_speedup": self.predicted_speedup, "pass_threshold": self.pass_threshold,
                "rounds": self.rounds, "mode": self.mode, "min_rounds": self.min_rounds,
                "max_rounds": self.max_rounds, "time_budget": self.time_budget, "precision": self.precision,
                "seed": self.seed}


def _expand(s: str) -> str:
    out = os.path.expandvars(s)
    if "$" in out:
        raise MboltError(f"prereg: unresolved variable in {s!r} (set it in the environment)")
    return out


def _read_toml(p: Path) -> dict:
    from mbolt.core.checks import read_text

    text = read_text(p, "pre-registration")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MboltError(f"{p}: not valid TOML ({e})") from None


def _read_lock(lp: Path) -> dict:
    try:
        return json.loads(lp.read_text())
    except ValueError:
        raise MboltError(f"{lp}: damaged lock file") from None


def load_prereg(path: str | os.PathLike) -> Prereg:
    p = Path(path)
    raw = _read_toml(p)
    need = ("name", "mode", "metric", "baseline", "treatment", "predicted_speedup", "pass_threshold", "arm")
    miss = [k for k in need if k not in raw]
    if miss:
        raise MboltError(f"{p}: missing {', '.join(miss)}")
    if raw["mode"] not in ("replay", "decode"):
        raise MboltError(f"{p}: mode {raw['mode']!r} is not replay or decode")
    if not isinstance(raw["arm"], list) or not raw["arm"]:
        raise MboltError(f"{p}: arm must be a list of [[arm]] tables")
    from mbolt.core.checks import check_range

    arms = []
    for i, a in enumerate(raw["arm"]):
        if not isinstance(a, dict) or "file" not in a or "name" not in a:
            raise MboltError(f"{p}: arm {i} needs name and file")
        arms.append(Arm(name=str(a["name"]), path=_expand(str(a["file"])),
                        gap=check_range(a.get("gap", 0), f"{p}: arm {i} gap", 0, 1 << 40),
                        io_threads=check_range(a.get("qd", 1), f"{p}: arm {i} qd", 1, 1024),
                        direct=bool(a.get("direct", False)), mode="os" if a.get("os") else "read",
                        cache_slots=check_range(a.get("cache", 0), f"{p}: arm {i} cache", 0, 1 << 20),
                        warm=bool(a.get("warm", False)), callback=bool(a.get("callback", False))))
    check_range(raw.get("rounds", 5), f"{p}: rounds", 1, 10_000)
    for k in ("predicted_speedup", "pass_threshold"):
        if not isinstance(raw[k], (int, float)) or isinstance(raw[k], bool) or raw[k] != raw[k]:
            raise MboltError(f"{p}: {k} is {raw[k]!r}: write the prediction down before the first run")
    names = [a.name for a in arms]
    for k in ("baseline", "treatment"):
        if raw[k] not in names:
            raise MboltError(f"{p}: {k} {raw[k]!r} is not one of the arms ({', '.join(names)})")
    if names[0] != raw["baseline"]:  # the harness compares every arm with the first
        arms.sort(key=lambda a: a.name != raw["baseline"])
    try:
        stop = dict(min_rounds=int(raw.get("min_rounds", 12)), max_rounds=int(raw.get("max_rounds", 400)),
                    time_budget=float(raw.get("time_budget", 600.0)), precision=float(raw.get("precision", 0.05)),
                    seed=int(raw.get("seed", 0)))
        rounds = int(raw["rounds"]) if "rounds" in raw else None
    except (TypeError, ValueError) as e:
        raise MboltError(f"{p}: rounds, min_rounds, max_rounds, time_budget, precision and seed are numbers ({e})") \
            from None
    return Prereg(str(p), file_sha256(p), raw["name"], raw.get("question", ""), raw["mode"],
                  _expand(raw["trace"]) if raw.get("trace") else None, rounds, raw["metric"],
                  raw["baseline"], raw["treatment"], float(raw["predicted_speedup"]), float(raw["pass_threshold"]),
                  arms, raw, **stop)


def lock_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".lock")


def check_and_lock(pr: Prereg) -> dict:
    """Refuse an edited pre-registration; lock a new one. Returns the lock record."""
    lp = lock_path(pr.path)
    if lp.exists():
        lock = _read_lock(lp)
        if lock.get("sha256") != pr.sha256:
            raise MboltError(f"{pr.path} was edited after its first run (hash {pr.sha256[:12]} vs locked "
                             f"{str(lock.get('sha256'))[:12]} at {lock.get('locked_at')}): refusing; "
                             f"a new prediction needs a new pre-registration file")
        lock["runs"] = int(lock.get("runs", 0)) + 1
    else:
        lock = {"sha256": pr.sha256, "locked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": 1}
    write_text_atomic(lp, json.dumps(lock, indent=1) + "\n")
    return lock


def verdict(pr: Prereg, summary: list[dict], aa_tolerance: float = AA_TOLERANCE) -> dict:
    """PASS/FAIL of the treatment's median of per-round speedups against the threshold;
    INCONCLUSIVE when the run's A/A control missed 1 by more than `aa_tolerance` (DESIGN.md:
    controls or it didn't happen), the threshold comparison still reported as `by_threshold`."""
    row = next((s for s in summary if s["arm"] == pr.treatment), None)
    if row is None or row.get("speedup_vs_baseline_median") is None:
        return {"verdict": "NO RESULT", "why": f"no valid rounds for {pr.treatment}"}
    got = row["speedup_vs_baseline_median"]
    ci = row.get("speedup_ci95")
    ok = got >= pr.pass_threshold
    aa = aa_row(summary, pr.baseline)
    aa_ok = aa is None or abs(aa["speedup_vs_baseline_median"] - 1.0) <= aa_tolerance
    return {
        "verdict": ("PASS" if ok else "FAIL") if aa_ok else "INCONCLUSIVE",
        "by_threshold": "PASS" if ok else "FAIL",
        "aa_control": None if aa is None else aa["speedup_vs_baseline_median"],
        "aa_within_tolerance": aa_ok,
        "measured_speedup": got,
        "speedup_definition": "median of per-round ratios",
        "ratio_of_medians": row.get("ratio_of_medians"),
        "ci95": list(ci) if ci else None,
        "pass_threshold": pr.pass_threshold,
        "predicted_speedup": pr.predicted_speedup,
        "prediction_error": got / pr.predicted_speedup - 1,
        "prediction_in_ci": None if not ci else ci[0] <= pr.predicted_speedup <= ci[1],
    }


# ---- the benchmark scripts' pre-registrations (scripts/bench_memlimit.py, scripts/bench_serve.py) ----
#
# A script's pre-registration is free-form TOML with `script`, `rounds`, a `[goals]` table (the
# decision rules the script reads: nothing of them lives in the script) and a `[predictions]`
# table. A re-run after a miss is a new file with an `[addendum]` table: `to` (the earlier
# pre-registration) and `miss` (which goal of which run it follows). Before a run: the file is
# committed (tracked, unchanged against HEAD), locked (`python -m mbolt.bench.prereg lock FILE`,
# the lock committed beside it), and the tree is clean outside results/ and prereg/; the result
# records the revision, the machine and the load average before and after.

BENCH_KEEP = ("results", "prereg")  # what a benchmark writes: a change there does not make the code dirty


@dataclass
class BenchPrereg:
    path: str
    sha256: str
    raw: dict
    goals: dict
    predictions: dict
    addendum: dict | None

    def goal(self, key: str):
        """A decision rule of the pre-registration; a missing one is refused (never a default)."""
        if key not in self.goals:
            raise MboltError(f"{self.path}: [goals] has no {key} (the script reads its goals from the "
                             "pre-registration)")
        return self.goals[key]

    def require_goals(self, keys) -> None:
        """Every goal the run will judge, checked before hours of measuring rather than after."""
        miss = [k for k in keys if k not in self.goals]
        if miss:
            raise MboltError(f"{self.path}: [goals] lacks {', '.join(miss)}")

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "goals": self.goals, "predictions": self.predictions,
                "addendum": self.addendum}


def load_bench_prereg(path: str | os.PathLike) -> BenchPrereg:
    p = Path(path)
    raw = _read_toml(p)
    for k in ("goals", "predictions"):
        if not isinstance(raw.get(k), dict) or not raw[k]:
            raise MboltError(f"{p}: no [{k}] table: write the {k} down before the first run")
    add = raw.get("addendum")
    if add is not None:
        if not isinstance(add, dict) or not str(add.get("to", "")).strip() or not str(add.get("miss", "")).strip():
            raise MboltError(f"{p}: [addendum] needs `to` (the earlier pre-registration) and `miss` (the goal it "
                             "missed, and in which result)")
    return BenchPrereg(str(p), file_sha256(p), raw, dict(raw["goals"]), dict(raw["predictions"]), add)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise MboltError(f"{root}: git is needed to check the pre-registration ({e})") from None


def _rel(root: Path, path: str | os.PathLike) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(root.resolve()))
    except ValueError:
        raise MboltError(f"{path}: the pre-registration must live in the repository ({root})") from None


def require_committed(root: Path, path: str | os.PathLike) -> None:
    """`path` is tracked by git and unchanged against HEAD (the index and the work tree alike)."""
    rel = _rel(root, path)
    if _git(root, "ls-files", "--error-unmatch", "--", rel).returncode != 0:
        raise MboltError(f"{path}: not committed: commit the pre-registration before the run")
    if _git(root, "diff", "--quiet", "HEAD", "--", rel).returncode != 0:
        raise MboltError(f"{path}: changed since it was committed: a new prediction is a new pre-registration")


def dirty_outside(root: Path, keep=BENCH_KEEP) -> list[str]:
    """Paths changed or untracked (not ignored) outside `keep`: code the result would not name."""
    r = _git(root, "status", "--porcelain", "--untracked-files=all", "--", ".",
             *(f":(exclude){k}" for k in keep))
    if r.returncode != 0:
        raise MboltError(f"{root}: not a git checkout ({r.stderr.strip() or 'git status failed'})")
    return [ln[3:] for ln in r.stdout.splitlines() if ln.strip()]


def lock_bench(path: str | os.PathLike) -> dict:
    """Write the lock of a new pre-registration (refused when one exists: a lock is written once)."""
    pr = load_bench_prereg(path)
    lp = lock_path(pr.path)
    if lp.exists():
        raise MboltError(f"{lp}: already locked (a new prediction is a new pre-registration file)")
    lock = {"sha256": pr.sha256, "locked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": 0}
    write_text_atomic(lp, json.dumps(lock, indent=1) + "\n")
    return lock


def open_bench_prereg(path: str | os.PathLike, root: str | os.PathLike,
                      count_run: bool = True) -> tuple[BenchPrereg, dict]:
    """The gate a benchmark script passes before it measures: committed, locked with the file's hash,
    the lock committed, the tree clean outside results/ and prereg/. Returns the pre-registration
    and its lock record (its run count incremented; `count_run` False: checked only, for a dry run)."""
    root = Path(root)
    pr = load_bench_prereg(path)
    require_committed(root, pr.path)
    lp = lock_path(pr.path)
    if not lp.exists():
        raise MboltError(f"{pr.path}: not locked: run `python -m mbolt.bench.prereg lock {pr.path}` and commit "
                         "the lock beside it")
    if _git(root, "ls-files", "--error-unmatch", "--", _rel(root, lp)).returncode != 0:
        raise MboltError(f"{lp}: not committed: commit the lock with the pre-registration")
    dirty = dirty_outside(root)
    if dirty:
        more = f" and {len(dirty) - 3} more" if len(dirty) > 3 else ""
        raise MboltError(f"{root}: uncommitted changes outside results/ and prereg/ ({', '.join(dirty[:3])}{more}): "
                         "commit them, so the result names the code it ran")
    if not count_run:
        lock = _read_lock(lp)
        if lock.get("sha256") != pr.sha256:
            raise MboltError(f"{pr.path} does not match its lock (hash {pr.sha256[:12]} vs locked "
                             f"{str(lock.get('sha256'))[:12]}): refusing")
        return pr, lock
    return pr, check_and_lock(pr)


def check_rerun(pr: BenchPrereg, result_path: str | os.PathLike) -> None:
    """Refuse to measure what this pre-registration already measured, in the result or in an earlier
    run the result keeps (`keep_earlier`): a re-run is an addendum."""
    p = Path(result_path)
    if not p.exists():
        return
    try:
        old = json.loads(p.read_text())
    except ValueError:
        raise MboltError(f"{p}: an earlier result that is not JSON: move it aside by hand") from None
    runs = [(p.name, old)] + [(r.get("file") or "an earlier run", r) for r in old.get("earlier_runs") or []
                              if isinstance(r, dict)]
    for name, run in runs:
        spent = run.get("prereg")
        if isinstance(spent, dict) and spent.get("sha256") == pr.sha256:
            raise MboltError(f"{p.parent / name} was measured under {pr.path} already: a re-run is a new "
                             "pre-registration with an [addendum] naming the miss")


def gate_run(path: str | os.PathLike, root: str | os.PathLike, goal_keys, result_path,
             count_run: bool = True) -> tuple[BenchPrereg, dict]:
    """A benchmark script's gate before it measures: `open_bench_prereg`, every goal the run will
    judge present (`require_goals`), the llama.cpp build it names (`build = "native"`), no result of this pre-registration yet in `result_path` (one
    path, or a list: a script that writes one result per model) (`check_rerun`); only then is the
    run counted in the lock (`count_run`), so a refused start counts none."""
    pr, lock = open_bench_prereg(path, root, count_run=False)
    pr.require_goals(goal_keys)
    if "build" in pr.raw:  # the llama.cpp build the run measures (issue 54: native, as users build it)
        from mbolt.bench.env import check_build

        check_build(str(pr.raw["build"]))
    for p in ([result_path] if isinstance(result_path, (str, os.PathLike)) else result_path):
        check_rerun(pr, p)
    return pr, (check_and_lock(pr) if count_run else lock)


def begin_run(doc: str, root: str | os.PathLike, default_out: str | os.PathLike, goal_keys,
              data_path: str | os.PathLike, argv: list[str] | None = None) -> tuple[Path, BenchPrereg, dict]:
    """The start of a script with one pre-registration and one result: `--prereg PATH` (required)
    and `--out PATH` parsed from `argv`, the run gated (`gate_run`) and its record begun
    (`run_record`). Returns the result's path, the pre-registration and the record."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prereg", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(default_out))
    a = ap.parse_args(argv)
    pr, lock = gate_run(a.prereg, root, goal_keys, a.out)
    return a.out, pr, run_record(pr, lock, root, data_path)


def keep_earlier(pr: BenchPrereg, result_path: str | os.PathLike, result: dict) -> dict:
    """Before a result replaces an earlier one: the earlier file stays beside it
    (`NAME.runK.json`) and the new result lists every earlier run (file, pre-registration, goals),
    so a report shows both. Returns `result`."""
    p = Path(result_path)
    earlier: list[dict] = []
    if p.exists():
        old = json.loads(p.read_text())
        earlier = list(old.get("earlier_runs", []))
        k = len(earlier) + 1
        kept = p.with_name(f"{p.stem}.run{k}.json")
        while kept.exists():
            k += 1
            kept = p.with_name(f"{p.stem}.run{k}.json")
        os.replace(p, kept)
        earlier.append({"file": kept.name, "prereg": old.get("prereg"), "git": old.get("git"),
                        "goals": old.get("goals")})
    result["earlier_runs"] = earlier
    return result


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") or line.startswith("Model"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run_record(pr: BenchPrereg, lock: dict, root: str | os.PathLike, data_path: str | os.PathLike) -> dict:
    """What a result records of its run, before it starts: the pre-registration, the revision, the
    machine (CPU, cores, memory, kernel, the block device under `data_path` with its read_ahead_kb),
    the build of each engine (llama_print_system_info()) and the load average. `finish_record`
    adds the load average after."""
    from mbolt.bench.env import environment, git_revision

    env = environment(data_path)
    return {"prereg": {**pr.to_dict(), "run": lock.get("runs"), "locked_at": lock.get("locked_at")},
            "git": git_revision(root),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_bytes": env["memory"].get("MemTotal"),
                        "kernel": env["kernel"], "device": env["device"], "block": env["block"],
                        "read_ahead_kb": env["block"].get("read_ahead_kb"), "filesystem": env["filesystem"]},
            "engines": env["engines"],  # each engine's build (bench.env.engine_builds)
            "loadavg_before": env["loadavg"], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def finish_record(rec: dict) -> dict:
    try:
        rec["loadavg_after"] = os.getloadavg()
    except OSError:
        rec["loadavg_after"] = None
    rec["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return rec


def write_result(pr: BenchPrereg, rec: dict, path: str | os.PathLike, result: dict, default=None) -> dict:
    """A pre-registered run's last write: its record finished (`finish_record`), the runs it replaces
    kept beside it and listed (`keep_earlier`), the JSON written whole or not at all (`default`:
    json.dumps's, for values it cannot write). Returns the result as written."""
    result.update(finish_record(rec))
    write_text_atomic(path, json.dumps(keep_earlier(pr, path, result), indent=1, default=default) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m mbolt.bench.prereg lock FILE`: lock a benchmark script's pre-registration."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "lock":
        print("usage: python -m mbolt.bench.prereg lock prereg/NAME.toml", file=sys.stderr)
        return 2
    try:
        lock = lock_bench(args[1])
    except MboltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{lock_path(args[1])}: sha256 {lock['sha256'][:16]}, locked {lock['locked_at']}: commit both files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
