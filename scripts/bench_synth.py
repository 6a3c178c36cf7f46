"""Benchmark `write_synth --fast-random` against a plain sequential write of the same size.

Writes a ~1 GB and a ~4 GB preset model into a temporary directory (not the repo), each in a
child process whose wall time and peak RSS (os.wait4 -> ru_maxrss) are measured, and beside each
one a plain write of the same number of bytes (16 MiB chunks + fsync, like `dd conv=fsync`) in
the same run, alternating which goes first. Big files are deleted right after each arm.
Results go to results/synth.json.

    python scripts/bench_synth.py [--small]     # --small: 64 MB and 256 MB (smoke test)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mbolt.synth.synth import SynthConfig, synth_size

ROOT = Path(__file__).resolve().parents[1]

HWM = """
def hwm_mb():  # peak RSS of this exec'd image (ru_maxrss would include the parent at fork time)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""

SYNTH_CHILD = HWM + """
import sys, json, time
from mbolt.synth.synth import SynthConfig, write_synth_info
cfg = SynthConfig.from_preset(sys.argv[1], n_layers=int(sys.argv[2]), fast_random=True)
t0 = time.perf_counter()
info = write_synth_info(sys.argv[3], cfg)
secs = time.perf_counter() - t0
print(json.dumps({"bytes": info.bytes, "fingerprint": info.fingerprint, "write_seconds": secs, "hwm_mb": hwm_mb()}))
"""

PLAIN_CHILD = HWM + """
import os, sys, time, json
n, path = int(sys.argv[1]), sys.argv[2]
buf = os.urandom(16 << 20)
t0 = time.perf_counter()
with open(path, "wb") as f:
    left = n
    while left:
        k = min(left, len(buf))
        f.write(memoryview(buf)[:k])
        left -= k
    f.flush()
    os.fsync(f.fileno())
print(json.dumps({"write_seconds": time.perf_counter() - t0, "hwm_mb": hwm_mb()}))
"""


def _poll_hwm(pid: int, box: list) -> None:
    """Poll /proc/PID/status VmHWM (peak RSS of the current image) until the process exits."""
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        box[0] = max(box[0], int(line.split()[1]) / 1024)
        except (FileNotFoundError, ProcessLookupError):
            return
        if box[1]:
            return
        time.sleep(0.01)


def run_child(args: list[str]) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    box = [0.0, False]
    poller = threading.Thread(target=_poll_hwm, args=(p.pid, box), daemon=True)
    poller.start()
    _, status, ru = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    box[1] = True
    poller.join()
    out, err = p.stdout.read().decode(), p.stderr.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"child failed ({p.returncode}): {' '.join(args[:3])}\n{err}")
    child = json.loads(out.strip().splitlines()[-1])
    return {"seconds": secs, "peak_rss_mb": max(box[0], child.get("hwm_mb") or 0.0),
            "ru_maxrss_mb": ru.ru_maxrss / 1024, "child": child}


def pick_layers(preset: str, target: int) -> tuple[int, int]:
    best = None
    from mbolt.core.errors import MboltError

    for n in range(1, PRESET_MAX_LAYERS[preset] + 1):
        try:  # qwen3-next needs a full-attention layer (every 4th)
            size = synth_size(SynthConfig.from_preset(preset, n_layers=n, fast_random=True))
        except MboltError:
            continue
        if best is None or abs(size - target) < abs(best[1] - target):
            best = (n, size)
    return best


PRESET_MAX_LAYERS = {"qwen3-30b-a3b": 48, "qwen3-next-80b-a3b": 48, "granite-moe-1b": 24, "olmoe-1b-7b": 16}


def arm_synth(tmp: Path, preset: str, layers: int, size: int) -> dict:
    path = tmp / f"{preset}.gguf"
    r = run_child([sys.executable, "-c", SYNTH_CHILD, preset, str(layers), str(path)])
    assert r["child"]["bytes"] == size == path.stat().st_size
    from mbolt.core.moe_map import moe_map

    m = moe_map(path)  # the big file is a valid MoE GGUF
    r["check"] = {"arch": m.arch, "n_layers": m.n_layers, "n_experts": m.n_experts}
    path.unlink()
    return r


def arm_plain(tmp: Path, size: int) -> dict:
    path = tmp / "plain.bin"
    r = run_child([sys.executable, "-c", PLAIN_CHILD, str(size), str(path)])
    assert path.stat().st_size == size
    path.unlink()
    return r


def arm_dd(tmp: Path, size: int) -> dict | None:
    if not shutil.which("dd"):
        return None
    path = tmp / "dd.bin"
    mib = size // (1 << 20)
    r = run_child(["sh", "-c", f"dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync status=none && echo '{{}}'"])
    r["bytes"] = mib << 20
    path.unlink()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="64 MB and 256 MB instead of 1 GB and 4 GB")
    ap.add_argument("--out", default=str(ROOT / "results" / "synth.json"))
    args = ap.parse_args()
    targets = [("qwen3-30b-a3b", 1 << 30), ("qwen3-next-80b-a3b", 4 << 30)]
    if args.small:
        targets = [("granite-moe-1b", 64 << 20), ("olmoe-1b-7b", 256 << 20)]
    tmp = Path(tempfile.mkdtemp(prefix="mbolt-bench-synth-"))
    runs = []
    try:
        for i, (preset, target) in enumerate(targets):
            layers, size = pick_layers(preset, target)
            print(f"{preset} x {layers} layers: {size / 1e9:.2f} GB", file=sys.stderr, flush=True)
            order = ["synth", "plain"] if i % 2 == 0 else ["plain", "synth"]
            res = {}
            for arm in order:
                res[arm] = arm_synth(tmp, preset, layers, size) if arm == "synth" else arm_plain(tmp, size)
            res["dd"] = arm_dd(tmp, size)
            row = {"preset": preset, "layers": layers, "bytes": size, "order": order}
            for arm in ("synth", "plain", "dd"):
                r = res[arm]
                if r is None:
                    continue
                nbytes = r.get("bytes", size)
                row[arm] = {"seconds": round(r["seconds"], 3), "mb_per_s": round(nbytes / 1e6 / r["seconds"], 1),
                            "peak_rss_mb": round(r["peak_rss_mb"], 1),
                            "ru_maxrss_mb_incl_parent_at_fork": round(r["ru_maxrss_mb"], 1)}
                if "write_seconds" in r["child"]:
                    w = r["child"]["write_seconds"]
                    row[arm].update(write_seconds=round(w, 3), write_mb_per_s=round(nbytes / 1e6 / w, 1))
            row["synth"]["check"] = res["synth"]["check"]
            row["synth_vs_plain_speed"] = round(row["synth"]["mb_per_s"] / row["plain"]["mb_per_s"], 3)
            row["synth_vs_plain_write_speed"] = round(row["synth"]["write_mb_per_s"] / row["plain"]["write_mb_per_s"], 3)
            row["rss_under_500mb"] = row["synth"]["peak_rss_mb"] < 500
            runs.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "bench": "synth",
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "method": "each arm a child process; seconds/mb_per_s = wall time incl. interpreter start and the "
                  "final fsync; write_seconds = the child's own timing of the write incl. fsync; peak_rss_mb = "
                  "VmHWM of the exec'd child (polled + self-reported; ru_maxrss kept for reference but it "
                  "includes the parent's RSS at fork); plain = 16 MiB os.urandom buffer written repeatedly + "
                  "fsync; dd = dd if=/dev/zero bs=1M conv=fsync; same temp dir on the same disk, one round, "
                  "synth/plain order alternated between sizes; machine shared with other jobs (noisy)",
        "small": args.small,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from mbolt.core.atomic import write_text_atomic

    write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
