"""The peers in the benchmark (mbolt.bench.peers): ik_llama.cpp's build cache, its output parser,
and a real run of the built binary.

The parser is checked on output captured from a real run (tests/data/README.md says how it was
made). The build cache is checked with a fake tarball holding a two-line C project that cmake
builds in seconds. The real run needs the peer built under $MBOLT_BENCH/peers (about 12 minutes
on 2 cores: `python scripts/bench_memlimit.py prepare` builds it); CI does not build it, so that
test skips there and wherever the build is absent.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import IN_CI
from mbolt.bench import peers
from mbolt.core.errors import MboltError

DATA = Path(__file__).parent / "data"
MAPPED_OUT = DATA / "ik_perplexity_tiny_mapped.txt"
PREFETCH_OUT = DATA / "ik_perplexity_tiny_prefetch2.txt"


# ---- the parser, on real output ----


# as the captured files print them (their llama_print_timings and Final estimate lines)
MAPPED_PROMPT_EVAL_MS, MAPPED_EVAL_MS, MAPPED_PPL = 19.82, 9.24, 398.6028


def test_parses_a_real_mapped_run():
    """At -b 1 llama.cpp books the first half of each chunk (no logits read) as 130 "prompt eval"
    tokens and the rest as 126 single runs: the decode is all 256, one per llama_decode."""
    run = peers.parse_perplexity(MAPPED_OUT.read_text(), "mapped")
    assert (run.tokens, run.chunks, run.n_ctx) == (256, 2, 128)
    assert run.decode_s == pytest.approx((MAPPED_PROMPT_EVAL_MS + MAPPED_EVAL_MS) / 1e3)
    assert run.tokens_per_s == pytest.approx(256 / 0.02906)
    assert run.load_s == pytest.approx(0.03952)
    assert run.ppl == pytest.approx(MAPPED_PPL)
    assert run.flash_attn is True
    assert run.prefetch is None


def test_parses_the_prefetch_engine():
    run = peers.parse_perplexity(PREFETCH_OUT.read_text(), "prefetch")
    assert run.tokens == 256 and run.decode_s == pytest.approx((12.05 + 13.47) / 1e3)
    assert run.prefetch == "threaded populate engine"


def _cut_before(text: str, marker: str) -> str:
    return text[:text.index(marker)]


@pytest.mark.parametrize("mangle, says", [
    (lambda t: "", "no eval, prompt eval, load, chunks, final line"),
    (lambda t: _cut_before(t, "llama_print_timings"), "no eval, prompt eval, load, final line"),
    (lambda t: _cut_before(t, "Final estimate"), "no final line"),
    (lambda t: t.replace("batch_size=1,", "batch_size=128,"), "at batch_size 128 .* not a teacher-forced decode"),
    (lambda t: t.replace("/   126 runs", "/   100 runs"), "decoded 100 \\+ 130 tokens"),
    (lambda t: t.replace("n_ctx=128 = 398.6028", "n_ctx=128 = garbage"), "'garbage' is not a number"),
])
def test_refuses_output_it_does_not_know(mangle, says):
    with pytest.raises(MboltError, match=says) as e:
        peers.parse_perplexity(mangle(MAPPED_OUT.read_text()), "arm x")
    assert str(e.value).startswith("arm x: ") and "\n" not in str(e.value)


def test_a_text_too_short_is_one_line():
    out = ("perplexity: you need at least 256 tokens to evaluate perplexity with a context of 128\n"
           "perplexity: the data file you provided tokenizes to only 40 tokens\n")
    with pytest.raises(MboltError, match="tokenizes to 40 tokens; llama-perplexity needs 256"):
        peers.parse_perplexity(out, "arm x")


def test_arm_flags_are_iks():
    """The flags as ik's common/common.cpp spells them; mapped passes none (no -rtr: no repack)."""
    arms = {a.name: a for a in peers.ik_arms()}
    assert list(arms) == ["ik-mapped", "ik-mapped (A/A)", "ik-prefetch-1", "ik-prefetch-2", "ik-prefetch-3",
                          "ik-prefetch-4"]
    assert arms["ik-mapped"].flags() == []
    assert arms["ik-prefetch-3"].flags() == ["--prefetch-experts", "--prefetch-experts-threads", "3"]
    assert peers.PeerArm("auto", prefetch_threads=0).flags() == ["--prefetch-experts"]


# ---- the build cache, with a fake tarball ----

FAKE_MAIN = "int main(void) { return 0; }\n"
FAKE_CMAKE = """cmake_minimum_required(VERSION 3.10)
project(fake C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(llama-perplexity main.c)
add_executable(llama-cli main.c)
"""

needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None,
                                 reason="the fake tarball's project needs cmake and a C compiler")


def fake_tarball(path: Path, cmake: str = FAKE_CMAKE, top: str = "ik_llama.cpp") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in (("CMakeLists.txt", cmake), ("main.c", FAKE_MAIN)):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def no_cmake(monkeypatch, tmp_path):
    """cmake is gone from PATH: any build attempt fails."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))


@needs_cmake
def test_builds_once_then_finds_the_build(tmp_path, monkeypatch):
    tarball = fake_tarball(tmp_path / peers.IK_TARBALL)
    cache = tmp_path / "peers"
    b = peers.build_ik(tarball, cache, jobs=1, nice=0)
    root = cache / "ik_llama.cpp-8337e4c"
    assert b.root == root and b.perplexity == root / "build" / "bin" / "llama-perplexity"
    assert subprocess.call([str(b.perplexity)]) == 0 and subprocess.call([str(b.cli)]) == 0
    stamp = json.loads((root / ".mbolt-build.json").read_text())
    assert stamp["tarball_sha256"] == hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert stamp["cmake_flags"] == ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                                    "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    log = (root / "mbolt-build.log").read_text()
    assert "-DGGML_NATIVE=OFF" in log and "--target llama-perplexity llama-cli" in log
    no_cmake(monkeypatch, tmp_path)
    again = peers.build_ik(tarball, cache)  # no cmake on PATH: only the cache can answer
    assert again.perplexity == b.perplexity
    assert peers.find_ik(cache) is not None


@needs_cmake
def test_a_half_done_build_is_built_again(tmp_path, monkeypatch):
    tarball = fake_tarball(tmp_path / peers.IK_TARBALL)
    cache = tmp_path / "peers"
    b = peers.build_ik(tarball, cache, jobs=1, nice=0)
    b.cli.unlink()  # as if the build stopped before its second target
    assert peers.find_ik(cache) is None
    rebuilt = peers.build_ik(tarball, cache, jobs=1, nice=0)
    assert rebuilt.cli.is_file()
    (rebuilt.root / ".mbolt-build.json").unlink()  # stopped after the binaries, before the stamp
    assert peers.find_ik(cache) is None
    no_cmake(monkeypatch, tmp_path)
    with pytest.raises(MboltError, match="cmake: not on PATH"):
        peers.build_ik(tarball, cache)


@needs_cmake
def test_another_tarball_or_other_flags_is_another_build(tmp_path, monkeypatch):
    cache = tmp_path / "peers"
    first = fake_tarball(tmp_path / "a.tar.gz")
    peers.build_ik(first, cache, jobs=1, nice=0)
    other = fake_tarball(tmp_path / "b.tar.gz", FAKE_CMAKE + "# another revision\n")
    assert peers.find_ik(cache, other) is None and peers.find_ik(cache, first) is not None
    b = peers.build_ik(other, cache, jobs=1, nice=0)
    assert b.stamp["tarball_sha256"] == hashlib.sha256(other.read_bytes()).hexdigest()
    assert "# another revision" in (b.root / "CMakeLists.txt").read_text()  # extracted afresh
    monkeypatch.setattr(peers, "IK_CMAKE_FLAGS", (*peers.IK_CMAKE_FLAGS, "-DGGML_AVX2=ON"))
    assert peers.find_ik(cache, other) is None


@needs_cmake
def test_a_failed_build_leaves_no_stamp(tmp_path):
    tarball = fake_tarball(tmp_path / "bad.tar.gz", FAKE_CMAKE.replace("main.c)", "missing.c)"))
    with pytest.raises(MboltError, match=r"mbolt-build\.log: `cmake .*` failed"):
        peers.build_ik(tarball, tmp_path / "peers", jobs=1, nice=0)
    assert not (tmp_path / "peers" / "ik_llama.cpp-8337e4c" / ".mbolt-build.json").exists()
    assert peers.find_ik(tmp_path / "peers") is None


def test_not_ik_source_is_one_line(tmp_path):
    tarball = fake_tarball(tmp_path / "other.tar.gz", top="something-else")
    with pytest.raises(MboltError, match="no ik_llama.cpp/CMakeLists.txt inside"):
        peers.build_ik(tarball, tmp_path / "peers")
    with pytest.raises(MboltError, match="no such file"):
        peers.build_ik(tmp_path / "absent.tar.gz", tmp_path / "peers")


# ---- the real binary on a tiny model ----

BUILT = peers.find_ik()


@pytest.mark.skipif(IN_CI or BUILT is None,
                    reason="needs ik_llama.cpp built under $MBOLT_BENCH/peers (bench_memlimit.py prepare); not in CI")
@pytest.mark.parametrize("arm, ram", [(peers.PeerArm("ik-mapped"), 0),
                                      (peers.PeerArm("ik-prefetch-2", prefetch_threads=2), 256 << 20)])
def test_the_built_peer_runs_cold_on_a_tiny_model(tmp_path, arm, ram):
    """One arm-round as the benchmark runs it: the file dropped, the process (in a memory cgroup
    where the machine has them) stopped after its load to drop what the load read, then its eval."""
    from mbolt.core.memlimit import hierarchy
    from mbolt.core.prompts import forced_texts
    from mbolt.gguf.synth import SynthConfig, write_synth

    if ram:
        try:
            hierarchy()
        except MboltError:
            ram = 0  # no memory cgroups here: the same round without a limit

    model = tmp_path / "tiny.gguf"
    write_synth(model, SynthConfig(arch="qwen3moe", n_layers=2, n_experts=16, n_used=2, hidden=256, expert_ff=128,
                                   n_heads=4, n_kv_heads=2, head_dim=64, expert_type="Q8_0", seed=7))
    text = tmp_path / "text.txt"
    text.write_text(forced_texts(None, 1)[0])
    row = peers.run_peer_round(BUILT, arm, model, text, ram=ram, n_ctx=128, chunks=2)
    assert row["tokens"] == 256 and row["decode_tokens_per_s"] > 0 and math.isfinite(row["ppl"])
    assert row["proven_cold"] and not row["rejected"]
    # cold when it starts decoding (ik mapped none of the experts; what the load's reads brought
    # into the page cache around the dense weights was dropped)
    assert row["experts_resident_at_eval"] <= 0.01
    assert (row["prefetch"] is not None) == (arm.prefetch_threads is not None)
    assert row["argv"][-len(arm.flags()) - 1:] == ["--defer-experts", *arm.flags()]
    assert (row["peak_bytes_with_load"] is not None) == bool(ram) and row["oom_kills"] in (None, 0)


def test_beside_tells_kernels_from_io():
    """The ratios against figures written out here: mbolt 6 tok/s, llama.cpp warm 30, ik warm 45,
    ik's arms under the limit 3 and 2.5."""
    limited = {"best_arm": "ik-mapped", "best_decode_tokens_per_s": 3.0, "fed": "f"}
    warm = {"summary": [{"arm": "ik-warm", "decode_tokens_per_s": 45.0}]}
    b = peers.peers_beside(6.0, 30.0, limited, warm)
    assert b["best_peer_arm"] == "ik-mapped" and b["mbolt_over_best_peer"] == pytest.approx(2.0)
    assert b["ik_kernels_over_llama_cpp_warm"] == pytest.approx(1.5)
    assert b["best_peer_share_of_its_warm"] == pytest.approx(3 / 45)
    assert b["mbolt_share_of_llama_cpp_warm"] == pytest.approx(0.2)
    assert peers.peers_beside(None, None, limited, None)["mbolt_over_best_peer"] is None


def test_fed_tokens_are_whole_chunks(tmp_path):
    with pytest.raises(MboltError, match="200 fed tokens are not whole chunks of 128"):
        peers.peer_decode(None, tmp_path / "m.gguf", tmp_path / "t.txt", "text", new_tokens=200, rounds=1, ram=0)
    # the full-depth benchmark's chunks of 64: 96 tokens are one and a half, 64 only one
    for n in (96, 64):
        with pytest.raises(MboltError, match=f"{n} fed tokens are not whole chunks of 64"):
            peers.peer_decode(None, tmp_path / "m.gguf", tmp_path / "t.txt", "text", new_tokens=n, rounds=1, ram=0,
                              n_ctx=64)
    assert [a.name for a in peers.ik_arms((2,))] == ["ik-mapped", "ik-mapped (A/A)", "ik-prefetch-2"]


def test_a_warm_arm_under_a_limit_is_refused(tmp_path):
    build = peers.PeerBuild(tmp_path, tmp_path / "llama-perplexity", tmp_path / "llama-cli", {})
    with pytest.raises(MboltError, match="a warm arm runs without a limit"):
        peers.run_peer_round(build, peers.IK_WARM, tmp_path / "m.gguf", tmp_path / "t.txt", ram=1 << 30, n_ctx=128,
                             chunks=2)
