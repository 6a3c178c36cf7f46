"""The environment a measurement ran in: kernel, filesystem, device, memory, load, git revision,
and the build of each engine a benchmark runs (llama.cpp's and the ik_llama.cpp peer's)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def mount_of(path: str) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) of the mount holding `path`, from /proc/mounts."""
    path = os.path.realpath(path)
    best = ("?", "/", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fs)
    except OSError:
        pass
    return best


def _block_info(dev: str) -> dict:
    name = Path(dev).name
    out: dict = {"name": name}
    base = Path("/sys/class/block") / name
    if not base.exists():
        return out
    if (base / "partition").exists():
        base = base.resolve().parent  # the whole disk
        out["disk"] = base.name
    q = base / "queue"
    for key in ("rotational", "logical_block_size", "max_sectors_kb", "nr_requests", "scheduler", "read_ahead_kb"):
        try:
            out[key] = (q / key).read_text().strip()
        except OSError:
            pass
    for key in ("device/model", "device/vendor"):
        try:
            out[key.split("/")[1]] = (base / key).read_text().strip()
        except OSError:
            pass
    return out


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemFree", "MemAvailable", "Cached"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def git_revision(root: str | os.PathLike | None = None) -> str:
    root = root or Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        rev = r.stdout.strip() if r.returncode == 0 else "no commit yet"
        # results/ and prereg locks are what a benchmark writes: they do not make the code it ran dirty
        d = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", ".", ":(exclude)results",
                            ":(exclude)prereg/*.lock"], capture_output=True, text=True, timeout=5)
        if d.returncode == 0 and d.stdout.strip():
            rev += " (dirty)"
        return rev
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def engine_builds() -> dict:
    """What each engine was built for, as its library says (`llama_print_system_info()`): llama.cpp
    through llama-cpp-python, and the ik_llama.cpp peer through its package in its own environment
    (bench.peers). None where an engine is not installed here."""
    from mbolt.core.errors import MboltError

    out: dict = {"llama.cpp": None, "ik_llama.cpp": None}
    try:
        import llama_cpp

        out["llama.cpp"] = {"package": f"llama-cpp-python=={llama_cpp.__version__}",
                            "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    except ImportError:
        pass
    try:
        from mbolt.bench.peers import find_ik

        peer = find_ik()
        out["ik_llama.cpp"] = peer and peer.record()
    except MboltError as e:  # an environment there without the package: say so, the run is not the peer's
        out["ik_llama.cpp"] = {"error": str(e)}
    return out


# /proc/cpuinfo flag -> the name llama_print_system_info() gives the instruction set
_ISA = {"avx2": "AVX2", "avx512f": "AVX512", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
        "avx512vbmi": "AVX512_VBMI"}


def check_build(kind: str, system_info: str | None = None, cpu_flags: set[str] | None = None) -> None:
    """Refuse a llama.cpp other than the build a pre-registration names: "native" (every instruction
    set of this CPU that llama.cpp can use, as `pip install` builds it) or "portable"
    (GGML_NATIVE=OFF: AVX2 and no AVX-512 on x86)."""
    from mbolt.core.errors import MboltError

    if kind not in ("native", "portable"):
        raise MboltError(f"build {kind!r}: expected native or portable")
    if system_info is None:
        import llama_cpp

        system_info = llama_cpp.llama_print_system_info().decode()
    if cpu_flags is None:
        with open("/proc/cpuinfo") as f:
            cpu_flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    from mbolt.core.repack import features_on

    on = features_on(system_info)
    have = {name for flag, name in _ISA.items() if flag in cpu_flags}
    if kind == "native" and have - on:
        raise MboltError(f"llama.cpp is built without {', '.join(sorted(have - on))}, which this CPU has: the run "
                         "measures the build users get (`pip install --force-reinstall --no-cache-dir --no-binary "
                         "llama-cpp-python llama-cpp-python==0.3.36` builds it native)")
    if kind == "portable" and on & (set(_ISA.values()) - {"AVX2"}):
        raise MboltError(f"llama.cpp is built with {', '.join(sorted(on & set(_ISA.values()) - {'AVX2'}))}: the "
                         "pre-registration names the portable build (CMAKE_ARGS=-DGGML_NATIVE=OFF)")


def environment(path: str | os.PathLike) -> dict:
    dev, mnt, fs = mount_of(str(path))
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "kernel": platform.release(),
        "system": platform.system(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg": load,
        "filesystem": fs,
        "mount": mnt,
        "device": dev,
        "block": _block_info(dev),
        "memory": _meminfo(),
        "git": git_revision(),
        "page_size": os.sysconf("SC_PAGE_SIZE"),
        "engines": engine_builds(),
    }


def _inflight_file(path: str) -> str | None:
    dev = mount_of(path)[0]
    name = os.path.basename(dev)
    base = f"/sys/class/block/{name}"
    if not os.path.exists(base):
        return None
    if os.path.exists(f"{base}/partition"):
        base = os.path.dirname(os.path.realpath(base))
    f = f"{base}/inflight"
    return f if os.path.exists(f) else None


def wait_quiet(path: str | os.PathLike, timeout: float = 2.0, poll: float = 0.005) -> dict:
    """Wait until the block device holding `path` has no I/O in flight (e.g. the readahead a
    previous arm left behind), at most `timeout` seconds. Returns what it saw."""
    import time

    f = _inflight_file(str(path))
    t0 = time.perf_counter()
    first = None
    while f is not None:
        try:
            r, w = (int(x) for x in open(f).read().split())
        except (OSError, ValueError):
            break
        if first is None:
            first = r + w
        if r + w == 0 or time.perf_counter() - t0 >= timeout:
            return {"inflight_at_start": first, "inflight_at_end": r + w, "waited_s": time.perf_counter() - t0}
        time.sleep(poll)
    return {"inflight_at_start": first, "inflight_at_end": None, "waited_s": time.perf_counter() - t0}
