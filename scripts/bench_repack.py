"""What llama.cpp's repacked CPU kernels would be worth to the runtime (issue 35, the peers' kernels).

The runtime loads a model with llama.cpp's extra buffer types off (`use_extra_bufts=False`): the
expert tensors must stay pages of the mapped file, so that its reads are what the matmuls use. The
default load repacks Q4_0/Q4_K/IQ4_NL weights into interleaved rows in anonymous memory (all of
them: a model larger than RAM cannot load that way), where the CPU backend has faster kernels.
This measures the two loads warm (the file in memory, no limit) on the same text, teacher-forced:

    mapped    the runtime's load: the file mapped, no repacking, no callback
    repacked  llama.cpp's default load: repackable weights copied and interleaved

Each arm-round is a fresh process (a load is per process), the arms alternate in a rotated order;
figures: a prompt's tokens per second (one `n_batch`-token pass per batch) and decode tokens per
second after it, the process's anonymous memory after the load. Ratios are medians of same-round
pairs. The pre-registration names the models, rounds, prompt and decode lengths and the goals.

    python scripts/bench_repack.py --prereg prereg/repack_kernels.toml   # writes results/repack.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.core.errors import MboltError  # noqa: E402

BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench"))
ARMS = ("mapped", "repacked")


def worker(arm: str, path: str, prompt: int, new: int, n_batch: int) -> dict:
    """One arm-round in this process: load, a prompt of `prompt` tokens, then `new` fed tokens."""
    from mbolt.data import path as data_path
    from mbolt.runtime.arm import own_bytes
    from mbolt.runtime.driver import open_driver

    # plain llama.cpp on the driver the commands use: mapped, or llama.cpp's default load
    with open_driver(path, reads=False, evict=False, repacked=arm == "repacked", n_ctx=prompt + new + 16,
                     n_ubatch=n_batch) as d:
        ids = d.tokenize(Path(data_path("kl_text.txt")).read_text(), add_special=True)
        if len(ids) < prompt + new:
            raise MboltError(f"kl_text.txt gives {len(ids)} tokens, fewer than {prompt + new}")
        anon = own_bytes(("RssAnon:",))
        steps = d.decode(ids[:prompt], new, fed=ids[prompt:prompt + new])  # teacher-forced
        t0 = time.perf_counter()
        next(steps)  # the prompt's passes
        t1 = time.perf_counter()
        for _ in steps:  # one decode step per fed token
            pass
        t2 = time.perf_counter()
    return {"arm": arm, "prompt_tokens_per_s": prompt / (t1 - t0), "decode_tokens_per_s": new / (t2 - t1),
            "rss_anon_bytes": anon}


def run_arm(arm: str, path: Path, p: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", arm, str(path), str(p["prompt_tokens"]), str(p["new_tokens"]),
           str(p["n_batch"])]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise MboltError(f"{path}: the {arm} arm took over 30 minutes: stopped") from None
    if r.returncode != 0:
        raise MboltError(f"{path}: the {arm} arm failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def measure(name: str, p: dict) -> dict:
    path = BENCH / "memlimit" / name / "stock.gguf"
    if not path.exists():
        raise MboltError(f"{path}: missing: python scripts/bench_memlimit.py prepare --models {name}")
    warm(path)
    rows = []
    for rnd in range(p["rounds"]):
        order = ARMS if rnd % 2 == 0 else ARMS[::-1]
        for arm in order:
            rows.append({**run_arm(arm, path, p), "round": rnd})
            print(f"{name} r{rnd} {arm}: prompt {rows[-1]['prompt_tokens_per_s']:.1f} tok/s, decode "
                  f"{rows[-1]['decode_tokens_per_s']:.2f} tok/s", flush=True)

    def of(arm, key):
        return [r[key] for r in rows if r["arm"] == arm]

    out = {"model": name, "file_bytes": path.stat().st_size, "rounds": rows, "median": {}, "repacked_over_mapped": {}}
    for key in ("prompt_tokens_per_s", "decode_tokens_per_s"):
        out["median"][key] = {a: float(np.median(of(a, key))) for a in ARMS}
        pairs = [b / a for a, b in zip(of("mapped", key), of("repacked", key))]
        out["repacked_over_mapped"][key] = {"median": float(np.median(pairs)), "rounds": pairs}
    out["rss_anon_bytes"] = {a: int(np.median(of(a, "rss_anon_bytes"))) for a in ARMS}
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        arm, path, prompt, new, n_batch = sys.argv[2:7]
        print(json.dumps(worker(arm, path, int(prompt), int(new), int(n_batch))))
        return 0
    from mbolt.bench.prereg import begin_run, write_result

    try:
        out, pr, rec = begin_run(__doc__, ROOT, ROOT / "results" / "repack.json",
                                 ["prompt_gain_min", "decode_gain_min"], BENCH)
        p = pr.raw
        results = [measure(m, p) for m in p["models"]]
    except MboltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    goals = []
    for res in results:
        for key, g in (("prompt_tokens_per_s", "prompt_gain_min"), ("decode_tokens_per_s", "decode_gain_min")):
            v = res["repacked_over_mapped"][key]["median"]
            goals.append({"goal": f"{res['model']}: repacked >= {pr.goal(g)}x mapped, {key.split('_')[0]}",
                          "value": v, "met": v >= pr.goal(g)})
    write_result(pr, rec, out, {"results": results, "goals": goals,
                                  "workload": f"warm, teacher-forced: a {p['prompt_tokens']}-token prompt in "
                                              f"{p['n_batch']}-token passes, then {p['new_tokens']} fed tokens"})
    for g in goals:
        print(f"  {g['goal']}: {g['value']:.3f} -> {'met' if g['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
