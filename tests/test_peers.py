"""The peer in the benchmarks (mbolt.bench.peers, mbolt.bench.ik_worker): ik_llama.cpp from the
package registry, run by a worker script in its own virtual environment.

- The worker's loop (teacher_forced) runs on plain llama.cpp too: fed one token per call, its
  greedy predictions and perplexity must equal what llama.cpp computes for the same ids in one
  batch with every row's logits (an independent computation of the same figures).
- The worker's cold start (drop_from_mapping): a mapped file's pages leave the process's page
  tables, so the page cache can drop them (mincore says so); without it they stay.
- The real peer, where its environment is installed: `$MBOLT_IK_VENV` names it (then the tests
  must run: a missing or broken environment fails them), else `$MBOLT_BENCH/ik-venv` is used when
  it exists (`python scripts/bench_memlimit.py prepare` installs it there). CI does not install it
  (its bindings are a second llama.cpp build, pinned to AVX2), so these tests skip there unless
  CI names one. Its arm-round on a tiny model is checked against llama.cpp's own figures.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_llama
from mbolt.bench import ik_worker, peers
from mbolt.core.errors import MboltError

NAMED = os.environ.get("MBOLT_IK_VENV")
needs_ik = pytest.mark.skipif(not NAMED and not (peers.default_venv() / "bin" / "python").exists(),
                              reason="no ik-llama-cpp-python environment ($MBOLT_IK_VENV, or $MBOLT_BENCH/ik-venv: "
                                     "bench_memlimit.py prepare installs it); CI installs none")


def tiny_model(path: Path) -> Path:
    from mbolt.synth.synth import SynthConfig, write_synth

    write_synth(path, SynthConfig(arch="qwen3moe", n_layers=2, n_experts=16, n_used=2, hidden=256, expert_ff=128,
                                  n_heads=4, n_kv_heads=2, head_dim=64, expert_type="Q8_0", seed=7))
    return path


class RunnerEngine:
    """The worker's engine interface over plain llama.cpp (mbolt's LlamaRunner)."""

    def __init__(self, runner):
        self.runner = runner

    def batch(self, ids, pos):
        assert pos == self.runner.n_past  # the loop feeds each token at the next position
        return ids

    def decode(self, ids):
        return self.runner.eval(ids)


def batch_figures(model: Path, prompt: list[int], fed: list[int]) -> tuple[list[int], float]:
    """llama.cpp on prompt + fed in one batch, every row's logits: the greedy prediction before each
    fed token and the fed tokens' perplexity, computed here."""
    from mbolt.runtime.runner import LlamaRunner

    with LlamaRunner(model, n_ctx=512, n_threads=2, f32_kv=False, capture=False, n_batch=512, all_logits=True) as r:
        rows = r.eval(prompt + fed, all_logits=True)[len(prompt) - 1: len(prompt) + len(fed) - 1].astype(np.float64)
    top = rows.max(axis=1)
    nll = top + np.log(np.exp(rows - top[:, None]).sum(axis=1)) - rows[np.arange(len(fed)), fed]
    return rows.argmax(axis=1).tolist(), float(np.exp(nll.mean()))


@needs_llama
def test_the_workers_loop_on_plain_llama_cpp(tmp_path):
    from mbolt.runtime.runner import LlamaRunner

    model = tiny_model(tmp_path / "tiny.gguf")
    ids = peers.arm_ids(model, 64, 32)  # the mbolt arms' ids for a 64-token prompt and 32 fed tokens
    with LlamaRunner(model, n_ctx=256, n_threads=2, f32_kv=False, capture=False, n_batch=256) as r:
        out = ik_worker.teacher_forced(RunnerEngine(r), ids[:64], ids[64:96])
    generated, ppl = batch_figures(model, ids[:64], ids[64:96])
    assert (out["prompt_tokens"], out["decode_tokens"]) == (64, 32)
    assert out["generated"] == generated
    assert out["ppl"] == pytest.approx(ppl, rel=1e-3)
    assert out["prompt_s"] > 0 and out["decode_s"] > 0
    # nothing fed: the one prediction after the prompt, no perplexity
    with LlamaRunner(model, n_ctx=256, n_threads=2, f32_kv=False, capture=False, n_batch=256) as r:
        alone = ik_worker.teacher_forced(RunnerEngine(r), ids[:64], [])
    assert alone["generated"] == generated[:1] and alone["ppl"] is None and alone["decode_tokens"] == 0


def test_a_mapped_file_leaves_the_page_cache_once_unmapped(tmp_path):
    """fadvise(DONTNEED) leaves the pages a process maps; drop_from_mapping unmaps the spans first."""
    from mbolt.core.pagecache import resident_share

    page = mmap.PAGESIZE
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(64 * page))
        os.fsync(f.fileno())  # clean pages: fadvise drops no dirty page
    spans = [[3 * page + 100, 20 * page - 7], [40 * page, 50 * page]]  # the first one not page-aligned
    covered = [[3 * page, 20 * page], [40 * page, 50 * page]]
    rest = [[0, 3 * page], [20 * page, 40 * page], [50 * page, 64 * page]]

    def fadvise(*whole):
        fd = os.open(path, os.O_RDONLY)
        try:
            for a, b in (covered if not whole else [[0, 64 * page]]):
                os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    fadvise("whole file")  # as a cold arm starts: the file read from the drive by its mapping
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            assert sum(m[i] for i in range(0, len(m), page)) >= 0  # every page mapped in
            fadvise()
            assert resident_share(path, covered) == 1.0  # mapped: the page cache keeps them
            assert ik_worker.drop_from_mapping(str(path), spans) == 27 * page
            fadvise()
            assert resident_share(path, covered) == 0.0
            assert resident_share(path, rest) == 1.0  # the rest stays mapped and resident
            assert m[45 * page: 45 * page + 8] == path.read_bytes()[45 * page: 45 * page + 8]  # faults back in
        finally:
            m.close()
    assert ik_worker.drop_from_mapping(str(path), spans) == 0  # not mapped any more


def test_arms():
    """ik mapped and its A/A, warm alone; no --prefetch-experts (the registry's ik predates it)."""
    assert [(a.name, a.control_of, a.warm) for a in peers.ik_arms()] == [
        ("ik-mapped", None, False), ("ik-mapped (A/A)", "ik-mapped", False)]
    assert peers.IK_WARM.warm and peers.IK_WARM.n_ubatch == 512


def test_beside_tells_kernels_from_io():
    """The ratios against figures written out here: mbolt 6 tok/s, llama.cpp warm 30, ik warm 45,
    ik's best arm under the limit 3."""
    limited = {"best_arm": "ik-mapped", "best_decode_tokens_per_s": 3.0, "fed": "f"}
    warm = {"summary": [{"arm": "ik-warm", "decode_tokens_per_s": 45.0}]}
    b = peers.peers_beside(6.0, 30.0, limited, warm)
    assert b["best_peer_arm"] == "ik-mapped" and b["mbolt_over_best_peer"] == pytest.approx(2.0)
    assert b["ik_kernels_over_llama_cpp_warm"] == pytest.approx(1.5)
    assert b["best_peer_share_of_its_warm"] == pytest.approx(3 / 45)
    assert b["mbolt_share_of_llama_cpp_warm"] == pytest.approx(0.2)
    assert peers.peers_beside(None, None, limited, None)["mbolt_over_best_peer"] is None


def test_each_arms_medians_are_over_its_cold_rounds(monkeypatch):
    """run_peers' summary: per arm the median decode rate and time to first token of the rounds
    that were cold (a rejected round counts in neither), and the A/A twin's ratio of either."""
    ttft = {"ik": [10.0, 30.0, 12.0], "ik (A/A)": [11.0, 13.0, 99.0]}
    rejected = {"ik": [False, True, False], "ik (A/A)": [False, False, True]}
    seen = {a: 0 for a in ttft}

    def one_round(peer, arm, *a, **kw):
        i = seen[arm.name]
        seen[arm.name] += 1
        return {"arm": arm.name, "ttft_s": ttft[arm.name][i], "decode_tokens_per_s": 2 * ttft[arm.name][i],
                "rejected": rejected[arm.name][i]}

    class Peer:
        def record(self):
            return {}

    monkeypatch.setattr(peers, "run_round", one_round)
    d = peers.run_peers(Peer(), [peers.PeerArm("ik"), peers.PeerArm("ik (A/A)", control_of="ik")], Path("m.gguf"),
                        [1], [2], rounds=3, ram=0, n_ctx=64)
    by = {s["arm"]: s for s in d["summary"]}
    assert (by["ik"]["ttft_s"], by["ik"]["decode_tokens_per_s"]) == (11.0, 22.0)  # rounds 0 and 2
    assert (by["ik (A/A)"]["ttft_s"], by["ik (A/A)"]["decode_tokens_per_s"]) == (12.0, 24.0)  # rounds 0 and 1
    assert peers.aa_of(d["summary"], "ttft_s") == {"ik (A/A)": 12.0 / 11.0}


def test_the_fed_ids_must_fit(tmp_path):
    with pytest.raises(MboltError, match="100 token ids; the peer's arms need a prompt of 64 .* and 256 fed"):
        peers.peer_decode(None, tmp_path / "m.gguf", list(range(100)), prompt_tokens=64, new_tokens=256, rounds=1,
                          ram=0)
    with pytest.raises(MboltError, match="do not fit n_ctx 256"):
        peers.peer_decode(None, tmp_path / "m.gguf", list(range(400)), prompt_tokens=64, new_tokens=256, rounds=1,
                          ram=0, n_ctx=256)


def test_a_warm_arm_under_a_limit_is_refused(tmp_path):
    peer = peers.IkPeer(tmp_path, tmp_path / "python", "0.1.5", "")
    with pytest.raises(MboltError, match="a warm arm runs without a limit"):
        peers.run_round(peer, peers.IK_WARM, tmp_path / "m.gguf", [1, 2], [3], ram=1 << 30, n_ctx=128)


def test_an_environment_without_the_package_is_one_line(tmp_path):
    """No environment: no peer (None). A python there that cannot import ik_llama_cpp: one line."""
    assert peers.find_ik(tmp_path / "absent") is None
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)  # this python: no ik_llama_cpp
    with pytest.raises(MboltError, match=r"venv/bin/python: cannot import ik_llama_cpp \(install it: pip install "
                                         r"ik-llama-cpp-python==0\.1\.5\)") as e:
        peers.find_ik(tmp_path / "venv")
    assert "\n" not in str(e.value)


def test_an_environment_this_user_cannot_look_into_is_one_line_and_only_recorded(tmp_path, monkeypatch):
    """A peer's environment whose python the OS will not even stat for this user (found as an
    ordinary user: `mbolt demo` stopped on root's /tmp/mbolt-bench/ik-venv, its python a link into
    /root) is one line naming it, and a run's record of the engines says so instead of stopping.
    The OS error here is a name too long for the filesystem (root passes every permission check)."""
    from mbolt.bench.env import engine_builds

    venv = tmp_path / ("x" * 300)
    with pytest.raises(MboltError, match=r"/bin/python: File name too long: not an environment this user can run"):
        peers.find_ik(venv)
    monkeypatch.setenv("MBOLT_IK_VENV", str(venv))
    assert "not an environment this user can run" in engine_builds()["ik_llama.cpp"]["error"]


@needs_llama
def test_the_environment_records_each_engines_build(tmp_path, monkeypatch):
    import llama_cpp
    from importlib.metadata import version

    from mbolt.bench.env import environment

    monkeypatch.setenv("MBOLT_IK_VENV", str(tmp_path / "none"))
    env = environment(tmp_path)
    assert env["engines"]["llama.cpp"] == {"package": f"llama-cpp-python=={version('llama-cpp-python')}",
                                           "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    assert "AVX2 = " in env["engines"]["llama.cpp"]["system_info"]
    assert env["engines"]["ik_llama.cpp"] is None  # not installed there


# ---- the real peer ----


@needs_ik
def test_the_installed_peer_is_the_registrys_avx2_wheel():
    peer = peers.find_ik()
    assert peer is not None, f"{peers.default_venv()}: no environment there"
    assert peer.version == "0.1.5"
    info = dict(kv.split(" = ") for kv in peer.system_info.strip(" |").split(" | "))
    assert info["AVX2"] == "1" and info["AVX512"] == "0"  # the wheel's build, whatever this CPU has


@needs_ik
@needs_llama
@pytest.mark.parametrize("warm", [False, True])
def test_the_peer_runs_an_arm_round_on_a_tiny_model(tmp_path, warm):
    """One arm-round as the benchmarks run it: cold (the file dropped, the worker's experts unmapped
    and dropped after its load, in a memory cgroup where the machine has them) or warm; fed the
    mbolt arms' ids, its predictions and perplexity agree with llama.cpp's on the same ids."""
    from mbolt.core.memlimit import hierarchy

    ram = 0 if warm else 256 << 20
    if ram:
        try:
            hierarchy()
        except MboltError:
            ram = 0  # no memory cgroups here: the same round without a limit
    model = tiny_model(tmp_path / "tiny.gguf")
    ids = peers.arm_ids(model, 64, 32)
    peer = peers.find_ik()
    row = peers.run_round(peer, peers.IK_WARM if warm else peers.PeerArm("ik-mapped"), model, ids[:64], ids[64:96],
                          ram=ram, n_ctx=256)
    assert (row["prompt_tokens"], row["tokens"]) == (64, 32)
    assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["flash_attn"]
    assert row["ik_timings"]["n_eval"] == 32  # ik's own count of its single-token decodes
    generated, ppl = batch_figures(model, ids[:64], ids[64:96])
    assert len(row["generated"]) == 32 and sum(a == b for a, b in zip(row["generated"], generated)) >= 29
    assert math.isfinite(row["ppl"]) and row["ppl"] == pytest.approx(ppl, rel=0.01)
    if warm:
        assert row["unmapped_bytes"] == 0 and not row["proven_cold"]
    else:
        assert row["proven_cold"] and not row["rejected"] and row["experts_resident_at_eval"] <= 0.01
        assert row["unmapped_bytes"] > 0
        assert (row["peak_bytes_with_load"] is not None) == bool(ram) and row["oom_kills"] in (None, 0)


@needs_ik
def test_a_worker_that_fails_is_one_line(tmp_path):
    """ik cannot load a truncated file: the arm fails in one line naming it and what ik said last."""
    model = tiny_model(tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(MboltError, match=r"arm ik-warm: ik_llama.cpp's worker failed \(exit 1\): RuntimeError: "
                                         r"Failed to load model") as e:
        peers.run_round(peers.find_ik(), peers.IK_WARM, cut, [1, 2, 3], [4], ram=0, n_ctx=64)
    assert "\n" not in str(e.value)


def test_a_benchmark_refuses_a_build_other_than_the_one_it_names():
    """bench.env.check_build against the CPU's own flags: native means every instruction set of
    this CPU that llama.cpp uses; portable means none past AVX2."""
    from mbolt.bench.env import check_build

    portable = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | REPACK = 1 |"
    native = portable + " AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 |"
    zen4 = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}
    check_build("native", native, zen4)
    check_build("portable", portable, zen4)
    check_build("native", portable, {"avx2"})  # a CPU without AVX-512: portable is native there
    with pytest.raises(MboltError, match="without AVX512, AVX512_BF16, AVX512_VNNI"):
        check_build("native", portable, zen4)
    with pytest.raises(MboltError, match="portable build"):
        check_build("portable", native, zen4)
    with pytest.raises(MboltError, match="expected native or portable"):
        check_build("fast", native, zen4)
