"""The decode driver: a llama.cpp context with an arm in it (the streaming runtime, or plain
llama.cpp), its sequences, and the steps every llama.cpp decode loop is made of. Nothing above it
reaches its arm or its runner implicitly: what the commands read of them is named here. Its one
loop over decode steps is `steps`, run by `decode` (the tracer, llama.cpp parity) and `generate`
(`mbolt generate --engine llama.cpp`, `ab` and the benchmarks); the server's turn
(serve/scheduler.py: `serve` and `chat`) runs the same steps (`prompt_pass`, `step`), one
llama_decode per turn.

- `prompt(tokens, seq)`: a prompt (or a turn) on a sequence, in passes of n_ubatch; a sequence
  keeps its tokens, so a follow-up turn that starts with them only evaluates what is new (the KV
  cache of the common prefix is reused). The runtime's prompt passes end inside it (read-ahead
  done, the cache grown back): its time is the time to first token.
- `step(feeds)`: one decode step, one token of each live sequence in one llama_decode (a batch of
  conversations shares each layer's reads: the runtime reads the union of their experts once).
- `prompt_pass(seq, tokens, feeds)`: one pass of a newcomer's prompt with a decode row of every
  reply under way in the same llama_decode (the server's continuous batching).
- `decode(prompt, n_new)`: greedy (or fed) decoding of one sequence, yielding the logits of the
  prompt and of each decode step (the tracer and parity watch the routing of each).
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
from typing import TYPE_CHECKING

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap
from mbolt.runtime.measured import StreamRun
from mbolt.runtime.runner import Phase
from mbolt.core.pagecache import proc_read_bytes
from mbolt.runtime.streamer import StreamRuntime, check_llama_streamable  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from mbolt.runtime.sampling import Sampler


_COUNTED = ("io_time", "reads", "ops", "bytes", "useful_bytes", "hits", "misses")


def common_prefix(a, b) -> int:
    """How many first tokens two token sequences (lists or arrays) share."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(diff[0]) if diff.size else m


def _of_arm(name: str, doc: str) -> property:
    """A read-only property of the driver that is its arm's `name`."""
    return property(lambda self: getattr(self.arm, name), doc=doc)


class Driver:
    """A llama.cpp context driven by mbolt, with `arm` (a StreamRuntime or a PlainLlama) in it;
    `n_seq` sequences of the arm's n_ctx tokens each. `watchers` (begin, on_topk, end: a routing
    recorder) see every step and every selection (the C fast path is then off)."""

    def __init__(self, arm, *, n_threads: int | None = None, n_seq: int = 1, watchers=()):
        from mbolt.runtime.runner import Hooks, LlamaRunner

        self.arm = arm
        self.runner = None
        self._eog: tuple[int, ...] | None = None  # the vocabulary's end-of-generation tokens, once asked
        if watchers:
            arm.record = True  # every selection reaches Python
            arm.uses_callback = True
        hooks = Hooks([arm, *watchers])
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

    # ---- what the commands, ab and the benchmarks read of the arm (each named: nothing else passes) ----

    mm = _of_arm("mm", "The model's MoE map (core.moe_map).")
    n_ctx = _of_arm("n_ctx", "The context asked for, per sequence (llama.cpp pads it: `n_ctx_seq`).")
    n_ubatch = _of_arm("n_ubatch", "Tokens per prompt pass.")
    flash_attn = _of_arm("flash_attn", "llama.cpp's flash attention is on.")
    repacking = _of_arm("repacking", "Where the weights' repacked layout comes from: off, or how.")
    pages = _of_arm("pages", "The expert tensors' pages (residency: `resident`, `mapped`).")
    budget = _of_arm("budget", "The memory budget (runtime.budget.Budget), or None without one.")
    cache_slots = _of_arm("cache_slots", "Expert slots per layer of the runtime's cache (0: plain).")
    prefill_slots = _of_arm("prefill_slots", "Slots per layer during a prompt (None without a budget).")
    decode_slots = _of_arm("decode_slots", "Slots per layer during decode (None without a budget).")
    pinned_per_layer = _of_arm("pinned_per_layer", "Hottest experts pinned per layer.")
    locked_bytes = _of_arm("locked_bytes", "Dense weights locked in memory (mlock).")
    copied_bytes = _of_arm("copied_bytes", "Dense weights copied out of the file.")
    reclaimed = _of_arm("reclaimed", "Cached experts found reclaimed by the kernel (read again).")

    def make_cold(self) -> None:
        """No expert page resident, the dense weights resident: a cold measurement starts here."""
        self.arm.make_cold()

    def hold_all(self) -> None:
        """Every expert resident: a warm measurement starts here."""
        self.arm.hold_all()

    def fit_budget(self) -> None:
        """The runtime's cache sized from its budget, nothing dropped (a warm arm under a budget)."""
        self.arm.fit_budget()

    def describe_budget(self) -> str:
        return self.arm.describe_budget()

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

    def decode(self, prompt: list[int], n_new: int, *, seq: int = 0, eos: int | None = None,
               fed: list[int] | None = None):
        """Greedy decoding of one sequence: the prompt (prompt passes), then up to `n_new` decode
        steps, each feeding the argmax of the last logits, or `fed[i]` (teacher-forced: read at
        step i, so a caller may append to it as it goes); yields (tokens fed, their logits) after the
        prompt and after each step, 1 + n_new of them, fewer when the greedy token is `eos` (not fed)."""
        logits, _, _ = self.prompt(prompt, seq)
        yield [int(t) for t in prompt], logits
        feed = (lambda i, s: fed[i]) if fed is not None else None
        for _, feeds, out, _ in self.steps([seq], [logits], n_new, feed=feed, eos=eos):
            yield [feeds[0][1]], out[0]

    def steps(self, seqs: list[int], logits: list[np.ndarray], n_new: int, feed=None, eos: int | None = None):
        """The one loop of decode steps (`decode`, `generate`; the server's scheduler steps its
        slots one `step` at a time): up to `n_new` steps, each one token of every sequence in
        `seqs` in one llama_decode. A sequence's greedy token is the argmax of its last logits
        (`logits[j]` for `seqs[j]` at first); it is fed, or `feed(i, seq)` at step i (teacher
        forcing). Yields (greedy tokens, feeds, their logits, seconds of the step: the arm's own
        time after it aside) after each step; stops before a step where a greedy token is `eos`."""
        arm = self.arm
        for i in range(n_new):
            greedy = [int(np.argmax(lg)) for lg in logits]
            if eos is not None and eos in greedy:
                return
            feeds = [(s, int(feed(i, s)) if feed is not None else g) for s, g in zip(seqs, greedy)]
            t0, a0 = time.perf_counter(), arm.after_step_s
            logits = self.step(feeds)
            yield greedy, feeds, logits, time.perf_counter() - t0 - (arm.after_step_s - a0)

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

    # what the server shows and keys its saved states by (the arm stated, not inferred)
    streaming = False  # the arm streams experts (mapped or kernel layout), else plain llama.cpp: open_driver says
    f32_kv = _of_arm("f32_kv", "The KV cache is F32 (else F16).")

    def runtime_view(self):
        """The streaming arm's counters, budget and cache (runtime.cache_view.RuntimeView, one shape
        for both streaming arms); None for plain llama.cpp."""
        return self.arm.runtime_view() if self.streaming else None

    @property
    def arch(self) -> str:
        """The model's architecture (a kernel-layout file's: the one it holds)."""
        return self.arm.mm.arch

    @property
    def model_fingerprint(self) -> str:
        """The header fingerprint of the file (or split set) llama.cpp computes with: a saved KV state
        loads only into the same. A kernel-layout file's is its own, not its source's (`mm.fingerprint`
        there: the same model, its weights summed by other kernels)."""
        if getattr(self, "_fingerprint", None) is None:
            from mbolt.core.gguf_set import open_model_header

            self._fingerprint = open_model_header(self.arm.path).fingerprint
        return self._fingerprint

    # ---- the measured loop ----

    def _counts(self) -> np.ndarray:
        c = self.arm.store.counters if self.streaming else None
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
            feed = (lambda i, s, group=group: group[s][forced + i]) if forced else None
            for i, (greedy, feeds, _, dt) in enumerate(self.steps(list(range(len(group))), logits, n_new, feed)):
                for s, pred in enumerate(greedy):
                    outs[s].append(pred)
                run.decode_s += dt
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
        if self.streaming:
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
                flash_attn: bool | None = None, watchers=(), plain_flag: str = "a run without --stream",
                **runtime_options) -> Driver:
    """A driver over the arm these options name: `reads` the streaming runtime (its options:
    gap, qd, cache_slots, budget, asynchronous, pins; `evict=False` a warm control), else plain
    llama.cpp (`evict`: drop every expert page after each decode step, the emulation without a
    limit; `callback`: the eval callback alone; `record`: keep each step's selections; `repacked`:
    llama.cpp's default load; `llama_model`: a model the caller loaded itself, a probe's own load,
    used as it is and not freed here). `plain_flag`: how the caller's user asks for plain llama.cpp
    (named when a kernel-layout file, which plain llama.cpp cannot load, is refused)."""
    from mbolt.runtime.kernel_stream import is_kernel_path, kernel_arm
    from mbolt.runtime.memory import default_ubatch
    from mbolt.runtime.plain import PlainLlama

    common = dict(mm=mm, n_ctx=n_ctx, n_ubatch=n_ubatch or default_ubatch(reads, n_seq), f32_kv=f32_kv, flash_attn=flash_attn,
                  record=record)
    if is_kernel_path(path):
        arm = kernel_arm(path, reads, evict, n_seq, common, runtime_options, plain_flag)
    elif reads:
        arm = StreamRuntime(path, evict=evict, n_seq=n_seq, **common, **runtime_options)
    else:
        if runtime_options.get("pins"):
            raise MboltError("pins keep experts the runtime reads: they need explicit reads")
        arm = PlainLlama(path, drop_after_step=evict, callback=bool(callback),
                         repacked=bool(runtime_options.get("repacked")), **common)
        arm.llama_model = runtime_options.get("llama_model")
    try:
        d = Driver(arm, n_threads=n_threads, n_seq=n_seq, watchers=watchers)
    except BaseException:
        arm.close()
        raise
    d.streaming = bool(reads)  # a kernel-layout file is streamed or refused (kernel_arm)
    return d
