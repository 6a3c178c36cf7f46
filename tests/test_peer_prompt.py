"""The peer's time to first token (mbolt.bench.peer_prompt): ik_llama.cpp's llama-cli output
parsed (checked on output captured from a real run: tests/data/ik_cli_tiny.README.md), its arms and
arguments, the prompt text cut from the mbolt arms' text by llama.cpp's own tokenizer, and a real
run of the built binary (skipped where ik_llama.cpp is not built, and in CI, which does not build it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import IN_CI, needs_llama
from mbolt.bench import peer_prompt, peers
from mbolt.core.errors import MboltError

DATA = Path(__file__).parent / "data"
CLI_OUT = DATA / "ik_cli_tiny_prompt.txt"  # read as run_cold reads output: bytes not UTF-8 replaced
# as the captured file prints them ("main: prompt eval time =      19.47 ms /   300 tokens")
CLI_PROMPT_EVAL_MS, CLI_PROMPT_TOKENS = 19.47, 300


def test_parses_a_real_prompt_run():
    ttft, n = peer_prompt.parse_prompt_eval(CLI_OUT.read_text(errors="replace"), "ik-512")
    assert n == CLI_PROMPT_TOKENS
    assert ttft == pytest.approx(CLI_PROMPT_EVAL_MS / 1e3)


@pytest.mark.parametrize("mangle, says", [
    (lambda t: "", "no prompt eval time line"),
    (lambda t: t.replace("main: prompt eval time", "main: prompt time"), "no prompt eval time line"),
    (lambda t: t.replace("eval time =       0.00 ms /     1 tokens", "eval time =      52.10 ms /    30 tokens"),
     "decoded 30 tokens after the prompt"),
    (lambda t: t.replace("19.47 ms /   300 tokens", "19.47 ms /     1 tokens"), "a prompt of 1 tokens"),
])
def test_refuses_output_it_does_not_know(mangle, says):
    with pytest.raises(MboltError, match=says) as e:
        peer_prompt.parse_prompt_eval(mangle(CLI_OUT.read_text(errors="replace")), "arm x")
    assert str(e.value).startswith("arm x: ") and "\n" not in str(e.value)


def test_arms_and_their_arguments():
    """ik mapped at its default pass (512, with an A/A) and at 2048, --prefetch-experts (ik's own
    worker count) at 2048; cold arms start as the decode arms do (--defer-experts), warm ones not."""
    arms = peer_prompt.prompt_arms()
    assert [(a.name, a.n_ubatch, a.peer.flags()) for a in arms] == [
        ("ik-512", 512, []), ("ik-512 (A/A)", 512, []), ("ik-2048", 2048, []),
        ("ik-prefetch-2048", 2048, ["--prefetch-experts"])]
    assert arms[1].peer.control_of == "ik-512"
    build = peers.PeerBuild(Path("/ik"), Path("/ik/llama-perplexity"), Path("/ik/llama-cli"), {})
    argv = peer_prompt.cli_argv(build, arms[0], Path("/m.gguf"), Path("/p.txt"))
    assert argv[0] == "/ik/llama-cli"
    assert argv[argv.index("-ub") + 1] == "512" and argv[argv.index("-b") + 1] == "2048"
    assert argv[argv.index("-n") + 1] == "1" and argv[-1] == "--defer-experts"
    warm = peer_prompt.warm_prompt_arms()
    assert [a.name for a in warm] == ["ik-warm-512", "ik-warm-2048"]
    assert "--defer-experts" not in peer_prompt.cli_argv(build, warm[1], Path("/m.gguf"), Path("/p.txt"))


@needs_llama
def test_the_prompt_is_the_arms_text_cut_by_the_tokenizer():
    """The session's prompt for the peer: the shortest prefix of the text the mbolt arms are fed
    that llama.cpp's tokenizer (a real vocabulary) makes 2,000 tokens long."""
    from mbolt.bench.ab import load_prompt_ids
    from mbolt.core.prompts import session_texts
    from mbolt.runtime.runner import LlamaRunner

    vocab = Path(__file__).parent / ".vocabs" / "ggml-vocab-qwen2.gguf"
    text = peer_prompt.prompt_text(vocab, 2000, 256, 200)
    ids = load_prompt_ids(str(vocab), None, 1, engine="llama.cpp", forced=2000, n_new=256, followup=200)[0]
    session = session_texts(1)[0]
    assert session.startswith(text)  # the session's text (the built-in one is shorter than 2,456 tokens)
    with LlamaRunner(str(vocab), vocab_only=True) as r:
        assert r.tokenize(session, add_special=True) == ids
        assert len(r.tokenize(text, add_special=True)) >= 2000 > len(r.tokenize(text[:-1], add_special=True))


def test_beside_tells_kernels_from_io():
    """Ratios against figures written out here: mbolt 12 s, llama.cpp warm 10 s, ik warm 8 and 9 s,
    ik's best arm under the limit 16 s."""
    limited = {"best_arm": "ik-2048", "best_ttft_s": 16.0}
    warm = {"summary": [{"arm": "ik-warm-512", "ttft_s": 9.0}, {"arm": "ik-warm-2048", "ttft_s": 8.0}]}
    b = peer_prompt.ttft_beside(12.0, 10.0, limited, warm)
    assert b["mbolt_over_best_peer"] == pytest.approx(0.75) and b["ik_warm_ttft_s"] == 8.0
    assert b["ik_kernels_over_llama_cpp_warm"] == pytest.approx(1.25)
    assert b["best_peer_over_its_warm"] == pytest.approx(2.0) and b["mbolt_over_llama_cpp_warm"] == pytest.approx(1.2)


BUILT = peers.find_ik()


@pytest.mark.skipif(IN_CI or BUILT is None,
                    reason="needs ik_llama.cpp built under $MBOLT_BENCH/peers (bench_memlimit.py prepare); not in CI")
@pytest.mark.parametrize("warm", [False, True])
def test_the_built_peer_times_a_prompt_on_a_tiny_model(tmp_path, warm):
    """One arm-round as the session benchmark runs it: cold (the file dropped, the process stopped
    after its load to drop what the load read, in a memory cgroup where the machine has them), or
    warm; its time to first token and its own count of the prompt's tokens."""
    from mbolt.core.memlimit import hierarchy
    from mbolt.gguf.synth import SynthConfig, write_synth

    ram = 0 if warm else 256 << 20
    if ram:
        try:
            hierarchy()
        except MboltError:
            ram = 0
    model = tmp_path / "tiny.gguf"
    write_synth(model, SynthConfig(arch="qwen3moe", n_layers=2, n_experts=16, n_used=2, hidden=256, expert_ff=128,
                                   n_heads=4, n_kv_heads=2, head_dim=64, expert_type="Q8_0", seed=7))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(peer_prompt.prompt_text(model, 300))
    arm = (peer_prompt.warm_prompt_arms() if warm else peer_prompt.prompt_arms())[0]
    row = peer_prompt.run_prompt_round(BUILT, arm, model, prompt, ram=ram)
    assert 290 <= row["prompt_tokens"] <= 310 and row["ttft_s"] > 0
    assert row["n_ubatch"] == 512
    if not warm:
        assert row["proven_cold"] and not row["rejected"] and row["experts_resident_at_eval"] <= 0.01
