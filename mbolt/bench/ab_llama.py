"""`mbolt ab --decode --engine llama.cpp`: one arm-round in llama.cpp (runtime.driver).

The protocol is run_ab's (rounds, arm order, A/A, pre-registration); this module only runs one
arm once and summarises what llama.cpp adds:
- an arm with reads (default) streams its experts with explicit reads from the eval callback;
  `os` leaves the reading to llama.cpp's page faults (no callback unless `callback`);
- cold: after the model is loaded, the expert tensors' pages are dropped from llama.cpp's mapping
  and the page cache, and mincore must show the expert spans' resident share <= the threshold
  (dense weights stay resident); the experts are dropped again after every decode step;
- `warm` keeps everything resident (the callback-overhead control: `os,warm` is plain llama.cpp,
  `os,warm,callback` the callback without reads); such a round is not cold, and says so.
Per round: decode time and tokens (wall_s/tokens), time to first token, reads, bytes, device
bytes, read time (io_s) of the decode steps, and the greedy tokens generated.

Under a real memory limit (`job.ram` bytes, `mbolt ab --ram`): every arm-round is a fresh process
(`python -m mbolt.bench.ab_llama`) inside a memory cgroup of that size (core.memlimit), started
after the model's pages were dropped from the page cache. An `os` arm there is plain llama.cpp
(mapped, no repacking, no callback, default KV cache, nothing dropped by us); an arm with reads
is mbolt's runtime with that budget (runtime.driver). The group's peak and its OOM kills are
recorded; an arm the kernel killed is one error naming the arm and the budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mbolt.bench.arms import Arm, ArmJob, RoundResult
from mbolt.runtime.driver import open_driver, check_llama_streamable
from mbolt.runtime.kernel_stream import is_kernel_path
from mbolt.bench.env import wait_quiet
from mbolt.core.errors import MboltError
from mbolt.core.memlimit import reset_own_peak
from mbolt.core.moe_map import MoeMap


def check_llama_arms(arms: list[Arm], info: dict, mode: str, ram: int = 0, drive: str = "") -> None:
    if mode != "decode":
        raise MboltError("--engine llama.cpp measures generation: use --decode (replay reads without an engine)")
    for a in arms:
        check_llama_streamable(info[a.path][0], a.path)
        if a.direct:
            raise MboltError(f"arm {a.name}: O_DIRECT bypasses the page cache, where llama.cpp's mmap finds the "
                             "experts: use buffered reads with --engine llama.cpp")
        if a.mode == "os" and a.cache_slots:
            raise MboltError(f"arm {a.name}: an os arm reads through page faults and has no slot cache (drop cache=)")
        if a.warm and a.cache_slots:
            raise MboltError(f"arm {a.name}: a warm arm keeps everything resident: cache= means nothing there")
        if a.repacked and (a.mode != "os" or not a.warm):
            raise MboltError(f"arm {a.name}: repacked is llama.cpp's default load, which copies the experts into its "
                             "own memory: an os arm, warm (a model larger than RAM cannot load that way)")
        if (a.inline or a.buffered or a.rows) and not (a.mode != "os" and Path(a.path).exists() and is_kernel_path(a.path)):
            raise MboltError(f"arm {a.name}: rows, inline and buffered are ways to read a kernel-layout file (mbolt repack)")
        if a.asynchronous and a.mode == "os":
            raise MboltError(f"arm {a.name}: async is a way to issue explicit reads; an os arm issues none")
        if a.resident_frac is not None:
            raise MboltError(f"arm {a.name}: give the llama.cpp slot budget as cache=N, not frac")
        if a.user and not ram:
            raise MboltError(f"arm {a.name}: user runs the arm as a process of its own: it needs --ram")
        if a.user and drive:
            raise MboltError(f"arm {a.name}: a drive profile is set by the worker in its block-I/O cgroup, which "
                             f"uid {ORDINARY_UID} cannot write: no user arm under --drive")
    users = sorted({a.path for a in arms if a.user})
    if users:
        check_ordinary_user(users)
    if drive and not ram:
        raise MboltError("--drive throttles each arm's own process: it needs --ram")
    if drive:
        from mbolt.core.blkio import profile

        profile(drive)  # an unknown name is one line, before anything runs


def _slots(arm: Arm) -> int:
    return arm.cache_slots if arm.mode != "os" else 0


# an ordinary user is an ordinary user: a non-root uid (no capability at all, so mlock obeys
# RLIMIT_MEMLOCK), at the 8 MiB default a distribution gives it; the model must be readable by it.
# The worker starts as root and gives root up itself once its libraries are loaded
# (`become_ordinary_user`): `runuser -u nobody python` cannot start an interpreter installed where
# nobody may not look (/root/.pyenv, mode 700), which is where this machine and CI keep it.
ORDINARY_UID = "nobody"
ORDINARY_MEMLOCK = 8 << 20


def check_ordinary_user(paths: list[str]) -> None:
    """Before a user arm runs: uid nobody can read each model file and see its page-cache
    residency, which the kernel shows only to the file's owner or to whom may write it (mincore
    reports every page resident to anyone else, cachestat refuses: the arm's cold proof and the
    runtime's check for reclaimed experts would both be blind). A user's own downloaded model is
    theirs. One line saying which file fails and why."""
    for p in paths:
        for test, why in ((["head", "-c", "1", p], "cannot read"),
                          (["sh", "-c", 'test -O "$1" || test -w "$1"', "sh", p],
                           "neither owns nor may write (the kernel hides its page-cache residency from it: "
                           "mincore says every page is resident), so the arm's cold start cannot be proven; "
                           f"give it the file: chown {ORDINARY_UID}")):
            try:
                r = subprocess.run(["runuser", "-u", ORDINARY_UID, "--", *test], capture_output=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as e:
                raise MboltError(f"user arm: cannot run as uid {ORDINARY_UID} ({e}): runuser needs root") from None
            if r.returncode != 0:
                last = (r.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
                raise MboltError(f"user arm: uid {ORDINARY_UID} {why} {p}" + (f": {last}" if last else ""))


def become_ordinary_user(home: str | None = None) -> str:
    """In the worker, before the model is opened: every module the round needs loaded as root (uid
    nobody cannot read site-packages under /root), then RLIMIT_MEMLOCK lowered to 8 MiB as a
    login would, root given up for uid nobody (setgroups, setgid, setuid: no capability is left,
    so mlock obeys the limit), /proc/self readable again (as after an exec), and a home of its own
    (`home`, else a new temporary directory) in which the C filter is compiled afresh. Returns it."""
    import ctypes
    import importlib
    import pkgutil
    import pwd
    import resource
    import tempfile

    import llama_cpp  # noqa: F401  (loaded as root, with its shared libraries)
    import numpy.ctypeslib  # noqa: F401
    import mbolt.core
    import mbolt.runtime
    from mbolt.runtime import binding, native

    for pkg in (mbolt.core, mbolt.runtime):  # the modules a round imports on its way, all of them now
        for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(m.name)
    binding.ggml_library()

    user = pwd.getpwnam(ORDINARY_UID)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (ORDINARY_MEMLOCK, ORDINARY_MEMLOCK))
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
    home = home or tempfile.mkdtemp(prefix="mbolt-user-")
    os.environ.update(HOME=home, XDG_CACHE_HOME=home)
    native._LIB = False  # built by nobody, into nobody's cache
    return home


WORKER_TIMEOUT_S = 3600  # one arm-round in a group; past it the process is killed (never a hang)


def run_llama_arm(arm: Arm, mm: MoeMap, job: ArmJob) -> RoundResult:
    """One arm, one round, in llama.cpp (see the module docstring): run_ab's runner for
    --engine llama.cpp, with the signature of bench.ab.ARM_RUNNERS."""
    if job.ram:
        return run_in_group(arm, mm, job)
    return llama_round(arm, mm, job)


def run_in_group(arm: Arm, mm: MoeMap, job: ArmJob) -> RoundResult:
    """The arm-round as a fresh process inside a memory cgroup of job.ram bytes."""
    from mbolt.core.pagecache import evict_model
    from mbolt.core.memlimit import MemoryGroup

    if not arm.warm:  # a warm arm finds the file in memory, as the caller left it
        evict_model(mm, job.threshold)  # uncharged and cold: the group fills its own page cache
    payload = json.dumps({"arm": asdict(arm), "job": {**asdict(job), "trace": None}})
    argv = [sys.executable, "-m", "mbolt.bench.ab_llama"]
    with MemoryGroup(job.ram) as group, _io_group(arm, job) as io:
        if arm.user:
            _let_reset_peak(group)
        proc = group.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           **({"also": io.path} if io is not None else {}))
        try:
            out, err = proc.communicate(payload, timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise MboltError(f"arm {arm.name}: no result after {WORKER_TIMEOUT_S} s inside a {job.ram} B memory "
                             "cgroup (killed)") from None
        peak, kills = group.peak(), group.oom_kills()
        served = io.served() if io is not None else None
    if proc.returncode != 0:
        if kills:
            raise MboltError(f"arm {arm.name}: the kernel OOM-killed it inside a {job.ram} B memory cgroup "
                             f"(peak {peak} B): the budget is below what this arm needs")
        last = (err.strip().splitlines() or ["no message"])[-1]
        raise MboltError(f"arm {arm.name}: its process failed inside the memory cgroup (exit {proc.returncode}): {last}")
    res = RoundResult(**json.loads(out.strip().splitlines()[-1]))
    res.peak_bytes = peak
    if served is not None:
        res.drive_served_bytes, res.drive_served_reads = served.bytes, served.ios
    return res


def _let_reset_peak(group) -> None:
    """The worker resets its group's peak after the load (reset_own_peak): hand that one file to
    the ordinary user's uid, as a cgroup delegation would."""
    import os
    import pwd

    f = group.path / ("memory.max_usage_in_bytes" if group.kind == "v1" else "memory.peak")
    try:
        os.chown(f, pwd.getpwnam(ORDINARY_UID).pw_uid, -1)
    except (OSError, KeyError):
        pass  # then its peak after load is unknown (None), said in the result, not a failure


def _io_group(arm: Arm, job: ArmJob):
    """A block-I/O cgroup for the arm's process when the run emulates a drive (`job.drive`): the
    worker sets the profile's cap once its model has loaded (core.blkio.own_io_group); the group's
    cap is cleared and the group removed afterwards."""
    import contextlib

    if not job.drive:
        return contextlib.nullcontext()
    from mbolt.core.blkio import IoGroup

    return IoGroup(arm.path)


def worker_main() -> int:
    """`python -m mbolt.bench.ab_llama`: one arm-round from the JSON on stdin, its RoundResult on
    stdout (what run_in_group starts inside the cgroup)."""
    from mbolt.core.moe_map import moe_map

    spec = json.loads(sys.stdin.read())
    arm = Arm(**spec["arm"])
    job = ArmJob(**spec["job"])
    home = become_ordinary_user() if arm.user else None
    try:
        res = llama_round(arm, moe_map(arm.path, kernel_ok=True), job)
    except MboltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(asdict(res)))
    return 0


def llama_round(arm: Arm, mm: MoeMap, job: ArmJob) -> RoundResult:
    """One arm-round in this process. Under a limit (job.ram) an os arm is plain llama.cpp and an
    arm with reads gets the budget; otherwise the emulation (drop after every step)."""
    threshold, rnd, position, prompts, n_new = job.threshold, job.rnd, job.position, job.prompts, job.n_new
    reads = arm.mode != "os"
    stream = open_driver(arm.path, reads=reads, gap=arm.gap, qd=arm.io_threads, cache_slots=_slots(arm),
                         evict=not arm.warm and not (job.ram and not reads), callback=arm.callback, mm=mm,
                         budget=job.ram if (job.ram and reads) else None, asynchronous=arm.asynchronous,
                         pins=arm.pins, n_ctx=job.n_ctx, n_ubatch=arm.n_ubatch or job.n_ubatch,
                         native_misses=not arm.py_misses, drop_behind=not arm.drops_now,
                         give_back_compute=not arm.keep_compute, n_seq=arm.parallel,
                         overlay=not arm.page_cache_passes, use_order=not arm.file_order,
                         **({"repacked": True} if arm.repacked else {}), **({"read_behind": False} if arm.inline else {}),
                         **({"buffered": True} if arm.buffered else {}), **({"paged": False} if arm.rows else {}))
    try:
        quiet = wait_quiet(arm.path)  # the previous arm's readahead must not overlap this arm
        before = stream.pages.resident()
        if arm.warm:
            stream.hold_all()
            note = "warm arm: every page resident by design (not a cold measurement)"
            if stream.budget:  # the cache sized from the budget, nothing dropped: the hot path under a budget
                stream.fit_budget()
                note += f"; {stream.cache_slots} expert slots/layer from a {job.ram} B budget"
            after, proven, rejected = before, False, False
        else:
            stream.make_cold()
            after = stream.pages.resident()
            proven = after <= threshold and stream.pages.mapped() <= threshold
            rejected = not proven
            note = "llama.cpp: resident share of the expert tensors' pages (mincore), unmapped from llama.cpp"
            if job.ram:
                note += (f"; inside a {job.ram} B memory cgroup: "
                         + (f"{stream.cache_slots} expert slots/layer ({stream.prefill_slots} during a prompt, "
                            f"{stream.pinned_per_layer} pinned), "
                            f"{stream.locked_bytes} B of dense weights locked, {stream.copied_bytes} B copied"
                            if reads else "plain llama.cpp (nothing dropped, nothing locked)"))
            if arm.user:
                note += (f"; as uid {os.geteuid()} ({ORDINARY_UID}), RLIMIT_MEMLOCK {ORDINARY_MEMLOCK} B, "
                         f"C filter {'built by it' if stream.native_filter else 'absent (Python callback)'}")
        peak_load = reset_own_peak() if job.ram else None  # the load touched the whole group: what follows counts
        io, marks = None, []
        if job.drive:
            from mbolt.core.blkio import own_io_group

            io = own_io_group(arm.path)
            io.set_profile(job.drive)  # throttled after the load, as a drive of that class would read

        def mark_decode(i, tok):
            # the served count once the first decode step is done: the prompt's reads are before it
            if io is not None and not marks:
                marks.append(io.served())

        run = stream.generate(prompts, n_new, forced=job.forced, followup=job.followup, on_token=mark_decode,
                              parallel=arm.parallel)
        decode_served = None
        if marks and not job.followup and len(prompts) == 1:
            end = io.served()
            decode_served = (end.bytes - marks[0].bytes, end.ios - marks[0].ios, run.decode_tokens - 1)
    finally:
        stream.close()
    n = max(len(prompts), 1)
    return RoundResult(arm.name, rnd, position, before, after, proven, rejected, run.decode_tokens, run.decode_s,
                       run.io_s, run.prefill_s / n, run.reads, run.bytes, run.useful_bytes, run.device_bytes,
                       run.hits, run.misses, run.major_faults, note, run.ops, quiet.get("inflight_at_start"),
                       quiet["waited_s"], prev_arm=job.prev_arm, generated=run.generated,
                       followup_ttft_s=run.followup_s / n if job.followup else None, prompt_tokens=run.prompt_tokens,
                       prompt_passes=run.prompt_passes, prompt_bytes=run.prompt_bytes,
                       prompt_read_s=run.prompt_read_s, prompt_device_bytes=run.prompt_device_bytes,
                       n_ctx=stream.n_ctx, n_ubatch=stream.n_ubatch, followup_bytes=run.followup_bytes,
                       peak_load_bytes=peak_load, reclaimed=stream.reclaimed,
                       tokens_sha256=hashlib.sha256(json.dumps(run.generated).encode()).hexdigest(),
                       kernels="mapped" if stream.repacking == "off" else "repacked",
                       dense_copied_bytes=stream.copied_bytes, decode_slots=stream.decode_slots or 0,
                       **(dict(zip(("drive_decode_bytes", "drive_decode_reads", "drive_decode_tokens"), decode_served))
                          if decode_served else {}))


def check_same_tokens(rounds: list[RoundResult]) -> None:
    """Every arm of every round computed by the same kernels generated the same greedy tokens, or the
    result is refused. llama.cpp's repacked kernels sum in another order than its kernels over the
    file's pages, so their logits differ in the last bits, and a near tie can go the other way:
    those are compared within their kind (`tokens_agreement` says how far the kinds agree)."""
    refs: dict[str, RoundResult] = {}
    for r in rounds:
        ref = refs.setdefault(r.kernels, r) if r.generated is not None else None
        if r.generated is None or r.generated == ref.generated:
            continue
        where = next((f"prompt {p}, token {i}" for p, (x, y) in enumerate(zip(ref.generated, r.generated))
                      for i, (u, v) in enumerate(zip(x, y)) if u != v), "token counts")
        raise MboltError(f"arm {r.arm} round {r.round} generated other tokens than arm {ref.arm} round {ref.round} "
                         f"(first difference at {where}): the arms do not compute the same model, refusing the result")


def tokens_agreement(rounds: list[RoundResult]) -> float | None:
    """The share of greedy tokens the repacked kernels' arms and the mapped ones' agree on (None:
    one kind only)."""
    kinds = {}
    for r in rounds:
        if r.generated is not None:
            kinds.setdefault(r.kernels, r.generated)
    if len(kinds) < 2:
        return None
    a, b = (sum(kinds[k], []) for k in sorted(kinds))
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def llama_summary(arms: list[Arm], rounds: list[RoundResult], summary: list[dict]) -> list[dict]:
    """Add what llama.cpp runs report to run_ab's summary rows: decode tok/s, the read share s of
    decode time, and that the tokens agree (checked first: a disagreeing run is refused)."""
    check_same_tokens(rounds)
    by_arm = {a.name: a for a in arms}
    for row in summary:
        rs = [r for r in rounds if r.arm == row["arm"] and not r.rejected and r.tokens]
        if not rs:
            continue
        a = by_arm[row["arm"]]
        row["decode_tokens_per_s"] = float(np.median([r.tokens / r.wall_s for r in rs]))
        row["decode_tokens_per_s_rounds"] = [r.tokens / r.wall_s for r in rs]
        row["ttft_s"] = float(np.median([r.ttft_s for r in rs]))
        if all(r.followup_ttft_s is not None for r in rs):
            row["followup_ttft_s"] = float(np.median([r.followup_ttft_s for r in rs]))
        if all(r.prompt_read_s > 0 for r in rs):
            row["prompt_read_mb_per_s"] = float(np.median([r.prompt_bytes / r.prompt_read_s / 1e6 for r in rs]))
            row["prompt_passes"] = float(np.median([r.prompt_passes for r in rs]))
        peaks = [r.peak_bytes for r in rs if r.peak_bytes is not None]
        if peaks:
            row["peak_after_load_bytes_max"] = int(max(peaks))
        row["reclaimed"] = int(sum(r.reclaimed for r in rs))
        row["read_share_s"] = float(np.median([r.io_s / r.wall_s for r in rs])) if a.mode != "os" else None
        row["device_bytes_per_token"] = (float(np.median([r.device_bytes / r.tokens for r in rs]))
                                         if all(r.device_bytes is not None for r in rs) else None)
        if a.mode == "os":
            row["mb_per_s"] = None  # page faults happen inside the compute: no read time to divide by
        row["tokens_identical"] = True  # within its kernels (check_same_tokens)
        row["kernels"] = rs[0].kernels
        row["tokens_agreement_across_kernels"] = tokens_agreement(rounds)
        row["engine"] = "llama.cpp"
    return summary


if __name__ == "__main__":
    sys.exit(worker_main())
