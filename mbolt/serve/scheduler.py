"""One model serving requests one at a time, in arrival order.

The server's HTTP handlers and the terminal chat both talk to an `Scheduler`: `prepare_chat` or
`prepare_text` turn a request into prompt tokens (the GGUF's own chat template, rendered by
llama-cpp-python's Jinja2 formatter; its stop strings and end-of-generation tokens), checked
against the context; `submit` queues it (bounded: beyond the bound it is refused, the server says
503); one worker thread runs the queue through `Llama.create_completion` on those tokens, which
reuses the KV cache of the prefix the previous request left (a follow-up turn after no other
conversation). Each job's events (text pieces, then the end with its usage) go to a callback;
`cancel` stops a job at its next token, or inside its prompt through llama.cpp's abort callback.

Sampling defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
repeat_penalty 1.0), so temperature 0 gives the runtime's greedy tokens.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from mbolt.core.errors import MboltError

SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}


class RequestError(MboltError):
    """A request the engine refuses (HTTP 400): `code` is OpenAI's error code, `param` the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Job:
    tokens: list[int]
    max_tokens: int
    sampling: dict
    stop: list[str]
    on_event: object  # on_event(kind, data): ("text", str), ("end", {"finish_reason", "usage"}), ("error", str)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: bool = False


class Scheduler:
    def __init__(self, loaded, *, max_queue: int = 8, recorder=None, name: str = ""):
        self.loaded = loaded
        self.llm = loaded.llm
        self.max_queue = int(max_queue)
        self.recorder = recorder
        self.name = name
        self._jobs: queue.Queue = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._running: Job | None = None
        self._template = self._chat_template()
        self._worker = threading.Thread(target=self._work, name="mbolt-engine", daemon=True)
        self._worker.start()

    # ---- requests ----

    def _chat_template(self):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        llm = self.llm
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            return None
        eos, bos = llm.token_eos(), llm.token_bos()
        text = lambda t: llm._model.token_get_text(t) if t != -1 else ""  # noqa: E731
        return Jinja2ChatFormatter(template=template, eos_token=text(eos), bos_token=text(bos),
                                   stop_token_ids=[eos])

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def prepare_chat(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        """Prompt tokens and the template's stop strings for a conversation."""
        if self._template is None:
            raise RequestError("this model's GGUF has no tokenizer.chat_template: use /v1/completions",
                               "messages", "no_chat_template")
        try:
            res = self._template(messages=messages)
        except Exception as e:  # a template may raise on a conversation it does not accept
            raise RequestError(f"the model's chat template refused the messages: {e}", "messages") from None
        ids = self.llm.tokenize(res.prompt.encode("utf-8"), add_bos=not res.added_special, special=True)
        stop = res.stop if isinstance(res.stop, list) else [res.stop] if res.stop else []
        return ids, [s for s in stop if s]

    def prepare_text(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            n_vocab = self.llm.n_vocab()
            if not prompt or any(not isinstance(t, int) or not 0 <= t < n_vocab for t in prompt):
                raise RequestError(f"prompt token ids must be integers in 0..{n_vocab - 1}", "prompt")
            return list(prompt)
        return self.llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)

    def check_fits(self, tokens: list[int], max_tokens: int | None) -> int:
        """The number of tokens to generate: max_tokens, or what the context leaves; refused
        (context_length_exceeded) when the prompt and max_tokens do not fit the context."""
        n_ctx = self.loaded.n_ctx
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
        with self._lock:
            if self._waiting >= self.max_queue:
                return False
            self._waiting += 1
        self._jobs.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """Stop a job: not started, it is skipped; running, it stops at its next token, or inside
        its prompt (llama.cpp's abort callback stops the graph between two nodes)."""
        job.cancelled.set()
        with self._lock:
            if self._running is job:
                self.loaded.abort.set()

    @property
    def queue_length(self) -> int:
        return self._waiting

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=60)

    # ---- the worker ----

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                if job.cancelled.is_set():
                    continue
                self._running = job
                self.loaded.abort.clear()
            try:
                self._run(job)
            except Exception as e:  # the server never dies from a request
                job.on_event("error", f"{type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._running = None
                    self.loaded.abort.clear()

    def _run(self, job: Job) -> None:
        llm = self.llm
        llm.begin_request()
        if self.recorder is not None:
            self.recorder.begin_request()
        finish = "length"
        t0 = time.perf_counter()
        try:
            stream = llm.create_completion(prompt=job.tokens, max_tokens=job.max_tokens, stream=True,
                                           stop=job.stop or None, **job.sampling)
            for chunk in stream:
                if job.cancelled.is_set():
                    stream.close()
                    finish = "cancelled"
                    break
                choice = chunk["choices"][0]
                if choice.get("text"):
                    job.on_event("text", choice["text"])
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        except RuntimeError as e:
            # llama_decode failed: aborted for a client that went away, or an error in the eval callback
            tap = self.loaded.tap
            if tap is not None and tap.error is not None:
                tap.raise_error()
            if not job.cancelled.is_set():
                raise MboltError(f"llama.cpp: {e}") from None
            finish = "cancelled"
        finally:
            llm.end_request()
            if self.recorder is not None:
                self.recorder.end_request()
        usage = {"prompt_tokens": len(job.tokens), "completion_tokens": llm.mbolt_generated,
                 "total_tokens": len(job.tokens) + llm.mbolt_generated}
        job.on_event("end", {"finish_reason": finish, "usage": usage, "seconds": time.perf_counter() - t0,
                             "tokens": list(llm.mbolt_tokens), "prompt_tokens": list(job.tokens)})

    # ---- numbers ----

    def stats(self) -> dict:
        """What /metrics, /stats and the chat's line show."""
        import resource

        from mbolt.runtime.store import proc_read_bytes

        lo, rt = self.loaded, self.loaded.runtime
        c = self.llm.mbolt_counters
        out = {"model": self.name, "mode": "plain llama.cpp" if rt is None else "mbolt runtime",
               "budget_bytes": lo.budget, "budget_from": lo.budget_from or None, "n_ctx": lo.n_ctx,
               "n_ubatch": lo.n_ubatch, "queue_length": self._waiting, **c.to_dict(),
               "device_read_bytes": proc_read_bytes(),
               "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}
        if rt is not None:
            sc, ps = rt.store.counters, rt.prompt
            out.update(dense_resident_bytes=rt.locked_bytes + rt.copied_bytes, dense_locked_bytes=rt.locked_bytes,
                       dense_copied_bytes=rt.copied_bytes, expert_slots=rt.decode_slots,
                       expert_slots_prompt=rt.prefill_slots, cache_hits=sc.hits - ps.hits,
                       cache_misses=sc.misses - ps.misses,  # decode steps (the prompt passes' are apart)
                       decode_read_bytes=sc.bytes, prompt_read_bytes=ps.bytes, prompt_passes=ps.passes,
                       reclaimed=rt.reclaimed)
        else:
            out.update(dense_resident_bytes=None, expert_slots=None, cache_hits=None, cache_misses=None)
        hm = (out.get("cache_hits") or 0) + (out.get("cache_misses") or 0)
        out["hit_rate"] = out["cache_hits"] / hm if hm else None
        out["decode_tokens_per_s"] = c.decode_tokens / c.decode_s if c.decode_s else None
        out["prompt_tokens_per_s"] = c.prompt_tokens / c.prompt_s if c.prompt_s else None
        out["mb_per_token"] = (out["decode_read_bytes"] / c.decode_tokens / 1e6
                               if rt is not None and c.decode_tokens else None)
        return out
