"""The ik_llama.cpp peer's worker: one arm-round, run by the python of the peer's own virtual
environment (bench.peers), with ik-llama-cpp-python's bindings.

Standalone on purpose: it imports the standard library, numpy and ik_llama_cpp (what that
environment holds; it has no mbolt), so the peer runs exactly as its users install it.

  python ik_worker.py --system-info   one JSON line: the package's version, llama_print_system_info()
  python ik_worker.py JOB.json        one job (below), then one RESULT line of JSON

A job names the model, the prompt's token ids and the fed ids (the mbolt arms' own ids), n_ctx,
n_ubatch, threads, and per model file the byte spans to unmap after the load (the expert tensors:
a cold arm). After the load the worker prints MARK and waits for one line on stdin: meanwhile the
parent drops the page cache's copies of those spans and proves them gone (mincore). Then it decodes
the prompt in one llama_decode (ik splits it into passes of n_ubatch) and reads its last logits (the
time to first token), and feeds each fed token in a llama_decode of its own, reading the logits at
every step: teacher forcing, as the plain llama.cpp arm decodes (runtime.driver.generate).

`teacher_forced(engine, prompt, fed)` is the loop; an engine is anything with `batch(ids, pos)`
(made before the clock starts) and `decode(batch)` returning the last token's logits, so the loop
runs on plain llama.cpp too (tests).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import time

MARK = "mbolt-ik-worker: loaded"
RESULT = "mbolt-ik-worker: result "
MADV_DONTNEED = 4
PACKAGE = "ik-llama-cpp-python"


def teacher_forced(engine, prompt: list[int], fed: list[int]) -> dict:
    """The prompt in one call (its time: the time to first token), then every fed token in a call
    of its own; timed: each call and the reading of its logits (perf_counter; the batch is made
    before the clock starts). The greedy prediction before each fed token (as the plain arm's
    `generated`; with nothing fed, the one after the prompt) and the fed text's perplexity are
    computed outside the timed calls."""
    import numpy as np

    batch = engine.batch(prompt, 0)
    t0 = time.perf_counter()
    logits = engine.decode(batch)
    prompt_s = time.perf_counter() - t0
    generated, nll, decode_s = [], 0.0, 0.0
    for i, token in enumerate(fed):
        generated.append(int(np.argmax(logits)))
        z = logits.astype(np.float64)
        top = z.max()
        nll += top + math.log(float(np.exp(z - top).sum())) - z[token]
        batch = engine.batch([int(token)], len(prompt) + i)
        t0 = time.perf_counter()
        logits = engine.decode(batch)
        decode_s += time.perf_counter() - t0
    return {"prompt_tokens": len(prompt), "prompt_s": prompt_s, "decode_tokens": len(fed), "decode_s": decode_s,
            "ppl": math.exp(nll / len(fed)) if fed else None, "generated": generated or [int(np.argmax(logits))]}


def drop_from_mapping(path: str, spans: list[list[int]]) -> int:
    """madvise(MADV_DONTNEED) over the pages holding `spans` (byte ranges of the file at `path`) in
    every mapping of that file in this process: they leave its page tables, so the page cache can
    drop them (a mapped page stays cached). Rounded outward: a page shared with a dense tensor
    faults back in on first use. Returns the bytes unmapped."""
    real = os.path.realpath(path)
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    with open("/proc/self/maps") as f:
        maps = [line.split(None, 5) for line in f]
    for m in maps:
        if len(m) < 6 or m[5].strip() != real:
            continue
        lo, hi = (int(x, 16) for x in m[0].split("-"))
        off = int(m[2], 16)  # the file offset the mapping starts at
        for a, b in spans:
            start, end = max(a // page * page, off), min(-(-b // page) * page, off + hi - lo)
            if end <= start:
                continue
            if libc.madvise(lo + start - off, end - start, MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"madvise of {real} [{start}, {end})")
            done += end - start
    return done


class IkEngine:
    """A model and a context of ik_llama.cpp through its package's bindings (`_internals`). The
    context is made from llama_context_default_params, as IkContext makes it, with n_ubatch set
    (IkContext leaves it at its default, and the prompt arms choose it)."""

    def __init__(self, model: str, n_ctx: int, n_ubatch: int, threads: int):
        import numpy as np
        from ik_llama_cpp import _ctypes_api as C
        from ik_llama_cpp._internals import IkModel

        self.C, self.np = C, np
        self.model = IkModel(model)  # mapped (use_mmap), no run-time repack: ik's defaults
        params = C.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx  # a prompt is one llama_decode
        params.n_ubatch = n_ubatch
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn = True  # ik's default, and every mbolt arm's
        self.ctx = C.llama_init_from_model(self.model.model, params)
        if not self.ctx:
            raise RuntimeError(f"{model}: ik_llama.cpp could not create a context of {n_ctx} tokens")
        self.n_ubatch = int(C.llama_n_ubatch(self.ctx))

    def _logits(self):
        ptr = self.C.llama_get_logits_ith(self.ctx, -1)
        return self.np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def batch(self, ids: list[int], pos: int):
        """The package's own batches: make_batch_single for a fed token, make_batch_range for a
        prompt (logits of its last token only)."""
        from ik_llama_cpp._internals import make_batch_range, make_batch_single

        return make_batch_single(ids[0], pos) if len(ids) == 1 else make_batch_range(ids, pos_start=pos)

    def decode(self, batch):
        """One llama_decode of the batch (freed after), then its last token's logits."""
        try:
            rc = self.C.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return self._logits()
        finally:
            self.C.llama_batch_free(batch)

    def timings(self) -> dict:
        t = self.C.llama_get_timings(self.ctx)
        return {"t_load_ms": t.t_load_ms, "t_p_eval_ms": t.t_p_eval_ms, "t_eval_ms": t.t_eval_ms,
                "n_p_eval": t.n_p_eval, "n_eval": t.n_eval}

    def close(self) -> None:
        if self.ctx:
            self.C.llama_free(self.ctx)
            self.ctx = None
        self.model.close()


def system_info() -> dict:
    """The package's version and its library's llama_print_system_info() (the package binds neither)."""
    from importlib.metadata import version

    from ik_llama_cpp import _ctypes_api as C

    f = C._lib.llama_print_system_info
    f.argtypes, f.restype = [], ctypes.c_char_p
    return {"package": PACKAGE, "version": version(PACKAGE), "system_info": f().decode().strip()}


def run_job(job: dict) -> dict:
    t0 = time.perf_counter()
    engine = IkEngine(job["model"], int(job["n_ctx"]), int(job["n_ubatch"]), int(job["threads"]))
    try:
        load_s = time.perf_counter() - t0
        dropped = sum(drop_from_mapping(path, spans) for path, spans in (job.get("drop") or {}).items())
        print(MARK, flush=True)
        sys.stdin.readline()  # the parent's go: the experts' pages dropped and proven cold
        out = teacher_forced(engine, job["prompt"], job["fed"])
        return {**out, "load_s": load_s, "unmapped_bytes": dropped, "n_ubatch": engine.n_ubatch,
                "ik_timings": engine.timings(), **system_info()}
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    if argv == ["--system-info"]:
        print(json.dumps(system_info()), flush=True)
        return 0
    if len(argv) != 1:
        print("usage: ik_worker.py --system-info | JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    print(RESULT + json.dumps(run_job(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
