"""An A/B's arms and what one arm-round reports: `Arm` (a file plus reader options, parsed from
`FILE:key=value,...`), `ArmJob` (what an arm does in one round), `RoundResult`, and the check
that every arm is the same model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap, moe_map
from mbolt.core.trace import Trace

@dataclass
class Arm:
    name: str
    path: str
    gap: int = 0
    io_threads: int = 1
    direct: bool = False
    mode: str = "read"  # read | os
    cache_slots: int = 0
    control_of: str = ""  # the A/A copy names the arm it repeats
    resident_frac: float | None = None  # slot-cache budget as a share of each layer's experts
    warm: bool = False  # --engine llama.cpp: keep every page resident (no eviction)
    callback: bool = False  # --engine llama.cpp, os arm: install the eval callback anyway
    asynchronous: bool = False  # --engine llama.cpp: submit the reads (WILLNEED), let the page faults wait
    pins: bool = False  # --engine llama.cpp: pin each layer's hottest experts (the route map's training heat)
    n_ubatch: int = 0  # --engine llama.cpp: tokens per prompt pass (0: the run's --ubatch-size)
    user: bool = False  # --ram: run as an ordinary user would (no CAP_IPC_LOCK, RLIMIT_MEMLOCK 8 MiB)
    py_misses: bool = False  # --engine llama.cpp: decode layers with misses handled in Python (not in C)
    drops_now: bool = False  # --engine llama.cpp: decode layers' victims dropped at once, not behind the layer
    keep_compute: bool = False  # --ram: llama.cpp's compute buffer stays resident after a prompt (and budgeted)
    parallel: int = 1  # --engine llama.cpp: prompts decoded this many at a time, one token of each per step
    page_cache_passes: bool = False  # --ram: prompt passes read through the page cache (not laid over with O_DIRECT)
    file_order: bool = False  # --engine llama.cpp: decode misses read in the file's tensor order, not llama.cpp's
    repacked: bool = False  # --engine llama.cpp, os arm: llama.cpp's default load (weights repacked into its buffers)
    inline: bool = False  # a kernel-layout file: a layer's up and down rows read before its matmuls, not behind them
    buffered: bool = False  # a kernel-layout file: reads through the page cache (WILLNEED, copy, drop), not O_DIRECT
    rows: bool = False  # a kernel-layout file: misses read into llama.cpp's buffers (O_DIRECT), not pages of its map

    def options(self) -> dict:
        return dict(gap=self.gap, io_threads=self.io_threads, direct=self.direct, mode=self.mode,
                    cache_slots=self.cache_slots, resident_frac=self.resident_frac)


ARM_KEYS = {"gap": int, "qd": int, "io_threads": int, "direct": bool, "os": bool, "mode": str,
            "cache": int, "cache_slots": int, "frac": float, "resident_frac": float, "name": str, "warm": bool,
            "callback": bool, "async": bool, "pins": bool, "ubatch": int, "user": bool,
            "pymisses": bool, "dropsnow": bool, "keepcompute": bool, "parallel": int, "passcache": bool,
            "fileorder": bool, "repacked": bool, "inline": bool, "buffered": bool,
            "rows": bool}


def parse_arm(spec: str, index: int, defaults: dict | None = None) -> Arm:
    """`path[:key=value,...]`, keys: name, gap, qd|io_threads, direct, os, cache|cache_slots,
    frac|resident_frac, and for --engine llama.cpp warm, callback, async, pins, ubatch, user, pymisses,
    dropsnow, keepcompute, parallel, passcache, fileorder, repacked, inline, buffered, rows."""
    path, _, opts = spec.partition(":")
    kw: dict = dict(defaults or {})
    for item in filter(None, (x.strip() for x in opts.split(","))):
        k, eq, v = item.partition("=")
        if k not in ARM_KEYS:
            raise MboltError(f"arm {spec!r}: unknown option {k!r} (name, gap, qd, direct, os, cache, frac, warm, callback, "
                             "async, pins, ubatch, user, pymisses, dropsnow, keepcompute, parallel, passcache, fileorder, "
                             "repacked, inline, buffered, rows)")
        typ = ARM_KEYS[k]
        try:
            val = (v.lower() not in ("0", "false", "no") if eq else True) if typ is bool else typ(v)
        except ValueError:
            raise MboltError(f"arm {spec!r}: {k} needs a {typ.__name__}, got {v!r}") from None
        k = {"qd": "io_threads", "cache": "cache_slots", "frac": "resident_frac", "async": "asynchronous",
             "ubatch": "n_ubatch", "pymisses": "py_misses", "dropsnow": "drops_now",
             "keepcompute": "keep_compute", "passcache": "page_cache_passes", "fileorder": "file_order"}.get(k, k)
        if k == "os":
            k, val = "mode", "os" if val else "read"
        kw[k] = val
    name = kw.pop("name", None) or Path(path).stem
    return Arm(name=name, path=path, **kw)


def default_arm_name(arm: Arm) -> str:
    bits = [Path(arm.path).stem]
    if arm.mode == "os":
        bits.append("os")
    else:
        bits.append(f"qd{arm.io_threads}")
        bits.append("direct" if arm.direct else "buffered")
        if arm.gap:
            bits.append(f"gap{arm.gap}")
    if arm.cache_slots:
        bits.append(f"cache{arm.cache_slots}")
    return "/".join(bits)


def read_pattern(mm: MoeMap, arm: Arm, layout: str) -> dict:
    """The named read pattern of an arm: what a gain measured against it transfers to."""
    layer = mm.moe_layers[0]
    ws = layer.weights
    per_expert = 1 if layout == "packed" else len(ws)
    desc = (f"{layout} layout, {per_expert} range{'s' if per_expert > 1 else ''} per expert "
            f"({'+'.join(w.role for w in ws)}), slices {'/'.join(str(w.slice_bytes) for w in ws)} B, ")
    if arm.mode == "os":
        desc += "mmap page faults (kernel readahead decides)"
    else:
        desc += ("explicit reads submitted with posix_fadvise(WILLNEED), not waited for (page faults wait), "
                 if arm.asynchronous else
                 f"explicit preadv, QD{arm.io_threads}, {'O_DIRECT' if arm.direct else 'buffered (no readahead)'}, ")
        desc += f"merge gap {arm.gap} B"
    if arm.warm:
        desc += ", warm (every page resident)" + (", eval callback installed" if arm.callback else "")
    if arm.pins:
        desc += ", hottest experts pinned (route map heat)"
    if arm.cache_slots or arm.resident_frac:
        desc += (f", {arm.cache_slots} cache slots/layer" if arm.resident_frac is None
                 else f", slot cache {100 * arm.resident_frac:.0f}% of each layer's experts")
    return {"description": desc, "layout": layout, "ranges_per_expert": per_expert,
            "slice_bytes": [w.slice_bytes for w in ws], "queue_depth": arm.io_threads,
            "direct": arm.direct, "mode": arm.mode, "gap": arm.gap, "cache_slots": arm.cache_slots}


@dataclass
class RoundResult:
    arm: str
    round: int
    position: int  # order within the round
    resident_before: float
    resident_after: float
    cold_proven: bool
    rejected: bool
    tokens: int
    wall_s: float
    io_s: float
    ttft_s: float
    reads: int
    bytes: int
    useful_bytes: int
    device_bytes: int | None
    hits: int
    misses: int
    major_faults: int  # os arms: the faults the store caused; decode: every major fault of the timed part
    note: str = ""
    ops: int = 0
    inflight_before: int | None = None  # device I/O in flight when the arm was about to start
    settle_s: float = 0.0  # time waited for it to drain
    prev_arm: str | None = None  # the arm that ran just before (carry-over), None for the first run
    drop_s: float = 0.0  # time the store spent dropping the pages it read (outside io_s, inside wall_s)
    generated: list | None = None  # --engine llama.cpp: greedy tokens per prompt (must agree across arms)
    peak_bytes: int | None = None  # --ram: the memory cgroup's peak charge (page cache included)
    followup_ttft_s: float | None = None  # a session's follow-up turn: time to its first token (mean over prompts)
    prompt_tokens: int = 0
    prompt_passes: int = 0  # passes over the experts of the prompts and follow-ups (mbolt's runtime)
    prompt_bytes: int = 0  # what the runtime's pass reader read
    prompt_read_s: float = 0.0  # time with a pass read outstanding
    prompt_device_bytes: int | None = None  # /proc/self/io read_bytes during the prompts and follow-ups
    n_ctx: int = 0
    n_ubatch: int = 0
    followup_bytes: int = 0  # read by the runtime's pass reader during the follow-up turn
    peak_load_bytes: int | None = None  # --ram: the group's peak through the load (then reset: peak_bytes is after it)
    reclaimed: int = 0  # cached experts the kernel reclaimed (read again)
    tokens_sha256: str = ""  # of the generated tokens (the same in every arm of its kernels, or the run is refused)
    kernels: str = "mapped"  # llama.cpp's kernels for the repackable weights: mapped (the file's pages) or repacked
    dense_copied_bytes: int = 0  # dense weights held as anonymous copies (mlock refused: an ordinary user)
    decode_slots: int = 0  # --ram, mbolt's runtime: expert slots per layer at the end (after any given back)
    drive_served_bytes: int | None = None  # --drive: what the device served the arm's group (the kernel's count)
    drive_served_reads: int | None = None
    # --drive: what the device served during decode after its first step (a prompt's reads left out)
    drive_decode_bytes: int | None = None
    drive_decode_reads: int | None = None
    drive_decode_tokens: int | None = None


def check_same_model(arms: list[Arm]) -> dict[str, tuple[MoeMap, str]]:
    """Every arm must be the same model: source fingerprints through the route map agree."""

    out = {}
    ref = None
    for a in arms:
        if not Path(a.path).exists():
            raise MboltError(f"{a.path}: no such file")
        mm = moe_map(a.path, kernel_ok=True)  # an arm may stream a kernel-layout file
        rm = mm.route_map
        fp = rm.source_fingerprint
        if ref is None:
            ref = (a, fp, mm)
        elif fp != ref[1]:
            raise MboltError(f"{a.path} is not the same model as {ref[0].path} (source fingerprint {fp[:12]} vs "
                             f"{ref[1][:12]}): refusing to compare them")
        elif (mm.n_layers, mm.n_experts) != (ref[2].n_layers, ref[2].n_experts):
            raise MboltError(f"{a.path}: shape differs from {ref[0].path}")
        out[a.path] = (mm, rm.layout)
    return out


@dataclass
class ArmJob:
    """What one arm does in one round (the same for every arm of the round)."""
    rnd: int
    position: int
    threshold: float
    trace: Trace | None = None  # replay: this round's tokens
    prompts: list | None = None  # decode
    n_new: int = 0
    prev_arm: str | None = None
    ram: int = 0  # --engine llama.cpp: run the arm as a process inside a memory cgroup of this many bytes
    forced: int = 0  # teacher forcing: prefill this many tokens of each prompt, then feed its next tokens
    followup: int = 0  # teacher-forced sessions: then this many tokens as one more turn on the same context
    n_ctx: int | None = None  # llama.cpp's context size (None: the default)
    n_ubatch: int = 0  # tokens per prompt pass, for arms that do not set their own (0: the driver's default)
    drive: str = ""  # --ram: a drive profile (core.blkio.PROFILES) set on the arm's reads once its model has loaded
