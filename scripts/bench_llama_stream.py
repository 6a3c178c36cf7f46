"""llama.cpp as the streaming engine (issue 15) -> results/llama_stream_*.json.

Arms, in llama.cpp 0.3.36 through the bindings (runtime.driver, `ab --engine llama.cpp`):
  stock-reads   stock file, mbolt's explicit reads from the eval callback (the A/B baseline and
                the law's reference)
  reorder-tsp   reorder(tsp) file, the same reads
  stock-os      stock file, no callback, llama.cpp's page faults + kernel readahead read
  + the A/A control (stock-reads again). Every cold arm drops the expert pages after each token.
Warm control run (not cold): plain llama.cpp (`os,warm`) vs the callback without reads
(`os,warm,callback`): the callback's own overhead, and the warm decode time of the limit.

Stages, so that predictions are pre-registered before anything is measured:
  python scripts/bench_llama_stream.py prepare [--models ..] [--families ..]
      models, a llama.cpp trace of training prompts, plan tsp, reorder; the held-out bench
      prompts' routing (one warm generation); predicted reads/token and g per QD (evaluator +
      results/probe.json); writes prereg/llama_stream_<model>_qd<N>.toml where none exists
      (s for the prediction: --s-assumed, else from one warm decode timing, said in the file)
  python scripts/bench_llama_stream.py run [--quiet-machine]
      the pre-registered cold A/Bs (QD1, QD4) and the warm control per model, then the goals
      -> results/llama_stream_summary.json
  python scripts/bench_llama_stream.py smoke      # seconds: tiny model, 1 round, checks the script

Models (files in $MBOLT_BENCH/llama_stream, default /tmp/mbolt-bench): s64k (16 x 64 experts,
k=8, 64 KiB F32 slices, planted groups), q30b8 (Qwen3-30B-A3B shapes, Q4_0 864 KiB slices,
128 experts, k=8, 8 layers, fast-random bytes), and one 64 KiB-slice file per family in
--families (the synth archs llama.cpp runs; a family synth does not know is skipped, said so).
Goals (issue 15; benchmarks, not tests): stock-reads >= 2x stock-os decode tok/s (s64k);
best arm within 1.25x of the limit (bytes/token / probe BW + warm decode time); reorder-tsp
over stock-reads within 10% of the law's prediction (s measured in the run); callback
overhead warm >= 0.9x plain decode tok/s; tokens identical in every arm of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbolt.bench.ab import run_ab, write_result  # noqa: E402

from mbolt.bench.arms import Arm  # noqa: E402

from mbolt.bench.llama_stream import (FAMILIES, GOALS, MODELS, SLICE_64K, family_spec, goals,  # noqa: E402
                                      predict_config, prereg_text, synth_config)
from mbolt.bench.paired import row  # noqa: E402
from mbolt.core.atomic import write_text_atomic  # noqa: E402

BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench")) / "llama_stream"
RESULTS = ROOT / "results"
PREREG = ROOT / "prereg"
PROBE = RESULTS / "probe.json"
PROMPTS = ROOT / "mbolt" / "data" / "prompts.jsonl"
QDS = (1, 4)
NOISE_NOTE = "2 shared cores, other workers running on the machine: timings are noisy"


def paths(name: str) -> dict:
    d = BENCH / name
    return {"dir": d, "stock": d / "stock.gguf", "train": d / "train.mbtrace", "plan": d / "plan.json",
            "reorder-tsp": d / "reorder-tsp.gguf", "bench": d / "bench.json"}


def prereg_path(name: str, qd: int) -> Path:
    return PREREG / f"llama_stream_{name}_qd{qd}.toml"


def cold_arms(name: str, qd: int) -> list[Arm]:
    p = paths(name)
    return [Arm("stock-reads", str(p["stock"]), io_threads=qd), Arm("reorder-tsp", str(p["reorder-tsp"]), io_threads=qd),
            Arm("stock-os", str(p["stock"]), mode="os")]


def warm_arms(name: str) -> list[Arm]:
    p = paths(name)
    return [Arm("plain", str(p["stock"]), mode="os", warm=True),
            Arm("callback", str(p["stock"]), mode="os", warm=True, callback=True)]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---- prepare: models, plan, predictions, pre-registration ----


def prepare(name: str, spec: dict, s_assumed: float | None) -> dict:
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.measured import record_routing
    from mbolt.core.header import read_header
    from mbolt.core.mbtrace import read_trace
    from mbolt.core.moe_map import moe_map
    from mbolt.core.plan import save_plan
    from mbolt.core.prompts import read_prompts
    from mbolt.synth.synth import write_synth
    from mbolt.layout.evaluate import geometry_from_model
    from mbolt.layout.plan import make_plan
    from mbolt.rewrite.reorder import reorder_file
    from mbolt.reference.tokenizer import Tokenizer
    from mbolt.trace.tracer import trace_prompts

    p = paths(name)
    p["dir"].mkdir(parents=True, exist_ok=True)
    write_synth(p["stock"], synth_config(spec["synth"]))
    prompts = read_prompts(PROMPTS)
    n_train = spec["train_prompts"]
    # held-out: the bench prompts come after the training prompts in the file (never planned on)
    trace_prompts(p["stock"], prompts[:n_train], p["train"], max_new_tokens=16, engine="llama.cpp")
    mm = moe_map(p["stock"])
    plan = make_plan(read_trace(p["train"]), "tsp", train_frac=1.0, phase="all",
                     geometry=geometry_from_model(mm, "reorder"))
    save_plan(p["plan"], plan)
    reorder_file(p["stock"], p["reorder-tsp"], plan=p["plan"], layout="reorder", force=True)
    texts = [pr.text for pr in prompts[n_train: n_train + spec["bench_prompts"]]]
    tok = Tokenizer.from_header(read_header(p["stock"]))
    ids = [tok.encode(t)[:64] for t in texts]  # as `ab --decode` does (bench.ab.load_prompt_ids)
    routing = record_routing(p["stock"], ids, spec["new_tokens"])
    warm_ms = None
    if s_assumed is None:  # the one timing prepare takes: a warm plain decode, for the s estimate
        with open_driver(p["stock"], reads=False, evict=False) as s:
            run = s.generate(ids, spec["new_tokens"])
        warm_ms = 1e3 * run.decode_s / run.decode_tokens
    preds = {qd: predict_config(cold_arms(name, qd)[:2], qd, routing, warm_ms, s_assumed, PROBE) for qd in QDS}
    meta = {"model": name, "synth": spec["synth"], "prompt_ids": ids, "new_tokens": spec["new_tokens"],
            "rounds": spec["rounds"], "warm_ms_per_token": warm_ms, "predictions": preds,
            "file_bytes": p["stock"].stat().st_size}
    write_text_atomic(p["bench"], json.dumps(meta, indent=1) + "\n")
    for qd in QDS:
        write_prereg(name, qd, meta)
    return meta


def write_prereg(name: str, qd: int, meta: dict) -> Path | None:
    """The pre-registration of one cold A/B (never over an existing file: it may be locked)."""
    path = prereg_path(name, qd)
    if path.exists():
        log(path.name, "exists: kept (a pre-registration is never rewritten)")
        return None
    write_text_atomic(path, prereg_text(name, qd, meta, PROBE.name))
    log("wrote", path.relative_to(ROOT))
    return path


# ---- run ----


def run_model(name: str, quiet: bool, rounds: int | None = None, tag: str = "") -> dict:
    from mbolt.runtime.measured import record_routing
    from mbolt.bench.predict import predict_llama
    from mbolt.bench.prereg import check_and_lock, load_prereg, verdict

    p = paths(name)
    meta = json.loads(p["bench"].read_text())
    ids, n_new = meta["prompt_ids"], meta["new_tokens"]
    os.environ.setdefault("MBOLT_BENCH", str(BENCH.parent))
    routing = record_routing(p["stock"], ids, n_new)
    out = {}
    for qd in QDS:
        cname = f"llama_stream_{name}_qd{qd}{tag}"
        pr = None
        arms = cold_arms(name, qd)
        if prereg_path(name, qd).exists() and not tag:
            pr = load_prereg(prereg_path(name, qd))
            lock = check_and_lock(pr)
            log(cname, "pre-registered:", pr.sha256[:16], "run", lock["runs"])
            arms = pr.arms
        t0 = time.perf_counter()
        res = run_ab(arms, mode="decode", rounds=rounds or (pr.rounds if pr else meta["rounds"]), name=cname,
                     prompts=ids, n_new=n_new, engine="llama.cpp", prereg=pr.to_dict() if pr else None)
        res.prediction = predict_llama(res, routing, PROBE)
        if pr:
            res.prereg["result"] = verdict(pr, res.summary)
        res.notes.append(NOISE_NOTE if not quiet else "no other jobs on the machine during the run (2 cores)")
        write_result(RESULTS / f"{cname}.json", res)
        log(cname, f"{time.perf_counter() - t0:.0f}s", json.dumps({s["arm"]: round(s.get("decode_tokens_per_s") or 0, 2)
                                                                    for s in res.summary}))
        out[qd] = res.to_dict()
    out["warm"] = run_warm(name, meta, ids, n_new, rounds, tag)
    return {"meta": meta, "runs": out}


def run_warm(name: str, meta: dict, ids, n_new: int, rounds: int | None = None, tag: str = "") -> dict:
    """The warm control: plain llama.cpp against the callback without reads (its own overhead)."""
    wname = f"llama_stream_{name}_warm{tag}"
    res = run_ab(warm_arms(name), mode="decode", rounds=rounds or meta["rounds"], name=wname, prompts=ids,
                 n_new=n_new, engine="llama.cpp")
    res.notes.append("warm control: every page resident by design (not cold)")
    write_result(RESULTS / f"{wname}.json", res)
    return res.to_dict()


def smoke() -> None:
    """Seconds: a tiny model through prepare-like steps and one round of each run (no prereg)."""
    global BENCH, MODELS, QDS, RESULTS
    BENCH = Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench")) / "llama_stream_smoke"
    RESULTS = BENCH / "results"  # a smoke run is not a result: nothing goes to results/
    RESULTS.mkdir(parents=True, exist_ok=True)
    MODELS = {"tiny": dict(synth={**SLICE_64K, "n_layers": 2, "n_experts": 16, "n_used": 4}, train_prompts=4,
                           bench_prompts=1, new_tokens=3, rounds=1)}
    QDS = (1,)
    meta = prepare_no_prereg("tiny")
    got = run_model("tiny", quiet=False, rounds=1, tag="_smoke")
    got["meta"] = meta
    log(json.dumps(goals("tiny", got, QDS, PROBE), indent=1, default=str)[:2000])


def prepare_no_prereg(name: str) -> dict:
    global write_prereg
    keep = write_prereg
    write_prereg = lambda *a, **k: None  # noqa: E731 (the smoke run registers nothing)
    try:
        return prepare(name, MODELS[name], s_assumed=0.9)
    finally:
        write_prereg = keep


def main() -> None:
    global QDS
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["prepare", "run", "warm", "smoke"],
                    help="warm: only the warm callback-overhead control of prepared models")
    ap.add_argument("--models", default=",".join(MODELS), help="models (s64k, q30b8)")
    ap.add_argument("--families", default=FAMILIES, help="synth archs llama.cpp runs, one 64 KiB-slice file each")
    ap.add_argument("--s-assumed", type=float, default=None,
                    help="prepare: s for the law's prediction (default: estimated from one warm decode)")
    ap.add_argument("--quiet-machine", action="store_true", help="record that nothing else ran on the machine")
    ap.add_argument("--qds", default=",".join(map(str, QDS)), help="queue depths to run (default 1,4)")
    args = ap.parse_args()
    QDS = tuple(int(q) for q in args.qds.split(",") if q)
    if args.stage == "smoke":
        smoke()
        return
    for fam in filter(None, args.families.split(",")):
        MODELS[f"fam-{fam}"] = family_spec(fam)
    names = [m for m in args.models.split(",") if m] + [f"fam-{f}" for f in args.families.split(",") if f]
    RESULTS.mkdir(exist_ok=True)
    if args.stage == "prepare":
        from mbolt.core.errors import MboltError

        skipped = {}
        for n in names:
            try:
                meta = prepare(n, MODELS[n], args.s_assumed)
                log(n, json.dumps({qd: {k: round(v, 3) for k, v in p.items() if isinstance(v, float)}
                                   for qd, p in meta["predictions"].items()}))
            except MboltError as e:  # a family the synth (or llama.cpp) does not know: said, not hidden
                skipped[n] = str(e)
                log(n, "SKIPPED:", e)
        write_text_atomic(BENCH / "prepare.json", json.dumps({"skipped": skipped}, indent=1) + "\n")
        return
    if args.stage == "warm":
        for n in names:
            if paths(n)["bench"].exists():
                meta = json.loads(paths(n)["bench"].read_text())
                w = run_warm(n, meta, meta["prompt_ids"], meta["new_tokens"])
                plain, cb = row(w, "plain"), row(w, "callback")
                log(n, f"callback {cb['decode_tokens_per_s']:.1f} / plain {plain['decode_tokens_per_s']:.1f} tok/s = "
                       f"{cb['decode_tokens_per_s'] / plain['decode_tokens_per_s']:.2f}x (goal >= "
                       f"{GOALS['callback_overhead_min']})")
        return
    t0 = time.perf_counter()
    # models measured in an earlier run keep their entries (each model's result files are its own)
    old = RESULTS / "llama_stream_summary.json"
    summary = json.loads(old.read_text()) if old.exists() else {}
    summary = {"models": summary.get("models", {}), "skipped": {}}
    for n in names:
        if not paths(n)["bench"].exists():
            summary["skipped"][n] = "not prepared (see prepare.json)"
            continue
        got = run_model(n, args.quiet_machine)
        # per queue depth: a run of --qds 4 alone keeps the model's earlier qd1 entry
        summary["models"][n] = {**summary["models"].get(n, {}), **goals(n, got, QDS, PROBE)}
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    write_text_atomic(RESULTS / "llama_stream_summary.json", json.dumps(summary, indent=1, default=str) + "\n")
    log(json.dumps(summary, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
