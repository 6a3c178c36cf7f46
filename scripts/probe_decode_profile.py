"""Exploratory probe (issue 54; not pre-registered, no goal): where a decode token's time goes
under the memory limit -> results/profile_<model>.json.

One arm of bench_kernel.py's limited stage (default mbolt-kernel: the runtime on the kernel-layout
file, paged), one round of its workload (a 2,000-token prompt, then 256 fed tokens) inside the 40%
memory cgroup at plain llama.cpp's tuned readahead (64 KiB, results/kernel_q4km.json), under
`perf record -a` (every CPU, 999 Hz, call graphs, CLOCK_MONOTONIC). The decode window is the
round's decode time (256 tokens at its measured rate) up to the last sample in a repacked GEMV
kernel (`ggml_gemv_*`: a one-token step), so it needs an arm that computes on llama.cpp's
repacked kernels. Each sample of that window is put in one class, first match wins:

  idle          the CPU ran nothing (the kernel's idle task)
  drop thread   the runtime's eviction thread (madvise/fadvise DONTNEED of victims)
  WILLNEED      llama.cpp's thread inside posix_fadvise: a miss's read being submitted (page-cache
                pages allocated, charged to the cgroup, bios built)
  page faults   llama.cpp's thread in a page fault (a page arriving, or being mapped)
  OpenMP wait   llama.cpp's thread spinning in libgomp (the other thread waits on a page, or on
                the callback between graph splits)
  compute       llama.cpp's thread in ggml or libm
  other         the rest (other kernel work, Python, other processes)

and reported as CPU milliseconds per decoded token (2 CPUs: wall ms x 2 in all). perf must be
installed and allowed (`perf_event_paranoid` <= 0 for -a, or root).

    python scripts/probe_decode_profile.py [--model q4km] [--arm mbolt-kernel]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402

RESULTS = ROOT / "results"
HZ = 999
KERNEL_ARMS = ("mbolt-kernel", "mbolt-kernel-rows")  # bench_kernel.py's limited arms on the repacked kernels
READAHEAD_KB = 64  # plain tuned's window on q4km and q512km (results/kernel_*.json)
CLASSES = ("compute", "OpenMP wait", "idle", "WILLNEED", "drop thread", "page faults", "other")


def measure(model: str, arm_name: str) -> dict:
    """The arm's one round inside the cgroup (what bench_kernel.py's limited stage runs)."""
    from mbolt.bench.memlimit import KERNEL_WORKLOAD, kernel_limited_arms, limit_of, run_ab_config
    from mbolt.core.memlimit import readahead

    p, _, ram = limit_of(model, 0.4)
    arms = [a for a in kernel_limited_arms(model) if a.name in KERNEL_ARMS]
    arm = next((a for a in arms if a.name == arm_name), None)
    if arm is None:
        raise MboltError(f"--arm {arm_name}: give one of {', '.join(a.name for a in arms)} (arms on llama.cpp's "
                         "repacked kernels)")
    with readahead(p["stock"], READAHEAD_KB):
        res = run_ab_config(model, [arm], KERNEL_WORKLOAD, 1, ram, 0, aa=False)
    s = res["summary"][0]
    return {k: s.get(k) for k in ("arm", "decode_tokens_per_s", "ttft_s", "device_bytes_per_token", "hit_rate",
                                  "kernels")} | {"budget_bytes": ram}


def classify(comm: str, frames: list[str]) -> str:
    """One sample's class (see the module docstring); `frames` leaf first."""
    if comm == "swapper":
        return "idle"
    if comm.startswith("mbolt-drops"):
        return "drop thread"
    if not comm.startswith("python") or not frames:
        return "other"
    stack = " ".join(frames)
    if "generic_fadvise" in stack:
        return "WILLNEED"
    if "exc_page_fault" in stack:
        return "page faults"
    if "libgomp" in frames[0]:
        return "OpenMP wait"
    if "libggml" in frames[0] or "libm.so" in frames[0]:
        return "compute"
    return "other"


def samples(script_text: str) -> list[tuple[float, str, list[str]]]:
    """(time, command, frames leaf first) of every sample of `perf script` output."""
    out = []
    for block in script_text.split("\n\n"):
        lines = [ln for ln in block.strip().splitlines() if ln.strip()]
        if not lines:
            continue
        head = lines[0].split()
        stamp = next((w for w in head if w.endswith(":") and w[:-1].replace(".", "", 1).isdigit()), None)
        if stamp is None:
            continue
        out.append((float(stamp[:-1]), head[0], [ln.strip() for ln in lines[1:]]))
    return out


def decode_window(ss: list[tuple[float, str, list[str]]], decode_s: float) -> tuple[float, float]:
    """The `decode_s` seconds up to the last sample in a repacked GEMV kernel (the last decode step)."""
    b = max((t for t, c, fr in ss if c.startswith("python") and fr and "ggml_gemv_" in fr[0]), default=None)
    if b is None:
        seen = Counter(c for _, c, _ in ss).most_common(3)
        raise MboltError(f"{len(ss)} samples ({', '.join(f'{c}: {n}' for c, n in seen)}) show no decode step in "
                         "llama.cpp's repacked kernels: give an arm that computes on them (--arm mbolt-kernel)")
    return b - decode_s, b


def profile(model: str, arm: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data, got = Path(tmp) / "perf.data", Path(tmp) / "arm.json"
        cmd = ["perf", "record", "-a", "-g", "-F", str(HZ), "-k", "CLOCK_MONOTONIC", "-o", str(data), "--",
               sys.executable, __file__, "--model", model, "--arm", arm, "--inner", str(got)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise MboltError("perf: not installed (apt-get install linux-perf)") from None
        if r.returncode != 0 or not got.exists():
            raise MboltError(f"perf record of the arm failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        text = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,tid,time,ip,sym,dso"],
                              capture_output=True, text=True).stdout
        measured = json.loads(got.read_text())
    ss = samples(text)
    from mbolt.bench.memlimit import KERNEL_WORKLOAD

    tokens = KERNEL_WORKLOAD.new
    a, b = decode_window(ss, tokens / measured["decode_tokens_per_s"])
    window = [(c, fr) for t, c, fr in ss if a < t <= b]
    counts = Counter(classify(c, fr) for c, fr in window)
    ms = {k: 1000.0 * counts[k] / HZ / tokens for k in CLASSES}
    return {"probe": "where a decode token's time goes under the memory limit (issue 54; exploratory)",
            "script": "scripts/probe_decode_profile.py", "model": model, "arm": measured,
            "readahead_kb": READAHEAD_KB, "perf_hz": HZ, "decode_window_s": b - a, "samples": len(window),
            "cpus": os.cpu_count(), "cpu_ms_per_token": ms,
            "share": {k: counts[k] / max(len(window), 1) for k in CLASSES},
            "wall_ms_per_token": 1000.0 / measured["decode_tokens_per_s"],
            "classes": {"compute": "ggml or libm", "OpenMP wait": "spinning in libgomp",
                        "idle": "the idle task", "WILLNEED": "in posix_fadvise (a miss submitted)",
                        "drop thread": "mbolt-drops (victims given back)", "page faults": "in a page fault",
                        "other": "the rest"},
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="q4km")
    ap.add_argument("--arm", default="mbolt-kernel")
    ap.add_argument("--inner", help=argparse.SUPPRESS)  # the measured run, under perf: its figures to this file
    a = ap.parse_args()
    try:
        if a.inner:
            Path(a.inner).write_text(json.dumps(measure(a.model, a.arm)))
            return
        out = profile(a.model, a.arm)
    except MboltError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    path = RESULTS / f"profile_{a.model}.json"
    write_text_atomic(path, json.dumps(out, indent=1) + "\n")
    per = out["cpu_ms_per_token"]
    print(f"{a.model} {a.arm}: {out['arm']['decode_tokens_per_s']:.2f} tok/s "
          f"({out['wall_ms_per_token']:.1f} ms a token, {out['cpus']} CPUs) -> {path}")
    for k in CLASSES:
        print(f"  {k:12s} {per[k]:6.1f} CPU-ms a token  ({out['share'][k]:.1%})")


if __name__ == "__main__":
    main()
