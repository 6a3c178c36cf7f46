"""Choosing the next token: llama.cpp's own sampler chain (the one llama-server builds), so a
reply samples as llama.cpp samples, greedy at temperature 0, and a grammar constrains the output.

Order (llama.cpp's common sampler): the logit bias (`ignore_eos`: every end-of-generation
token at -inf, as llama-server does it), grammar (GBNF: tool calls, JSON output), repetition
penalties, top-k, top-p, min-p, temperature, then a draw from the distribution (seeded); at
temperature 0 the most likely token (greedy) after the grammar. `sample(ctx, i)` samples from the
logits of output i of the last llama_decode (-1: its last) and accepts the token into every
sampler of the chain (the grammar's state, the penalties' history).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from mbolt.core.errors import MboltError

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed per sampler


@dataclass
class SamplingOptions:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    grammar: str | None = None  # GBNF, root rule "root"
    ignore_eos: bool = False  # never sample an end-of-generation token (llama.cpp's --ignore-eos)


def eog_tokens(L, vocab) -> tuple[int, ...]:
    """Every end-of-generation token of a vocabulary (llama.cpp keeps the set internal: asked token
    by token; the driver asks once per model)."""
    return tuple(t for t in range(int(L.llama_vocab_n_tokens(vocab))) if L.llama_vocab_is_eog(vocab, t))


class Sampler:
    def __init__(self, L, vocab, opts: SamplingOptions, eog: tuple[int, ...] = ()):
        self.L = L
        p = L.llama_sampler_chain_default_params()
        self.chain = L.llama_sampler_chain_init(p)
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731  (the chain owns it)
        if opts.ignore_eos:
            bias = (L.llama_logit_bias * len(eog))(*[L.llama_logit_bias(t, float("-inf")) for t in eog])
            add(L.llama_sampler_init_logit_bias(int(L.llama_vocab_n_tokens(vocab)), len(eog), bias))
        if opts.grammar:
            g = L.llama_sampler_init_grammar(vocab, opts.grammar.encode("utf-8"), b"root")
            if not g:
                self.close()
                raise MboltError("llama.cpp could not parse the grammar built for this request")
            add(g)
        if opts.repeat_penalty != 1.0 or opts.presence_penalty or opts.frequency_penalty:
            # this release's signature leads with n_vocab (include/llama.h of llama-cpp-python 0.3.36)
            add(L.llama_sampler_init_penalties(int(L.llama_vocab_n_tokens(vocab)), int(opts.repeat_last_n),
                                               ctypes.c_float(opts.repeat_penalty),
                                               ctypes.c_float(opts.frequency_penalty),
                                               ctypes.c_float(opts.presence_penalty)))
        if opts.temperature <= 0:
            add(L.llama_sampler_init_greedy())
        else:
            if opts.top_k > 0:
                add(L.llama_sampler_init_top_k(int(opts.top_k)))
            add(L.llama_sampler_init_top_p(ctypes.c_float(opts.top_p), 1))
            add(L.llama_sampler_init_min_p(ctypes.c_float(opts.min_p), 1))
            add(L.llama_sampler_init_temp(ctypes.c_float(opts.temperature)))
            add(L.llama_sampler_init_dist(DEFAULT_SEED if opts.seed is None else int(opts.seed) & 0xFFFFFFFF))

    def sample(self, ctx, i: int = -1) -> int:
        return int(self.L.llama_sampler_sample(self.chain, ctx, int(i)))

    def close(self) -> None:
        if self.chain:
            self.L.llama_sampler_free(self.chain)
            self.chain = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
