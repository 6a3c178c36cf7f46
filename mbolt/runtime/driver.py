"""llama.cpp as the streaming engine, driven by mbolt: `LlamaStream` is the runtime
(runtime.streamer: explicit expert reads from the eval callback, bounded expert memory) on a
context of its own (runtime.runner), with the generation loop that generate, ab and the
benchmarks time: a prompt (its time to first token), decode steps (greedy or teacher-forced) and,
in a session, a follow-up turn appended to the same context (its KV cache reused).

The `os` arm: the same cold condition without explicit reads (llama.cpp's page faults and the
kernel's readahead decide what is read); by default without the callback, as users run llama.cpp.
llama.cpp cannot load the `packed` layout (its tensors are blobs llama.cpp does not know).
"""

from __future__ import annotations

import ctypes
import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap
from mbolt.runtime.streamer import StreamRuntime, check_llama_streamable  # noqa: F401 (re-exported)
from mbolt.runtime.store import proc_read_bytes


@dataclass
class StreamRun:
    """What one generation measured (prefill = the prompt, decode = the generated tokens)."""

    generated: list[list[int]]  # per prompt
    prefill_s: float = 0.0  # time to first token, summed over prompts
    decode_s: float = 0.0  # llama_decode wall time of the decode steps (eviction excluded)
    decode_tokens: int = 0
    io_s: float = 0.0  # decode: wall time of the explicit reads
    reads: int = 0  # decode: merged reads (os arm: major faults)
    ops: int = 0
    bytes: int = 0
    useful_bytes: int = 0
    hits: int = 0
    misses: int = 0
    major_faults: int = 0
    device_bytes: int | None = None  # decode: /proc/self/io read_bytes delta
    prompt_tokens: int = 0
    prompt_passes: int = 0  # passes over the experts (prompts and follow-ups): ceil(tokens / n_ubatch) each
    prompt_bytes: int = 0  # read by the pass reader
    prompt_read_s: float = 0.0  # time with a pass read outstanding
    prompt_device_bytes: int | None = None
    prompt_major_faults: int = 0
    followup_s: float = 0.0  # a session's follow-up turn: time to its first token, summed over prompts
    followup_tokens: int = 0
    followup_bytes: int = 0  # read by the pass reader during the follow-up turns
    routing: list[dict] = field(default_factory=list)  # per decode step: {layer: positions}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("routing")
        return d


class LlamaStream(StreamRuntime):
    """The streaming runtime on a llama.cpp context of its own (see the module docstring and
    StreamRuntime for the options; n_threads: llama.cpp's threads)."""

    def __init__(self, path, *, n_threads: int | None = None, **kw):
        from mbolt.runtime.runner import LlamaRunner

        super().__init__(path, **kw)
        self.runner = None
        try:
            self.runner = LlamaRunner(self.model_path, n_ctx=self.n_ctx, n_threads=n_threads, capture=False,
                                      on_topk=self.on_topk if self.uses_callback else None, load_mode="mmap",
                                      f32_kv=self.f32_kv, flash_attn=self.flash_attn, n_batch=self.n_ubatch)
            self.attach(self.runner.memory)
        except BaseException:
            self.close()
            raise

    _COUNTED = ("io_time", "reads", "ops", "bytes", "useful_bytes", "hits", "misses")

    def _counts(self) -> np.ndarray:
        c = self.store.counters if self.store is not None else None
        return np.array([getattr(c, k) if c else 0 for k in self._COUNTED], float)

    def generate(self, prompts: list[list[int]], n_new: int, on_token=None, forced: int = 0,
                 followup: int = 0) -> StreamRun:
        """Decode `n_new` tokens after each prompt; timings and reads of the decode steps only (the
        prompt's reads count in its time to first token). Greedy by default; `forced` > 0 is
        teacher forcing: prefill the prompt's first `forced` tokens, then feed its next tokens one
        at a time (routing follows the text). `followup` > 0 (teacher-forced sessions): then feed
        the next `followup` tokens of the text as one more turn on the same context (its KV cache
        reused): its time to first token is `followup_s`. `generated` holds the greedy prediction
        of every step (and of the follow-up's first token), so arms that compute the same model agree."""
        run = StreamRun(generated=[])
        r = self.runner
        acc = np.zeros(len(self._COUNTED))
        dev: int | None = 0
        check = self.store is not None
        prompt0 = self.prompt.to_dict()
        self.prompt_major_faults = 0
        pdev: int | None = 0
        for p, ids in enumerate(prompts):
            if forced and len(ids) < forced + n_new + followup:
                raise MboltError(f"prompt {p}: {len(ids)} tokens; teacher forcing needs {forced} + {n_new}"
                                 f"{f' + {followup}' if followup else ''} (give a longer text or fewer --new-tokens)")
            r.reset()
            self._step = {}
            first = list(ids[:forced] if forced else ids)
            logits, dt, d = self._prompt(first)
            run.prefill_s += dt
            run.prompt_tokens += len(first)
            pdev = None if (pdev is None or d is None) else pdev + d
            out = []
            for i in range(n_new):
                pred = int(np.argmax(logits))
                out.append(pred)
                tok = int(ids[forced + i]) if forced else pred
                self._step = {}
                c0, d0 = self._counts(), proc_read_bytes()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
                t0 = time.perf_counter()
                logits = r.eval([tok])
                run.decode_s += time.perf_counter() - t0
                run.major_faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
                acc += self._counts() - c0
                d1 = proc_read_bytes()
                dev = None if (dev is None or d0 is None or d1 is None) else dev + d1 - d0
                if check:
                    self.check_routed()
                run.decode_tokens += 1
                if self.record:
                    run.routing.append(dict(self._step))
                self.drop_experts()
                if on_token:
                    on_token(i, tok)
            if followup:
                turn = [int(t) for t in ids[forced + n_new: forced + n_new + followup]]
                b0 = self.prompt.bytes
                logits, dt, d = self._prompt(turn)
                run.followup_bytes += self.prompt.bytes - b0
                run.followup_s += dt
                run.followup_tokens += len(turn)
                pdev = None if (pdev is None or d is None) else pdev + d
                out.append(int(np.argmax(logits)))
            run.generated.append(out)
        run.device_bytes = dev
        run.prompt_device_bytes = pdev
        run.prompt_major_faults = self.prompt_major_faults
        now = self.prompt.to_dict()
        run.prompt_passes = now["passes"] - prompt0["passes"]
        run.prompt_bytes = now["bytes"] - prompt0["bytes"]
        run.prompt_read_s = now["read_s"] - prompt0["read_s"]
        if self.store is not None:
            run.io_s = float(acc[0])
            run.reads, run.ops, run.bytes, run.useful_bytes, run.hits, run.misses = (int(x) for x in acc[1:])
        else:
            # os arm: every major fault is one read the kernel issued, readahead included
            run.reads = run.ops = run.major_faults
            run.bytes = dev or 0
        return run

    def _prompt(self, tokens: list[int]):
        """Evaluate a prompt (or a turn) on the context as it stands: (logits of its last token,
        seconds to them, device bytes read). The runtime's prompt passes end here (read-ahead
        done, the cache grown back), inside the time."""
        d0 = proc_read_bytes()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        t0 = time.perf_counter()
        logits = self.runner.eval(tokens)
        self.finish_prompt()
        self.drop_experts()
        dt = time.perf_counter() - t0
        d1 = proc_read_bytes()
        self.prompt_major_faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
        self._seen = set()
        return logits, dt, (None if d0 is None or d1 is None else d1 - d0)

    def detokenize(self, ids: list[int]) -> str:
        L = self.runner.L
        out = b""
        buf = ctypes.create_string_buffer(256)
        for t in ids:
            n = L.llama_token_to_piece(self.runner.vocab, int(t), buf, len(buf), 0, False)
            if n > 0:
                out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    def close(self) -> None:
        if getattr(self, "runner", None) is not None:
            self.runner.close()
            self.runner = None
        super().close()


def routing_trace(runs: list[StreamRun], mm: MoeMap):
    """The decode routing llama.cpp computed, as a Trace of ORIGINAL expert ids (for the predictor)."""
    from mbolt.core.trace import DECODE, Trace

    steps = [s for r in runs for s in r.routing]
    k = mm.n_used
    ex = np.full((len(steps), mm.n_layers, k), -1, np.int16)
    perm = mm.route_map.perm
    for t, st in enumerate(steps):
        for layer, pos in st.items():
            if layer < mm.n_layers:
                p = np.asarray(pos[:k], np.int64)
                ex[t, layer, : p.size] = perm[layer][p]
    n = len(steps)
    return Trace(n_layers=mm.n_layers, n_experts=mm.n_experts, k=k, experts=ex,
                 phase=np.full(n, DECODE, np.uint8), seq=np.zeros(n, np.int32), pos=np.arange(n, dtype=np.int32),
                 fingerprint=mm.source_fingerprint)


def record_routing(path, prompts: list[list[int]], n_new: int, mm: MoeMap | None = None, forced: int = 0):
    """Generate once warm (no reads, no eviction) with the callback recording the decode routing;
    returns it as a Trace (original ids). Deterministic (greedy or teacher-forced): every arm routes
    the same."""
    with LlamaStream(path, reads=False, evict=False, record=True, mm=mm) as s:
        return routing_trace([s.generate(prompts, n_new, forced=forced)], s.mm)
