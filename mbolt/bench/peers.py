"""The peer in the benchmarks: ik_llama.cpp from the package registry, run as an arm.

ik_llama.cpp comes as its users install it: `pip install ik-llama-cpp-python==0.1.5` (a package
that vendors ik_llama.cpp and binds its C API with ctypes; its wheel is built for AVX2) in a
virtual environment of its own, `$MBOLT_IK_VENV` (default `$MBOLT_BENCH/ik-venv`); `install_ik`
makes it. An arm-round is a fresh process of that environment's python running
`bench/ik_worker.py`: it is fed the mbolt arms' own token ids, a prompt in one llama_decode, then
the text one token per llama_decode (teacher-forced, as the plain llama.cpp arm), and reports its
time to first token and its decode time. The registry's ik_llama.cpp predates
`--prefetch-experts` and `--defer-experts`: the peer's arms are ik mapped (cold or warm) only.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mbolt.core.errors import MboltError

IK_PACKAGE = "ik-llama-cpp-python"
IK_VERSION = "0.1.5"
WORKER = Path(__file__).with_name("ik_worker.py")
# the worker's protocol (bench/ik_worker.py: MARK, RESULT); not imported, the worker is a script
MARK = "mbolt-ik-worker: loaded"
RESULT = "mbolt-ik-worker: result "
PEER_TIMEOUT_S = 3600


@dataclass(frozen=True)
class IkPeer:
    """The installed peer: its environment's python, the package's version and its library's
    llama_print_system_info() (what it was built for)."""

    venv: Path
    python: Path
    version: str
    system_info: str

    def record(self) -> dict:
        return {"engine": "ik_llama.cpp", "package": f"{IK_PACKAGE}=={self.version}",
                "installed": f"pip install {IK_PACKAGE}=={IK_VERSION} in a virtual environment of its own (its wheel)",
                "venv": str(self.venv), "system_info": self.system_info}


def default_venv() -> Path:
    if os.environ.get("MBOLT_IK_VENV"):
        return Path(os.environ["MBOLT_IK_VENV"])
    return Path(os.environ.get("MBOLT_BENCH", "/tmp/mbolt-bench")) / "ik-venv"


@functools.lru_cache(maxsize=None)
def _probe(python: Path) -> tuple[str, str]:
    try:
        r = subprocess.run([str(python), str(WORKER), "--system-info"], capture_output=True, text=True, timeout=120)
        info = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        info = None
    if not info:
        raise MboltError(f"{python}: cannot import ik_llama_cpp (install it: pip install {IK_PACKAGE}=={IK_VERSION})")
    return info["version"], info["system_info"]


def find_ik(venv: str | os.PathLike | None = None) -> IkPeer | None:
    """The peer installed in `venv` (default: default_venv()), or None where there is no such
    environment. An environment without the package, or with another version of it, is one line."""
    venv = Path(venv or default_venv())
    python = venv / "bin" / "python"
    try:
        if not python.exists():
            return None
    except OSError as e:  # another user's environment (its python under a home this user cannot enter)
        raise MboltError(f"{python}: {e.strerror or e}: not an environment this user can run") from None
    version, info = _probe(python)
    if version != IK_VERSION:
        raise MboltError(f"{venv}: holds {IK_PACKAGE} {version}; the benchmarks run {IK_VERSION} "
                         f"({venv}/bin/pip install {IK_PACKAGE}=={IK_VERSION})")
    return IkPeer(venv, python, version, info)


def install_ik(venv: str | os.PathLike | None = None) -> IkPeer:
    """The peer, installed as its users install it (python -m venv; pip install the package: its
    wheel) unless `venv` already holds it. pip's output goes to venv/mbolt-install.log."""
    venv = Path(venv or default_venv())
    found = find_ik(venv)
    if found is not None:
        return found
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-install.log"
    with open(log, "w") as out:
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(venv / "bin" / "pip"), "install", f"{IK_PACKAGE}=={IK_VERSION}"]):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT) != 0:
                raise MboltError(f"{log}: `{' '.join(cmd)}` failed; the log's end says why")
    _probe.cache_clear()
    found = find_ik(venv)
    if found is None:
        raise MboltError(f"{venv}: no python there after `python -m venv`")
    return found


# ---- arms ----

@dataclass(frozen=True)
class PeerArm:
    """An ik_llama.cpp configuration: mapped as shipped (its default mmap; no run-time repack,
    which is off by default and would load the whole model into anonymous memory), cold (the
    experts' pages dropped once loaded) or warm (the file in memory, no limit), at a prompt pass
    size (n_ubatch; 512 is ik's default)."""

    name: str
    warm: bool = False
    control_of: str | None = None  # an A/A: the same configuration as that arm
    n_ubatch: int = 512


def ik_arms(aa: bool = True) -> list[PeerArm]:
    """ik mapped, and its A/A."""
    return [PeerArm("ik-mapped")] + ([PeerArm("ik-mapped (A/A)", control_of="ik-mapped")] if aa else [])


IK_WARM = PeerArm("ik-warm", warm=True)

FED = ("ik-llama-cpp-python's bindings (bench/ik_worker.py), fed the mbolt arms' token ids: a prompt of {prompt} "
       "tokens in one llama_decode, then {new} teacher-forced tokens, one per llama_decode, the logits read at every "
       "step (as the plain llama.cpp arm); n_ctx {n_ctx}, flash attention on; timed: the fed tokens' decodes "
       "(perf_counter around each llama_decode and the reading of its logits; load excluded). Cold arms: once "
       "loaded, the expert tensors' pages unmapped from the process (madvise) and dropped from the page cache "
       "(mincore checked) before the prompt: the mbolt arms' cold start.")


def merged_pages(spans) -> list[tuple[int, int]]:
    """Byte spans rounded outward to whole pages, those that touch merged: one fadvise per run of
    adjacent tensors (a large folio across two tensors' boundary lies inside neither tensor's own
    range, and the kernel drops only folios inside the range it is given)."""
    from mbolt.core.pagecache import PAGE

    out: list[list[int]] = []
    for a, b in sorted(spans):
        a, b = a // PAGE * PAGE, -(-b // PAGE) * PAGE
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def drop_experts(mm) -> tuple[float, float]:
    """Drop the pages holding the expert tensors from the page cache, rounded outward as the worker
    unmaps them (a page shared with a dense tensor is read again when that tensor is used); the
    experts' resident share (mincore) before and after. Pages a process has mapped stay."""
    from mbolt.core.pagecache import expert_spans, resident_share

    shares = []
    for i, path in enumerate(mm.paths):
        spans = expert_spans(mm, i)
        before = resident_share(path, spans)
        fd = os.open(path, os.O_RDONLY)
        try:
            for a, b in merged_pages(spans):
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


def _run_to_end(proc: subprocess.Popen, at_mark, timeout: float) -> str:
    """proc's merged output; when it prints MARK (loaded, waiting), at_mark() runs and proc is told
    to go on (a line on its stdin)."""
    import threading

    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(MARK):
                try:
                    if at_mark is not None:
                        at_mark()
                finally:
                    try:
                        proc.stdin.write("go\n")
                        proc.stdin.close()
                    except BrokenPipeError:
                        pass  # it died meanwhile: its exit status says so
        proc.wait()
    finally:
        timer.cancel()
        if not proc.stdin.closed:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
    return "".join(lines)


def run_round(peer: IkPeer, arm: PeerArm, model: Path, prompt: list[int], fed: list[int], *, ram: int, n_ctx: int,
              threads: int = 2, threshold: float = 0.01, timeout: float = PEER_TIMEOUT_S) -> dict:
    """One arm-round: a fresh worker process, started as bench.ab_llama starts the mbolt arms: the
    device idle, the file dropped and proven cold (mincore), the process inside a memory cgroup of
    `ram` bytes (0: none). Once loaded it unmaps the expert tensors' pages, the page cache's copies
    are dropped and their resident share recorded (above the threshold: the round is rejected, as a
    round not proven cold is), and it decodes. A warm arm reads the file into memory first and
    drops nothing. The round's record, with the worker's figures."""
    from mbolt.bench.env import wait_quiet
    from mbolt.core.memlimit import MemoryGroup
    from mbolt.core.moe_map import moe_map
    from mbolt.core.pagecache import evict_model, expert_spans

    if arm.warm and ram:
        raise MboltError(f"arm {arm.name}: a warm arm runs without a limit (the file in memory): give ram=0")
    model = Path(model).resolve()
    quiet = wait_quiet(model)
    at_eval: dict = {}
    job = {"model": str(model), "prompt": [int(t) for t in prompt], "fed": [int(t) for t in fed], "n_ctx": n_ctx,
           "n_ubatch": arm.n_ubatch, "threads": threads, "drop": None}
    if arm.warm:
        read_into_cache(model)
        ev, at_mark = None, None
    else:
        mm = moe_map(model)
        job["drop"] = {str(Path(p).resolve()): expert_spans(mm, i) for i, p in enumerate(mm.paths)}
        ev = evict_model(mm, threshold)

        def at_mark():
            at_eval["experts_resident_loaded"], at_eval["experts_resident_at_eval"] = drop_experts(mm)

    workdir = tempfile.mkdtemp(prefix="mbolt-ik-")  # the job, and whatever ik writes where it runs
    (Path(workdir) / "job.json").write_text(json.dumps(job))
    argv = [str(peer.python), str(WORKER), str(Path(workdir) / "job.json")]
    popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 errors="replace", cwd=workdir)
    peak = kills = None
    try:
        if ram:
            with MemoryGroup(ram) as group:
                proc = group.popen(argv, **popen)
                out = _run_to_end(proc, at_mark, timeout)
                peak, kills = group.peak(), group.oom_kills()
        else:
            proc = subprocess.Popen(argv, **popen)
            out = _run_to_end(proc, at_mark, timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    last = next((line for line in reversed(out.strip().splitlines()) if line.strip()), "no output").strip()
    if proc.returncode != 0:
        if kills:
            raise MboltError(f"arm {arm.name}: the kernel OOM-killed ik_llama.cpp inside a {ram} B memory cgroup "
                             f"(peak {peak} B): the budget is below what it needs")
        why = f"killed (no result after {timeout:.0f} s?)" if proc.returncode == -9 else f"exit {proc.returncode}"
        raise MboltError(f"arm {arm.name}: ik_llama.cpp's worker failed ({why}): {last}")
    res = next((json.loads(line[len(RESULT):]) for line in out.splitlines() if line.startswith(RESULT)), None)
    if res is None:
        raise MboltError(f"arm {arm.name}: ik_llama.cpp's worker printed no result: {last}")
    rejected = bool(ev is not None and (not ev.proven or at_eval.get("experts_resident_at_eval", 0.0) > threshold))
    return {"arm": arm.name, "control_of": arm.control_of, "warm": arm.warm, "n_ubatch": res["n_ubatch"],
            "n_ctx": n_ctx, "budget_bytes": ram, "resident_before": ev.resident_before if ev else None,
            "resident_after": ev.resident_after if ev else None, "proven_cold": ev.proven if ev else False,
            **at_eval, "unmapped_bytes": res["unmapped_bytes"], "rejected": rejected,
            "inflight_at_start": quiet.get("inflight_at_start"), "quiet_waited_s": quiet["waited_s"],
            "peak_bytes_with_load": peak, "oom_kills": kills, "load_s": res["load_s"],
            "prompt_tokens": res["prompt_tokens"], "ttft_s": res["prompt_s"], "tokens": res["decode_tokens"],
            "decode_s": res["decode_s"],
            "decode_tokens_per_s": res["decode_tokens"] / res["decode_s"] if res["decode_tokens"] else None,
            "ppl": res["ppl"], "flash_attn": True, "generated": res["generated"], "ik_timings": res["ik_timings"]}


def run_peers(peer: IkPeer, arms: list[PeerArm], model: Path, prompt: list[int], fed: list[int], *, rounds: int,
              ram: int, n_ctx: int, threads: int = 2, seed: int = 0, progress=None) -> dict:
    """Every arm once per round, in the balanced orders of bench.design.arm_orders (as run_ab
    orders the mbolt arms); per arm the median decode tok/s and time to first token over its
    rounds that were cold."""
    import numpy as np

    from mbolt.bench.design import run_rounds

    rows, orders = run_rounds(arms, rounds, seed, progress=progress, one_round=lambda a: run_round(
        peer, a, model, prompt, fed, ram=0 if a.warm else ram, n_ctx=n_ctx, threads=threads))
    summary = []
    for a in arms:
        cold = [r for r in rows if r["arm"] == a.name and not r["rejected"]]
        xs = [r["decode_tokens_per_s"] for r in cold]
        summary.append({"arm": a.name, "warm": a.warm, "control_of": a.control_of,
                        "decode_tokens_per_s": float(np.median(xs)) if xs else None, "decode_tokens_per_s_rounds": xs,
                        "ttft_s": float(np.median([r["ttft_s"] for r in cold])) if cold else None})
    measured = [s for s in summary if s["decode_tokens_per_s"] is not None and not s["control_of"] and not s["warm"]]
    best = max(measured, key=lambda s: s["decode_tokens_per_s"], default=None)
    return {**peer.record(), "fed": FED.format(prompt=len(prompt), new=len(fed), n_ctx=n_ctx),
            "threads": threads, "budget_bytes": ram, "orders": orders,
            "rounds": rows, "summary": summary, "best_arm": best and best["arm"],
            "best_decode_tokens_per_s": best and best["decode_tokens_per_s"],
            "aa": aa_of(summary)}


def aa_of(summary: list[dict], key: str = "decode_tokens_per_s") -> dict:
    """Each A/A control's median (`key`) over its arm's (1.0: the same configuration measured the same)."""
    by = {s["arm"]: s[key] for s in summary}
    return {s["arm"]: (s[key] / by[s["control_of"]] if s[key] and by.get(s["control_of"]) else None)
            for s in summary if s["control_of"]}


# ---- beside the mbolt arms (scripts/bench_memlimit.py, scripts/bench_deep.py) ----

def arm_ids(model: Path, prompt_tokens: int, new_tokens: int, followup: int = 0) -> list[int]:
    """The token ids the mbolt arms are fed (bench.ab.load_prompt_ids without a prompt file, by
    llama.cpp's tokenizer): the peer is fed the same ids."""
    from mbolt.bench.ab import load_prompt_ids

    return load_prompt_ids(str(model), None, 1, engine="llama.cpp", forced=prompt_tokens, n_new=new_tokens,
                           followup=followup)[0]


def peer_decode(peer: IkPeer, model: Path, ids: list[int], *, prompt_tokens: int, new_tokens: int, rounds: int,
                ram: int, n_ctx: int = 4096, seed: int = 0, warm: bool = False, progress=None) -> dict:
    """ik's arms on the mbolt arms' ids: a prompt of `prompt_tokens`, then `new_tokens` fed one per
    decode; under the limit ik mapped (with its A/A), warm: ik with the file in memory."""
    if len(ids) < prompt_tokens + new_tokens or prompt_tokens < 1 or new_tokens < 1:
        raise MboltError(f"peers: {len(ids)} token ids; the peer's arms need a prompt of {prompt_tokens} (at least 1) "
                         f"and {new_tokens} fed (at least 1)")
    if prompt_tokens + new_tokens > n_ctx:
        raise MboltError(f"peers: a prompt of {prompt_tokens} and {new_tokens} fed tokens do not fit n_ctx {n_ctx}")
    arms = [IK_WARM] if warm else ik_arms()
    return run_peers(peer, arms, model, ids[:prompt_tokens], ids[prompt_tokens:prompt_tokens + new_tokens],
                     rounds=rounds, ram=0 if warm else ram, n_ctx=n_ctx, seed=seed, progress=progress)


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
                    "rounds): ratios across engines are of medians; the peer is fed the same token ids, and its "
                    "greedy predictions are recorded per round (`generated`), not required to match llama.cpp's "
                    "(other kernels round otherwise)"}
