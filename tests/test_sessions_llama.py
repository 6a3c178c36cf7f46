"""Real sessions on the streaming runtime (issue 26): prompts longer than a micro-batch under a
real memory limit, any context size with its KV cache in the budget, and an ordinary user.

What is checked comes from outside mbolt: llama.cpp's own tokens through llama-cpp-python's
high-level `Llama` (the same flash attention and micro-batch), the KV cache size written out from
the hyperparameters by hand and the size llama.cpp logs when it allocates it, the kernel's
cgroup peak and fault counters, and a process without CAP_IPC_LOCK under the 8 MiB RLIMIT_MEMLOCK
an ordinary user has. These tests run in CI, as root on a machine with memory cgroups.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import needs_llama
from test_memlimit_llama import MODEL as MEMLIMIT_MODEL
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama

LIMIT = 160 << 20  # below the model's 183 MB, above what the runtime needs for 256-token passes
PROMPT, FOLLOWUP, N_NEW, UBATCH = 700, 60, 6, 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """6 layers x 64 Q4_0 experts of 144 KiB slices (183 MB), dense weights of 13 MB (more than an
    ordinary user may lock)."""
    d = tmp_path_factory.mktemp("sessions")
    path = d / "model.gguf"
    write_synth(path, MEMLIMIT_MODEL)
    assert path.stat().st_size > LIMIT
    return path


def _session_ids(path) -> list[int]:
    from mbolt.bench.ab import load_prompt_ids

    return load_prompt_ids(str(path), None, 1, engine="llama.cpp", forced=PROMPT, n_new=N_NEW, followup=FOLLOWUP)[0]


def _llama_session(path, ids) -> list[int]:
    """llama.cpp's greedy predictions through the high-level API: the prompt, N_NEW fed tokens, then
    the follow-up turn's first token (flash attention on and UBATCH-token passes, as mbolt runs them)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_batch=UBATCH, n_ubatch=UBATCH, flash_attn=True, use_mmap=True,
                          verbose=False)
    n_vocab = llm.n_vocab()

    def pred():
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    try:
        llm.eval(ids[:PROMPT])
        out = []
        for i in range(N_NEW):
            out.append(pred())
            llm.eval([ids[PROMPT + i]])
        llm.eval(ids[PROMPT + N_NEW: PROMPT + N_NEW + FOLLOWUP])
        out.append(pred())
    finally:
        llm.close()
    return out


def test_a_long_session_under_a_limit_gives_llamas_tokens(model, tmp_path):
    """`ab --ram`: a 700-token prompt, 6 fed tokens and a 60-token follow-up turn on the same context,
    each arm a process in a cgroup below the model's size. mbolt's runtime runs the prompt in
    ceil(700 / 256) + ceil(60 / 256) passes, takes no major fault while decoding, stays under the
    limit, and every arm predicts llama.cpp's own tokens."""
    from typer.testing import CliRunner

    from mbolt.cli import app

    r = CliRunner().invoke(app, ["ab", f"{model}:os,name=plain", f"{model}:name=mbolt,async", "--decode", "--engine",
                                 "llama.cpp", "--ram", str(LIMIT), "--forced", "--prompt-tokens", str(PROMPT),
                                 "--followup-tokens", str(FOLLOWUP), "-n", str(N_NEW), "--n-prompts", "1", "-c", "2048",
                                 "-ub", str(UBATCH), "--rounds", "1", "--no-aa", "--out-dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["environment"]["llama"]["n_ubatch"] == UBATCH and d["environment"]["teacher_forced"] == PROMPT
    rounds = {x["arm"]: x for x in d["rounds"]}
    mb = rounds["mbolt"]
    assert mb["n_ubatch"] == UBATCH  # the budget holds a pass of this size
    assert mb["prompt_tokens"] == PROMPT
    assert mb["prompt_passes"] == math.ceil(PROMPT / UBATCH) + math.ceil(FOLLOWUP / UBATCH)
    assert mb["prompt_bytes"] > 0 and mb["prompt_read_s"] > 0
    assert mb["major_faults"] == 0 and mb["followup_ttft_s"] > 0
    for x in rounds.values():
        assert 0 < x["peak_bytes"] <= LIMIT and x["tokens"] == N_NEW and not x["rejected"]
    assert rounds["plain"]["major_faults"] > 0  # the limit is real
    want = _llama_session(model, _session_ids(model))
    assert mb["generated"] == rounds["plain"]["generated"] == [want]


def _kv_by_hand(n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int) -> int:
    return n_layers * n_ctx * n_kv_heads * head_dim * 2 * 2  # K and V, F16


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    """A model trained for 32k tokens whose KV cache is large beside its weights: 16 KiB per token."""
    path = tmp_path_factory.mktemp("kv") / "kv.gguf"
    write_synth(path, SynthConfig(arch="qwen3moe", n_layers=4, n_experts=16, n_used=2, hidden=256, expert_ff=128,
                                  n_heads=8, n_kv_heads=8, head_dim=128, dense_ff=128, expert_type="Q8_0",
                                  fast_random=True, context_length=32768, seed=5))
    return path


def test_context_sizes_are_llamas(kv_model):
    """What the budget counts before the context exists (llama.cpp's memory-fit pass) is the KV
    cache written out from the hyperparameters and what llama.cpp logs when it allocates it; the
    compute buffer is what it logs too."""
    from mbolt.runtime.memory import simulate
    from mbolt.runtime.runner import LlamaRunner

    for n_ctx, ub in ((2048, 512), (8192, 128)):
        plan = simulate(str(kv_model), n_ctx, ub)
        assert plan.n_ctx == n_ctx and plan.kv_bytes == pytest.approx(_kv_by_hand(4, n_ctx, 8, 128), abs=20 << 10)
        with LlamaRunner(kv_model, n_ctx=n_ctx, n_batch=ub, f32_kv=False, capture=False, load_mode="mmap") as r:
            assert r.memory.kv_bytes == plan.kv_bytes and r.memory.compute_bytes == plan.compute_bytes


def test_a_context_the_budget_cannot_hold_is_one_line(kv_model):
    """-c 32768 needs a 512 MiB KV cache: with 300 MiB the command stops before anything is
    allocated and names the largest context that fits; that context runs, 256 tokens more does not
    (each a fresh process, as a user runs it: the process's own memory is in the budget)."""
    import re

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "mbolt", "generate", str(kv_model), "hello", "--engine",
                               "llama.cpp", "--stream", "--ram", "300M", "-n", "2", *extra], capture_output=True,
                              text=True, timeout=300)

    r = run("-c", "32768")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r.stderr
    assert "the KV cache of a 32768-token context (512 MiB)" in r.stderr
    m = re.search(r"the largest context that fits is (\d+) tokens \(-c (\d+)\)", r.stderr)
    assert m and m.group(1) == m.group(2)
    best = int(m.group(1))
    assert 1024 <= best < 32768 and best % 256 == 0
    ok = run("-c", str(best), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["n_ctx"] == best
    over = run("-c", str(best + 256))
    assert over.returncode == 2 and "cannot hold" in over.stderr


def test_ctx_size_is_capped_by_the_training_context(model):
    from typer.testing import CliRunner

    from mbolt.cli import app

    r = CliRunner().invoke(app, ["generate", str(model), "hello", "--engine", "llama.cpp", "-n", "2",
                                 "-c", "100000", "--json"])
    assert r.exit_code == 0, r.stderr
    assert "beyond the 4096 tokens" in r.stderr and json.loads(r.stdout)["n_ctx"] == 4096


def _generate_json(cmd_prefix: list[str], model, ids_text: str) -> dict:
    p = subprocess.run([*cmd_prefix, sys.executable, "-m", "mbolt", "generate", str(model), ids_text, "--engine",
                        "llama.cpp", "--stream", "--ram", str(LIMIT + (40 << 20)), "-n", "8", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.skipif(shutil.which("setpriv") is None or shutil.which("prlimit") is None,
                    reason="util-linux's setpriv and prlimit are needed")
def test_an_ordinary_user_gets_roots_tokens(model):
    """Without CAP_IPC_LOCK and with the 8 MiB RLIMIT_MEMLOCK an ordinary user has, the runtime
    locks what the limit allows, holds the rest of the dense weights as anonymous copies, and
    generates root's tokens."""
    from mbolt.core.prompts import builtin_text

    text = builtin_text()[:900]
    root = _generate_json([], model, text)
    user = _generate_json(["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "prlimit",
                           "--memlock=8388608"], model, text)
    assert root["dense_copied_bytes"] == 0 and root["dense_locked_bytes"] > 8 << 20
    assert 0 < user["dense_locked_bytes"] <= 8 << 20 and user["dense_copied_bytes"] > 0
    assert user["dense_locked_bytes"] + user["dense_copied_bytes"] == root["dense_locked_bytes"]
    assert user["ids"] == root["ids"] and user["prompt_passes"] == root["prompt_passes"] > 0
