"""Are the benchmarks' figures unchanged by a refactoring? A smoke run of each scripts/bench_*.py
at two commits -> results/smoke_before_after.json (issue 56: "the figures of the benchmarks are
unchanged by the move").

Both commits are cloned from this repository into --workdir (WORKDIR/before, WORKDIR/after), and
each bench script's cheapest real invocation (its smoke stage, or small flags from its docstring;
SMOKE below) runs inside its own clone, before then after, back to back, never two at once. Each
side runs its own `mbolt`: PYTHONPATH is the clone (it comes before the editable install of the
working tree in site-packages), and the run goes through a wrapper that prints the imported
`mbolt.__file__` when the interpreter exits, which is checked to lie in the clone. Each side has its
own TMPDIR and MBOLT_BENCH (WORKDIR/tmp-<side>, WORKDIR/<side>-bench): nothing is shared and
nothing in /tmp/mbolt-bench is touched.

The figures are the leaves of each side's output JSON (or the goals it logs). Provenance (revision,
dates, load, paths, the machine) is left out. A leaf is "timed" when its path names a time, a rate or
a memory peak (tok/s, seconds, wall, RSS), or one of the script's own timed words (its A/A, speedups,
ratios over plain, the arms that read through page faults, whose reads the kernel's readahead
decides: SMOKE's timed_words); timed leaves are reported side by side with after/before, never
judged, since the machine is shared and the runs are smoke-sized. Every other leaf (token hashes,
hits, misses, reads, bytes, slots, counts) is "deterministic" and must be equal: each difference is
listed, and CAUSES says why where the reason is known. A leaf only one side has (a field added since)
is listed apart, not judged.

  python scripts/smoke_before_after.py --before acfcf8c --after 7016b47 [--only bench_cache,bench_memlimit]
                                       [--workdir /tmp/fig] [--timeout 300]
  python scripts/smoke_before_after.py --recompare    # the same runs, the rules of reading changed
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The wrapper each side runs: the script as `python script.py` would run it (its own directory first
# on sys.path), and at exit the mbolt it really imported, so a run that fell back to another tree
# is caught instead of compared.
WRAPPER = (
    "import atexit, os, runpy, sys\n"
    "def _said():\n"
    "    m = sys.modules.get('mbolt')\n"
    "    sys.stderr.write('SMOKE_MBOLT_FILE %s\\n' % getattr(m, '__file__', None))\n"
    "atexit.register(_said)\n"
    "script, sys.argv = sys.argv[1], sys.argv[1:]\n"
    "sys.path[0] = os.path.dirname(os.path.abspath(script))\n"
    "runpy.run_path(script, run_name='__main__')\n"
)

# One entry per bench script. "args": the script's arguments (either side; "args_before" where the
# old script took others); "outputs": the JSON files it writes, relative to the clone, with {tmp}
# and {bench} for the side's TMPDIR and MBOLT_BENCH; "not_run": why there is no cheap run. Ordered
# deterministic and cheap first, so a short run still covers the most.
SMOKE: dict[str, dict] = {
    "bench_predictor": {"not_run": "its inputs are gone: results/ab_*_seed1fix.json name held-out traces in "
                                   "/tmp/mbolt-bench/s64k_seed1/ (held.mbtrace), no longer on this machine; "
                                   "remaking them is bench_ab.py's prepare and run (tens of minutes)"},
    "bench_cache": {"args": [], "outputs": ["results/cache_granite.json", "results/cache_real.json"],
                    "note": "replay of real routing traces: counts only"},
    "bench_layout": {"args": ["--quick", "--only", "granite,gap,synth,null", "-o", "{tmp}/layout.json"],
                     "outputs": ["{tmp}/layout.json"], "note": "--quick: fewer layers and tokens"},
    "bench_cache_families": {"args": [], "outputs": ["results/cache_families.json"], "timeout": 600,
                             "note": "replay only (about 5 minutes a side)"},
    "bench_reliability": {"args": [], "outputs": ["results/reliability.json"],
                          "note": "the bad-input and fuzz suites of the clone's tests/"},
    "bench_llama_stream": {"args": ["smoke"], "outputs": ["{bench}/llama_stream_smoke/results/*.json"],
                           # stock-os is page faults and the kernel's readahead: its reads are not ours to fix;
                           # speedups are ratios of times; inflight is what a timed read left in flight
                           "timed_words": ["os", "speedup", "ratios", "ratio", "median", "medians", "inflight"],
                           "ignore_words": ["flags"],
                           "note": "tiny model, 1 round, QD1 (results in MBOLT_BENCH, not results/)"},
    "bench_engine": {"args": ["--layers", "1", "--tokens", "4", "--warmup", "1", "--out", "{tmp}/engine.json"],
                     "outputs": ["{tmp}/engine.json"], "timed_words": ["runs", "share", "ratio"],
                     "note": "1 layer, 4 timed tokens; tok/s only (runs, cProfile shares)"},
    "bench_synth": {"args": ["--small", "--out", "{tmp}/synth.json"], "outputs": ["{tmp}/synth.json"],
                    "note": "--small: 64 MB and 256 MB files"},
    "bench_rewrite": {"args": ["--sizes", "0.05", "--reps", "1", "--tmp", "{tmp}", "--out", "{tmp}/rewrite.json"],
                      "outputs": ["{tmp}/rewrite.json"], "timed_words": ["ratios", "goals"],
                      "note": "one 50 MB model, 1 round; times, RSS, their ratios and the goals on them are timed"},
    "bench_split": {"args": ["--set-gb", "0.05", "--geo-gb", "0.03", "--reps", "1", "--tokens", "500",
                             "--tmp", "{tmp}", "--out", "{tmp}/split.json"],
                    "outputs": ["{tmp}/split.json", "{tmp}/split_geometry.json"], "timed_words": ["ratios", "goals"],
                    "note": "the docstring's smoke run"},
    "bench_demo": {"args": ["--tiny", "2", "--small", "0", "--workdir", "{tmp}/demo", "--out", "{tmp}/demo_aa.json"],
                   "outputs": ["{tmp}/demo_aa.json"],
                   # the demo is a timed A/B: its rounds stop on a time budget or on convergence, so the
                   # rounds, the stop, the speedups and the order effects are all of them times
                   "timed_words": ["aa", "speedups", "effects", "rounds", "ci95", "deviation", "noisy"],
                   "ignore_words": ["measured", "significant", "stop"],
                   "note": "2 tiny demos (a timed A/B each: counts are only runs, seeds and exit codes)"},
    "bench_memlimit": {"args": ["smoke"], "outputs": ["{tmp}/mbolt-memlimit-smoke/session_smoke.json"],
                       # plain, its readahead sweep and the warm arms read through page faults (the kernel's
                       # readahead decides): their reads and bytes vary run to run; the goals, A/A and the
                       # ratios over plain are ratios of times. The mbolt arms' reads, hits, misses, slots
                       # and token hashes are ours: those are judged. device bytes are /proc/self/io's read_bytes:
                       # every fault and file read of the process, as the page cache stands (two runs of one
                       # side differ by a few pages): environmental, reported with the timed figures.
                       "timed_words": ["plain", "sweep", "warm", "goals", "aa", "over", "speedup", "ratios", "ratio",
                                       "median", "medians", "inflight", "effects", "drive", "prediction", "bound",
                                       "best", "device"],
                       "ignore_words": ["flags", "stop"],
                       "note": "tiny model, one round of the session in a memory cgroup; sets the "
                               "device's read_ahead_kb for its arms and restores it. Beside 128 KiB (as shipped) its "
                               "configs are plain tuned's windows, chosen by a timed sweep: one only a side chose is "
                               "listed apart (only_before/only_after)"},
    "bench_deep": {"args": ["smoke"], "outputs": [], "stdout_goals": True,
                   "timed_words": ["plain", "within", "drive", "readahead", "compute", "warm"],
                   "note": "one round on bench_memlimit's smoke model; its figures are the goals it logs"},
    "bench_hotpath": {"args": ["--prereg", "prereg/hotpath.toml", "--out", "{tmp}/hotpath.json"],
                      "outputs": ["{tmp}/hotpath.json"], "timed_words": ["aa", "measured", "judged"],
                      "note": "the pre-registered run (toy models of a few MB, warm): its only mode"},
    "bench_probe_conditions": {"args": ["--dir", "{bench}", "--reps", "1", "--out", "{tmp}/probe_conditions.json"],
                               "outputs": ["{tmp}/probe_conditions.json"], "note": "1 repeat; timed only"},
    "bench_ab": {"args": ["prepare", "--models", "s64k", "--tag", "smoke"], "outputs": ["{bench}/prepare.json"],
                 "note": "prepare of s64k (probe, model, reference trace, plan, rewrites); its cold A/B rounds: not run"},
    "bench_repack": {"not_run": "its one mode is the pre-registered run on q864 and q72 "
                                "(bench_memlimit's multi-GB files, 5 rounds)"},
    "bench_serve": {"not_run": "servers run under 40% of the file: the small model (bench_memlimit's smoke, 62 MB) gives "
                               "25 MB, below llama.cpp's own buffers (that smoke runs at 4x its file); others are GBs"},
    "bench_kernel": {"not_run": "not at the before commit (issue 54, after it); needs the q4km files (GBs)"},
}

# Why a script's output differs between acfcf8c and 7016b47 where it does (read from the runs and
# /work/main's git log): written down once found, so the result carries its reason.
KIND_FIELDS = ("fields added by issue 54's kernel layout, not by the move: ab arms' options inline and repacked "
               "and the summaries' kernels and tokens_agreement_across_kernels (2bb01e6), buffered (7149ff5), "
               "rows (bc53e0a); every figure both sides have is compared")
CAUSES = {
    "bench_reliability": "the suites grew, no result changed: 8 new bad-input cases for `mbolt repack` (7 in 999f315, "
                         "'mbolt repack (issue 54) in the CLI with its bad-input cases'; repack-output-inspected in "
                         "e2b9f3c), so bad_input_cases 145 -> 153, commands_covered 22 -> 23, tests_passed 169 -> 177; "
                         "tests_failed 0 on both sides",
    "bench_llama_stream": KIND_FIELDS,
    "bench_memlimit": KIND_FIELDS + "; prompt_device_bytes (/proc/self/io) of the mbolt arms is environmental: the "
                                    "before side run twice gave 24,502,272 and 24,604,672 bytes (timed figures)",
    "bench_hotpath": "engines.llama.cpp.package appears after (999f315: benchmarks check the llama.cpp build a "
                     "pre-registration names): provenance, not a figure",
}

# Leaves that say when, where and on what a run happened, not what it measured: a path segment's
# words (split at _ - and spaces) that name one of these.
PROVENANCE = {"git", "revision", "commit", "rev", "dirty", "date", "when", "started", "finished", "utc",
              "timestamp", "host", "hostname", "machine", "cpu", "cores", "kernel", "python", "platform",
              "uname", "version", "load", "loadavg", "argv", "command", "cmd", "cwd", "path", "paths", "file",
              "dir", "tmp", "prereg", "lock", "env", "build", "system", "note", "notes", "log", "workdir",
              "updated", "created", "environment", "engines"}
# Words of a time, a rate or a memory peak: such leaves are reported, not judged. Ratios and medians
# are not here (a ratio of misses is a count's); a script's timed ratios are named in its entry.
TIMED = {"time", "times", "s", "sec", "secs", "seconds", "tok", "tps", "wall", "ms", "us", "ns", "speed", "bw",
         "bandwidth", "throughput", "rss", "peak", "elapsed", "ttft", "duration", "latency", "tokps", "gbps",
         "mbps", "mb/s", "gb/s", "maxrss"}


HEADLINE, SHAPE_LISTED = 16, 12  # the result lists this many timed figures and added fields; the rest are counted


def words(path: str) -> set[str]:
    """The lower-case words of every segment of a leaf's path."""
    return {w for w in re.split(r"[._\[\]\- /()]+", path.lower()) if w}


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """Every leaf of a JSON value, keyed by its path (a.b[3].c). A list element that names its arm
    is keyed by the arm (rounds[stock-os]), so an arm's figures meet their twin whatever the order."""
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list):
        out, seen = {}, set()
        for i, v in enumerate(obj):
            key = v.get("arm") if isinstance(v, dict) and isinstance(v.get("arm"), str) else str(i)
            key = key if key not in seen else f"{key}#{i}"
            seen.add(key)
            out.update(flatten(v, f"{prefix}[{key}]"))
        return out
    return {prefix: obj}


def normalise(value, side_dirs: dict[str, str]):
    """A string leaf with the side's own directories named the same way on both sides."""
    if isinstance(value, str):
        for real, name in side_dirs.items():
            value = value.replace(real, name)
        value = re.sub(r"(?<![\w<])(before|after)/", "<side>/", value)  # paths relative to the clone's parent
    return value


def classify(figures: dict[str, object], timed_words=(), ignore_words=()) -> tuple[dict, dict]:
    """(deterministic, timed) leaves; provenance dropped. `timed_words`: a script's own words for
    timed figures (bench_engine's per-run tok/s are "runs"); `ignore_words`: its own provenance."""
    det, timed = {}, {}
    for k, v in figures.items():
        w = words(k.split(".json", 1)[-1])  # not the file's name: demo_aa.json is not an A/A figure
        if w & (PROVENANCE | set(ignore_words)):
            continue
        (timed if w & (TIMED | set(timed_words)) else det)[k] = v  # a timed arm's name or verdict is timed too
    return det, timed


def stdout_goals(text: str) -> dict:
    """The `  smoke: GOAL: VALUE` lines bench_deep's smoke logs."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"\bsmoke: (.+): (.+)$", line)
        if m:  # a goal names plain tuned's window in parentheses: a timed choice, not part of its name
            key = re.sub(r"\s*\(.*?\)|\d+ KiB", "", m.group(1)).strip()
            key = key if key not in out else f"{key} #{sum(k.startswith(key) for k in out) + 1}"  # the tuned stage's twin
            value = m.group(2).strip()
            try:
                out[key] = {"True": True, "False": False}.get(value, None) if value in ("True", "False") else float(value)
            except ValueError:
                out[key] = value
    return out


def collect(outputs: list[str], logged: str, entry: dict, side: str, repo: Path, workdir: Path) -> dict:
    """The figures of one run: its output files' leaves (and the goals it logged), the side's own
    directories named alike on both sides."""
    figures: dict[str, object] = {}
    for p in outputs:
        figures.update(flatten(json.loads(Path(p).read_text()), Path(p).name))
    if entry.get("stdout_goals"):
        figures.update(flatten(stdout_goals(logged), "goals"))
    side_dirs = {str(workdir / f"tmp-{side}"): "<tmp>", str(workdir / f"{side}-bench"): "<bench>", str(repo): "<repo>"}
    return {k: normalise(v, side_dirs) for k, v in figures.items()}


def clone(workdir: Path, side: str, commit: str) -> Path:
    """WORKDIR/<side> at `commit`, a fresh clone of this repository (the working tree is never used)."""
    dst = workdir / side
    if not dst.exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(dst)], check=True)
    subprocess.run(["git", "-C", str(dst), "checkout", "-q", commit], check=True)
    return dst


def run_side(name: str, entry: dict, side: str, repo: Path, workdir: Path, timeout: int) -> dict:
    """One smoke run of scripts/<name>.py inside `repo`; its figures and what it imported."""
    tmp, bench = workdir / f"tmp-{side}", workdir / f"{side}-bench"
    tmp.mkdir(parents=True, exist_ok=True)
    bench.mkdir(parents=True, exist_ok=True)
    fill = {"tmp": str(tmp), "bench": str(bench)}
    args = [a.format(**fill) for a in entry.get(f"args_{side}", entry["args"])]
    env = {**os.environ, "PYTHONPATH": str(repo), "TMPDIR": str(tmp), "MBOLT_BENCH": str(bench)}
    script = repo / "scripts" / f"{name}.py"
    cmd = [sys.executable, "-c", WRAPPER, str(script), *args]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        rc, out, err = None, text(e.stdout), text(e.stderr) + f"\ntimed out after {timeout} s"
    wall = time.time() - t0
    (workdir / "logs").mkdir(exist_ok=True)
    (workdir / "logs" / f"{name}.{side}.out").write_text(out)
    (workdir / "logs" / f"{name}.{side}.err").write_text(err)
    said = re.findall(r"SMOKE_MBOLT_FILE (.*)", err)
    mbolt_file = said[-1] if said else None
    # an output may be a glob (bench_llama_stream's smoke writes one file per arm and config): after the run;
    # only a file this run wrote counts: a clone holds committed results of the same name
    outputs = [g for o in entry.get("outputs", []) for g in sorted(glob.glob(str(repo / o.format(**fill))))
               if Path(g).stat().st_mtime >= t0]
    figures = collect(outputs, out + err, entry, side, repo, workdir)
    return {"command": " ".join([f"cd {repo} &&", "PYTHONPATH=" + str(repo), f"TMPDIR={tmp}",
                                 f"MBOLT_BENCH={bench}", "python", f"scripts/{name}.py", *args]),
            "returncode": rc, "wall_s": round(wall, 1), "mbolt_file": mbolt_file,
            "own_mbolt": bool(mbolt_file and mbolt_file.startswith(str(repo) + "/")),
            "outputs": outputs, "figures": figures, "stderr_tail": err[-1500:] if rc else ""}


def compare(before: dict, after: dict, entry: dict) -> dict:
    """Deterministic leaves equal or not (each difference listed); leaves one side has and the other
    lacks (a field added or removed: the output's shape, not a figure) listed apart; timed leaves side
    by side with after/before."""
    kw = {"timed_words": entry.get("timed_words", ()), "ignore_words": entry.get("ignore_words", ())}
    db, tb = classify(before["figures"], **kw)
    da, ta = classify(after["figures"], **kw)
    diffs = [{"figure": k, "before": db[k], "after": da[k]} for k in sorted(set(db) & set(da)) if db[k] != da[k]]
    timed = {}
    for k in sorted(set(tb) & set(ta)):
        b, a = tb[k], ta[k]
        number = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
        timed[k] = {"before": b, "after": a, "after_over_before": round(a / b, 3) if number and b else None}
    ok = before["returncode"] == 0 and after["returncode"] == 0 and before["own_mbolt"] and after["own_mbolt"]
    ratios = [t["after_over_before"] for t in timed.values() if (t["after_over_before"] or 0) > 0]
    headline = [k for k in timed if words(k.split(".json", 1)[-1]) & TIMED][:HEADLINE]
    return {"deterministic_equal": (not diffs) if ok and set(db) & set(da) else None,
            "deterministic_figures_compared": len(set(db) & set(da)), "differences": diffs,
            "only_before": shape(set(db) - set(da)), "only_after": shape(set(da) - set(db)),
            "timed": {"figures": len(timed), "geomean_after_over_before":
                      round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3) if ratios else None,
                      "headline": {k: timed[k] for k in headline}}}


def shape(keys: set[str]) -> dict:
    """Leaves one side lacks, counted, with the first few (a field added is added on every arm)."""
    return {"count": len(keys), "first": sorted(keys)[:SHAPE_LISTED]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="acfcf8c", help="the commit before the refactoring")
    ap.add_argument("--after", default="7016b47", help="the commit after it")
    ap.add_argument("--only", default="", help="comma-separated script names (default: every entry)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fig"), help="clones, TMPDIRs and logs go here")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "smoke_before_after.json",
                    help="the result; entries already in it are kept unless run again")
    ap.add_argument("--recompare", action="store_true",
                    help="run nothing: compare the figures already in --out again (after a change to the rules)")
    a = ap.parse_args()
    from mbolt.core.atomic import json_default, write_text_atomic

    names = [n.strip().removesuffix(".py") for n in a.only.split(",") if n.strip()] or list(SMOKE)
    unknown = [n for n in names if n not in SMOKE]
    if unknown:
        print(f"error: --only: no smoke entry for {', '.join(unknown)} (known: {', '.join(SMOKE)})", file=sys.stderr)
        return 2
    missing = [p.stem for p in sorted((ROOT / "scripts").glob("bench_*.py")) if p.stem not in SMOKE]
    if missing:  # a new bench script must get an entry, run or not
        print(f"warning: no smoke entry for {', '.join(missing)}", file=sys.stderr)
    (a.workdir / "figures").mkdir(parents=True, exist_ok=True)  # every leaf of every run, for --recompare
    if a.recompare:
        result = json.loads(a.out.read_text())
        for name, rec in result["scripts"].items():
            if rec.get("before") and rec.get("after"):
                runs = {}
                for side in ("before", "after"):  # the files again where they are still there (new rules of reading)
                    r, logs = rec[side], a.workdir / "logs" / f"{name}.{side}"
                    if all(Path(o).exists() for o in r["outputs"]) and Path(f"{logs}.err").exists():
                        logged = Path(f"{logs}.out").read_text() + Path(f"{logs}.err").read_text()
                        figures = collect(r["outputs"], logged, SMOKE.get(name, {}), side, a.workdir / side, a.workdir)
                    else:
                        figures = json.loads((a.workdir / "figures" / f"{name}.{side}.json").read_text())
                    runs[side] = {**r, "figures": figures}
                    (a.workdir / "figures" / f"{name}.{side}.json").write_text(json.dumps(figures, default=json_default))
                    rec[side] = {**r, "figures": len(figures)}
                rec.update(compare(runs["before"], runs["after"], SMOKE.get(name, {})))
                rec["note"] = SMOKE.get(name, {}).get("note", rec.get("note", ""))
                rec["cause"] = CAUSES.get(name, "")
        write_text_atomic(a.out, json.dumps(result, indent=1, default=json_default) + "\n")
        return 0
    shared = a.workdir / "shared"  # scripts read ROOT/../shared/data (real traces): the same files on both sides
    if (ROOT.parent / "shared").is_dir() and not shared.exists():
        shared.symlink_to(ROOT.parent / "shared")
    repos = {"before": clone(a.workdir, "before", a.before), "after": clone(a.workdir, "after", a.after)}
    result = json.loads(a.out.read_text()) if a.out.exists() else {}
    result.update({"before": a.before, "after": a.after, "workdir": str(a.workdir)})
    scripts = result.setdefault("scripts", {})
    for name in names:
        entry = SMOKE[name]
        if "not_run" in entry:
            scripts[name] = {"command": None, "before": None, "after": None, "deterministic_equal": None,
                             "differences": [], "timed": {}, "note": "not run: " + entry["not_run"]}
            continue
        runs = {}
        for side in ("before", "after"):  # back to back, one at a time: the same machine state
            if not (repos[side] / "scripts" / f"{name}.py").exists():
                runs[side] = None
                continue
            print(f"{name} ({side}) ...", file=sys.stderr, flush=True)
            runs[side] = run_side(name, entry, side, repos[side], a.workdir, entry.get("timeout", a.timeout))
            print(f"  rc {runs[side]['returncode']}, {runs[side]['wall_s']} s, mbolt {runs[side]['mbolt_file']}",
                  file=sys.stderr, flush=True)
        rec = {"command": {s: r["command"] for s, r in runs.items() if r}, "note": entry.get("note", ""),
               "cause": CAUSES.get(name, "")}
        if runs["before"] and runs["after"]:
            rec.update(compare(runs["before"], runs["after"], entry))
        for s, r in runs.items():  # every leaf stays in the workdir (for --recompare); the result holds counts
            if r:
                (a.workdir / "figures" / f"{name}.{s}.json").write_text(json.dumps(r["figures"], default=json_default))
            rec[s] = r and {**{k: v for k, v in r.items() if k not in ("command", "figures")},
                            "figures": len(r["figures"])}
        scripts[name] = rec
        print(f"  deterministic equal: {rec.get('deterministic_equal')} "
              f"({len(rec.get('differences', []))} differences)", file=sys.stderr, flush=True)
        write_text_atomic(a.out, json.dumps(result, indent=1, default=json_default) + "\n")  # after each script
    result["wall_s_all_runs"] = round(sum(r[s]["wall_s"] for r in scripts.values() for s in ("before", "after")
                                          if r.get(s)), 1)
    write_text_atomic(a.out, json.dumps(result, indent=1, default=json_default) + "\n")
    for name in names:
        r = scripts[name]
        print(f"{name:24s} equal={r.get('deterministic_equal')!s:5s} diffs={len(r.get('differences', []))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
