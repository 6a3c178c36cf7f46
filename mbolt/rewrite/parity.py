"""Run both files and compare: the reference engine (exact) and llama.cpp (within tolerance).

routing_parity: the reference engine on source and output over N prompts, prefill then greedy
  decode; every layer's routing (ORIGINAL expert ids, the engine maps positions through the
  output's route map) must be identical and the logits bit-identical.
llama_parity: llama.cpp on both (reorder layout only; llama.cpp knows nothing of route maps, so
  its top-k ids of the output are positions, mapped here through perm to original ids); the
  greedy tokens must match, the logits agree within LLAMA_ATOL + LLAMA_RTOL * max|logit|
  (llama.cpp's router softmax sums in position order, so last bits move under permutation),
  and every routing decision (the set of k experts of every token in every MoE layer, read off
  llama.cpp's ffn_moe_topk-N tensors) must map to the same original experts. This is the
  routing check for families the reference engine does not run (deepseek2, gpt-oss, qwen3next).
"""

from __future__ import annotations

import numpy as np

from mbolt.core.routemap import read_route_map
from mbolt.core.prompts import BUILTIN_PROMPTS
from mbolt.core.vocab import byte_tokens
from mbolt.reference.generate import greedy_decode  # the reference engine's loop (routing_parity)

LLAMA_ATOL = 1e-4
LLAMA_RTOL = 1e-4


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def routing_parity(src, out, *, prompts: list[str] | None = None, n_tokens: int = 8, on_step=None) -> dict:
    """Reference engine on both files; see the module docstring. on_step() after every forward
    (len(prompts) * (n_tokens + 1) of them)."""
    from mbolt.reference import load_model

    prompts = prompts or BUILTIN_PROMPTS
    a, b = load_model(src, route="file"), load_model(out, route="file")
    decisions = same = 0
    logits_steps = logits_equal = 0
    first_bad = ""
    try:
        h = a.header
        for pi, text in enumerate(prompts):
            ids = byte_tokens(h, text)[:64] or [0]
            ca, cb = a.new_cache(), b.new_cache()
            for st in greedy_decode(lambda x: (a.forward(x, ca), b.forward(x, cb)), ids, n_tokens):
                step, (la, lb) = st.index, st.out
                for li, (ra, rb) in enumerate(zip(a.last_routing, b.last_routing)):
                    if ra is None and rb is None:
                        continue
                    if ra is None or rb is None:
                        decisions += 1
                        first_bad = first_bad or f"prompt {pi} step {step} layer {li}: routed in one file only"
                        continue
                    if ra.experts.shape != rb.experts.shape:  # k differs (expert_used_count): every decision differs
                        decisions += max(ra.experts.size, rb.experts.size)
                        first_bad = first_bad or (f"prompt {pi} step {step} layer {li}: {ra.experts.shape[-1]} experts "
                                                  f"per token in the source, {rb.experts.shape[-1]} in the output")
                        continue
                    eq = ra.experts == rb.experts
                    decisions += eq.size
                    same += int(eq.sum())
                    if not eq.all() and not first_bad:
                        t, r = np.argwhere(~eq)[0]
                        first_bad = (f"prompt {pi} step {step} layer {li} token {t} rank {r}: expert "
                                     f"{ra.experts[t, r]} in the source, {rb.experts[t, r]} in the output")
                logits_steps += 1
                if np.array_equal(_bits(la), _bits(lb)):
                    logits_equal += 1
                elif not first_bad:
                    first_bad = (f"prompt {pi} step {step}: logits differ "
                                 f"(max |diff| {float(np.max(np.abs(la - lb))):.3g})")
                a.last_routing = [None] * len(a.last_routing)
                b.last_routing = [None] * len(b.last_routing)
                if on_step is not None:
                    on_step()
    finally:
        a.close()
        b.close()
    ok = decisions > 0 and same == decisions and logits_equal == logits_steps
    detail = (f"{same:,}/{decisions:,} routing decisions identical, logits bit-identical at "
              f"{logits_equal}/{logits_steps} steps ({len(prompts)} prompts, {n_tokens} greedy tokens)")
    if first_bad:
        detail += f"; first difference: {first_bad}"
    return {"ok": ok, "detail": detail, "decisions": decisions, "identical": same,
            "logit_steps": logits_steps, "logits_bit_identical": logits_equal, "prompts": len(prompts),
            "n_tokens": n_tokens, "first_difference": first_bad}


def llama_parity(src, out, *, prompts: list[str] | None = None, n_tokens: int = 8, n_threads: int | None = None,
                 on_step=None, n_ctx: int | None = None) -> dict:
    """llama.cpp on both files (reorder layout); see the module docstring. on_step() after every
    forward of both (len(prompts) * (n_tokens + 1) of them). Each file runs on a driver of its own
    (plain llama.cpp, llama.cpp's default load, an F32 KV cache): the prompt in prompt passes, then
    decode steps (`Driver.decode`), the output fed the source's greedy tokens."""
    from mbolt.core.moe_map import moe_map
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.measured import TopkRows
    from mbolt.runtime.memory import resolve_ctx

    prompts = prompts or BUILTIN_PROMPTS
    perm = read_route_map(out).perm
    max_diff = 0.0
    tol_used = 0.0
    tokens_same = tokens_total = 0
    decisions = same = 0
    first_bad = ""
    n_ctx, warning = resolve_ctx(n_ctx, moe_map(src))
    if warning:
        import warnings

        warnings.warn(warning, stacklevel=2)
    ka, kb = TopkRows(), TopkRows()
    opts = dict(reads=False, evict=False, repacked=True, f32_kv=True, n_ctx=n_ctx, n_threads=n_threads)
    with open_driver(src, watchers=[ka], **opts) as da, open_driver(out, watchers=[kb], **opts) as db:
        for pi, text in enumerate(prompts):
            da.forget()
            db.forget()
            ids = da.tokenize(text)[:64] or [0]
            if db.tokenize(text)[:64] != ids:
                first_bad = first_bad or f"prompt {pi}: tokenization differs"
            fed: list[int] = []  # the source's greedy tokens: the output is fed them too
            steps_b = db.decode(ids, n_tokens, fed=fed)
            for step, (_, la) in enumerate(da.decode(ids, n_tokens)):
                _, lb = next(steps_b)
                tol = LLAMA_ATOL + LLAMA_RTOL * float(np.max(np.abs(la)))
                d = float(np.max(np.abs(la - lb)))
                max_diff, tol_used = max(max_diff, d), max(tol_used, tol)
                if d > tol and not first_bad:
                    first_bad = f"prompt {pi} step {step}: max |logit diff| {d:.3g} > {tol:.3g}"
                ra, rb = ka.take(), kb.take()
                for li in sorted(set(ra) | set(rb)):
                    xa, xb = ra.get(li), rb.get(li)
                    if xa is None or xb is None or xb.shape != xa.shape:
                        decisions += (xa if xa is not None else xb).size
                        first_bad = first_bad or f"prompt {pi} step {step} layer {li}: routed in one file only"
                        continue
                    mapped = perm[li][xb]  # llama.cpp reports positions in the output file
                    # compare as sets per token: rank order can swap on near-ties
                    eq = np.sort(mapped, axis=1) == np.sort(xa, axis=1)
                    decisions += eq.size
                    same += int(eq.sum())
                    if not eq.all() and not first_bad:
                        t = int(np.argwhere(~eq.all(axis=1))[0][0])
                        first_bad = (f"prompt {pi} step {step} layer {li} token {t}: experts "
                                     f"{sorted(xa[t].tolist())} in the source, {sorted(mapped[t].tolist())} "
                                     "in the output (original ids)")
                ta, tb = int(np.argmax(la)), int(np.argmax(lb))  # both decode the source's tokens
                fed.append(ta)
                tokens_total += 1
                tokens_same += ta == tb
                if ta != tb and not first_bad:
                    first_bad = f"prompt {pi} step {step}: greedy token {ta} vs {tb}"
                if on_step is not None:
                    on_step()
    share = same / decisions if decisions else 0.0
    ok = tokens_same == tokens_total and not first_bad and decisions > 0 and same == decisions
    detail = (f"greedy tokens {tokens_same}/{tokens_total} identical, max |logit diff| {max_diff:.3g} "
              f"(tolerance {tol_used:.3g}), routing {same:,}/{decisions:,} decisions map through the route map")
    if first_bad:
        detail += f"; first difference: {first_bad}"
    return {"ok": ok, "detail": detail, "tokens_identical": tokens_same, "tokens": tokens_total,
            "max_logit_diff": max_diff, "tolerance": tol_used, "routing_share": share,
            "routing_decisions": decisions, "first_difference": first_bad}
