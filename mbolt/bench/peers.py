"""The peers in the benchmark: ik_llama.cpp built from its source tarball and run as an arm.

`build_ik(tarball)` extracts the tarball (kept outside git: `../shared/peers/`) under
`$MBOLT_BENCH/peers/` and builds its `llama-perplexity` and `llama-cli`, cached: a stamp written
only after both binaries exist records the tarball's sha256 and the cmake flags, so a second call
returns at once and a half-done build (no stamp, or a stamp for other inputs) is built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mbolt.core.errors import MboltError

IK_COMMIT = "8337e4c"
IK_TARBALL = f"ik_llama.cpp-{IK_COMMIT}.tar.gz"
IK_TOP_DIR = "ik_llama.cpp"  # the one directory at the top of the tarball
# As ../shared/peers/README.md built it for the issues' figures: portable code, so the peer runs
# the same kernels the figures came from whatever CPU the build ran on.
IK_CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)
IK_TARGETS = ("llama-perplexity", "llama-cli")
SOURCE_STAMP = ".mbolt-source.json"  # the source tree is complete (written after extraction)
CONFIGURE_STAMP = ".mbolt-configure.json"  # build/ was configured with these flags (an interrupted build resumes)
BUILD_STAMP = ".mbolt-build.json"  # the binaries are complete (written after the build)


@dataclass(frozen=True)
class PeerBuild:
    root: Path  # the source tree; the build is in root / "build"
    perplexity: Path
    cli: Path
    stamp: dict


def default_peers_dir() -> Path:
    return Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench")) / "peers"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(path: Path, stamp: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: a stamp is whole or absent


def _binaries(root: Path) -> tuple[Path, Path]:
    bin_dir = root / "build" / "bin"
    return bin_dir / "llama-perplexity", bin_dir / "llama-cli"


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_ik(cache_dir: Path | None = None, tarball: Path | None = None) -> PeerBuild | None:
    """The finished build under cache_dir, or None. With a tarball, only a build of that tarball
    (same sha256) and of today's cmake flags counts."""
    root = (cache_dir or default_peers_dir()) / f"ik_llama.cpp-{IK_COMMIT}"
    stamp = _read_stamp(root / BUILD_STAMP)
    if stamp is None or stamp.get("cmake_flags") != list(IK_CMAKE_FLAGS):
        return None
    if tarball is not None and stamp.get("tarball_sha256") != sha256_of(tarball):
        return None
    perplexity, cli = _binaries(root)
    if not (_is_executable(perplexity) and _is_executable(cli)):
        return None
    return PeerBuild(root, perplexity, cli, stamp)


def _extract(tarball: Path, root: Path, sha: str) -> None:
    """A fresh source tree at root: extracted beside it, then renamed into place."""
    if (_read_stamp(root / SOURCE_STAMP) or {}).get("tarball_sha256") == sha:
        return  # complete from an earlier call: keep its build/ so cmake resumes
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".extract-") as tmp:
        try:
            with tarfile.open(tarball) as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise MboltError(f"{tarball}: cannot extract ({e})") from None
        top = Path(tmp) / IK_TOP_DIR
        if not (top / "CMakeLists.txt").is_file():
            raise MboltError(f"{tarball}: no {IK_TOP_DIR}/CMakeLists.txt inside; not ik_llama.cpp's source")
        os.replace(top, root)
    _write_stamp(root / SOURCE_STAMP, {"tarball": tarball.name, "tarball_sha256": sha})


def _run_logged(cmd: list[str], cwd: Path, log: Path, nice: int) -> None:
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        rc = subprocess.call(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(nice))
    if rc != 0:
        raise MboltError(f"{log}: `{' '.join(cmd)}` failed (exit {rc}); the log's end says why")


def build_ik(tarball: Path, cache_dir: Path | None = None, jobs: int = 2, nice: int = 19) -> PeerBuild:
    """ik_llama.cpp's llama-perplexity and llama-cli built from tarball, under cache_dir
    (default $MBOLT_BENCH/peers); returns at once when a finished build of the same inputs is there."""
    tarball = Path(tarball)
    if not tarball.is_file():
        raise MboltError(f"{tarball}: no such file (ik_llama.cpp's source tarball, see ../shared/peers/README.md)")
    sha = sha256_of(tarball)
    cache_dir = Path(cache_dir or default_peers_dir())
    done = find_ik(cache_dir, tarball)
    if done is not None:
        return done
    if shutil.which("cmake") is None:
        raise MboltError("cmake: not on PATH; building ik_llama.cpp needs cmake and a C/C++ compiler")
    root = cache_dir / f"ik_llama.cpp-{IK_COMMIT}"
    (root / BUILD_STAMP).unlink(missing_ok=True)  # stale stamp: other tarball or flags
    _extract(tarball, root, sha)
    log = root / "mbolt-build.log"
    configured = root / "build" / CONFIGURE_STAMP
    if (_read_stamp(configured) or {}).get("cmake_flags") != list(IK_CMAKE_FLAGS):
        shutil.rmtree(root / "build", ignore_errors=True)  # a flag left out must not linger in CMakeCache.txt
        _run_logged(["cmake", "-B", "build", *IK_CMAKE_FLAGS], root, log, nice)
        _write_stamp(configured, {"cmake_flags": list(IK_CMAKE_FLAGS)})
    _run_logged(["cmake", "--build", "build", "--target", *IK_TARGETS, f"-j{jobs}"], root, log, nice)
    perplexity, cli = _binaries(root)
    for binary in (perplexity, cli):
        if not _is_executable(binary):
            raise MboltError(f"{log}: the build finished but {binary} is not there")
    _write_stamp(root / BUILD_STAMP, {
        "tarball": tarball.name, "tarball_sha256": sha, "commit": IK_COMMIT,
        "cmake_flags": list(IK_CMAKE_FLAGS), "targets": list(IK_TARGETS)})
    found = find_ik(cache_dir, tarball)
    assert found is not None
    return found


# ---- what llama-perplexity prints ----

# llama_print_timings (src/llama.cpp) and examples/perplexity/perplexity.cpp at 8337e4c
_EVAL = re.compile(r"llama_print_timings:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_PROMPT_EVAL = re.compile(r"llama_print_timings: prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_LOAD = re.compile(r"llama_print_timings:\s+load time =\s*([\d.]+) ms")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+)")
_FINAL = re.compile(r"Final estimate: PPL over (\d+) chunks for n_ctx=(\d+) = (\S+)")
_FLASH = re.compile(r"^\w+: flash_attn\s*=\s*(\d)", re.M)
_PREFETCH = re.compile(r"enabling MoE expert read-ahead \(prefetch_experts\), (.+)")
_TOO_SHORT = re.compile(r"you need at least (\d+) tokens .*\n.*tokenizes to only (\d+) tokens")


@dataclass(frozen=True)
class PerplexityRun:
    """One llama-perplexity run, as it reported it."""

    tokens: int  # tokens decoded, one per llama_decode (batch_size 1)
    decode_s: float  # their time (llama_print_timings' prompt eval + eval; load, warmup, tokenizing excluded)
    load_s: float
    chunks: int
    n_ctx: int
    ppl: float
    flash_attn: bool | None
    prefetch: str | None  # ik's prefetch engine ("threaded populate engine" or "madvise fallback"), None: off

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s


def parse_perplexity(text: str, source: str) -> PerplexityRun:
    """llama-perplexity's stdout+stderr -> its timings, or one line saying what is missing.

    At -b 1 every llama_decode holds one token, but llama.cpp books decodes whose logits nobody
    read before the next (the first half of each chunk: perplexity scores the second) as one
    "prompt eval" of several tokens when the logits are read, and the rest as "eval" runs of one:
    the decode is both together, which must be every chunk's every token. Output without these
    lines, or with other counts, is refused."""
    short = _TOO_SHORT.search(text)
    if short:
        raise MboltError(f"{source}: the text tokenizes to {short[2]} tokens; llama-perplexity needs {short[1]}")
    found = {k: rx.search(text) for k, rx in
             (("eval", _EVAL), ("prompt eval", _PROMPT_EVAL), ("load", _LOAD), ("chunks", _CHUNKS), ("final", _FINAL))}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise MboltError(f"{source}: not llama-perplexity output this parser knows (no {', '.join(missing)} line)")
    chunks, n_ctx, batch = (int(x) for x in found["chunks"].groups())
    runs, queued = int(found["eval"][2]), int(found["prompt eval"][2])
    if batch != 1 or runs + queued != chunks * n_ctx:
        raise MboltError(f"{source}: llama-perplexity decoded {runs} + {queued} tokens at batch_size {batch} where "
                         f"{chunks} chunks x {n_ctx} one at a time were asked: not a teacher-forced decode")
    decode_ms = float(found["eval"][1]) + float(found["prompt eval"][1])
    if decode_ms <= 0:
        raise MboltError(f"{source}: llama-perplexity reports a decode time of 0 ms")
    try:
        ppl = float(found["final"][3])
    except ValueError:
        raise MboltError(f"{source}: llama-perplexity's final estimate {found['final'][3]!r} is not a number") from None
    flash, prefetch = _FLASH.search(text), _PREFETCH.search(text)
    return PerplexityRun(runs + queued, decode_ms / 1e3, float(found["load"][1]) / 1e3, chunks, n_ctx, ppl,
                         None if flash is None else flash[1] == "1", None if prefetch is None else prefetch[1].strip())


# ---- arms ----

# How the peer was fed, in every result (it takes a text, not token ids, and no prompt/decode split)
FED = ("llama-perplexity -b 1 -ub 1: the text's first {chunks} x {n_ctx} tokens (its own tokenizer, BOS first) in "
       "{chunks} chunks of {n_ctx}, each chunk from an empty KV cache, one token per llama_decode; logits (the output "
       "matrix) for the second half of each chunk only, the tokens it scores; timed: llama_print_timings' prompt "
       "eval + eval (every decode; load and tokenizing excluded). Cold arms run with --defer-experts (dense weights "
       "loaded, no expert page mapped, no warmup) and their experts' pages dropped once loaded: the mbolt arms' "
       "cold start. The mbolt arms: a prompt, then teacher-forced decode steps of the same text, logits every step.")


@dataclass(frozen=True)
class PeerArm:
    """An ik_llama.cpp configuration: mapped as shipped (its default mmap; no -rtr, whose run-time
    repack is off by default and would load the whole model into anonymous memory), or with
    --prefetch-experts and its worker count (0: ik's auto); warm: the file in memory, no limit."""

    name: str
    prefetch_threads: int | None = None
    warm: bool = False
    control_of: str | None = None  # an A/A: the same configuration as that arm

    def flags(self) -> list[str]:
        if self.prefetch_threads is None:
            return []
        return ["--prefetch-experts"] + (["--prefetch-experts-threads", str(self.prefetch_threads)]
                                         if self.prefetch_threads else [])


def ik_arms(prefetch_threads=(1, 2, 3, 4), aa: bool = True) -> list[PeerArm]:
    """ik mapped (and its A/A), and --prefetch-experts at each worker count."""
    arms = [PeerArm("ik-mapped")]
    if aa:
        arms.append(PeerArm("ik-mapped (A/A)", control_of="ik-mapped"))
    return arms + [PeerArm(f"ik-prefetch-{n}", n) for n in prefetch_threads]


IK_WARM = PeerArm("ik-warm", warm=True)


def perplexity_argv(build: PeerBuild, arm: PeerArm, model: Path, text: Path, n_ctx: int, chunks: int,
                    threads: int = 2) -> list[str]:
    # A cold arm starts as the mbolt arms do (dense weights resident, experts cold) through ik's
    # own --defer-experts: by default ik maps the file MAP_POPULATE and warms up with every expert
    # (n_expert_used = n_expert), which under a limit streams the whole file through the group
    # before the clock and leaves it full of the last layers' experts. --defer-experts loads the
    # dense weights, maps no expert page (it drops their mapping after the load) and skips that
    # warmup; nothing else in ik reads it (src/llama.cpp, llama-model-loader.cpp at 8337e4c).
    cold = [] if arm.warm else ["--defer-experts"]
    return [str(build.perplexity), "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", "1", "-ub", "1",
            "--chunks", str(chunks), "-t", str(threads), *cold, *arm.flags()]


def drop_experts(mm) -> tuple[float, float]:
    """Drop the expert tensors' pages from the page cache (dense weights stay); the experts'
    resident share (mincore) before and after. Pages a process has mapped stay."""
    from mbolt.core.pagecache import expert_spans, resident_share

    shares = []
    for i, path in enumerate(mm.paths):
        spans = expert_spans(mm, i)
        before = resident_share(path, spans)
        fd = os.open(path, os.O_RDONLY)
        try:
            for a, b in spans:
                os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        shares.append((before, resident_share(path, spans)))
    return max(b for b, _ in shares), max(a for _, a in shares)


def read_into_cache(path: Path) -> None:
    """The whole file in the page cache (a warm arm's start)."""
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


# the line perplexity prints once the model is loaded (and warmed up, where it warms up), before it
# tokenizes the text and decodes
EVAL_MARK = "tokenizing the input"
PEER_TIMEOUT_S = 3600


def _run_to_end(proc: subprocess.Popen, at_mark, timeout: float, mark: str = EVAL_MARK) -> str:
    """proc's merged output; at_mark() runs once, with proc stopped (SIGSTOP), when `mark` appears."""
    import signal
    import threading

    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if at_mark is not None and mark in line:
                proc.send_signal(signal.SIGSTOP)
                try:
                    at_mark()
                finally:
                    proc.send_signal(signal.SIGCONT)
                at_mark = None
        proc.wait()
    finally:
        timer.cancel()
    return "".join(lines)


def run_cold(arm: PeerArm, model: Path, argv: list[str], *, ram: int, mark: str, tool: str,
             threshold: float = 0.01, timeout: float = PEER_TIMEOUT_S) -> tuple[str, dict]:
    """One peer process, started as bench.ab_llama starts the mbolt arms: the device idle, the
    file dropped and proven cold (mincore), the process inside a memory cgroup of `ram` bytes (0:
    none). The mbolt arms drop the experts again once the model has loaded
    (runtime.streamer.make_cold); ik's --defer-experts maps none of them, and here the process is
    also stopped (SIGSTOP) when it prints `mark` (loaded, not yet computing), the expert tensors'
    pages its load's reads brought into the page cache are dropped and their resident share
    recorded (above the threshold: the round is rejected, as a round not proven cold is), and it
    continues. A warm arm reads the file into memory first. (its output, the round's record)"""
    from mbolt.bench.env import wait_quiet
    from mbolt.core.memlimit import MemoryGroup
    from mbolt.core.moe_map import moe_map
    from mbolt.core.pagecache import evict_model

    if arm.warm and ram:
        raise MboltError(f"arm {arm.name}: a warm arm runs without a limit (the file in memory): give ram=0")
    quiet = wait_quiet(model)
    at_eval: dict = {}
    if arm.warm:
        read_into_cache(model)
        ev, at_mark = None, None
    else:
        mm = moe_map(model)
        ev = evict_model(mm, threshold)

        def at_mark():
            at_eval["experts_resident_loaded"], at_eval["experts_resident_at_eval"] = drop_experts(mm)

    # ik's tools write llama.log into their working directory: keep it out of the caller's
    logdir = tempfile.mkdtemp(prefix="mbolt-ik-")
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", cwd=logdir)
    peak = kills = None
    try:
        if ram:
            with MemoryGroup(ram) as group:
                proc = group.popen(argv, **popen)
                out = _run_to_end(proc, at_mark, timeout, mark)
                peak, kills = group.peak(), group.oom_kills()
        else:
            proc = subprocess.Popen(argv, **popen)
            out = _run_to_end(proc, at_mark, timeout, mark)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    if proc.returncode != 0:
        if kills:
            raise MboltError(f"arm {arm.name}: the kernel OOM-killed {tool} inside a {ram} B memory cgroup "
                             f"(peak {peak} B): the budget is below what it needs")
        last = next((l for l in reversed(out.strip().splitlines()) if l.strip()), "no output")
        why = f"killed (no result after {timeout:.0f} s?)" if proc.returncode == -9 else f"exit {proc.returncode}"
        raise MboltError(f"arm {arm.name}: {tool} failed ({why}): {last.strip()}")
    return out, {"arm": arm.name, "control_of": arm.control_of, "warm": arm.warm, "argv": argv, "budget_bytes": ram,
                 "resident_before": ev.resident_before if ev else None,
                 "resident_after": ev.resident_after if ev else None, "proven_cold": ev.proven if ev else False,
                 **at_eval,
                 "rejected": bool(ev is not None and ((not ev.proven and ev.resident_after == ev.resident_after)
                                                      or at_eval.get("experts_resident_at_eval", 0.0) > threshold)),
                 "inflight_at_start": quiet.get("inflight_at_start"), "quiet_waited_s": quiet["waited_s"],
                 "peak_bytes_with_load": peak, "oom_kills": kills}


def run_peer_round(build: PeerBuild, arm: PeerArm, model: Path, text: Path, *, ram: int, n_ctx: int, chunks: int,
                   threads: int = 2, threshold: float = 0.01, timeout: float = PEER_TIMEOUT_S) -> dict:
    """One arm-round of teacher-forced decoding: a fresh llama-perplexity process (run_cold)."""
    model, text = Path(model).resolve(), Path(text).resolve()  # ik runs in a directory of its own
    argv = perplexity_argv(build, arm, model, text, n_ctx, chunks, threads)
    out, row = run_cold(arm, model, argv, ram=ram, mark=EVAL_MARK, tool="llama-perplexity", threshold=threshold,
                        timeout=timeout)
    run = parse_perplexity(out, f"arm {arm.name}")
    return {**row, "tokens": run.tokens, "decode_s": run.decode_s, "decode_tokens_per_s": run.tokens_per_s,
            "load_s": run.load_s, "ppl": run.ppl, "flash_attn": run.flash_attn, "prefetch": run.prefetch}


def run_peers(build: PeerBuild, arms: list[PeerArm], model: Path, text: Path, *, rounds: int, ram: int, n_ctx: int,
              chunks: int, threads: int = 2, seed: int = 0, progress=None) -> dict:
    """Every arm once per round, in the balanced orders of bench.design.arm_orders (as run_ab
    orders the mbolt arms); per arm the median decode tok/s over its rounds that were cold."""
    import numpy as np

    from mbolt.bench.design import run_rounds

    rows, orders = run_rounds(arms, rounds, seed, progress=progress, one_round=lambda a: run_peer_round(
        build, a, model, text, ram=ram, n_ctx=n_ctx, chunks=chunks, threads=threads))
    summary = []
    for a in arms:
        xs = [r["decode_tokens_per_s"] for r in rows if r["arm"] == a.name and not r["rejected"]]
        summary.append({"arm": a.name, "flags": a.flags(), "warm": a.warm, "control_of": a.control_of,
                        "decode_tokens_per_s": float(np.median(xs)) if xs else None, "decode_tokens_per_s_rounds": xs})
    measured = [s for s in summary if s["decode_tokens_per_s"] is not None and not s["control_of"] and not s["warm"]]
    best = max(measured, key=lambda s: s["decode_tokens_per_s"], default=None)
    return {"engine": "ik_llama.cpp", "commit": build.stamp.get("commit"), "tarball_sha256": build.stamp.get("tarball_sha256"),
            "cmake_flags": build.stamp.get("cmake_flags"), "fed": FED.format(chunks=chunks, n_ctx=n_ctx),
            "threads": threads, "budget_bytes": ram, "orders": orders,
            "rounds": rows, "summary": summary, "best_arm": best and best["arm"],
            "best_decode_tokens_per_s": best and best["decode_tokens_per_s"],
            "aa": aa_of(summary)}


def aa_of(summary: list[dict], key: str = "decode_tokens_per_s") -> dict:
    """Each A/A control's median (`key`) over its arm's (1.0: the same configuration measured the same)."""
    by = {s["arm"]: s[key] for s in summary}
    return {s["arm"]: (s[key] / by[s["control_of"]] if s[key] and by.get(s["control_of"]) else None)
            for s in summary if s["control_of"]}


# ---- beside the mbolt arms (scripts/bench_memlimit.py) ----

PEER_CTX = 128  # llama-perplexity's chunk: a decode of 256 tokens is 2 chunks (the figures)


def fed_text(model: Path, prompt_tokens: int, new_tokens: int) -> str:
    """The text the mbolt arms are fed (bench.ab.load_prompt_ids without a prompt file): the
    built-in teacher-forcing text when it holds their tokens, else the session texts."""
    from mbolt.bench.ab import load_prompt_ids
    from mbolt.core.prompts import forced_texts, session_texts
    from mbolt.runtime.runner import LlamaRunner

    ids = load_prompt_ids(str(model), None, 1, engine="llama.cpp", forced=prompt_tokens, n_new=new_tokens)[0]
    builtin = forced_texts(None, 1)[0]
    with LlamaRunner(str(model), vocab_only=True) as r:
        return builtin if r.tokenize(builtin, add_special=True) == ids else session_texts(1)[0]


def peer_decode(build: PeerBuild, model: Path, text_path: Path, text: str, *, new_tokens: int, rounds: int, ram: int,
                seed: int = 0, warm: bool = False, progress=None, n_ctx: int = PEER_CTX,
                prefetch_threads=(1, 2, 3, 4)) -> dict:
    """ik's arms on `text` (written to text_path), `new_tokens` one per decode in chunks of n_ctx:
    under the limit ik mapped (with its A/A) and --prefetch-experts at each of `prefetch_threads`
    workers; warm: ik with the file in memory."""
    if new_tokens < 2 * n_ctx or new_tokens % n_ctx:
        raise MboltError(f"peers: {new_tokens} fed tokens are not whole chunks of {n_ctx} (at least 2)")
    text_path.write_text(text)
    arms = [IK_WARM] if warm else ik_arms(prefetch_threads)
    return run_peers(build, arms, model, text_path, rounds=rounds, ram=0 if warm else ram, n_ctx=n_ctx,
                     chunks=new_tokens // n_ctx, seed=seed, progress=progress)


def peers_beside(mbolt_tokens_per_s: float | None, plain_warm_tokens_per_s: float | None, limited: dict,
                 warm: dict | None) -> dict:
    """The figures that tell kernels from I/O: each engine warm (ik's kernels vs llama.cpp's),
    mbolt over the best peer arm under the limit, and how far each engine falls from its warm speed."""
    ik_warm = warm and warm["summary"][0]["decode_tokens_per_s"]
    best = limited["best_decode_tokens_per_s"]
    div = lambda a, b: a / b if a and b else None  # noqa: E731
    return {"best_peer_arm": limited["best_arm"], "best_peer_tokens_per_s": best,
            "mbolt_over_best_peer": div(mbolt_tokens_per_s, best),
            "ik_warm_tokens_per_s": ik_warm, "llama_cpp_warm_tokens_per_s": plain_warm_tokens_per_s,
            "ik_kernels_over_llama_cpp_warm": div(ik_warm, plain_warm_tokens_per_s),
            "best_peer_share_of_its_warm": div(best, ik_warm),
            "mbolt_share_of_llama_cpp_warm": div(mbolt_tokens_per_s, plain_warm_tokens_per_s),
            "fed": limited["fed"],
            "note": "the peer arms run after the mbolt arms at the same readahead and budget (not inside their "
                    "rounds): ratios across engines are of medians; the tokens are not compared (llama-perplexity "
                    "prints none)"}
