"""What the benchmark scripts' shared modules write and name (mbolt.bench.llama_stream,
mbolt.bench.replay_ab): a pre-registration `prepare` writes is one `run` accepts, and a run's
names are the files the results directory holds."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from mbolt.bench.llama_stream import prereg_text
from mbolt.bench.prereg import load_prereg
from mbolt.bench.replay_ab import RESULTS, ReplayRun

META = {"rounds": 10, "predictions": {4: {
    "arms": {"stock-reads": {"reads_per_token": 96.0, "bytes_per_token": 4.2e6, "io_ms_per_token": 8.5},
             "reorder-tsp": {"reads_per_token": 40.0, "bytes_per_token": 4.2e6, "io_ms_per_token": 5.0}},
    "g": 1.7, "s": 0.5, "s_how": "assumed (--s-assumed)", "predicted_speedup": 1.2592}}}


@pytest.mark.parametrize("name,reads_over_os", [("s64k", 2.0), ("q30b8", 0.0)])
def test_llama_stream_prereg_is_one_the_run_accepts(tmp_path, monkeypatch, name, reads_over_os):
    """The text prepare writes loads through bench.prereg (the run stage's reader): three arms at
    QD4 on the model's files, the prediction rounded to 3 places, the pass threshold at the lower
    edge of the law's 10% band (1.2592 / 1.1 = 1.1447...), the goals table as issue 15 set it."""
    monkeypatch.setenv("MBOLT_BENCH", str(tmp_path))
    path = tmp_path / "p.toml"
    path.write_text(prereg_text(name, 4, META, "probe.json"))
    pr = load_prereg(path)
    assert [(a.name, a.io_threads, a.mode) for a in pr.arms] == [("stock-reads", 4, "read"),
                                                                 ("reorder-tsp", 4, "read"), ("stock-os", 1, "os")]
    assert pr.arms[1].path == str(tmp_path / "llama_stream" / name / "reorder-tsp.gguf")
    raw = tomllib.loads(path.read_text())
    assert (raw["predicted_speedup"], raw["pass_threshold"], raw["rounds"]) == (1.259, 1.145, 10)
    assert raw["goals"] == {"reads_over_os_min": reads_over_os, "limit_ratio_max": 1.25, "law_tolerance": 0.1,
                            "callback_overhead_min": 0.9, "tokens_identical": True}


def test_replay_run_names_the_stored_results():
    """--tag seed1fix names the results of that run (results/ab_*_seed1fix.json, its probe and
    summary); --model-tag sends the models to their own directory, the names keep the tag."""
    run = ReplayRun(seed=1, tag="seed1fix", model_tag="seed1")
    for qd in (1, 4):
        for direct in (False, True):
            assert (RESULTS / f"{run.cfg_name('s64k', qd, direct)}.json").exists()
    assert run.probe == RESULTS / "probe_seed1fix.json" and run.probe.exists()
    assert (RESULTS / run.summary_name()).exists()
    assert run.paths("s64k")["held"].parent.name == "s64k_seed1"
    assert ReplayRun().cfg_name("q30b", 4, True) == "ab_q30b_qd4_direct"
    assert ReplayRun().probe == Path(RESULTS) / "probe.json"
    assert ReplayRun(quiet_machine=True).noise_note != ReplayRun().noise_note
