"""Models and traces: inspect, synth, generate, trace-stats, synth-trace."""

from __future__ import annotations

from pathlib import Path

import typer

from mbolt.cli.common import (console, ctx_size_option, err_console, output, print_json, ram_option, show,
                               user_errors)
from mbolt.core.errors import MboltError


@user_errors
def inspect_cmd(
    model: Path = typer.Argument(..., help="A llama.cpp MoE GGUF file."),
    as_json: bool = typer.Option(False, "--json", help="Print the MoE map as JSON."),
):
    """Show the MoE map of a GGUF: layers, experts, and every expert-indexed tensor."""
    from mbolt.core.moe_map import moe_map
    from mbolt.report.tables import moe_map_table

    m = moe_map(model)
    show(as_json, m.to_dict(), lambda: moe_map_table(m))


@user_errors
def synth_cmd(
    out: Path = typer.Argument(..., help="Output GGUF path."),
    arch: str = typer.Option(None, "--arch", help="qwen3moe (default), olmoe, mixtral, qwen2moe, glm4moe, "
                             "deepseek2, gpt-oss or qwen3next (docs/families.md)."),
    preset: str = typer.Option(None, "--preset", help="Real model geometry: qwen3-30b-a3b, qwen3-next-80b-a3b, "
                               "olmoe-1b-7b, granite-moe-1b, glm-4.5-air, deepseek-v3, gpt-oss-20b, glm-5.2 "
                               "(other options override it)."),
    layers: int = typer.Option(None, "--layers", help="Number of layers (scales a preset down)."),
    experts: int = typer.Option(None, "--experts", help="Routed experts per layer."),
    k: int = typer.Option(None, "--k", help="Experts used per token."),
    hidden: int = typer.Option(None, "--hidden", help="Hidden size."),
    expert_ff: int = typer.Option(None, "--expert-ff", help="Expert FFN size."),
    heads: int = typer.Option(None, "--heads", help="Attention heads."),
    kv_heads: int = typer.Option(None, "--kv-heads", help="KV heads."),
    head_dim: int = typer.Option(None, "--head-dim", help="Head dimension."),
    shared_ff: int = typer.Option(None, "--shared-ff", help="Shared expert FFN size (qwen2moe)."),
    expert_type: str = typer.Option(None, "--type", help="Expert tensor type: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 "
                                    "MXFP4, and with --fast-random Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_XS IQ4_NL IQ3_XXS "
                                    "IQ3_S IQ2_XXS IQ2_XS IQ1_S, or Q4_K_M (llama-quantize's mix: gate/up Q4_K, down "
                                    "Q6_K in about half the layers)."),
    down_type: str = typer.Option(None, "--down-type", help="Type of ffn_down_exps (default: --type); Q4_K_M "
                                  "files keep down in Q6_K."),
    layer_types: str = typer.Option(None, "--layer-types", help="Per-layer expert types over --type, "
                                    "e.g. '0-3:Q6_K,10:Q5_K'."),
    fused_gate_up: bool = typer.Option(False, "--fused-gate-up", help="One ffn_gate_up_exps tensor per layer "
                                       "(llama.cpp loads it for deepseek2 and qwen3next only)."),
    dense_type: str = typer.Option(None, "--dense-type", help="Attention/dense FFN/shared expert/output matrices: "
                                   "F32, F16, Q8_0, and with --fast-random Q2_K Q3_K Q4_K Q5_K Q6_K or Q4_K_M "
                                   "(llama-quantize's mix: Q4_K, attn_v and ffn_down Q6_K in about half the layers, "
                                   "output Q6_K). `--type Q4_K_M --dense-type Q4_K_M --fast-random`: a Q4_K_M-like "
                                   "file."),
    seed: int = typer.Option(None, "--seed", help="Random seed (same seed, same bytes)."),
    structure: str = typer.Option(None, "--structure", help="planted (default) or none (null control)."),
    groups: int = typer.Option(None, "--groups", help="Planted expert groups (default experts / (2k))."),
    strength: float = typer.Option(None, "--strength", help="Planted structure strength in [0, 1] (default 0.5)."),
    heat_skew: float = typer.Option(None, "--heat-skew", help="Per-expert heat skew >= 0 (default 0.5)."),
    context: float = typer.Option(None, "--context", help="Context-dependent routing >= 0 (default 0: routing "
                                  "follows the token; ~1: recent tokens move it too)."),
    routing_like: Path = typer.Option(None, "--routing-like", help="Plant a real model's routing instead of groups: "
                                      "PROFILE is a co-activation JSON (the original mbolt's coactivation_*.json) or "
                                      "any trace mbolt reads. Per-layer heat, the pairs' lift and how often "
                                      "neighbouring tokens share experts are fitted on calibration text (prompts.jsonl "
                                      "lines 1-100); needs the profile's expert count, qwen3moe/olmoe/mixtral, "
                                      "head_dim >= 64."),
    fast_random: bool = typer.Option(False, "--fast-random", help="Random valid expert/matrix blocks: disk speed, "
                                     "routing still planted, forward pass not meaningful."),
    probs_bias: bool = typer.Option(False, "--probs-bias", help="Add blk.N.exp_probs_b.bias (glm4moe and deepseek2 "
                                    "have it; llama.cpp refuses it elsewhere)."),
    expert_bias: bool = typer.Option(False, "--expert-bias", help="Add ffn_*_exps.bias (gpt-oss has them; llama.cpp "
                                     "refuses them elsewhere)."),
    dense_layers: int = typer.Option(None, "--dense-layers", help="Leading dense-FFN layers (glm4moe, deepseek2; "
                                     "llama.cpp refuses them elsewhere)."),
    vocab: Path = typer.Option(None, "--vocab", help="Take the tokenizer of this GGUF (every tokenizer.* key, e.g. "
                               "llama.cpp's models/ggml-vocab-*.gguf): the model tokenizes as the real one does."),
    tensor_order: str = typer.Option(None, "--tensor-order", help="The routed tensors' order in each block: use "
                                     "(default: gate, up, down, the order llama.cpp's matmuls use them) or converter "
                                     "(down, gate, up: as llama.cpp's convert_hf_to_gguf writes real models)."),
    force: bool = typer.Option(False, "--force", help="Overwrite the output."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
):
    """Write a synthetic MoE GGUF (llama.cpp-loadable) with planted co-activation structure."""
    import dataclasses

    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from mbolt.synth.synth import SynthConfig, synth_size, write_synth_info

    given = dict(arch=arch, n_layers=layers, n_experts=experts, n_used=k, hidden=hidden, expert_ff=expert_ff,
                 n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, shared_ff=shared_ff,
                 expert_type=expert_type.upper() if expert_type else None,
                 dense_type=dense_type.upper() if dense_type else None, seed=seed,
                 down_type=down_type, layer_types=layer_types, fused_gate_up=fused_gate_up or None,
                 structure=structure, n_groups=groups, strength=strength, heat_skew=heat_skew, context=context,
                 dense_layers=dense_layers, fast_random=fast_random or None, probs_bias=probs_bias or None,
                 expert_bias=expert_bias or None, vocab=str(vocab) if vocab else None, tensor_order=tensor_order)
    if routing_like:
        from mbolt.layout.stats import routing_target

        given["routing_like"] = routing_target(routing_like)
    given = {key: v for key, v in given.items() if v is not None}
    if not preset and head_dim is None and (hidden or heads):  # keep heads x head_dim == hidden
        given["head_dim"] = (hidden or SynthConfig.hidden) // (heads or SynthConfig.n_heads)
    if not preset and arch == "olmoe" and kv_heads is None:  # olmoe has no GQA
        given["n_kv_heads"] = heads or SynthConfig.n_heads
    if not preset and arch == "deepseek2" and kv_heads is None:  # MLA: one latent kv head
        given["n_kv_heads"] = 1
    cfg = SynthConfig.from_preset(preset, **given) if preset else SynthConfig(**given)
    output(out, "gguf-mbolt", force=force, what="synthetic model")
    cfg.validate()  # before the progress bar: an error is then the only output
    if routing_like and not as_json:
        with err_console.status(f"fitting the routing to {routing_like.name} on calibration text"):
            total = synth_size(cfg)  # the fit, kept for the write
    else:
        total = synth_size(cfg)
    if total > 64 << 20 and not as_json:
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=err_console) as bar:
            task = bar.add_task(f"writing {out.name}", total=total)
            info = write_synth_info(out, cfg, force=force, progress=lambda d, t: bar.update(task, completed=d))
    else:
        info = write_synth_info(out, cfg, force=force)
    if as_json:
        print_json(dataclasses.asdict(info))
    else:
        g = info.geometry
        routing = (f"routing like {routing_like.name}" if routing_like
                   else f"structure {info.structure} ({g['n_groups']} groups)")
        console.print(
            f"wrote [bold]{info.path}[/] ({info.bytes / 1e6:,.1f} MB): {info.arch}"
            f"{' (' + info.preset + ')' if info.preset else ''}, {g['n_layers']} layers x {g['n_experts']} experts, "
            f"k={g['n_used']}, hidden {g['hidden']}, expert ff {g['expert_ff']}, experts {info.expert_type}, "
            f"{routing}{', fast-random' if info.fast_random else ''}",
            highlight=False,
        )
        if routing_like:
            c = info.extra["routing_like"]["calibration"]
            console.print(f"[dim]on the calibration text: heat entropy / max {c['entropy_norm']:.3f}, hottest 10% share "
                          f"{c['top10_share']:.3f}, median pair lift {c['cut_lift_p50']:.2f}, consecutive overlap / "
                          f"heat overlap {c['overlap_vs_heat']:.2f} (`mbolt trace-stats` measures them)[/]", highlight=False)


@user_errors
def generate_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF (reference engine: qwen3moe, olmoe, mixtral, qwen2moe; "
                                 "llama.cpp: any MoE arch it runs)."),
    prompt: str = typer.Argument(..., help="Prompt text."),
    n: int = typer.Option(32, "--new-tokens", "-n", min=1, help="Tokens to generate (greedy)."),
    route: str = typer.Option("file", help="Reference engine, reordered files: 'file' (router rows permuted in the "
                              "file) or 'map'."),
    engine: str = typer.Option("reference", "--engine", help="'reference' (numpy engine) or 'llama.cpp'."),
    stream: bool = typer.Option(False, "--stream", help="llama.cpp: mbolt's streaming runtime. The selected experts "
                                "are read explicitly from the eval callback into an expert cache sized from the memory "
                                "budget (--ram, else the cgroup limit, else available memory); dense weights stay "
                                "resident."),
    ram: str = ram_option("--stream"),
    cache_slots: int = typer.Option(0, "--cache-slots", min=0, help="--stream: experts per layer kept (LRU) instead of "
                                    "sizing the cache from the budget."),
    drop_every_token: bool = typer.Option(False, "--drop-every-token", help="--stream: drop every expert page after "
                                          "every token (the s = 1 bound of a model far larger than RAM; an "
                                          "emulation, not a budget)."),
    qd: int = typer.Option(1, "--qd", min=1, max=1024, help="--stream with blocking reads: queue depth."),
    blocking: bool = typer.Option(False, "--blocking-reads", help="--stream: wait for every read before llama.cpp "
                                  "computes (default: submit the reads and let its page faults wait, which overlaps "
                                  "them with compute)."),
    gap: int = typer.Option(0, "--gap", min=0, help="--stream: merge gap (bytes)."),
    pins: bool = typer.Option(False, "--pins", help="--stream: keep each layer's hottest experts (by the training "
                              "heat a reorder file's route map carries) in 3/4 of the cache; the rest is LRU."),
    ctx_size: int = ctx_size_option("llama.cpp", ". Under --stream its KV cache is counted in the budget."),
    ubatch: int = typer.Option(None, "--ubatch-size", "-ub", min=1, help="llama.cpp: tokens per prompt pass (each "
                               "pass reads the experts the cache does not hold; --stream may take fewer to fit the "
                               "budget). Default: 2048 with --stream, else llama.cpp's 512."),
    as_json: bool = typer.Option(False, "--json", help="Print prompt ids, generated ids, text and timings as JSON."),
):
    """Greedy decode with tokens/s: the numpy reference engine, or llama.cpp (with --stream: mbolt's expert reads)."""
    if engine == "llama.cpp":
        return _generate_llama(model, prompt, n, stream, ram, cache_slots, drop_every_token, qd, blocking, gap,
                               pins, as_json, ctx_size, ubatch)
    if engine != "reference":
        raise MboltError(f"--engine must be reference or llama.cpp, not {engine!r}")
    if stream or cache_slots or ram or drop_every_token or pins or ctx_size:
        raise MboltError("--stream, --ram, --cache-slots, --drop-every-token, --pins and --ctx-size need --engine "
                         "llama.cpp")
    from mbolt.reference import load_model
    from mbolt.reference.generate import generate

    if route not in ("file", "map"):
        raise MboltError(f"--route {route!r}: choose file or map")
    m = load_model(model, route=route)
    if as_json:
        print_json(generate(m, prompt, n))
        return
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("generating", total=n)
        res = generate(m, prompt, n, on_token=lambda i, t: bar.update(task, completed=i + 1))
    console.print(prompt, end="", highlight=False, markup=False)
    console.print(res["text"], style="bold", highlight=False, markup=False)
    console.print(f"[dim]prompt {len(res['prompt_ids'])} tokens at {res['prefill_tokens_per_s']:.1f} tok/s, "
                  f"generated {len(res['ids'])} at {res['decode_tokens_per_s']:.1f} tok/s[/]")


REPACK_NOTE = ("repacking off: the weights stay pages of the mapped file (llama.cpp's default load copies "
               "Q4_0/Q4_K experts into anonymous memory, which a model larger than RAM cannot hold)")


def _generate_llama(model, prompt, n, stream, ram, cache_slots, drop_every_token, qd, blocking, gap, pins, as_json,
                    ctx_size, ubatch):
    from rich.progress import Progress

    from mbolt.core.memlimit import budget
    from mbolt.runtime.driver import open_driver

    if (cache_slots or ram or drop_every_token or blocking or pins) and not stream:
        raise MboltError("--ram, --cache-slots, --drop-every-token, --blocking-reads and --pins need --stream")
    if drop_every_token and (ram or cache_slots):
        raise MboltError("--drop-every-token drops everything after each token: it takes no --ram or --cache-slots")
    limit, where = budget(ram) if (stream and not drop_every_token and not cache_slots) else (None, "")
    with open_driver(model, reads=stream, evict=stream, cache_slots=cache_slots, qd=qd, gap=gap, budget=limit,
                     asynchronous=stream and not blocking, pins=pins, n_ctx=ctx_size, n_ubatch=ubatch) as s:
        ids = s.tokenize(prompt, add_special=True)
        if not ids:
            raise MboltError("the prompt has no tokens")
        if len(ids) + n > s.n_ctx_seq:
            raise MboltError(f"the prompt's {len(ids)} tokens and {n} new ones do not fit a context of "
                             f"{s.n_ctx_seq} tokens: give a larger --ctx-size/-c")
        if stream:
            s.make_cold()
        if not as_json:
            err_console.print(f"[dim]llama.cpp: {REPACK_NOTE if s.repacking == 'off' else 'repacking ' + s.repacking}[/]")
            if limit:
                err_console.print(f"[dim]budget {limit / 2**30:.2f} GiB ({where}): {s.describe_budget()}[/]",
                                  highlight=False)
        with Progress(console=err_console, transient=True, disable=as_json) as bar:
            task = bar.add_task(f"prompt ({len(ids)} tokens)", total=None)
            run = s.generate([ids], n, on_token=lambda i, t: bar.update(task, description="generating",
                                                                         completed=i + 1, total=n))
        text = s.detokenize(run.generated[0])
    tok = max(run.decode_tokens, 1)
    res = {"engine": "llama.cpp", "stream": stream, "cache_slots": s.cache_slots, "budget_bytes": limit,
           "budget_from": where or None, "repacking": s.repacking, "qd": qd, "gap": gap, "async_reads": stream and not blocking,
           "drop_every_token": drop_every_token, "pinned_per_layer": s.pinned_per_layer,
           "n_ctx": s.n_ctx, "n_ubatch": s.n_ubatch, "flash_attn": s.flash_attn,
           "dense_locked_bytes": s.locked_bytes, "dense_copied_bytes": s.copied_bytes,
           "prompt_ids": ids, "ids": run.generated[0], "text": text,
           "ttft_s": run.prefill_s, "prompt_passes": run.prompt_passes, "prompt_read_bytes": run.prompt_bytes,
           "prompt_read_mb_per_s": run.prompt_bytes / run.prompt_read_s / 1e6 if run.prompt_read_s else None,
           "decode_tokens_per_s": run.decode_tokens / run.decode_s if run.decode_s else None,
           "reads_per_token": run.reads / tok, "bytes_per_token": run.bytes / tok,
           "device_bytes_per_token": None if run.device_bytes is None else run.device_bytes / tok,
           "read_share_s": run.io_s / run.decode_s if (stream and run.decode_s) else None,
           "hits": run.hits, "misses": run.misses}
    if as_json:
        print_json(res)
        return
    console.print(prompt, end="", highlight=False, markup=False)
    console.print(text, style="bold", highlight=False, markup=False)
    reads = ("kernel layout, reads into llama.cpp's buffers QD%d" % qd if s.repacking != "off"
             else 'blocking reads QD%d' % qd if blocking else 'async reads')
    how = (f"mbolt streaming ({reads}, gap {gap} B, "
           f"{s.cache_slots} cache slots/layer"
           f"{f' ({s.prefill_slots} during the prompt)' if s.prefill_slots and s.prefill_slots != s.cache_slots else ''}"
           f"{', every expert dropped after every token' if drop_every_token else ''})"
           if stream else "plain llama.cpp (the file mapped, nothing dropped)")
    line = f"[dim]llama.cpp, {how}: prompt {len(ids)} tokens in {run.prefill_s:.2f} s"
    if run.prompt_passes:
        line += (f" ({run.prompt_passes} pass{'es' if run.prompt_passes > 1 else ''} of up to {s.n_ubatch} tokens, "
                 f"{run.prompt_bytes / 1e6:.0f} MB read at {res['prompt_read_mb_per_s'] or 0:.0f} MB/s)")
    line += f", generated {len(run.generated[0])} at {res['decode_tokens_per_s'] or 0:.1f} tok/s"
    if stream:
        line += (f", {res['reads_per_token']:.1f} reads/token, {res['bytes_per_token'] / 1e6:.2f} MB/token, "
                 f"s = {res['read_share_s'] or 0:.2f}")
    console.print(line + "[/]", highlight=False)


@user_errors
def trace_stats_cmd(
    trace: Path = typer.Argument(..., help="A .mbtrace, or MBOLT_TRACE / nuthatch text / NUTHTRC1 (auto-detected), or "
                                 "a co-activation profile (the original mbolt's coactivation_*.json)."),
    fmt: str = typer.Option("auto", "--format", help="auto, mbtrace, mbolt, nuthatch-text or nuthatch-bin."),
    phase: str = typer.Option("all", "--phase", help="The tokens counted: decode, prefill or all."),
    profile: Path = typer.Option(None, "--profile", help="A co-activation profile to put beside the trace, both "
                                 "in the profile's cut (pairs seen >= 5 times with lift >= 1.5, top 2000)."),
    cache_slots: str = typer.Option("", "--cache-slots", help="Also replay a per-layer cache of these slot counts "
                                    "(comma separated) over the --phase tokens: LRU's and MIN's hit rates."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
):
    """Tokens, sequences, per-layer heat entropy, pair lift percentiles and token-to-token overlap (and its ratio
    to chance); the same statistics in a co-activation profile's cut, beside a profile's own; with
    --cache-slots, LRU and MIN hit rates."""
    from mbolt.layout.stats import is_profile, profile_stats, trace_stats
    from mbolt.report.layout_tables import profile_stats_renderables, trace_stats_renderables

    if is_profile(trace):
        if profile:
            raise MboltError(f"{trace}: a co-activation profile; --profile puts one beside a trace")
        s = profile_stats(trace)
        show(as_json, s, lambda: profile_stats_renderables(s))
        return
    slots = _slot_list(cache_slots)
    s = trace_stats(trace, fmt, phase)
    if profile:
        s["compare"] = profile_stats(profile)
        s["compare"]["source"] = profile.name
    if slots:
        s["cache"] = _cache_hits(trace, fmt, phase, slots)
    show(as_json, s, lambda: trace_stats_renderables(s) + ([_cache_line(s["cache"])] if slots else []))


def _slot_list(text: str) -> list[int]:
    try:
        slots = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MboltError(f"--cache-slots: expected comma-separated integers, got {text!r}") from None
    if any(b < 1 for b in slots):
        raise MboltError(f"--cache-slots: expected integers >= 1, got {text!r}")
    return slots


def _cache_hits(path: Path, fmt: str, phase: str, slots: list[int]) -> list[dict]:
    """Per slot count, the per-layer LRU's and MIN's hit rates from an empty cache."""
    from mbolt.bench.replay import compare_policies
    from mbolt.core.trace import select_phase
    from mbolt.trace.formats import load_trace

    tr = select_phase(load_trace(path, fmt), phase, str(path))
    return [{"slots": r["budget"], "lru": r["lru"]["hit_rate"], "opt": r["opt"]["hit_rate"],
             "lru_misses_vs_min": r["lru"]["vs_min"]} for r in compare_policies(tr, slots, ("lru",))]


def _cache_line(rows: list[dict]) -> str:
    return "per-layer cache from empty (hit rate LRU / MIN, LRU misses / MIN's): " + "; ".join(
        f"{r['slots']} slots {r['lru']:.3f} / {r['opt']:.3f} ({r['lru_misses_vs_min']:.2f}x)" for r in rows)


@user_errors
def synth_trace_cmd(
    like: Path = typer.Option(..., "--like", help="A published co-activation profile (coactivation_*.json)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .mbtrace path."),
    tokens: int = typer.Option(0, "--tokens", min=0, help="Tokens to sample (default: the profile's count)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite the output."),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration report as JSON."),
):
    """Sample a decode trace whose per-layer heat and strong pairs match a published profile."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from mbolt.layout.calibrate import load_profile, synth_trace_like
    from mbolt.report.layout_tables import match_table
    from mbolt.core.mbtrace import write_trace

    output(out, "mbtrace", inputs=[like], force=force, what="trace")
    prof = load_profile(like)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("fitting layers", total=prof.n_layers)
        tr, rep = synth_trace_like(prof, tokens or None, seed=seed, progress=lambda l: bar.update(task, completed=l + 1))
    write_trace(out, tr, force=force)
    rep["out"] = str(out)
    if as_json:
        print_json(rep)
    else:
        console.print(match_table(rep))
        console.print(f"wrote [bold]{out}[/]: {tr.n_tokens:,} decode tokens, {tr.n_layers} layers x "
                      f"{tr.n_experts} experts, k={tr.k}", highlight=False)
