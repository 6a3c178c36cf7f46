"""How long a kernel-layout file takes to load, with and without huge pages (issue 54) -> results/kernel_load_<model>.json.

The runtime loads a kernel-layout file through a stand-in (runtime.kernel_load): llama.cpp reads a
data section of zeros, repacks them into its buffers, and the runtime gives every page back as the
next tensor starts. At full depth that took 25-27 s of one CPU before the first token, most of it
the kernel's 4 KiB page faults. The buffers now take huge pages while llama.cpp writes them
(`load_kernel_model(huge_pages=True)`, the default).

Arms, each a fresh process per round (balanced orders, bench.design): `4k` (huge_pages=False, as
before), `huge` and its A/A twin `huge (A/A)`. Each process loads the file, finds its weights'
places and gives every weight's pages back (load_kernel_model, what every run of the runtime does
first), then closes it. Timed: wall and CPU seconds of that call; the peak RSS of the process.
No memory limit: the load reads no weight from the drive (the stand-in's data section is holes).

    python scripts/bench_kernel_load.py --model q48 --rounds 5 --prereg PREREG [--out PATH]

The model: the kernel-layout file of bench_deep_kernel.py (q48: `stock.kl.gguf`) or bench_kernel.py
(`reorder.kl.gguf`), whichever `prepare` wrote. Goals, from the pre-registration: `huge_over_4k_max`
(the median of same-round ratios huge / 4k) and `aa_within`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.design import run_rounds  # noqa: E402
from mbolt.bench.memlimit import kernel_of, log, paths  # noqa: E402
from mbolt.bench.prereg import gate_run, run_record, write_result  # noqa: E402
from mbolt.core.errors import MboltError  # noqa: E402

GOALS = ("huge_over_4k_max", "aa_within")
ONE_LOAD = """
import json, resource, sys, time
from mbolt.runtime.kernel_load import load_kernel_model
t, c = time.perf_counter(), time.process_time()
km = load_kernel_model(sys.argv[1], huge_pages=sys.argv[2] == "1")
wall, cpu = time.perf_counter() - t, time.process_time() - c
km.close()
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "llama_load_s": km.timings["load_s"],
                  "buffers_dropped": km.timings["buffers_dropped"],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


class LoadArm:
    def __init__(self, name: str, huge: bool, control_of: str | None = None):
        self.name, self.huge, self.control_of = name, huge, control_of


ARMS = [LoadArm("4k", False), LoadArm("huge", True), LoadArm("huge (A/A)", True, control_of="huge")]


def kernel_file(model: str) -> Path:
    for source in ("stock", "reorder"):
        if kernel_of(model, source).exists():
            return kernel_of(model, source)
    raise MboltError(f"{paths(model)['dir']}: no kernel-layout file (run bench_deep_kernel.py or bench_kernel.py prepare)")


def one_load(path: Path, arm: LoadArm) -> dict:
    p = subprocess.run([sys.executable, "-c", ONE_LOAD, str(path), "1" if arm.huge else "0"], capture_output=True,
                       text=True, cwd=ROOT)
    if p.returncode != 0:
        raise MboltError(f"{path}: the {arm.name} load failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return {"arm": arm.name, **json.loads(p.stdout.strip().splitlines()[-1])}


def same_round_ratio(rows: list[dict], a: str, b: str, key: str = "wall_s") -> dict:
    import numpy as np

    by = {(r["round"], r["arm"]): r[key] for r in rows}
    ratios = [by[(k, a)] / by[(k, b)] for k in sorted({r["round"] for r in rows}) if (k, a) in by and (k, b) in by]
    return {"median": float(np.median(ratios)), "rounds": ratios}


def measure(model: str, rounds: int, seed: int = 0) -> dict:
    import numpy as np

    path = kernel_file(model)
    rows, orders = run_rounds(ARMS, rounds, seed, lambda arm: one_load(path, arm),
                              progress=lambda d, t, r: log(f"  {d}/{t} {r['arm']}: {r['wall_s']:.2f} s "
                                                           f"({r['cpu_s']:.2f} s CPU)"))
    summary = {a.name: {k: float(np.median([r[k] for r in rows if r["arm"] == a.name]))
                        for k in ("wall_s", "cpu_s", "peak_rss_bytes")} for a in ARMS}
    return {"model": model, "kernel_file": str(path), "kernel_file_bytes": path.stat().st_size, "rounds": rounds,
            "orders": orders, "summary": summary, "huge_over_4k": same_round_ratio(rows, "huge", "4k"),
            "aa": same_round_ratio(rows, "huge (A/A)", "huge"), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="q48", help="the bench model whose kernel-layout file is loaded (default q48)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prereg", type=Path, required=True, help="the run's pre-registration, committed and locked")
    ap.add_argument("--out", type=Path, default=None, help="default results/kernel_load_<model>.json")
    a = ap.parse_args(argv)
    out = a.out or ROOT / "results" / f"kernel_load_{a.model}.json"
    try:
        path = kernel_file(a.model)
        pr, lock = gate_run(a.prereg, ROOT, GOALS, out)
        rec = run_record(pr, lock, ROOT, path)
        res = measure(a.model, a.rounds)
        ratio, aa = res["huge_over_4k"]["median"], res["aa"]["median"]
        res["goals"] = [{"goal": f"load with huge pages <= {pr.goal('huge_over_4k_max')}x the 4 KiB load (wall)",
                         "value": ratio, "met": ratio <= pr.goal("huge_over_4k_max")},
                        {"goal": f"A/A within {pr.goal('aa_within'):.0%}", "value": abs(aa - 1),
                         "met": abs(aa - 1) <= pr.goal("aa_within")}]
        res.update({"benchmark": "a kernel-layout file's load with and without huge pages (issue 54)",
                    "script": "scripts/bench_kernel_load.py"})
        write_result(pr, rec, out, res)
    except MboltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log("wrote", out)
    for g in res["goals"]:
        log(f"  {g['goal']}: {g['value']:.3f}: {'met' if g['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
