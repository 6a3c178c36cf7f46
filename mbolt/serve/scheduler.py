"""One model serving many conversations: slots decoded together (continuous batching).

The server's HTTP handlers and the terminal chat both talk to a `Scheduler`: `prepare_chat` or
`prepare_text` turn a request into prompt tokens (the GGUF's own chat template, rendered by
llama-cpp-python's Jinja2 formatter, tools included; its stop strings), checked against the
context; `submit` queues it (bounded: beyond the bound it is refused, the server says 503).

One worker thread runs the model through the runtime's one driver (runtime.driver), the same
path `generate` and the benchmarks run. The driver holds `parallel` sequences (llama-server's
slots, `-np`); a job takes the free slot whose tokens share the longest prefix with its prompt (a
follow-up turn reuses its KV cache). Each turn of the loop is one llama_decode: a decode step of
every slot that is replying (one token each, so the runtime reads the union of their experts once
per layer), or, while a newcomer's prompt is under way, one pass of it (up to n_ubatch tokens, less
one row per reply) with a decode row of every reply in the same batch (llama-server's mixed
batches): the replies go on during a newcomer's prompt, each waiting for no more than one pass, and
the pass's reads serve their rows too. A prompt starts from the longest prefix held anywhere
(serve.prompt_cache): its slot's own KV, another slot's (copied), a file of the prompt cache on
disk (restored); with a cache, the pass that reaches the start of the last user turn ends there and
the slot's state is saved. A reply that ends or a client that leaves frees its slot at
the next step. Each job's events (text pieces, then the
end with its usage) go to a callback; `cancel` stops a job at its next step, or inside its prompt
pass through llama.cpp's abort callback.

Sampling is llama.cpp's sampler chain (runtime.sampling) with llama-server's defaults
(temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.0): temperature 0 gives the
runtime's greedy tokens; a job's grammar (GBNF) constrains its reply.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.runtime.driver import common_prefix
from mbolt.serve.text import ReplyText

SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
RATE_WINDOW_S = 10.0  # tok/s per slot and in total over this many seconds


class RequestError(MboltError):
    """A request the scheduler refuses (HTTP 400): `code` is OpenAI's error code, `param` the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Job:
    tokens: list[int]
    max_tokens: int
    sampling: dict
    stop: list[str]
    on_event: object  # on_event(kind, data): ("text", str), ("end", {"finish_reason", "usage", ...}), ("error", str)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    grammar: str | None = None  # GBNF the reply must match (tool calls, JSON output)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class Slot:
    seq: int
    job: Job | None = None
    sampler: object = None
    todo: list[int] = field(default_factory=list)  # prompt tokens still to evaluate
    last: int | None = None  # the token the next step feeds
    out: list[int] = field(default_factory=list)
    text: ReplyText | None = None
    t_start: float = 0.0
    t_first: float | None = None
    prompt_s: float = 0.0
    n_prompt_new: int = 0
    recent: collections.deque = field(default_factory=collections.deque)  # times of its last tokens
    request: int = 0  # the recorder's number of its job
    n_cached: int = 0  # prompt tokens not evaluated (reused, copied or restored)
    save_at: int = 0  # save the slot's state to the prompt cache when it holds this many tokens (0: never)


@dataclass
class Counters:
    """What the server did (cumulative), for /metrics and the page."""

    requests: int = 0
    prompt_tokens: int = 0  # evaluated (a reused prefix is not)
    prompt_s: float = 0.0
    decode_tokens: int = 0  # replies' tokens, of decode steps and mixed passes
    decode_s: float = 0.0  # the llama_decodes they waited for (a mixed pass counts in prompt_s too)
    decode_steps: int = 0  # decode steps alone (a reply's token inside a prompt pass is a mixed pass's)
    step_rows: int = 0  # sequences decoded, summed over decode steps
    mixed_passes: int = 0  # prompt passes with replies' decode rows in them
    last_decode_tokens_per_s: float = 0.0  # of the reply under way, else of the last one
    cached_tokens: int = 0  # prompt tokens not evaluated: a slot's own prefix, a copy, a restore
    kv_copies: int = 0  # prefixes copied from another slot (llama_memory_seq_cp)


class Scheduler:
    def __init__(self, loaded, *, max_queue: int = 8, recorder=None, name: str = "", prompt_cache=None):
        self.loaded = loaded
        self.driver = loaded.driver
        self.n_ctx = loaded.n_ctx
        self.max_queue = int(max_queue)
        self.recorder = recorder
        self.name = name
        self.counters = Counters()
        self.slots = [Slot(seq) for seq in range(self.driver.n_seq)]
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._in_pass: Job | None = None
        self._recent: collections.deque = collections.deque()  # times of tokens of every slot
        self._template = self._chat_template()
        self.cache = prompt_cache  # serve.prompt_cache.PromptCache (--prompt-cache), or None
        self._turn_starts: collections.OrderedDict = collections.OrderedDict()  # prompt -> its last user turn's start
        self._copied_from: set[int] = set()  # slots whose KV copy llama.cpp makes at the next llama_decode
        self._worker = threading.Thread(target=self._work, name="mbolt-scheduler", daemon=True)
        self._worker.start()

    # ---- requests ----

    def _chat_template(self):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.loaded.metadata.get(Keys.Tokenizer.CHAT_TEMPLATE)
        if not template:
            return None
        eos, bos = self.driver.eos_token, self.driver.bos_token
        return Jinja2ChatFormatter(template=template, eos_token=self.driver.token_text(eos),
                                   bos_token=self.driver.token_text(bos), stop_token_ids=[eos])

    @property
    def chat_template(self) -> str | None:
        """The model's chat template text (None without one): it tells the family's tool-call format."""
        return None if self._template is None else self._template.template

    def prepare_chat(self, messages: list[dict], tools: list[dict] | None = None,
                     tool_choice=None) -> tuple[list[int], list[str]]:
        """Prompt tokens and the template's stop strings for a conversation (and the tools it may
        call, rendered by the template)."""
        if self._template is None:
            raise RequestError("this model's GGUF has no tokenizer.chat_template: use /v1/completions",
                               "messages", "no_chat_template")
        try:
            res = self._template(messages=messages, tools=tools, tool_choice=tool_choice)
        except Exception as e:  # a template may raise on a conversation it does not accept
            raise RequestError(f"the model's chat template refused the messages: {e}", "messages") from None
        ids = self.driver.tokenize(res.prompt, add_special=not res.added_special, parse_special=True)
        if self.cache is not None:  # where the cache saves this prompt: before its last user turn
            from mbolt.serve.prefixes import turn_start

            def tokenize(text: str, added: bool) -> list[int]:
                return self.driver.tokenize(text, add_special=not added, parse_special=True)

            n = turn_start(self._template, messages, tools, tool_choice, tokenize, ids)
            with self._cv:
                self._turn_starts[tuple(ids)] = n
                while len(self._turn_starts) > 64:
                    self._turn_starts.popitem(last=False)
        stop = res.stop if isinstance(res.stop, list) else [res.stop] if res.stop else []
        return ids, [s for s in stop if s]

    def prepare_text(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            n_vocab = self.driver.n_vocab
            if not prompt or any(not isinstance(t, int) or not 0 <= t < n_vocab for t in prompt):
                raise RequestError(f"prompt token ids must be integers in 0..{n_vocab - 1}", "prompt")
            return list(prompt)
        return self.driver.tokenize(prompt, add_special=True, parse_special=True)

    def check_fits(self, tokens: list[int], max_tokens: int | None) -> int:
        """The number of tokens to generate: max_tokens, or what the context leaves; refused
        (context_length_exceeded) when the prompt and max_tokens do not fit the context."""
        n_ctx = self.n_ctx
        if not tokens:
            raise RequestError("the prompt has no tokens", "prompt")
        if len(tokens) >= n_ctx:
            raise RequestError(f"the prompt's {len(tokens)} tokens do not fit the context of {n_ctx} tokens",
                               "messages", "context_length_exceeded")
        if max_tokens is None:
            return n_ctx - len(tokens)
        if len(tokens) + max_tokens > n_ctx:
            raise RequestError(f"max_tokens {max_tokens} and the prompt's {len(tokens)} tokens exceed the context of "
                               f"{n_ctx} tokens", "max_tokens", "context_length_exceeded")
        return max_tokens

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the job is not taken)."""
        with self._cv:
            if len(self._queue) >= self.max_queue and not any(s.job is None for s in self.slots):
                return False
            job.submitted = time.perf_counter()
            self._queue.append(job)
            self._cv.notify()
        return True

    def cancel(self, job: Job) -> None:
        """Stop a job: queued, it is dropped; running, it stops at the next step, or inside its
        prompt pass (llama.cpp's abort callback stops the graph between two nodes)."""
        job.cancelled.set()
        with self._cv:
            if self._in_pass is job:
                self.loaded.abort.set()
            self._cv.notify()

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._worker.join(timeout=60)
        if self.cache is not None:
            self.cache.close()

    # ---- the worker ----

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._queue and not any(s.job for s in self.slots):
                    self._cv.wait()
                if self._closing:
                    return
                jobs = self._take()
            try:
                self._copied_from.clear()  # the last turn's llama_decode made them
                for slot, job in jobs:
                    self._start(slot, job)
                self._turn()
            except Exception as e:  # the server never dies from a request: every job in flight gets the error
                for s in self.slots:
                    if s.job is not None:
                        self._finish(s, "error", f"{type(e).__name__}: {e}")
                        self.driver.forget(s.seq)

    def _take(self) -> list[tuple[Slot, Job]]:
        """Queued jobs for the free slots (each the one holding the longest prefix of its prompt);
        called with the lock held."""
        free = [s for s in self.slots if s.job is None]
        out = []
        while self._queue and free:
            job = self._queue.popleft()
            if job.cancelled.is_set():
                continue
            held = self.driver.tokens
            slot = max(free, key=lambda s: common_prefix(held[s.seq], job.tokens))
            free.remove(slot)
            out.append((slot, job))
        return out

    def _start(self, s: Slot, job: Job) -> None:
        from mbolt.runtime.sampling import SamplingOptions

        opts = SamplingOptions(**{k: v for k, v in job.sampling.items() if k in SamplingOptions.__dataclass_fields__},
                               grammar=job.grammar)
        try:
            s.sampler = self.driver.sampler(opts)
        except Exception as e:  # a grammar llama.cpp refuses: this job's error, not the server's
            job.on_event("error", f"{type(e).__name__}: {e}" if not isinstance(e, MboltError) else str(e))
            return
        job.started = True
        s.job, s.out, s.last, s.text = job, [], None, ReplyText(job.stop)
        self._reuse(s, job)
        s.t_start, s.t_first, s.prompt_s, s.n_prompt_new = job.submitted, None, 0.0, len(s.todo)
        self.counters.requests += 1
        if self.recorder is not None:
            s.request = self.recorder.begin_request()

    def _reuse(self, s: Slot, job: Job) -> None:
        """The slot starts from the longest prefix of the job's prompt held anywhere (the one place
        the prompt cache restores); where its state will be saved."""
        from mbolt.serve.prefixes import MIN_TOKENS, reuse

        got = reuse(self.driver, s.seq, job.tokens, self.cache, self._copied_from)
        s.todo, s.n_cached = got.todo, got.cached
        self.counters.cached_tokens += got.cached
        self.counters.kv_copies += got.source == "copy"
        s.save_at = 0
        if self.cache is not None:
            with self._cv:
                at = self._turn_starts.pop(tuple(job.tokens), None)
            at = at or len(job.tokens)  # no turns known (a completion): the whole prompt
            if at >= max(MIN_TOKENS, got.cached + 1):
                s.save_at = at

    def _turn(self) -> None:
        """One pass of the oldest newcomer's prompt with a decode row of every reply in it, or one
        decode step of every reply."""
        for s in self.slots:
            if s.job is not None and s.job.cancelled.is_set():
                self._finish(s, "cancelled")
        prompting = [s for s in self.slots if s.job is not None and s.todo]
        replying = [s for s in self.slots if s.job is not None and not s.todo and s.last is not None]
        if prompting:
            s = min(prompting, key=lambda s: s.job.submitted)
            if self.driver.n_batch > len(replying):
                self._prompt_pass(s, replying)
                return
            self._prompt_pass(s, [])  # a micro-batch of fewer rows than the replies: the pass, then the step
        if replying:
            self._decode(replying)

    def _prompt_pass(self, s: Slot, replying: list[Slot]) -> None:
        d, job = self.driver, s.job
        n = d.n_batch - len(replying)
        held = len(d.tokens[s.seq])
        if held < s.save_at:
            n = min(n, s.save_at - held)  # the pass ends where the cache saves
        chunk, s.todo = s.todo[:n], s.todo[n:]
        with self._cv:
            self._in_pass = job
        t0 = time.perf_counter()
        if self.recorder is not None:
            self.recorder.rows([s.request] * len(chunk) + [r.request for r in replying], len(replying))
        try:
            d.prompt_pass(s.seq, chunk, [(r.seq, r.last) for r in replying])
            if not s.todo:
                d.end_prompt()
        except MboltError:
            if not job.cancelled.is_set():
                raise
            # aborted inside the pass: what the newcomer holds is not a prefix any more; the
            # replies did not advance (their rows were taken back) and go on at the next turn
            d.forget(s.seq)
            self._finish(s, "cancelled")
            return
        finally:
            with self._cv:
                self._in_pass = None
                self.loaded.abort.clear()
        now = time.perf_counter()
        dt = now - t0
        s.prompt_s += dt
        c = self.counters
        c.prompt_tokens += len(chunk)
        c.prompt_s += dt
        if s.save_at and len(d.tokens[s.seq]) == s.save_at:
            self.cache.save(d, s.seq)  # the one place the prompt cache saves
            s.save_at = 0
        if replying:
            c.mixed_passes += 1
            self._replies(replying, [d.sample(r.sampler, len(chunk) + j) for j, r in enumerate(replying)],
                          dt, now)
        if not s.todo:
            s.t_first = now
            self._emit(s, d.sample(s.sampler, len(chunk) - 1))

    def _decode(self, replying: list[Slot]) -> None:
        d = self.driver
        if self.recorder is not None:
            self.recorder.rows([s.request for s in replying])
        t0 = time.perf_counter()
        d.step([(s.seq, s.last) for s in replying], want_logits=False)
        tokens = [d.sample(s.sampler, i) for i, s in enumerate(replying)]
        now = time.perf_counter()
        c = self.counters
        c.decode_steps += 1
        c.step_rows += len(replying)
        self._replies(replying, tokens, now - t0, now)

    def _replies(self, replying: list[Slot], tokens: list[int], dt: float, now: float) -> None:
        """The replies' tokens of a decode step or a mixed pass (`dt` the llama_decode they waited for)."""
        c = self.counters
        c.decode_s += dt
        c.decode_tokens += len(replying)
        for s, tok in zip(replying, tokens):
            s.recent.append(now)
            self._recent.append(now)
            self._emit(s, tok)
        while self._recent and now - self._recent[0] > RATE_WINDOW_S:
            self._recent.popleft()

    def _emit(self, s: Slot, tok: int) -> None:
        """A sampled token: the end of the reply (end of generation, a stop string, max_tokens), or
        its text out and the token fed at the next step."""
        d = self.driver
        if d.is_eog(tok):
            self._finish(s, "stop")
            return
        s.out.append(int(tok))
        piece = s.text.add(d.piece_bytes([tok]))
        if piece:
            s.job.on_event("text", piece)
        if s.text.stopped:
            self._finish(s, "stop")
        elif len(s.out) >= s.job.max_tokens:
            self._finish(s, "length")
        else:
            s.last = int(tok)

    def _finish(self, s: Slot, reason: str, error: str | None = None) -> None:
        job = s.job
        s.job, s.last, s.todo = None, None, []
        if s.sampler is not None:
            s.sampler.close()
            s.sampler = None
        if self.recorder is not None:
            self.recorder.end_request()
        if error is not None:
            job.on_event("error", error)
            return
        rest = s.text.flush() if reason != "stop" else ""
        if rest:
            job.on_event("text", rest)
        now = time.perf_counter()
        n = len(s.out)
        reply_s = now - s.t_first if s.t_first else 0.0
        if n > 1 and reply_s > 0:
            self.counters.last_decode_tokens_per_s = (n - 1) / reply_s
        usage = {"prompt_tokens": len(job.tokens), "completion_tokens": n, "total_tokens": len(job.tokens) + n,
                 "prompt_tokens_details": {"cached_tokens": s.n_cached}}
        job.on_event("end", {"finish_reason": reason, "usage": usage, "seconds": now - s.t_start,
                             "ttft_s": (s.t_first - s.t_start) if s.t_first else None,
                             "prompt_eval_s": s.prompt_s, "prompt_tokens_evaluated": s.n_prompt_new,
                             "tokens": list(s.out), "prompt_tokens": list(job.tokens), "slot": s.seq})

    # ---- numbers ----

    def stats(self) -> dict:
        """What /metrics, /stats and the chat's line show."""
        from mbolt.serve.stats import scheduler_stats

        c = self.counters
        out = {**scheduler_stats(self), "cached_tokens": c.cached_tokens, "kv_copies": c.kv_copies}
        return {**out, **self.cache.stats()} if self.cache is not None else out
