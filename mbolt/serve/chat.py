"""`mbolt chat`: a conversation in the terminal over the same scheduler the server runs.

Multi-turn with the model's chat template (each turn is sent with the whole history; the KV cache
of the shared prefix is reused; when the history outgrows three quarters of the context the oldest
turns leave it), tokens printed as they come (a reply takes at most half the context), a line of
numbers after each reply.
Ctrl-C stops the reply (at the next token, or inside the prompt), not the program; `/exit` or
Ctrl-D ends it.
"""

from __future__ import annotations

import queue
import sys

from mbolt.serve.scheduler import SAMPLING_DEFAULTS, Scheduler, Job, RequestError


def chat_loop(scheduler: Scheduler, *, system: str | None = None, sampling: dict | None = None, read=input,
              write=sys.stdout.write, note=None) -> int:
    """Run the conversation until /exit or end of input; returns the number of replies."""
    note = note or (lambda text: write(text + "\n"))
    history = [{"role": "system", "content": system}] if system else []
    replies = 0
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return replies
        except KeyboardInterrupt:  # at the prompt: a fresh line, not the end
            write("\n")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return replies
        if not text:
            continue
        history.append({"role": "user", "content": text})
        try:
            tokens, stop, dropped = fit_history(scheduler, history)
        except RequestError as e:
            history.pop()
            note(f"[{e}]")
            continue
        if dropped:
            note(f"[the {dropped} oldest turn{'s' if dropped > 1 else ''} left the context]")
        n_new = min(scheduler.check_fits(tokens, None), max(1, scheduler.loaded.n_ctx // 2))
        events: queue.Queue = queue.Queue()
        job = Job(tokens, n_new, {**SAMPLING_DEFAULTS, **(sampling or {})}, stop, lambda k, d: events.put((k, d)))
        scheduler.submit(job)
        before = scheduler.stats()
        reply, end = [], None
        while end is None:
            try:
                k, d = events.get(timeout=0.1)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                scheduler.cancel(job)
                continue
            if k == "text":
                reply.append(d)
                write(d)
                if hasattr(sys.stdout, "flush"):
                    sys.stdout.flush()
            elif k == "end":
                end = d
            else:
                write(f"\nerror: {d}\n")
                end = {"finish_reason": "error"}
        write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
        replies += 1
        note(summary_line(before, scheduler.stats(), end))


def fit_history(scheduler: Scheduler, history: list[dict]) -> tuple[list[int], list[str], int]:
    """The conversation's tokens, the oldest turns dropped (the system prompt kept) until it
    leaves a quarter of the context for the reply. Returns (tokens, stop strings, turns dropped)."""
    room = scheduler.loaded.n_ctx * 3 // 4
    dropped = 0
    while True:
        tokens, stop = scheduler.prepare_chat(history)
        first = 1 if history and history[0]["role"] == "system" else 0
        if len(tokens) <= room or len(history) - first <= 1:
            scheduler.check_fits(tokens, None)  # the last message alone too long: one line, the chat goes on
            return tokens, stop, dropped
        del history[first]
        dropped += 1


def summary_line(before: dict, after: dict, end: dict) -> str:
    """One line after a reply: its tok/s, the expert cache's hit rate, prompt time."""
    dt = after["decode_tokens"] - before["decode_tokens"]
    ds = after["decode_s"] - before["decode_s"]
    pt = after["prompt_tokens"] - before["prompt_tokens"]
    ps = after["prompt_s"] - before["prompt_s"]
    bits = [f"{dt / ds:.1f} tok/s" if ds > 0 else "0 tokens"]
    if after.get("cache_hits") is not None:
        h = after["cache_hits"] - before["cache_hits"]
        m = after["cache_misses"] - before["cache_misses"]
        if h + m:
            bits.append(f"hit rate {100 * h / (h + m):.0f}%")
    bits.append(f"prompt {pt} new tokens in {ps:.1f} s")
    if end.get("finish_reason") == "cancelled":
        bits.append("stopped")
    return "[" + ", ".join(bits) + "]"
