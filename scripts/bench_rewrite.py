"""Benchmark `mbolt reorder` and `mbolt verify` against cp and a plain gguf-py copy -> results/rewrite.json.

For each size (default ~1 GB and ~4 GB) a fast-random synth model with Qwen3-30B-A3B expert
geometry (Q4_0, 128 experts, 864 KiB slices) is written to a temp dir (never the repo) and
deleted afterwards. Every arm runs as its own process, timed from outside (wall clock,
interpreter start-up included) with its peak RSS (RUSAGE_CHILDREN of a fresh wrapper):

  cp            cp src dst                       (no fsync: the page cache absorbs the write)
  cp+sync       cp src dst && sync dst           (same durability as reorder, which fsyncs)
  gguf-py copy  GGUFReader + GGUFWriter (add_tensor_info, write_tensor_data(data[perm]) per
                tensor), the way gguf-py's own gguf_new_metadata.py copies, then sync
  reorder       mbolt reorder --plan (random perm: every slice moves), layouts reorder, packed
  read both     cat src out > /dev/null
  verify        mbolt verify --no-parity (bit-identity of every byte)

Two cache states: "warm" (files in the page cache) and "cold" (every input evicted with
posix_fadvise DONTNEED before the arm, proven with mincore). Goals (issue 5): reorder
throughput >= 0.8x cp; verify >= 0.8x the speed of reading both files once; peak RSS flat
from 1 GB to 4 GB. The machine is shared (2 cores, other jobs running): numbers are noisy.

usage: python scripts/bench_rewrite.py [--sizes 1,4] [--tmp DIR] [--out results/rewrite.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.core.pagecache import evict  # noqa: E402
from mbolt.synth.synth import SynthConfig, synth_size, write_synth  # noqa: E402
from mbolt.core.plan import Plan, save_plan  # noqa: E402

PRESET = "qwen3-30b-a3b"
MBOLT = [sys.executable, "-m", "mbolt"]

WRAPPER = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
out = subprocess.PIPE if "--json" in sys.argv else subprocess.DEVNULL  # never capture cat's bytes
r = subprocess.run(sys.argv[1:], stdout=out, stderr=subprocess.PIPE, text=True)
dt = time.perf_counter() - t
try:  # mbolt --json reports its own time (without interpreter start-up and imports)
    inner = json.loads(r.stdout)["seconds"]
except Exception:
    inner = None
print(json.dumps({"rc": r.returncode, "seconds": dt, "internal_seconds": inner, "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "stderr": r.stderr[-2000:]}))
"""

GGUFPY_COPY = r"""
import re, sys
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
src, dst, perm_path = sys.argv[1:4]
perm = np.load(perm_path)
r = GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = GGUFWriter(dst, arch)
for f in r.fields.values():
    if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.alignment"):
        continue
    vtype = f.types[0]
    w.add_key_value(f.name, f.contents(), vtype, f.types[-1] if vtype == GGUFValueType.ARRAY else None)
for t in r.tensors:
    w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
pat = re.compile(r"^blk\.(\d+)\.(ffn_(gate|up|down|gate_up)_exps\.(weight|bias)|ffn_gate_inp\.(weight|bias)|exp_probs_b\.bias)$")
for t in r.tensors:
    m = pat.match(t.name)
    w.write_tensor_data(t.data[perm[int(m.group(1))]] if m else t.data)
w.close()
import os
fd = os.open(dst, os.O_RDONLY)
os.fsync(fd)  # same durability as reorder
os.close(fd)
"""


def run(cmd: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    if d["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({d['rc']}): {d['stderr']}")
    d.pop("stderr")
    return d


def cold(*paths) -> list[dict]:
    return [evict(p).to_dict() for p in paths]


ARMS = ["cp", "cp+sync", "gguf-py copy", "reorder", "reorder packed", "read both", "verify"]


def timed_arms(cmds: dict, reps: int, log, prepare=None) -> tuple[dict, list]:
    """Every arm (name -> (command, bytes, input files)) `reps` times per cache state (warm: inputs
    read once before; cold: inputs evicted, proven by mincore), the arm order alternating between
    rounds, each arm its own process timed from outside with its peak RSS; `prepare()` runs before
    every arm. Returns the per-arm medians by cache state and every run."""
    runs = []
    names = list(cmds)
    for mode in ("warm", "cold"):
        for rep in range(reps):
            for name in (names if rep % 2 == 0 else names[::-1]):  # alternate the order each round
                cmd, nbytes, inputs = cmds[name]
                if prepare:
                    prepare()
                if mode == "warm":
                    run(["cat", *map(str, inputs)])
                    ev = []
                else:
                    ev = cold(*inputs)
                d = run(cmd)
                d.update(arm=name, mode=mode, round=rep, bytes=nbytes, throughput_gb_s=nbytes / d["seconds"] / 1e9,
                         cold_proven=all(e["proven"] for e in ev) if ev else None)
                runs.append(d)
                log(f"  {mode:4} r{rep} {name:14} {d['seconds']:7.2f} s  {d['throughput_gb_s']:6.2f} GB/s  "
                    f"rss {d['peak_rss_mb']:7.1f} MB" + (f"  (in-process {d['internal_seconds']:.2f} s)"
                                                         if d.get("internal_seconds") else ""))
    arms = {}
    for mode in ("warm", "cold"):
        arms[mode] = {}
        for name in names:
            xs = [r for r in runs if r["arm"] == name and r["mode"] == mode]
            sec = float(np.median([r["seconds"] for r in xs]))
            arms[mode][name] = {"median_seconds": sec, "seconds": [r["seconds"] for r in xs],
                                "throughput_gb_s": xs[0]["bytes"] / sec / 1e9, "bytes": xs[0]["bytes"],
                                "peak_rss_mb": max(r["peak_rss_mb"] for r in xs)}
            inner = [r["internal_seconds"] for r in xs if r.get("internal_seconds")]
            if inner:
                arms[mode][name]["internal_median_seconds"] = float(np.median(inner))
                arms[mode][name]["internal_throughput_gb_s"] = xs[0]["bytes"] / float(np.median(inner)) / 1e9
    return arms, runs


def bench_size(target_gb: float, tmp: Path, reps: int, log) -> dict:
    per_layer = synth_size(SynthConfig.from_preset(PRESET, n_layers=2, fast_random=True)) - synth_size(
        SynthConfig.from_preset(PRESET, n_layers=1, fast_random=True))
    n_layers = max(1, round(target_gb * 1e9 / per_layer))
    cfg = SynthConfig.from_preset(PRESET, n_layers=n_layers, fast_random=True, seed=1)
    src = tmp / f"src_{n_layers}.gguf"
    t0 = time.perf_counter()
    write_synth(src, cfg)
    gen = time.perf_counter() - t0
    size = src.stat().st_size
    log(f"synth {size / 1e9:.2f} GB ({n_layers} layers) in {gen:.1f} s")
    rng = np.random.default_rng(0)
    perm = np.stack([rng.permutation(cfg.n_experts) for _ in range(n_layers)]).astype(np.int32)
    plan = tmp / "plan.json"
    save_plan(plan, Plan("random", n_layers, cfg.n_experts, perm, np.ones(perm.shape)))
    np.save(tmp / "perm.npy", perm)
    out = tmp / "out.gguf"  # the reorder output the read/verify arms use (written once, untimed)
    subprocess.run([*MBOLT, "reorder", str(src), str(out), "--plan", str(plan), "--force", "--json"],
                   capture_output=True, text=True, check=True)
    out_size = out.stat().st_size
    scratch = tmp / "scratch.gguf"
    cmds = {
        "cp": (["cp", str(src), str(scratch)], size, [src]),
        "cp+sync": (["sh", "-c", f"cp '{src}' '{scratch}' && sync '{scratch}'"], size, [src]),
        "gguf-py copy": ([sys.executable, "-c", GGUFPY_COPY, str(src), str(scratch), str(tmp / "perm.npy")], size, [src]),
        "reorder": ([*MBOLT, "reorder", str(src), str(scratch), "--plan", str(plan), "--force", "--json"], size, [src]),
        "reorder packed": ([*MBOLT, "reorder", str(src), str(scratch), "--plan", str(plan), "--force",
                            "--layout", "packed", "--json"], size, [src]),
        "read both": (["cat", str(src), str(out)], size + out_size, [src, out]),
        "verify": ([*MBOLT, "verify", str(src), str(out), "--no-parity", "--json"], size + out_size, [src, out]),
    }
    def fresh_scratch():
        for p in (scratch, Path(str(scratch) + ".mbolt.json")):
            p.unlink(missing_ok=True)

    arms, runs = timed_arms({name: cmds[name] for name in ARMS}, reps, log, prepare=fresh_scratch)
    for p in (scratch, Path(str(scratch) + ".mbolt.json"), out, Path(str(out) + ".mbolt.json"), src):
        p.unlink(missing_ok=True)

    ratios = {}
    for mode in ("warm", "cold"):
        a = arms[mode]
        tp = lambda n: a[n]["throughput_gb_s"]  # noqa: E731
        ratios[mode] = {
            "reorder_vs_cp": tp("reorder") / tp("cp"),
            "reorder_vs_cp_sync": tp("reorder") / tp("cp+sync"),
            "packed_vs_cp": tp("reorder packed") / tp("cp"),
            "packed_vs_cp_sync": tp("reorder packed") / tp("cp+sync"),
            "reorder_vs_gguf_py_copy": tp("reorder") / tp("gguf-py copy"),
            "verify_vs_read_both": tp("verify") / tp("read both"),
            # without interpreter start-up and imports (~0.3-0.6 s per mbolt command on this machine)
            "reorder_internal_vs_cp_sync": a["reorder"]["internal_throughput_gb_s"] / tp("cp+sync"),
            "verify_internal_vs_read_both": a["verify"]["internal_throughput_gb_s"] / tp("read both"),
        }
    return {
        "target_gb": target_gb, "file_bytes": size, "out_bytes": out_size, "n_layers": n_layers, "preset": PRESET,
        "expert_type": cfg.expert_type, "n_experts": cfg.n_experts, "synth_seconds": gen, "reps": reps,
        "arms": arms, "ratios": ratios, "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4", help="target sizes in GB, comma separated")
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--out", default=str(ROOT / "results" / "rewrite.json"))
    ap.add_argument("--reps", type=int, default=2, help="rounds per cache state (arm order alternates)")
    ap.add_argument("--quiet-machine", action="store_true", help="record that nothing else ran during the run")
    a = ap.parse_args()
    sizes = [float(x) for x in a.sizes.split(",")]
    base = Path(a.tmp or tempfile.gettempdir())
    need = max(sizes) * 1e9 * 3.2
    free = shutil.disk_usage(base).free
    if free < need:
        sys.exit(f"{base}: {free / 1e9:.1f} GB free, need {need / 1e9:.1f} GB")
    runs = []
    with tempfile.TemporaryDirectory(prefix="mbolt-bench-rewrite-", dir=base) as tmp:
        for s in sizes:
            print(f"size ~{s} GB", flush=True)
            runs.append(bench_size(s, Path(tmp), a.reps, lambda m: print(m, flush=True)))
    q = SynthConfig.from_preset(PRESET)
    slice_bytes = q.hidden * q.expert_ff // 32 * 18  # Q4_0: 18 bytes per 32 weights
    for r in runs:
        r["slice_bytes"] = slice_bytes
    goals = {}
    for mode in ("warm", "cold"):
        goals[mode] = {
            "reorder_ge_0.8x_cp": all(r["ratios"][mode]["reorder_vs_cp"] >= 0.8 for r in runs),
            "reorder_ge_0.8x_cp_sync": all(r["ratios"][mode]["reorder_vs_cp_sync"] >= 0.8 for r in runs),
            "verify_ge_0.8x_read_both": all(r["ratios"][mode]["verify_vs_read_both"] >= 0.8 for r in runs),
            "in_process_reorder_ge_0.8x_cp_sync": all(r["ratios"][mode]["reorder_internal_vs_cp_sync"] >= 0.8 for r in runs),
            "in_process_verify_ge_0.8x_read_both": all(r["ratios"][mode]["verify_internal_vs_read_both"] >= 0.8 for r in runs),
        }
    if len(runs) >= 2:
        lo, hi = runs[0], runs[-1]
        for name in ("reorder", "reorder packed", "verify", "gguf-py copy", "cp"):
            rl = max(lo["arms"][m][name]["peak_rss_mb"] for m in ("warm", "cold"))
            rh = max(hi["arms"][m][name]["peak_rss_mb"] for m in ("warm", "cold"))
            goals[f"rss_{name.replace(' ', '_')}_mb"] = {
                "small_file": rl, "large_file": rh, "ratio": rh / rl,
                "flat": rh <= 1.1 * rl + 8, "under_300mb": rh < 300}
    result = {
        "benchmark": "rewrite",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "filesystem_note": "temp dir on the same filesystem as the source (copy_file_range in-kernel)",
                    "shared": ("2 cores, no other jobs during the run" if a.quiet_machine
                               else "2 cores shared with other jobs; single run per arm: noisy")},
        "method": __doc__,
        "runs": runs,
        "goals": goals,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from mbolt.core.atomic import write_text_atomic

    write_text_atomic(out, json.dumps(result, indent=1) + "\n")
    print(json.dumps(goals, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
