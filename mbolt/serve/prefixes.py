"""Where a prompt's first tokens come from: the slot's own KV cache, another slot's (copied),
or a file of the prompt cache (restored, serve.prompt_cache); and where a conversation's last user
turn starts (what the cache keeps)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mbolt.runtime.driver import common_prefix
from mbolt.serve.prompt_cache import MIN_TOKENS, PromptCache


@dataclass
class Reuse:
    """Where a prompt's first tokens came from, and what is left to evaluate."""

    todo: list[int]
    cached: int  # prompt tokens not evaluated (this slot's own KV, a copy, a restore)
    source: str  # "slot", "copy", "disk" or "none"


def reuse(driver, seq: int, tokens: list[int], cache: PromptCache | None, copied_from: set[int]) -> Reuse:
    """The longest prefix of `tokens` held anywhere put into sequence `seq`: its own KV, another
    sequence's (copied), or a file of the cache (restored); the tokens left to evaluate (at least
    one: its logits are the answer). `copied_from`: sequences whose copy llama.cpp has not made yet
    (it is made at the next llama_decode): a restore must not overwrite them before, and a copy from
    this one is added."""
    limit = len(tokens) - 1
    t = np.asarray(tokens, dtype=np.int32)
    held = [common_prefix(h, t) for h in driver.tokens]
    own = min(held[seq], limit)
    other = max((s for s in range(len(held)) if s != seq), key=lambda s: held[s], default=None)
    best_mem = min(held[other], limit) if other is not None else 0
    tried: set = set()
    while cache is not None and seq not in copied_from:
        disk = cache.best(tokens, limit, exclude=tried)
        if disk is None or disk[1] < max(own, best_mem) + MIN_TOKENS:
            break
        if cache.restore(driver, seq, *disk):
            return Reuse([int(x) for x in tokens[disk[1]:]], disk[1], "disk")
        tried.add(disk[0].path)  # skipped: the next best (this sequence is empty now)
        own = 0
    if other is not None and best_mem >= own + MIN_TOKENS and driver.copy_sequence(other, seq, best_mem):
        copied_from.add(other)
        return Reuse([int(x) for x in tokens[best_mem:]], best_mem, "copy")
    todo = driver.keep_prefix(seq, tokens)
    return Reuse(todo, len(tokens) - len(todo), "slot" if len(todo) < len(tokens) else "none")


def turn_start(template, messages: list[dict], tools, tool_choice, tokenize, ids: list[int]) -> int | None:
    """Where a conversation's last user turn starts in its tokens `ids`: the common prefix of `ids`
    and the conversation before that turn, rendered by the same template (None when there is no
    earlier part or the template refuses it)."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=None)
    if not last:
        return None
    try:
        res = template(messages=messages[:last], tools=tools, tool_choice=tool_choice)
        before = tokenize(res.prompt, res.added_special)
    except Exception:  # a template may refuse a conversation that does not end with a user turn
        return None
    n = common_prefix(before, ids)
    return n if n >= MIN_TOKENS else None
