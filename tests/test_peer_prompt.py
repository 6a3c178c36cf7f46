"""The peer's time to first token (mbolt.bench.peer_prompt): its arms, the ratios it reports, and a
real arm-round of the registry's ik_llama.cpp where its environment is installed (tests/test_peers.py
says where that is looked for; CI installs none, so the round skips there unless CI names one).
"""

from __future__ import annotations

import pytest

from conftest import needs_llama
from mbolt.bench import peer_prompt, peers
from mbolt.core.errors import MboltError
from test_peers import batch_figures, needs_ik, tiny_model


def test_arms():
    """ik mapped at its default pass (512, with an A/A) and at 2048; warm at both."""
    arms = peer_prompt.prompt_arms()
    assert [(a.name, a.n_ubatch, a.control_of, a.warm) for a in arms] == [
        ("ik-512", 512, None, False), ("ik-512 (A/A)", 512, "ik-512", False), ("ik-2048", 2048, None, False)]
    assert [(a.name, a.n_ubatch, a.warm) for a in peer_prompt.warm_prompt_arms()] == [
        ("ik-warm-512", 512, True), ("ik-warm-2048", 2048, True)]


def test_beside_tells_kernels_from_io():
    """Ratios against figures written out here: mbolt 12 s, llama.cpp warm 10 s, ik warm 8 and 9 s,
    ik's best arm under the limit 16 s."""
    limited = {"best_arm": "ik-2048", "best_ttft_s": 16.0}
    warm = {"summary": [{"arm": "ik-warm-512", "ttft_s": 9.0}, {"arm": "ik-warm-2048", "ttft_s": 8.0}]}
    b = peer_prompt.ttft_beside(12.0, 10.0, limited, warm)
    assert b["mbolt_over_best_peer"] == pytest.approx(0.75) and b["ik_warm_ttft_s"] == 8.0
    assert b["ik_kernels_over_llama_cpp_warm"] == pytest.approx(1.25)
    assert b["best_peer_over_its_warm"] == pytest.approx(2.0) and b["mbolt_over_llama_cpp_warm"] == pytest.approx(1.2)


@needs_ik
@needs_llama
@pytest.mark.parametrize("warm", [False, True])
def test_the_peer_times_a_prompt_on_a_tiny_model(tmp_path, warm):
    """One arm-round as the session benchmark runs it: cold (the file dropped, the worker's experts
    unmapped and dropped after its load, in a memory cgroup where the machine has them) or warm;
    the prompt is the mbolt arms' ids, in passes of n_ubatch, and the one prediction after it is
    llama.cpp's."""
    from mbolt.core.memlimit import hierarchy

    ram = 0 if warm else 256 << 20
    if ram:
        try:
            hierarchy()
        except MboltError:
            ram = 0
    model = tiny_model(tmp_path / "tiny.gguf")
    ids = peers.arm_ids(model, 300, 1)
    arm = (peer_prompt.warm_prompt_arms((128,)) if warm else peer_prompt.prompt_arms((128,), aa=False))[0]
    row = peer_prompt.run_prompt_round(peers.find_ik(), arm, model, ids[:300], ram=ram, n_ctx=512)
    assert row["prompt_tokens"] == 300 and row["ttft_s"] > 0 and row["tokens"] == 0
    assert row["n_ubatch"] == 128 and row["prompt_tokens_per_s"] == pytest.approx(300 / row["ttft_s"])
    assert row["ik_timings"]["n_p_eval"] == 300  # ik's own count of the prompt's tokens
    assert row["generated"] == batch_figures(model, ids[:300], ids[300:301])[0]
    if not warm:
        assert row["proven_cold"] and not row["rejected"] and row["experts_resident_at_eval"] <= 0.01
