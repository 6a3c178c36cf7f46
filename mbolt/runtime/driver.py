"""The decode driver: a llama.cpp context with an arm in it (the streaming runtime, or plain
llama.cpp), its sequences, and the steps every llama.cpp decode loop is made of. The loops are
still three: `generate` below (`mbolt generate --engine llama.cpp`, `ab` and the benchmarks), the
server's turn (serve/scheduler.py: `serve` and `chat`) and reference.generate.greedy_decode (`trace`
over `prompt`; llama.cpp parity over a bare runner).

- `prompt(tokens, seq)`: a prompt (or a turn) on a sequence, in passes of n_ubatch; a sequence
  keeps its tokens, so a follow-up turn that starts with them only evaluates what is new (the KV
  cache of the common prefix is reused). The runtime's prompt passes end inside it (read-ahead
  done, the cache grown back): its time is the time to first token.
- `step(feeds)`: one decode step, one token of each live sequence in one llama_decode (a batch of
  conversations shares each layer's reads: the runtime reads the union of their experts once).
- `prompt_pass(seq, tokens, feeds)`: one pass of a newcomer's prompt with a decode row of every
  reply under way in the same llama_decode (the server's continuous batching).
- `generate(...)`: the measured loop (greedy or teacher-forced, with a follow-up turn), returning
  a `StreamRun` of timings and counters.

`open_driver` builds the arm from the options every command shares: `reads=False` is plain
llama.cpp (runtime.plain), else the streaming runtime (runtime.streamer). llama.cpp cannot load the
`packed` layout (its tensors are blobs llama.cpp does not know).
"""

from __future__ import annotations

import ctypes
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap
from mbolt.runtime.runner import Phase
from mbolt.core.pagecache import proc_read_bytes
from mbolt.runtime.streamer import StreamRuntime, check_llama_streamable  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from mbolt.runtime.sampling import Sampler


@dataclass
class StreamRun:
    """What one generation measured (prefill = the prompt, decode = the generated tokens)."""

    generated: list[list[int]]  # per prompt
    prefill_s: float = 0.0  # time to first token, summed over prompts
    decode_s: float = 0.0  # llama_decode wall time of the decode steps (dropping pages after them excluded)
    decode_tokens: int = 0
    io_s: float = 0.0  # decode: wall time of the explicit reads
    reads: int = 0  # decode: merged reads (plain: major faults)
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


_COUNTED = ("io_time", "reads", "ops", "bytes", "useful_bytes", "hits", "misses")


class _Hooks:
    """The runtime and whoever watches the steps (a routing recorder), told in that order."""

    def __init__(self, parts):
        self.parts = parts

    def begin(self, phase, n_rows: int) -> None:
        for h in self.parts:
            h.begin(phase, n_rows)

    def end(self) -> None:
        for h in self.parts:
            h.end()

    def on_topk(self, layer: int, rows) -> None:
        for h in self.parts:
            h.on_topk(layer, rows)


def common_prefix(a, b) -> int:
    """How many first tokens two token sequences (lists or arrays) share."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(diff[0]) if diff.size else m


class Driver:
    """A llama.cpp context driven by mbolt, with `arm` (a StreamRuntime or a PlainLlama) in it;
    `n_seq` sequences of the arm's n_ctx tokens each. `watchers` (begin, on_topk, end: a routing
    recorder) see every step and every selection (the C fast path is then off)."""

    def __init__(self, arm, *, n_threads: int | None = None, n_seq: int = 1, watchers=()):
        from mbolt.runtime.runner import LlamaRunner

        self.arm = arm
        self.runner = None
        self._eog: tuple[int, ...] | None = None  # the vocabulary's end-of-generation tokens, once asked
        if watchers:
            arm.record = True  # every selection reaches Python
            arm.uses_callback = True
        hooks = _Hooks([arm, *watchers])
        try:
            self.runner = LlamaRunner(arm.model_path, n_ctx=arm.n_ctx, n_threads=n_threads, capture=False,
                                      on_topk=hooks.on_topk if arm.uses_callback else None, load_mode=arm.load_mode,
                                      f32_kv=arm.f32_kv, flash_attn=arm.flash_attn, n_batch=arm.n_ubatch,
                                      n_seq=n_seq, model=arm.llama_model)
            self.runner.hooks = hooks
            arm.attach(self.runner.memory, self.runner.tap)
        except BaseException:
            self.close()
            raise
        self.tokens: list[list[int]] = [[] for _ in range(n_seq)]  # what each sequence holds
        self.prompt_major_faults = 0

    # the arm's state, as generate, ab and the benchmarks read it
    def __getattr__(self, name):
        if name in ("arm", "runner"):
            raise AttributeError(name)
        return getattr(self.arm, name)

    @property
    def n_seq(self) -> int:
        return self.runner.n_seq

    @property
    def native_filter(self) -> bool:
        """The eval callback's C filter was built (else Python answers every selection)."""
        return self.runner.native_filter

    # ---- sequences ----

    def keep_prefix(self, seq: int, tokens: list[int]) -> list[int]:
        """Keep what the sequence holds of the start of `tokens` (its KV cache reused: a follow-up
        turn of the same conversation) and forget the rest; returns the tokens still to evaluate
        (at least one: its logits are the answer)."""
        held = self.tokens[seq]
        n = min(common_prefix(held, tokens), len(tokens) - 1)
        self.runner.truncate(seq, n)
        del held[n:]
        return [int(t) for t in tokens[n:]]

    def hold(self, seq: int, tokens: list[int], n: int) -> bool:
        """The sequence's KV cache now holds `tokens` (a state loaded or copied into it behind
        llama_decode's back): keep their first `n`; False, the sequence cleared, where llama.cpp
        cannot cut it there (a recurrent state)."""
        self.runner.pos[seq] = len(tokens)
        if not self.runner.truncate(seq, n):
            self.forget(seq)
            return False
        self.tokens[seq] = [int(t) for t in tokens[:n]]
        return True

    def prompt_pass(self, seq: int, tokens: list[int], feeds: list[tuple[int, int]] = ()) -> None:
        """Evaluate the next tokens of a prompt (at most n_ubatch: one pass) on a sequence, with
        one decode row of each (sequence, token) in `feeds` in the same llama_decode (the replies
        under way go on during a newcomer's prompt). Samplers read the prompt's output at row
        len(tokens) - 1 and feed j's at len(tokens) + j. The prompt ends with `end_prompt` (a
        decode step ends it too)."""
        self.runner.mixed_pass(seq, [int(t) for t in tokens], list(feeds))
        self.tokens[seq].extend(int(t) for t in tokens)
        for s, t in feeds:
            self.tokens[s].append(int(t))

    def end_prompt(self) -> None:
        self.arm.end_prompt()

    def prompt(self, tokens: list[int], seq: int = 0) -> tuple[np.ndarray, float, int | None]:
        """Evaluate a prompt (or a turn) after what a sequence holds: (logits of its last token,
        seconds to them, device bytes read)."""
        todo = [int(t) for t in tokens]
        d0 = proc_read_bytes()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        t0 = time.perf_counter()
        logits = self.runner.eval(todo, seq=seq, phase=Phase.PROMPT)
        self.arm.end_prompt()
        dt = time.perf_counter() - t0
        d1 = proc_read_bytes()
        self.prompt_major_faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
        self.tokens[seq].extend(todo)
        return logits, dt, (None if d0 is None or d1 is None else d1 - d0)

    def step(self, feeds: list[tuple[int, int]], want_logits: bool = True) -> list[np.ndarray]:
        """One decode step: one token of each of these (sequence, token) in one llama_decode;
        the logits of each (or none: samplers read output i of the context, `Sampler.sample`)."""
        out = self.runner.decode_step(feeds, want_logits)
        for s, t in feeds:
            self.tokens[s].append(int(t))
        return out

    def sampler(self, opts) -> "Sampler":
        from mbolt.runtime.sampling import Sampler, eog_tokens

        if opts.ignore_eos and self._eog is None:
            self._eog = eog_tokens(self.runner.L, self.runner.vocab)
        return Sampler(self.runner.L, self.runner.vocab, opts, self._eog or ())

    def is_eog(self, token: int) -> bool:
        return bool(self.runner.L.llama_vocab_is_eog(self.runner.vocab, int(token)))

    def token_text(self, token: int) -> str:
        from mbolt.runtime.binding import token_text

        return token_text(self.runner.L, self.runner.vocab, token)

    def forget(self, seq: int | None = None) -> None:
        """Clear a sequence (every sequence when None)."""
        self.runner.reset(seq)
        for s in (range(self.n_seq) if seq is None else [seq]):
            self.tokens[s] = []

    # ---- for the server (nothing above the driver reaches the runner) ----

    @property
    def n_ctx_seq(self) -> int:
        """The tokens one sequence holds at most: llama.cpp's context per sequence, which it pads
        up to a multiple of 256 (so it can exceed the arm's n_ctx, what was asked)."""
        return self.runner.n_ctx

    @property
    def n_batch(self) -> int:
        """Rows of one llama_decode (a prompt pass's tokens plus the replies' decode rows)."""
        return self.runner.n_batch

    @property
    def n_vocab(self) -> int:
        return self.runner.n_vocab

    @property
    def n_layer(self) -> int:
        """The model's layers as llama.cpp counts them (what a saved state was laid out for)."""
        return int(self.runner.L.llama_model_n_layer(self.runner.model))

    @property
    def bos_token(self) -> int:
        return int(self.runner.L.llama_vocab_bos(self.runner.vocab))

    @property
    def eos_token(self) -> int:
        return int(self.runner.L.llama_vocab_eos(self.runner.vocab))

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return self.runner.tokenize(text, add_special=add_special, parse_special=parse_special)

    def sample(self, sampler: "Sampler", row: int) -> int:
        """The token `sampler` draws from output `row` of the last llama_decode (a step's row i is
        its i-th feed; a prompt pass's rows are told by `prompt_pass`)."""
        return sampler.sample(self.runner.ctx, row)

    def abort_flag(self):
        """A flag (native.AbortFlag) that, set, stops the llama_decode under way at its next node
        (it then fails); kept here too: llama.cpp calls it until the context is freed."""
        from mbolt.runtime.native import AbortFlag

        flag = AbortFlag(self.runner.L)
        self.runner.L.llama_set_abort_callback(self.runner.ctx, flag.cb, flag.data)
        self._abort_flag = flag
        return flag

    def copy_sequence(self, src: int, dst: int, n: int) -> bool:
        """Sequence `dst` takes the first `n` tokens of what `src` holds (llama_memory_seq_cp:
        between the streams of a context that is not unified, llama.cpp copies the stream's buffers
        at the next llama_decode, before the batch is computed); False as `hold`."""
        L = self.runner.L
        self.forget(dst)
        L.llama_memory_seq_cp(L.llama_get_memory(self.runner.ctx), src, dst, -1, -1)
        return self.hold(dst, self.tokens[src], n)

    @property
    def kv_cache_only(self) -> bool:
        """The context's memory is a KV cache alone (not a recurrent state, a hybrid, or a sliding
        window): a sequence's state is the cells of its own stream."""
        L, model = self.runner.L, self.runner.model
        return (not L.llama_model_is_recurrent(model) and not L.llama_model_is_hybrid(model)
                and int(L.llama_model_n_swa(model)) == 0)

    def state_size(self, seq: int) -> int:
        return int(self.runner.L.llama_state_seq_get_size(self.runner.ctx, seq))

    def save_state(self, seq: int, buf) -> int:
        """A sequence's state into `buf` (a ctypes byte array of `state_size` bytes); bytes written."""
        return int(self.runner.L.llama_state_seq_get_data(self.runner.ctx, buf, len(buf), seq))

    def load_state(self, seq: int, buf) -> int:
        """A saved state into sequence `seq`; bytes read, 0 when llama.cpp refuses it (`hold` then
        tells the driver its tokens)."""
        return int(self.runner.L.llama_state_seq_set_data(self.runner.ctx, buf, len(buf), seq))

    # ---- the measured loop ----

    def _counts(self) -> np.ndarray:
        c = self.arm.store.counters if self.arm.store is not None else None
        return np.array([getattr(c, k) if c else 0 for k in _COUNTED], float)

    def generate(self, prompts: list[list[int]], n_new: int, on_token=None, forced: int = 0,
                 followup: int = 0, parallel: int = 1) -> StreamRun:
        """Decode `n_new` tokens after each prompt; timings and reads of the decode steps only (the
        prompt's reads count in its time to first token). Greedy by default; `forced` > 0 is
        teacher forcing: prefill the prompt's first `forced` tokens, then feed its next tokens one
        at a time (routing follows the text). `followup` > 0 (teacher-forced sessions): then feed
        the next `followup` tokens of the text as one more turn on the same context (its KV cache
        reused): its time to first token is `followup_s`. `parallel` > 1: the prompts in groups of
        that many, one sequence each, every decode step one token of each in one llama_decode (a
        server's batch; decode_tokens counts every row). `generated` holds the greedy prediction of
        every step (and of the follow-up's first token), so arms that compute the same model agree."""
        run = StreamRun(generated=[])
        arm = self.arm
        if parallel < 1 or parallel > self.n_seq or len(prompts) % parallel:
            raise MboltError(f"{len(prompts)} prompts cannot be decoded {parallel} at a time by a driver of "
                             f"{self.n_seq} sequence{'s' if self.n_seq > 1 else ''} (give a multiple of {parallel})")
        acc = np.zeros(len(_COUNTED))
        dev: int | None = 0
        prompt0 = arm.prompt.to_dict()
        self.prompt_major_faults = 0
        pdev: int | None = 0
        for p, ids in enumerate(prompts):
            if forced and len(ids) < forced + n_new + followup:
                raise MboltError(f"prompt {p}: {len(ids)} tokens; teacher forcing needs {forced} + {n_new}"
                                 f"{f' + {followup}' if followup else ''} (give a longer text or fewer --new-tokens)")
        for g in range(0, len(prompts), parallel):
            group = prompts[g:g + parallel]
            for s in range(len(group)):
                self.forget(s)
            logits = []
            for s, ids in enumerate(group):
                first = list(ids[:forced] if forced else ids)
                lg, dt, d = self.prompt(first, seq=s)
                logits.append(lg)
                run.prefill_s += dt
                run.prompt_tokens += len(first)
                pdev = None if (pdev is None or d is None) else pdev + d
            outs = [[] for _ in group]
            c0, d0 = self._counts(), proc_read_bytes()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            for i in range(n_new):
                feeds = []
                for s, ids in enumerate(group):
                    pred = int(np.argmax(logits[s]))
                    outs[s].append(pred)
                    feeds.append((s, int(ids[forced + i]) if forced else pred))
                t0, a0 = time.perf_counter(), arm.after_step_s
                logits = self.step(feeds)
                run.decode_s += time.perf_counter() - t0 - (arm.after_step_s - a0)
                run.decode_tokens += len(feeds)
                if arm.record:
                    run.routing.append(dict(arm.step_routing))
                if on_token:
                    on_token(i, feeds[0][1])
            run.major_faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
            acc += self._counts() - c0
            d1 = proc_read_bytes()
            dev = None if (dev is None or d0 is None or d1 is None) else dev + d1 - d0
            for s, ids in enumerate(group):
                if followup:
                    turn = [int(t) for t in ids[forced + n_new: forced + n_new + followup]]
                    b0 = arm.prompt.bytes
                    lg, dt, d = self.prompt(turn, seq=s)
                    run.followup_bytes += arm.prompt.bytes - b0
                    run.followup_s += dt
                    run.followup_tokens += len(turn)
                    pdev = None if (pdev is None or d is None) else pdev + d
                    outs[s].append(int(np.argmax(lg)))
                run.generated.append(outs[s])
        run.device_bytes = dev
        run.prompt_device_bytes = pdev
        run.prompt_major_faults = self.prompt_major_faults
        now = arm.prompt.to_dict()
        run.prompt_passes = now["passes"] - prompt0["passes"]
        run.prompt_bytes = now["bytes"] - prompt0["bytes"]
        run.prompt_read_s = now["read_s"] - prompt0["read_s"]
        if arm.store is not None:
            run.io_s = float(acc[0])
            run.reads, run.ops, run.bytes, run.useful_bytes, run.hits, run.misses = (int(x) for x in acc[1:])
        else:
            # plain: every major fault is one read the kernel issued, readahead included
            run.reads = run.ops = run.major_faults
            run.bytes = dev or 0
        return run

    def detokenize(self, ids: list[int]) -> str:
        return self.piece_bytes(ids).decode("utf-8", errors="replace")

    def piece_bytes(self, ids: list[int], special: bool = False) -> bytes:
        """The bytes of these tokens (a multibyte character can span two of them)."""
        L = self.runner.L
        out = b""
        buf = ctypes.create_string_buffer(256)
        for t in ids:
            n = L.llama_token_to_piece(self.runner.vocab, int(t), buf, len(buf), 0, special)
            if n > 0:
                out += buf.raw[:n]
        return out

    def close(self) -> None:
        if getattr(self, "runner", None) is not None:
            settle = getattr(self.arm, "settle", None)
            if settle is not None:
                try:
                    settle()  # no layer laid over (or being) when llama.cpp unmaps the model
                except MboltError:
                    pass  # a failed read under way: nothing left to read it for
            self.runner.close()
            self.runner = None
        self.arm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_driver(path, *, reads: bool = True, evict: bool = True, callback: bool | None = None,
                record: bool = False, n_threads: int | None = None, n_seq: int = 1, mm: MoeMap | None = None,
                n_ctx: int | None = None, n_ubatch: int | None = None, f32_kv: bool = False,
                flash_attn: bool | None = None, watchers=(), **runtime_options) -> Driver:
    """A driver over the arm these options name: `reads` the streaming runtime (its options:
    gap, qd, cache_slots, budget, asynchronous, pins; `evict=False` a warm control), else plain
    llama.cpp (`evict`: drop every expert page after each decode step, the emulation without a
    limit; `callback`: the eval callback alone; `record`: keep each step's selections)."""
    from mbolt.runtime.kernel_stream import is_kernel_path, kernel_arm
    from mbolt.runtime.memory import default_ubatch
    from mbolt.runtime.plain import PlainLlama

    common = dict(mm=mm, n_ctx=n_ctx, n_ubatch=n_ubatch or default_ubatch(reads, n_seq), f32_kv=f32_kv, flash_attn=flash_attn,
                  record=record)
    if is_kernel_path(path):
        arm = kernel_arm(path, reads, evict, n_seq, common, runtime_options)
    elif reads:
        arm = StreamRuntime(path, evict=evict, n_seq=n_seq, **common, **runtime_options)
    else:
        if runtime_options.get("pins"):
            raise MboltError("pins keep experts the runtime reads: they need explicit reads")
        arm = PlainLlama(path, drop_after_step=evict, callback=bool(callback),
                         repacked=bool(runtime_options.get("repacked")), **common)
    try:
        return Driver(arm, n_threads=n_threads, n_seq=n_seq, watchers=watchers)
    except BaseException:
        arm.close()
        raise


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
    with open_driver(path, reads=False, evict=False, record=True, mm=mm) as s:
        return routing_trace([s.generate(prompts, n_new, forced=forced)], s.mm)
