"""Record routing while running prompts: the reference engine or llama.cpp as the backend.

`trace_prompts(model, prompts, out, ...)` runs every prompt (prefill, then greedy decode of
`max_new_tokens`), and appends each token's routing to an `.mbtrace` as ORIGINAL expert ids
(a reordered file's positions are mapped back through its route map), with the prompt file's
`source` field as the sequence's domain tag.

Backends:
  reference  mbolt's numpy engine: every layer of every prompt token, with routing weights.
  llama.cpp  llama-cpp-python with an eval callback on `ffn_moe_topk-N`: native speed, any
             architecture llama.cpp runs, through the runtime's driver (`Driver.decode`: the
             prompt in prompt passes, each generated token a decode step, as every command
             runs them); during prefill llama.cpp routes the last layer only for the output
             token, so the other prompt tokens have -1 at that layer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import moe_map
from mbolt.core.mbtrace import TraceWriter
from mbolt.core.prompts import Prompt, read_prompts
from mbolt.core.trace import DECODE, PREFILL
from mbolt.reference.generate import greedy_decode

ENGINES = ("reference", "llama.cpp")


class _Reference:
    weights = True

    def __init__(self, path, route, threads):
        from mbolt.reference import load_model
        from mbolt.reference.tokenizer import Tokenizer

        self.m = load_model(path, route=route)
        self.tok = Tokenizer.from_header(self.m.header)
        self.eos = self.tok.eos
        self.cache = None

    def encode(self, text):
        return self.tok.encode(text)

    def steps(self, ids, n_new):
        """(experts, weights) of the prompt's tokens, then of each greedy token fed: the reference
        engine's loop (reference.generate.greedy_decode)."""
        self.cache = self.m.new_cache()
        for st in greedy_decode(self.run, ids, n_new, eos=self.eos):
            yield st.out[1:]

    def run(self, ids):
        """-> (logits of last token, experts [n, L, k] original ids, weights [n, L, k])."""
        logits = self.m.forward(ids, self.cache)
        n, L, k = len(ids), self.m.n_layers, self.m.hp.n_used
        ex = np.full((n, L, k), -1, np.int16)
        w = np.zeros((n, L, k), np.float32)
        for li, r in enumerate(self.m.last_routing):
            if r is not None:
                ex[:, li] = r.experts
                w[:, li] = r.weights
        return logits, ex, w

    def close(self):
        self.m.close()


class _Llama:
    weights = False

    def __init__(self, path, route, threads, n_ctx=None):
        from mbolt.runtime.driver import open_driver
        from mbolt.runtime.measured import TopkRows

        self.mm = moe_map(path)
        self.perm = self.mm.route_map.perm  # positions -> original ids
        # plain llama.cpp on the runtime's one driver, mapped, no repacking: the weights stay file
        # pages the kernel can reclaim, so tracing a model larger than RAM runs in bounded memory (a
        # copying or repacking load put every expert in anonymous memory and was OOM-killed under a
        # 2 GiB limit, issue 19)
        self.cap = TopkRows()
        self.d = open_driver(path, reads=False, evict=False, mm=self.mm, n_ctx=n_ctx, n_threads=threads,
                             watchers=[self.cap])
        self.eos = None
        try:
            self.eos = int(self.mm.header.get("tokenizer.ggml.eos_token_id"))
        except (TypeError, ValueError):
            pass

    def encode(self, text):
        return self.d.tokenize(text, add_special=True)

    def steps(self, ids, n_new):
        """(experts, None) of the prompt's tokens (prompt passes), then of each greedy token fed
        (decode steps): the driver's loop (`Driver.decode`). A prompt longer than the context is
        cut to it, and decoding stops where the context is full."""
        self.d.forget()
        room = self.d.n_ctx_seq
        ids = ids[:room]
        self.cap.take()
        for fed, _ in self.d.decode(ids, min(n_new, room - len(ids)), eos=self.eos):
            yield self._experts(len(fed)), None

    def _experts(self, n):
        """The original experts of the last `n` tokens the driver ran, from what the watcher saw."""
        L, k = self.mm.n_layers, self.mm.n_used
        ex = np.full((n, L, k), -1, np.int16)
        for li, seen in self.cap.take().items():
            if li >= L:
                continue
            rows = self.perm[li][seen]  # position -> original id
            ex[n - rows.shape[0]:, li] = rows[-n:]
        return ex

    def close(self):
        self.d.close()


def part_path(out: str | os.PathLike) -> Path:
    """Where a trace being recorded lives until it is complete (kept when interrupted)."""
    out = Path(out)
    return out.with_name(out.name + ".part")


def check_part(out: str | os.PathLike, force: bool) -> None:
    """Refuse to start over a kept OUT.part (an interrupted run's tokens) unless `force`."""
    part = part_path(out)
    if part.exists() and not force:
        raise MboltError(f"{part}: kept from an interrupted trace (a readable trace): move it away, or use "
                         f"--force to discard it")


def trace_prompts(model: str | os.PathLike, prompts: str | os.PathLike | list[Prompt], out: str | os.PathLike, *,
                  max_new_tokens: int = 16, engine: str = "reference", limit: int | None = None,
                  route: str = "file", threads: int | None = None, on_progress=None,
                  shard: tuple[int, int] | None = None, force: bool = False, n_ctx: int | None = None) -> dict:
    """Trace prompts through `model` into `out` (.mbtrace). Returns a summary dict.

    `shard` (i, n), 1-based: trace only prompts i-1, i-1+n, i-1+2n, ... (a deterministic share,
    for tracing on n machines; `mbolt trace-merge` joins the n traces). Sequence ids stay the
    prompts' indices in the whole prompt list. A kept `OUT.part` from an interrupted run is
    replaced only with `force`.

    on_progress(done_prompts, total_prompts, tokens_so_far, seconds) once the model is loaded
    (done_prompts = 0) and after every prompt.
    """
    if engine not in ENGINES:
        raise MboltError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if max_new_tokens < 0:
        raise MboltError(f"--new-tokens must be >= 0, got {max_new_tokens}")
    check_part(out, force)
    items = read_prompts(prompts, limit) if not isinstance(prompts, list) else prompts[:limit or None]
    seqs = list(range(len(items)))
    if shard is not None:
        i, n = shard
        if not 1 <= i <= n:
            raise MboltError(f"--shard {i}/{n}: expected I/N with 1 <= I <= N")
        seqs = seqs[i - 1::n]
        if not seqs:
            raise MboltError(f"--shard {i}/{n}: no prompts in this share ({len(items)} prompts)")
    mm = moe_map(model)  # opened once: the reference engine takes it as is
    backend = _Reference(mm, route, threads) if engine == "reference" else _Llama(mm.path, route, threads, n_ctx)
    n_prefill = n_decode = 0
    t0 = time.perf_counter()
    if on_progress is not None:
        on_progress(0, len(seqs), 0, 0.0)  # the model loaded: work starts
    # The trace appears at `out` only when every prompt is done. An interrupted run keeps what it
    # recorded in OUT.part (the format is crash-safe, so it stays readable) and never leaves a
    # partial file at `out`.
    out = Path(out)
    part = part_path(out)
    try:
        with TraceWriter(part, mm.n_layers, mm.n_experts, mm.n_used, fingerprint=mm.source_fingerprint,
                         weights=backend.weights, flush_every=64) as w:
            w.add_note(f"mbolt trace --engine {engine} --new-tokens {max_new_tokens} ({Path(model).name})")
            if shard is not None:
                w.add_note(f"share {shard[0]}/{shard[1]} of {len(items)} prompts")
            for done, seq in enumerate(seqs):
                p = items[seq]
                ids = backend.encode(p.text)
                if not ids:
                    raise MboltError(f"prompt on line {p.line} has no tokens")
                if p.domain:
                    w.set_domain(seq, p.domain)
                pos = 0
                for i, (ex, wt) in enumerate(backend.steps(ids, max_new_tokens)):
                    n = ex.shape[0]
                    w.extend(PREFILL if i == 0 else DECODE, seq, np.arange(pos, pos + n), ex, wt)
                    pos += n
                    if i == 0:
                        n_prefill += n
                    else:
                        n_decode += n
                if on_progress is not None:
                    on_progress(done + 1, len(seqs), n_prefill + n_decode, time.perf_counter() - t0)
    except BaseException as e:
        if part.exists() and part.stat().st_size > 0 and isinstance(e, KeyboardInterrupt):
            raise MboltError(f"{out}: interrupted; the {n_prefill + n_decode} tokens traced so far are in "
                             f"{part} (readable by every mbolt command)") from None
        part.unlink(missing_ok=True)
        raise
    finally:
        backend.close()
    os.replace(part, out)
    dt = time.perf_counter() - t0
    return {
        "out": str(out), "engine": engine, "prompts": len(seqs), "prefill_tokens": n_prefill,
        "decode_tokens": n_decode, "seconds": dt,
        "tokens_per_s": (n_prefill + n_decode) / dt if dt > 0 else 0.0,
        "n_layers": mm.n_layers, "n_experts": mm.n_experts, "k": mm.n_used,
        "fingerprint": mm.source_fingerprint,
    }
