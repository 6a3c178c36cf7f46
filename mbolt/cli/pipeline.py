"""The pipeline: trace, trace-merge, plan, reorder, verify, ab."""

from __future__ import annotations

from pathlib import Path

import typer

from mbolt.cli.common import (console, ctx_size_option, err_console, output, print_json, show, threads_option,
                               user_errors)
from mbolt.core.errors import MboltError


@user_errors
def trace_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF file."),
    prompts: Path = typer.Option(None, "--prompts", "-p", help="Prompts: .jsonl ({\"prompt\", \"source\"} per line) or text "
                                 "(one per line). Default: the 200 Dolly + CodeAlpaca prompts shipped with mbolt."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace file."),
    max_new_tokens: int = typer.Option(16, "--new-tokens", "-n", min=0, help="Greedy decode tokens per prompt."),
    engine: str = typer.Option("reference", "--engine", help="'reference' (numpy engine) or 'llama.cpp' (eval callback, any llama.cpp arch)."),
    limit: int = typer.Option(0, "--n-prompts", min=0, help="Use at most this many prompts (0 = all)."),
    threads: int = threads_option(),
    ctx_size: int = ctx_size_option("llama.cpp", "; a longer prompt is cut to fit."),
    route: str = typer.Option("file", help="Reference engine on reordered files: 'file' or 'map'."),
    shard: str = typer.Option(None, "--shard", help="I/N: trace only the I-th of N deterministic shares of the "
                              "prompts (prompts I, I+N, ...), e.g. on N machines; join with `mbolt trace-merge`."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing trace."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Run prompts and record every token's routing (prefill and decode) into an .mbtrace.
    MODEL may be any shard of a split set."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mbolt.core.moe_map import moe_map
    from mbolt.core.prompts import read_prompts
    from mbolt.trace.tracer import ENGINES, check_part, trace_prompts

    # everything checked before the progress bar starts (an error is then the only output)
    if engine not in ENGINES:
        raise MboltError(f"--engine {engine!r}: choose from {', '.join(ENGINES)}")
    if route not in ("file", "map"):
        raise MboltError(f"--route {route!r}: choose file or map")
    share = parse_share(shard) if shard else None
    mm = moe_map(model)
    output(out, "mbtrace", inputs=[model, prompts], force=force, what="trace",
           protected=(mm.fingerprint, mm.source_fingerprint))
    check_part(out, force)
    if prompts is None:
        from mbolt.data import PROMPTS, path

        prompts = path(PROMPTS)
    items = read_prompts(prompts, limit or None)
    if engine == "llama.cpp" and not as_json:
        from mbolt.core.memlimit import budget

        ram, where = budget(None)
        err_console.print(f"[dim]llama.cpp: the file mapped, repacking off (llama.cpp's default load copies Q4_0/Q4_K "
                          f"experts into anonymous memory): the weights stay reclaimable pages of the file, within "
                          f"the memory budget of {ram / 2**30:.1f} GiB ({where})[/]")
    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err_console, transient=as_json)
    tasks = []

    def progress(done, total, toks, secs):
        if not tasks:  # the bar appears once the model has loaded: a load error is the only output
            bar.start()
            tasks.append(bar.add_task(f"tracing ({engine})", total=len(items), rate=""))
        bar.update(tasks[0], completed=done, rate=f"{toks} tok, {toks / secs if secs > 0 else 0:.1f} tok/s")

    try:
        res = trace_prompts(model, items, out, max_new_tokens=max_new_tokens, engine=engine,
                            route=route, threads=threads or None, on_progress=progress, shard=share,
                            force=force, n_ctx=ctx_size)
    finally:
        bar.stop()
    if as_json:
        print_json(res)
    else:
        console.print(f"wrote [bold]{res['out']}[/]: {res['prompts']} prompts, {res['prefill_tokens']} prefill + "
                      f"{res['decode_tokens']} decode tokens in {res['seconds']:.1f} s "
                      f"({res['tokens_per_s']:.1f} tok/s, {engine})")


def parse_share(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4) for `trace --shard`."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise MboltError(f"--shard {text!r}: expected I/N, e.g. 2/4") from None
    if not 1 <= i <= n:
        raise MboltError(f"--shard {text}: expected I/N with 1 <= I <= N")
    return i, n


@user_errors
def trace_merge_cmd(
    traces: list[Path] = typer.Argument(..., help="Traces of the same model (e.g. from `mbolt trace --shard I/N`)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace."),
    force: bool = typer.Option(False, "--force", help="Replace a previous trace at --out (never an input)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Join traces of one model into one .mbtrace: refuses other models (fingerprint) or
    geometry, renumbers sequences, keeps domains."""
    from mbolt.core.atomic import check_output
    from mbolt.core.mbtrace import write_trace
    from mbolt.trace.formats import load_traces

    check_output(out, kind="mbtrace", inputs=traces, force=force, what="merged trace")
    tr = load_traces(traces)
    write_trace(out, tr, force=True)
    res = {"out": str(out), "inputs": [str(t) for t in traces], "tokens": tr.n_tokens,
           "sequences": int(len(set(tr.seq.tolist()))), "n_layers": tr.n_layers, "n_experts": tr.n_experts,
           "k": tr.k, "fingerprint": tr.fingerprint, "domains": len(tr.domains)}
    if as_json:
        print_json(res)
    else:
        console.print(f"wrote [bold]{out}[/]: {res['tokens']} tokens, {res['sequences']} sequences from "
                      f"{len(traces)} traces")


@user_errors
def plan_cmd(
    trace: list[Path] = typer.Argument(..., help="A .mbtrace or any importable trace (see `mbolt import-trace`); "
                                       "several traces of the same model are merged (as `mbolt trace-merge`). "
                                       "A colibri .coli_usage (heat only) gives a --method heat plan."),
    out: Path = typer.Option(None, "-o", "--out", help="Write the plan JSON here."),
    fmt: str = typer.Option("mbolt", "--format", help="mbolt (plan.json) or perms (the original mbolt's perms.json: "
                            "clique/chain/heat perms and heat, plus this plan's perm; `reorder --plan` reads both)."),
    method: str = typer.Option("tsp", "--method", help="stock, heat, heat-tsp, mbolt-chain or tsp."),
    train_frac: float = typer.Option(0.5, "--train-frac", min=0.0, max=1.0,
                                     help="Leading share of tokens to train on, in (0, 1] (rest held out)."),
    holdout_domain: str = typer.Option(None, "--holdout-domain", help="Hold out the sequences of this domain instead."),
    phase: str = typer.Option("decode", "--phase", help="decode or all."),
    model: Path = typer.Option(None, "--model", help="GGUF: slice sizes and a trace/model consistency check."),
    geometry: str = typer.Option(None, "--geometry", help="Slice-size preset when no --model (see mbolt.layout.evaluate.PRESETS)."),
    layout: str = typer.Option("reorder", "--layout", help="reorder (three tensors) or packed (gate|up|down per expert)."),
    gap: int = typer.Option(0, "--gap", min=0, help="Merge gap in bytes (the reader reads through holes this small)."),
    cache: int = typer.Option(0, "--cache-slots", min=0, help="Per-layer LRU cache slots when scoring."),
    compare: bool = typer.Option(False, "--compare", help="Score every method and the bound."),
    bound: str = typer.Option("auto", "--bound", help="auto, subtour, lp, top2 or none (with --compare)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output (plan and held-out trace)."),
    heldout: Path = typer.Option(None, "--heldout", help="Also write the held-out tokens here (.mbtrace, for `mbolt ab --replay`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Co-activation -> expert order per layer (plan.json), scored on held-out tokens."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from mbolt.layout.plan import plan_file
    from mbolt.report.layout_tables import compare_table, plan_summary

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(f"planning ({method})")
        res = plan_file(trace if len(trace) > 1 else trace[0], out, method=method, train_frac=train_frac, holdout_domain=holdout_domain,
                        phase=phase, model=model, geometry=geometry, layout=layout, gap=gap, cache_slots=cache,
                        compare=compare, bound=bound, force=force, heldout_out=heldout, fmt=fmt,
                        progress=lambda m: bar.update(task, description=f"planned {m}"))
    if as_json:
        print_json(res)
        return
    console.print(plan_summary(res), highlight=False)
    if "compare" in res:
        console.print(compare_table(res["compare"]))


@user_errors
def reorder_cmd(
    src: Path = typer.Argument(..., help="Source MoE GGUF (stock, or a file mbolt already rewrote), or any shard "
                               "of a split set (NAME-0000I-of-0000N.gguf: the whole set is read)."),
    dst: Path = typer.Argument(..., help="Output GGUF (a new path; the source is never modified). A set is written "
                               "as DST-00001-of-0000N.gguf ..."),
    plan: Path = typer.Option(None, "--plan", help="plan.json from `mbolt plan` (perms name original expert ids)."),
    layout: str = typer.Option("reorder", "--layout", help="reorder: standard tensor names, loads in unmodified "
                               "llama.cpp. packed: each expert's gate|up|down adjacent in one blob per layer "
                               "(blk.N.ffn_exps_packed) for explicit-read engines; the reference engine and "
                               "the store read it, llama.cpp does NOT load this layout."),
    identity: bool = typer.Option(False, "--identity", help="Identity plan: stock order plus a route map "
                                  "(a control for the whole pipeline; restores stock order of a rewritten file)."),
    trace: list[Path] = typer.Option(None, "--trace", help="Plan inline from this .mbtrace with the default method "
                                     "(repeat to merge traces of the same model)."),
    split_max_tensors: int = typer.Option(0, "--split-max-tensors", help="Write a set: at most this many tensors "
                                          "per shard (default: the input's shards, one file for one file)."),
    split_max_size: str = typer.Option(None, "--split-max-size", help="Write a set: at most this much tensor data "
                                       "per shard (e.g. 4G, 500M)."),
    no_split: bool = typer.Option(False, "--no-split", help="Write one file, even from a split set."),
    align: str = typer.Option(None, "--align", help="Alignment in bytes (a power of two, e.g. 4096, 64K): every tensor "
                              "starts aligned (general.alignment) and packed slots are padded to it (64K for Windows "
                              "unbuffered reads). Default: 4 KiB tensors, slots padded to 4 KiB where it costs <= 12.5%."),
    force: bool = typer.Option(False, "--force", help="Replace a previous mbolt output (never an input, nor the "
                               "model an input was made from, nor any other file)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Rewrite a MoE GGUF bit-exactly with experts in plan order (+ route map and JSON sidecar).

    Streams with bounded memory (os.copy_file_range); writes temp files beside the output,
    fsyncs and renames, so an interrupted run never leaves a partial output (a set is
    renamed into place as a whole: readers refuse a mix of shards of two runs)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from mbolt.report.rewrite_tables import reorder_table
    from mbolt.core.memlimit import parse_size
    from mbolt.core.packed import check_align
    from mbolt.rewrite.outplan import SplitSpec
    from mbolt.rewrite.reorder import reorder_file

    split = SplitSpec(no_split, split_max_tensors, parse_size(split_max_size, "--split-max-size"))
    split.check()
    align_bytes = None if align is None else check_align(parse_size(align, "--align"))
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task(f"writing {dst.name}", total=None)
        r = reorder_file(src, dst, plan=plan, trace=trace or None, identity=identity, layout=layout, force=force,
                         progress=lambda d, t: bar.update(task, completed=d, total=t), split=split,
                         align=align_bytes)
    show(as_json, r.to_dict(), lambda: reorder_table(r))


@user_errors
def verify_cmd(
    src: Path = typer.Argument(..., help="The source GGUF (one file or any shard of a split set)."),
    out: Path = typer.Argument(..., help="The file or set `mbolt reorder` wrote from it (any shard, or the "
                               "path given to reorder)."),
    prompts: Path = typer.Option(None, "--prompts", help="Prompts for routing parity: .jsonl (prompt/text field) "
                                 "or one per line (default: a built-in set)."),
    n_prompts: int = typer.Option(8, "--n-prompts", min=1, help="Use at most this many prompts."),
    tokens: int = typer.Option(8, "--new-tokens", "-n", min=1, help="Greedy tokens generated per prompt."),
    no_parity: bool = typer.Option(False, "--no-parity", help="Skip the reference-engine routing parity "
                                   "(bit-identity only)."),
    llama: bool = typer.Option(False, "--llama", help="Also load both in llama.cpp (reorder layout): same "
                               "greedy tokens, logits within tolerance."),
    ctx_size: int = ctx_size_option("--llama"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Check a rewritten GGUF: every tensor byte-identical through the route map, metadata
    identical apart from mbolt.* and alignment, routing parity.

    Exit 0: OUT is SRC rewritten, nothing but the order changed. Exit 1: OUT is a rewrite of SRC
    and differs (a byte, a key, the padding, routing). Exit 2: the two files are not one model and
    its rewrite (other geometry, no route map, made from another file), or a file is unreadable."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from mbolt.report.rewrite_tables import verify_table
    from mbolt.report.tables import human_bytes
    from mbolt.core.prompts import prompt_texts
    from mbolt.rewrite.verify import verify

    if ctx_size and not llama:
        raise MboltError("--ctx-size is llama.cpp's context: it needs --llama")
    if _is_kernel_file(out):
        return _verify_kernel(src, out, as_json)
    texts = prompt_texts(prompts, n_prompts)
    # one bar per long phase: the byte comparison, then the engine runs (forwards of both files)
    with Progress("[progress.description]{task.description}", BarColumn(), TextColumn("{task.fields[amount]}"),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        data = bar.add_task(f"comparing {out.name}", total=None, amount="")
        engines = None

        def on_bytes(d, t):
            bar.update(data, completed=d, total=t, amount=f"{human_bytes(d)} / {human_bytes(t)}")

        def on_forwards(d, t):
            nonlocal engines
            if engines is None:
                bar.stop_task(data)
                runs = [name for name, on in (("routing", not no_parity), ("llama.cpp", llama)) if on]
                engines = bar.add_task(" + ".join(runs) + " parity", total=t, amount="")
            bar.update(engines, completed=d, total=t, amount=f"{d}/{t} forwards")

        rep = verify(src, out, parity=not no_parity, prompts=texts, n_tokens=tokens, llama=llama,
                     progress=on_bytes, parity_progress=on_forwards, n_ctx=ctx_size)
    show(as_json, rep.to_dict(), lambda: verify_table(rep))
    if not rep.ok:
        raise typer.Exit(1)


def _is_kernel_file(path: Path) -> bool:
    from mbolt.core.header import read_header
    from mbolt.rewrite.kernel import is_kernel_file

    return path.is_file() and is_kernel_file(read_header(path))


def _verify_kernel(src: Path, out: Path, as_json: bool) -> None:
    """A kernel-layout file (`mbolt repack`) is checked by its round trip: restored in memory,
    byte for byte against SRC and against its recorded SHA-256."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from mbolt.rewrite.kernel import verify_kernel

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task(f"restoring {out.name} against {src.name}", total=None)
        rep = verify_kernel(src, out, progress=lambda d, t: bar.update(task, completed=d, total=t))
    ok = rep["identical"] and rep["sha256_ok"]
    show(as_json, rep, lambda: f"{out}: {'restores' if ok else 'does NOT restore'} {src} bit for bit "
         f"({rep['repacked_tensors']} tensors repacked for {rep['build']}"
         + ("" if rep["first_difference"] is None else f"; first difference at byte {rep['first_difference']}")
         + ("" if rep["sha256_ok"] else "; SHA-256 differs from the recorded one") + ")")
    if not ok:
        raise typer.Exit(1)


@user_errors
def ab_cmd(
    arms: list[str] = typer.Argument(None, help="Arms: FILE[:name=N,qd=4,direct,gap=B,os,cache=S] (llama.cpp also: "
                                     "warm, callback, async, pins, ubatch=N, pymisses, dropsnow, keepcompute, passcache, fileorder, "
                                     "parallel=N: decode N prompts together, one token of each per step). The first is the baseline."),
    replay_trace: Path = typer.Option(None, "--replay", help="Held-out trace: read exactly what each token needs (I/O only)."),
    decode: bool = typer.Option(False, "--decode", help="Generate with the engine (compute + I/O)."),
    engine: str = typer.Option("reference", "--engine", help="Decode engine: 'reference' (numpy engine + store) or "
                               "'llama.cpp' (explicit expert reads from llama.cpp's eval callback; os arms: page faults)."),
    prompts: Path = typer.Option(None, "--prompts", help="Decode: prompts file (.jsonl with a prompt field, or text lines)."),
    n_prompts: int = typer.Option(2, "--n-prompts", min=1, help="Decode: prompts used."),
    new_tokens: int = typer.Option(8, "--new-tokens", "-n", min=1, help="Decode: tokens generated per prompt."),
    forced: bool = typer.Option(False, "--forced", help="Decode: teacher forcing. Prefill each prompt's first 8 "
                                "tokens, then feed its next tokens one at a time (routing follows real text, every "
                                "arm decodes the same tokens). Without --prompts: the built-in text."),
    prompt_tokens: int = typer.Option(8, "--prompt-tokens", min=1, help="--forced: the prompt's length (tokens "
                                      "prefilled before the fed ones); its time is the time to first token."),
    followup_tokens: int = typer.Option(0, "--followup-tokens", min=0, help="--forced: after the decode steps, feed "
                                        "this many more tokens of the text as a follow-up turn on the same context "
                                        "(a session: its KV cache reused; its time to first token is recorded)."),
    ctx_size: int = ctx_size_option("llama.cpp"),
    ubatch: int = typer.Option(None, "--ubatch-size", "-ub", min=1, help="llama.cpp: tokens per prompt pass for arms "
                               "without ubatch=N (mbolt's runtime may take fewer to fit its budget). Default: 2048 "
                               "for arms with reads, llama.cpp's 512 for os arms."),
    ram: str = typer.Option(None, "--ram", help="llama.cpp: run every arm-round as a fresh process inside a memory "
                            "cgroup of this size (e.g. 2G; v1 or v2, needs root): a real memory limit. os arms are "
                            "then plain llama.cpp, arms with reads mbolt's runtime with this budget."),
    readahead_kb: int = typer.Option(None, "--readahead", min=0, help="Set the model's block device read_ahead_kb "
                                  "(KiB) for the run, restored afterwards (even on error or Ctrl-C). The value in "
                                  "force is recorded either way."),
    rounds: int = typer.Option(None, "--rounds", min=1, help="Run exactly this many rounds (default: adaptive, see "
                               "--time-budget). Each round runs every arm once, in a seeded balanced order."),
    min_rounds: int = typer.Option(12, "--min-rounds", min=1, help="Adaptive: never stop before this many rounds."),
    max_rounds: int = typer.Option(400, "--max-rounds", min=1, help="Adaptive: stop after this many rounds at most."),
    time_budget: float = typer.Option(600.0, "--time-budget", min=0.0, help="Adaptive: seconds to spend at most; the "
                                      "run stops at the end of a balanced block of rounds once another block would "
                                      "overrun it."),
    precision: float = typer.Option(0.05, "--precision", min=0.0, help="Adaptive: stop once the A/A interval is inside "
                                    "the tolerance and every treated arm's 95%% interval half-width is at most this "
                                    "share of its speedup."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the arm orders (recorded in the result)."),
    qd: int = typer.Option(1, "--qd", min=1, max=1024, help="Default queue depth (reads in flight) for arms."),
    direct: bool = typer.Option(False, "--direct", help="Default: O_DIRECT reads for arms."),
    gap: int = typer.Option(0, "--gap", min=0, help="Default merge gap (bytes)."),
    cache_slots: int = typer.Option(0, "--cache-slots", min=0, help="Default per-layer slot cache."),
    resident_frac: float = typer.Option(None, "--resident-frac", min=0.0, max=1.0,
                                        help="Default slot cache as a share of each layer's experts."),
    no_aa: bool = typer.Option(False, "--no-aa", help="Drop the A/A control arm."),
    threshold: float = typer.Option(0.01, "--threshold", min=0.0, max=1.0,
                                    help="Reject a round whose resident share exceeds this."),
    max_tokens: int = typer.Option(0, "--max-tokens", min=0, help="Replay at most this many held-out tokens (0 = all)."),
    tokens_per_round: int = typer.Option(0, "--tokens-per-round", min=0,
                                         help="Replay: each round reads the next slice of this many tokens (0 = all)."),
    name: str = typer.Option("", "--name", help="Result name: results/<name>.json."),
    out_dir: Path = typer.Option(Path("results"), "--out-dir", help="Where the result JSON goes."),
    prereg: Path = typer.Option(None, "--prereg", help="Run a pre-registration (prereg/x.toml): arms and rule from the file."),
    probe_json: Path = typer.Option(None, "--probe", help="Probe figures (mbolt probe): print each arm's predicted "
                                    "speedup (from its own route map) next to the measured one."),
    plot: Path = typer.Option(None, "--plot", help="Also draw speedups with CIs and reads/token into this PNG."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier result JSON (and --plot PNG)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Controlled cold A/B of arms (files + reader options): balanced seeded arm orders, eviction proven, A/A
    control, adaptive number of rounds."""
    from rich.progress import Progress

    from mbolt.bench.ab_command import AbRequest, run_ab_request
    from mbolt.report.bench_tables import ab_table

    req = AbRequest(arms=list(arms or []), replay_trace=replay_trace, decode=decode, engine=engine, prompts=prompts,
                    n_prompts=n_prompts, new_tokens=new_tokens, forced=forced, prompt_tokens=prompt_tokens,
                    followup_tokens=followup_tokens, ctx_size=ctx_size, ubatch=ubatch, ram=ram,
                    readahead_kb=readahead_kb,
                    rounds=rounds, min_rounds=min_rounds, max_rounds=max_rounds, time_budget=time_budget,
                    precision=precision, seed=seed, qd=qd, direct=direct, gap=gap, cache_slots=cache_slots,
                    resident_frac=resident_frac, no_aa=no_aa, threshold=threshold, max_tokens=max_tokens,
                    tokens_per_round=tokens_per_round, name=name, out_dir=out_dir, prereg=prereg,
                    probe_json=probe_json, plot=plot, force=force)
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("cold rounds", total=None)
        res, out, pr = run_ab_request(
            req, announce=lambda text: console.print(text, highlight=False),
            progress=lambda d, t, r: bar.update(task, completed=d, total=t, description=f"{r.arm} r{r.round}"))
    if as_json:
        print_json(res.to_dict())
        return
    console.print(ab_table(res))
    console.print(f"stopped: {res.stop['reason']} ({res.stop['detail']})", highlight=False)
    for f in res.flags:
        console.print(f"[yellow]flag:[/] {f}")
    for n in res.notes:
        console.print(f"[red]note:[/] {n}")
    if res.prediction:
        from mbolt.report.bench_tables import prediction_table

        console.print(prediction_table(res.prediction))
    if pr is not None:
        v = res.prereg["result"]
        colour = {"PASS": "green", "FAIL": "red"}.get(v["verdict"], "yellow")
        ci = v.get("ci95")
        ci_s = f"95% CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else "no CI: fewer than 10 rounds"
        console.print(f"[bold {colour}]{v['verdict']}[/]: {pr.treatment} vs {pr.baseline} "
                      f"{v.get('measured_speedup', float('nan')):.3f}x ({ci_s}), "
                      f"threshold {pr.pass_threshold}, predicted {pr.predicted_speedup}")
    console.print(f"wrote {out}")


@user_errors
def repack_cmd(
    src: Path = typer.Argument(..., help="A GGUF (stock or reordered); with --restore, a kernel-layout file."),
    dst: Path = typer.Argument(..., help="Output GGUF (a new path; the source is never modified)."),
    restore: bool = typer.Option(False, "--restore", help="Write the stock GGUF back from a kernel-layout file "
                                 "(bit for bit: its recorded SHA-256 is checked before the file appears)."),
    isa: str = typer.Option(None, "--isa", help="The llama.cpp build to repack for: avx2 or avx512 (default: the "
                            "installed llama-cpp-python's, from llama_print_system_info)."),
    force: bool = typer.Option(False, "--force", help="Replace a previous kernel-layout output (never a model)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Store the weights in llama.cpp's repacked CPU layout (the kernel layout), or restore the stock file.

    The tensors llama.cpp's CPU backend would repack at load (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2;
    Q2_K too on AVX-512) are written as it holds them, so a reader fills its repack buffer with no
    CPU work. Stock llama.cpp refuses the file (its architecture is mbolt-kernel); `--restore`
    gives the source back bit for bit, so one copy on disk is enough once `mbolt verify SRC DST`
    has proven the round trip."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from mbolt.core.repack import build_named, this_build
    from mbolt.report.tables import human_bytes
    from mbolt.rewrite.kernel import restore_stock, write_kernel

    if restore and isa:
        raise MboltError("--isa names the build to repack for; --restore takes none")
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=err_console, transient=True) as bar:
        task = None

        def on_progress(d, t):  # the first call comes once every check has passed
            nonlocal task
            if task is None:  # about the output's size, before it is written (a second copy on the disk)
                what = "restoring" if restore else "writing"
                size = human_bytes(src.stat().st_size)
                task = bar.add_task(f"{what} {dst.name} ({size}; the source stays)", total=t)
            bar.update(task, completed=d, total=t)

        if restore:
            r = restore_stock(src, dst, progress=on_progress)
        else:
            r = write_kernel(src, dst, build_named(isa) if isa else this_build(), force=force,
                             progress=on_progress).to_dict()

    def render():
        if restore:
            return f"{dst}: the stock file ({human_bytes(r['size'])}), SHA-256 {r['sha256'][:16]}... as recorded"
        lays = ", ".join(f"{n} x{c}" for n, c in sorted(r["repacked"].items())) or "none"
        lines = [f"{dst}: {human_bytes(r['size'])} for {r['build']}; repacked {human_bytes(r['repacked_bytes'])} "
                 f"({lays})"]
        if r["kept"]:
            kept = ", ".join(f"{t} x{c}" for t, c in sorted(r["kept"].items()))
            lines.append(f"kept as in the file (no repacked kernel for their type in this build): {kept}")
        return lines

    show(as_json, r, render)
