"""Benchmark split GGUF sets -> results/split.json (and results/split_geometry.json).

Part 1, "set" (issue 11 goal: reorder >= 0.8x cp+sync with peak RSS < 300 MB; verify >= 0.8x
of reading both sets once, cold). A fast-random synth model with Qwen3-30B-A3B expert geometry
(~--set-gb GB) is written to a temp dir and cut into a set of --shards shards (`mbolt reorder
--identity --split-max-size`, the tensors of a layer together as gguf-split keeps them).
Arms, each its own process timed from outside with its peak RSS (bench_rewrite.py's wrapper):
  cp+sync         cp every shard, then sync them (the durability reorder gives: it fsyncs)
  reorder         mbolt reorder SET OUT --plan (random perm: every slice moves), as a set
  reorder packed  the same, --layout packed
  read both       cat every shard of the input and of the output > /dev/null
  verify          mbolt verify SET OUT --no-parity (every byte, padding included)
in two cache states (warm: files read once before; cold: every input evicted, proven by
mincore), arm order alternating between rounds, medians reported.

Part 3 (with --like PROFILE): `mbolt synth-trace --like PROFILE` and `mbolt plan` (tsp,
mbolt-chain, --compare for held-out reads/token of every method) on that trace, timed.

Part 2, "geometry" (goal: flat memory, RSS < 300 MB whatever the size): the 744B-class geometry
of --preset (default glm-5.2, the GLM-5.2-shaped synth preset; if this mbolt has no such preset
it falls back to qwen3moe with 78 layers x 256 experts, k=8) with its expert slices scaled down
so the set is ~--geo-gb GB. Wall time and peak RSS of: inspect, plan (tsp on a sampled
Zipf trace of --tokens decode tokens over every MoE layer), reorder (both layouts, as a set)
and verify of each output.

The machine this runs on must be quiet (the lead runs it): a tiny smoke run is
  python scripts/bench_split.py --set-gb 0.05 --geo-gb 0.03 --reps 1 --tokens 500 --out /tmp/s.json

usage: python scripts/bench_split.py [--set-gb 4] [--shards 4] [--preset glm-5.2] [--geo-gb 4]
                                     [--reps 2] [--tmp DIR] [--out results/split.json]
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
sys.path.insert(0, str(ROOT / "scripts"))

from bench_rewrite import MBOLT, run, timed_arms  # noqa: E402
from mbolt.core.atomic import write_text_atomic  # noqa: E402
from mbolt.core.moe_map import moe_map  # noqa: E402
from mbolt.core.plan import Plan, save_plan  # noqa: E402
from mbolt.synth.synth import PRESETS, SynthConfig, synth_size, write_synth  # noqa: E402

SET_PRESET = "qwen3-30b-a3b"
FALLBACK = dict(arch="qwen3moe", n_layers=78, n_experts=256, n_used=8, expert_type="Q4_0")


def set_files(out: Path) -> list[Path]:
    """The files of the model mbolt wrote at `out` (a set's shards, or the one file)."""
    return [Path(p) for p in moe_map(out).paths]


def remove_model(out: Path) -> None:
    for p in out.parent.glob(out.stem + "-0*-of-*.gguf*"):
        p.unlink()
    for p in (out, Path(str(out) + ".mbolt.json")):
        p.unlink(missing_ok=True)


def random_plan(path: Path, n_layers: int, n_experts: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(n_experts) for _ in range(n_layers)]).astype(np.int32)
    save_plan(path, Plan("random", n_layers, n_experts, perm, np.ones(perm.shape)))


def model_for_size(base: dict, target_gb: float, preset: str | None) -> SynthConfig:
    """A config with `base`'s layers/experts and expert_ff scaled so the file is ~target_gb."""
    def cfg(ff: int) -> SynthConfig:
        kw = dict(base, expert_ff=ff, fast_random=True, seed=1)
        return SynthConfig.from_preset(preset, **kw) if preset else SynthConfig(**kw)
    ff = 32
    small, big = synth_size(cfg(ff)), synth_size(cfg(2 * ff))
    per_ff = (big - small) / ff
    want = int((target_gb * 1e9 - small) / per_ff) + ff if per_ff > 0 else ff
    return cfg(max(32, want // 32 * 32))


def synth_set(cfg: SynthConfig, src: Path, n_shards: int) -> tuple[Path, list[Path], int]:
    """Write the model `cfg` and cut it into a set of about `n_shards` shards at `src` (an
    identity reorder with --split-max-size, the tensors of a layer together as gguf-split keeps
    them); returns (src, shard paths, bytes of the one-file model)."""
    one = write_synth(src.with_name(src.stem + ".one.gguf"), cfg)
    size = one.stat().st_size
    run([*MBOLT, "reorder", str(one), str(src), "--identity", "--split-max-size", str(-(-size // n_shards) + 1), "--json"])
    one.unlink()
    return src, set_files(src), size


def bench_set(target_gb: float, n_shards: int, tmp: Path, reps: int, log) -> dict:
    per_layer = synth_size(SynthConfig.from_preset(SET_PRESET, n_layers=2, fast_random=True)) - synth_size(
        SynthConfig.from_preset(SET_PRESET, n_layers=1, fast_random=True))
    n_layers = max(n_shards, round(target_gb * 1e9 / per_layer))
    cfg = SynthConfig.from_preset(SET_PRESET, n_layers=n_layers, fast_random=True, seed=1)
    src, shards, size = synth_set(cfg, tmp / "set.gguf", n_shards)
    log(f"set of {len(shards)} shards, {size / 1e9:.2f} GB ({n_layers} layers)")
    plan = tmp / "plan.json"
    random_plan(plan, n_layers, cfg.n_experts)
    out = tmp / "out.gguf"  # the output the read/verify arms use (written once, untimed)
    run([*MBOLT, "reorder", str(shards[0]), str(out), "--plan", str(plan), "--json"])
    outs = set_files(out)
    out_size = sum(p.stat().st_size for p in outs)
    scratch = tmp / "scratch.gguf"
    copies = [tmp / f"copy-{p.name}" for p in shards]
    cp_sync = " && ".join(f"cp '{a}' '{b}'" for a, b in zip(shards, copies)) + " && sync " + " ".join(
        f"'{b}'" for b in copies)
    cmds = {
        "cp+sync": (["sh", "-c", cp_sync], size, shards),
        "reorder": ([*MBOLT, "reorder", str(shards[0]), str(scratch), "--plan", str(plan), "--force", "--json"],
                    size, shards),
        "reorder packed": ([*MBOLT, "reorder", str(shards[0]), str(scratch), "--plan", str(plan), "--force",
                            "--layout", "packed", "--json"], size, shards),
        "read both": (["cat", *map(str, shards), *map(str, outs)], size + out_size, shards + outs),
        "verify": ([*MBOLT, "verify", str(shards[0]), str(outs[0]), "--no-parity", "--json"], size + out_size,
                   shards + outs),
    }

    def prepare():
        remove_model(scratch)
        for c in copies:
            c.unlink(missing_ok=True)
    arms, runs = timed_arms(cmds, reps, log, prepare)
    prepare()
    for p in shards + outs:
        p.unlink(missing_ok=True)
    remove_model(src)
    remove_model(out)
    ratios = {}
    for mode in ("warm", "cold"):
        a = arms[mode]
        tp = lambda n: a[n]["throughput_gb_s"]  # noqa: E731
        ratios[mode] = {"reorder_vs_cp_sync": tp("reorder") / tp("cp+sync"),
                        "packed_vs_cp_sync": tp("reorder packed") / tp("cp+sync"),
                        "verify_vs_read_both": tp("verify") / tp("read both")}
    goals = {
        "reorder_ge_0.8x_cp_sync_cold": ratios["cold"]["reorder_vs_cp_sync"] >= 0.8,
        "verify_ge_0.8x_read_both_cold": ratios["cold"]["verify_vs_read_both"] >= 0.8,
        "reorder_rss_under_300mb": max(arms[m][n]["peak_rss_mb"] for m in arms for n in ("reorder", "reorder packed")) < 300,
        "verify_rss_under_300mb": max(arms[m]["verify"]["peak_rss_mb"] for m in arms) < 300,
    }
    return {"target_gb": target_gb, "bytes": size, "out_bytes": out_size, "n_shards": len(shards),
            "n_layers": n_layers, "preset": SET_PRESET, "reps": reps, "arms": arms, "ratios": ratios,
            "goals": goals, "runs": runs}


def zipf_trace(path: Path, m, n_tokens: int, seed: int = 0) -> None:
    """Decode tokens routed with a per-layer Zipf heat (no co-activation structure: a timing load)."""
    from mbolt.core.mbtrace import write_trace
    from mbolt.core.trace import DECODE, Trace

    rng = np.random.default_rng(seed)
    L, E, k = m.n_layers, m.n_experts, m.n_used
    ex = np.full((n_tokens, L, k), -1, np.int16)
    p = 1.0 / np.arange(1, E + 1) ** 0.8
    p /= p.sum()
    for layer in m.moe_layers:
        order = rng.permutation(E)
        g = rng.gumbel(size=(n_tokens, E)) + np.log(p)[None, :]
        ex[:, layer.index] = order[np.argsort(-g, axis=1)[:, :k]]
    tr = Trace(L, E, k, ex, np.full(n_tokens, DECODE, np.uint8), np.zeros(n_tokens, np.int32),
               np.arange(n_tokens, dtype=np.int32), fingerprint=m.source_fingerprint)
    write_trace(path, tr)


def bench_like(profile: str, tokens: int, tmp: Path, log) -> dict:
    """Planning on a calibrated trace: `mbolt synth-trace --like PROFILE`, then `mbolt plan
    --compare` (every method on held-out tokens, tsp and mbolt-chain among them), timed."""
    trace = tmp / "like.mbtrace"
    d = run([*MBOLT, "synth-trace", "--like", profile, "-o", str(trace), "--tokens", str(tokens), "--json"])
    log(f"  synth-trace      {d['seconds']:7.2f} s  rss {d['peak_rss_mb']:7.1f} MB")
    out = {"profile": profile, "synth_trace": {"seconds": d["seconds"], "peak_rss_mb": d["peak_rss_mb"]}}
    for method in ("tsp", "mbolt-chain"):
        d = run([*MBOLT, "plan", str(trace), "--method", method, "--geometry", "unit", "--json"])
        out[method] = {"seconds": d["seconds"], "peak_rss_mb": d["peak_rss_mb"]}
        log(f"  plan {method:11} {d['seconds']:7.2f} s  rss {d['peak_rss_mb']:7.1f} MB")
    res = subprocess.run([*MBOLT, "plan", str(trace), "--compare", "--bound", "none", "--geometry", "unit", "--json"],
                         capture_output=True, text=True, check=True)
    out["compare"] = json.loads(res.stdout).get("compare")
    trace.unlink(missing_ok=True)
    return out


def bench_geometry(preset: str, target_gb: float, n_shards: int, tokens: int, tmp: Path, log) -> dict:
    if preset in PRESETS:
        base = {k: PRESETS[preset][k] for k in ("n_layers", "n_experts", "n_used")}
        base.update(hidden=min(PRESETS[preset].get("hidden", 256), 256))
        used, note = preset, f"preset {preset}, hidden and expert_ff scaled down"
        cfg = model_for_size(base, target_gb, preset)
    else:
        used, note = "fallback", (f"preset {preset!r} not in this mbolt: qwen3moe, 78 layers x 256 experts, k=8 "
                                  "(expert slices scaled down)")
        cfg = model_for_size(dict(FALLBACK, hidden=256), target_gb, None)
    log(f"geometry: {note}; {cfg.n_layers} layers x {cfg.n_experts} experts, hidden {cfg.hidden}, "
        f"expert_ff {cfg.expert_ff}")
    src, shards, size = synth_set(cfg, tmp / "g.gguf", n_shards)
    m = moe_map(shards[0])
    trace = tmp / "g.mbtrace"
    zipf_trace(trace, m, tokens)
    steps = {}

    def step(name, cmd):
        d = run(cmd)
        steps[name] = {"seconds": d["seconds"], "peak_rss_mb": d["peak_rss_mb"]}
        log(f"  {name:16} {d['seconds']:7.2f} s  rss {d['peak_rss_mb']:7.1f} MB")

    step("inspect", [*MBOLT, "inspect", str(shards[0]), "--json"])
    step("plan", [*MBOLT, "plan", str(trace), "--model", str(shards[0]), "--method", "tsp", "-o", str(tmp / "gp.json")])
    for layout in ("reorder", "packed"):
        out = tmp / f"g-{layout}.gguf"
        step(f"reorder {layout}", [*MBOLT, "reorder", str(shards[0]), str(out), "--plan", str(tmp / "gp.json"),
                                   "--layout", layout, "--json"])
        outs = set_files(out)
        step(f"verify {layout}", [*MBOLT, "verify", str(shards[0]), str(outs[0]), "--no-parity", "--json"])
        remove_model(out)
    remove_model(src)
    return {"preset": used, "requested_preset": preset, "note": note, "bytes": size, "n_shards": len(shards),
            "n_layers": cfg.n_layers, "n_experts": cfg.n_experts, "k": cfg.n_used, "hidden": cfg.hidden,
            "expert_ff": cfg.expert_ff, "trace_tokens": tokens, "steps": steps,
            "goals": {"rss_under_300mb": all(s["peak_rss_mb"] < 300 for s in steps.values())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set-gb", type=float, default=4.0, help="size of the set of part 1, GB (0 = skip part 1)")
    ap.add_argument("--shards", type=int, default=4, help="shards of each input set")
    ap.add_argument("--preset", default="glm-5.2", help="synth preset of the 744B-class geometry (part 2)")
    ap.add_argument("--geo-gb", type=float, default=4.0, help="size of the part 2 set, GB (0 = skip part 2)")
    ap.add_argument("--tokens", type=int, default=20000, help="decode tokens of the part 2 planning trace")
    ap.add_argument("--like", default=None, help="a co-activation profile (e.g. ../shared/data/mbolt/"
                    "coactivation_glm52_overlay.json): also time synth-trace --like and plan on it")
    ap.add_argument("--reps", type=int, default=2, help="rounds per cache state (arm order alternates)")
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--out", default=str(ROOT / "results" / "split.json"))
    ap.add_argument("--quiet-machine", action="store_true", help="record that nothing else ran during the run")
    a = ap.parse_args()
    base = Path(a.tmp or tempfile.gettempdir())
    need = max(a.set_gb, a.geo_gb) * 1e9 * 3.3
    free = shutil.disk_usage(base).free
    if free < need:
        sys.exit(f"{base}: {free / 1e9:.1f} GB free, need {need / 1e9:.1f} GB")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    result = {
        "benchmark": "split",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "shared": ("no other jobs during the run" if a.quiet_machine
                               else "shared with other jobs: noisy")},
        "method": __doc__,
    }
    with tempfile.TemporaryDirectory(prefix="mbolt-bench-split-", dir=base) as tmp:
        if a.set_gb > 0:
            log(f"part 1: set of ~{a.set_gb} GB")
            result["set"] = bench_set(a.set_gb, a.shards, Path(tmp), a.reps, log)
        if a.geo_gb > 0:
            log(f"part 2: 744B-class geometry, ~{a.geo_gb} GB")
            result["geometry"] = bench_geometry(a.preset, a.geo_gb, a.shards, a.tokens, Path(tmp), log)
        if a.like:
            log(f"part 3: planning on a trace calibrated to {a.like}")
            try:
                result["like"] = bench_like(a.like, a.tokens, Path(tmp), log)
            except (RuntimeError, subprocess.CalledProcessError) as e:  # e.g. a profile this mbolt cannot read
                result["like"] = {"profile": a.like, "error": str(e)[-500:]}
                log(f"  skipped: {str(e)[-300:]}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k]["goals"] for k in ("set", "geometry") if k in result}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
