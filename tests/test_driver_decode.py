"""The driver's greedy loop (`Driver.decode`, issue 56): a prompt runs as prompt passes and each
generated token as a decode step, as every command runs them; the tracer's llama.cpp backend and
llama.cpp parity decode through it. Checked against the measured loop (`Driver.generate`), against
llama.cpp's own view of each llama_decode (the phase a watcher is told, the sequence's positions),
and against the reference engine (the tracer's routing, tests/test_tracer.py)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import EXPERT_GAIN, needs_llama
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama


class _Phases:
    """A watcher: the phase and rows of every llama_decode."""

    def __init__(self):
        self.seen = []

    def begin(self, phase, n_rows: int) -> None:
        self.seen.append((phase.name, n_rows))

    def on_topk(self, layer, rows) -> None:
        pass

    def end(self) -> None:
        pass


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("m") / "m.gguf",
                       SynthConfig(n_experts=8, n_used=2, seed=4, expert_gain=EXPERT_GAIN))


def test_decode_runs_a_prompt_pass_then_decode_steps_and_agrees_with_generate(model):
    from mbolt.runtime.driver import open_driver

    w = _Phases()
    with open_driver(str(model), reads=False, evict=False, n_ctx=256, n_ubatch=8, watchers=[w]) as d:
        ids = d.tokenize("the theater in a tin", add_special=True)
        assert 8 < len(ids) <= 16
        out = list(d.decode(ids, 5))
        # two prompt passes of at most n_ubatch = 8 tokens, then one decode step (one row) per fed token
        assert w.seen == [("PROMPT", 8), ("PROMPT", len(ids) - 8)] + [("DECODE", 1)] * 5
        assert [fed for fed, _ in out][0] == ids and all(len(fed) == 1 for fed, _ in out[1:])
        greedy = [int(np.argmax(lg)) for _, lg in out]
        assert [fed[0] for fed, _ in out[1:]] == greedy[:-1]  # each step fed the last step's argmax
        assert d.runner.pos[0] == len(ids) + 5 == len(d.tokens[0])
        assert len(set(greedy)) > 1  # a model whose tokens move: the comparisons below can fail
        run = d.generate([ids], 5)
        assert run.generated[0] == greedy[:5]  # the measured loop predicts the same tokens
        # teacher-forced: `fed` is read as the steps go, so a caller may append to it
        fed = []
        steps = d.decode(ids, 3, fed=fed)
        d.forget()
        next(steps)
        for tok in (7, 9, 11):
            fed.append(tok)
            next(steps)
        assert d.tokens[0] == ids + [7, 9, 11]


def test_decode_stops_at_eos_without_feeding_it(model):
    from mbolt.runtime.driver import open_driver

    with open_driver(str(model), reads=False, evict=False, n_ctx=256) as d:
        ids = d.tokenize("x = 1", add_special=True)
        greedy = [int(np.argmax(lg)) for _, lg in d.decode(ids, 4)]
        d.forget()
        out = list(d.decode(ids, 4, eos=greedy[2]))
        assert len(out) == 3 and d.tokens[0] == ids + greedy[:2]


def test_tracer_decodes_its_tokens_as_decode_steps(model):
    from mbolt.trace.tracer import _Llama

    b = _Llama(str(model), "file", 1, n_ctx=256)
    try:
        ids = b.encode("the theater in a tin")
        got = list(b.steps(ids, 4))
        assert [ex.shape[0] for ex, _ in got] == [len(ids), 1, 1, 1, 1]
        assert b.d.arm.prompt.passes == 1  # the prompt's one pass; the 4 tokens were decode steps
        assert all((ex >= 0).all() for ex, _ in got[1:])  # a decode step routes every layer
        # a prompt longer than the context is cut to it, and decoding stops there (no error)
        long = (ids * 400)[:b.d.n_ctx_seq + 40]
        got = list(b.steps(long, 4))
        assert [ex.shape[0] for ex, _ in got] == [b.d.n_ctx_seq]
    finally:
        b.close()
