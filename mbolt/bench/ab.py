"""The controlled A/B harness behind `mbolt ab` (DESIGN.md, measurement protocol).

An arm is a file plus reader options. Each round runs every arm once; the order alternates
(A B C, C B A, ...). Before every arm the file is evicted (posix_fadvise DONTNEED) and coldness is
proven with mincore; a round whose resident share exceeds the threshold is rejected, and a run
where eviction cannot be proven says so (`cold: false`). An A/A control (the first arm again,
as a separate arm) is on by default. Per round, each arm's time is compared with the baseline
(the first arm) in the same round; the ratios get a bootstrap 95% CI.

Modes:
- replay: for every held-out token and MoE layer, read exactly that token's experts through the
  store (no compute). Metric: I/O time per token (wall time of the read batches).
- decode: the reference engine generates from prompts with the store as its expert source.
  Metric: wall time per generated token (compute + I/O); TTFT is recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from mbolt.bench.env import environment
from mbolt.bench.pagecache import evict_model, expert_resident_share, wait_quiet
from mbolt.engine.store import ExpertStore
from mbolt.core.compat import check_compatible
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

    def options(self) -> dict:
        return dict(gap=self.gap, io_threads=self.io_threads, direct=self.direct, mode=self.mode,
                    cache_slots=self.cache_slots, resident_frac=self.resident_frac)


ARM_KEYS = {"gap": int, "qd": int, "io_threads": int, "direct": bool, "os": bool, "mode": str,
            "cache": int, "cache_slots": int, "frac": float, "resident_frac": float, "name": str}


def parse_arm(spec: str, index: int, defaults: dict | None = None) -> Arm:
    """`path[:key=value,...]`, keys: name, gap, qd|io_threads, direct, os, cache|cache_slots,
    frac|resident_frac."""
    path, _, opts = spec.partition(":")
    kw: dict = dict(defaults or {})
    for item in filter(None, (x.strip() for x in opts.split(","))):
        k, eq, v = item.partition("=")
        if k not in ARM_KEYS:
            raise MboltError(f"arm {spec!r}: unknown option {k!r} (name, gap, qd, direct, os, cache, frac)")
        typ = ARM_KEYS[k]
        try:
            val = (v.lower() not in ("0", "false", "no") if eq else True) if typ is bool else typ(v)
        except ValueError:
            raise MboltError(f"arm {spec!r}: {k} needs a {typ.__name__}, got {v!r}") from None
        k = {"qd": "io_threads", "cache": "cache_slots", "frac": "resident_frac"}.get(k, k)
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
        desc += (f"explicit preadv, QD{arm.io_threads}, {'O_DIRECT' if arm.direct else 'buffered (no readahead)'}, "
                 f"merge gap {arm.gap} B")
    if arm.cache_slots or arm.resident_frac:
        desc += (f", {arm.cache_slots} cache slots/layer" if arm.resident_frac is None
                 else f", slot cache {100 * arm.resident_frac:.0f}% of each layer's experts")
    return {"description": desc, "layout": layout, "ranges_per_expert": per_expert,
            "slice_bytes": [w.slice_bytes for w in ws], "queue_depth": arm.io_threads,
            "direct": arm.direct, "mode": arm.mode, "gap": arm.gap, "cache_slots": arm.cache_slots}


def bootstrap_ci(x: np.ndarray, n: int = 4000, seed: int = 0, stat=np.median) -> tuple[float, float]:
    """Percentile bootstrap 95% CI of `stat` over per-round values."""
    x = np.asarray(x, float)
    if x.size == 0:
        return (float("nan"), float("nan"))
    if x.size == 1:
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n, x.size))
    s = stat(x[idx], axis=1)
    return float(np.percentile(s, 2.5)), float(np.percentile(s, 97.5))


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
    major_faults: int
    note: str = ""
    ops: int = 0
    inflight_before: int | None = None  # device I/O in flight when the arm was about to start
    settle_s: float = 0.0  # time waited for it to drain


@dataclass
class AbResult:
    name: str
    mode: str
    arms: list[dict]
    rounds: list[RoundResult]
    summary: list[dict]
    flags: list[str]
    cold: bool
    environment: dict
    trace: dict
    metric: str
    baseline: str
    prereg: dict | None = None
    prediction: list[dict] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rounds"] = [asdict(r) for r in self.rounds]
        if self.arms:
            d["baseline_read_pattern"] = self.arms[0]["read_pattern"]["description"]
        return d


# ---- checks ----


def check_same_model(arms: list[Arm]) -> dict[str, tuple[MoeMap, str]]:
    """Every arm must be the same model: source fingerprints through the route map agree."""

    out = {}
    ref = None
    for a in arms:
        if not Path(a.path).exists():
            raise MboltError(f"{a.path}: no such file")
        mm = moe_map(a.path)
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


# ---- one arm, one round ----


def _replay_arm(store: ExpertStore, trace: Trace, layers: np.ndarray) -> tuple[float, float]:
    ex = trace.experts
    t0 = time.perf_counter()
    ttft = 0.0
    for t in range(ex.shape[0]):
        row = ex[t]
        for l in layers:
            ids = row[l]
            store.read(int(l), ids[ids >= 0])
        if t == 0:
            ttft = time.perf_counter() - t0
    return time.perf_counter() - t0, ttft


def _decode_arm(model, prompts: list[list[int]], n_new: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft = None
    n = 0
    for ids in prompts:
        cache = model.new_cache()
        logits = model.forward(list(ids), cache)
        if ttft is None:
            ttft = time.perf_counter() - t0
        for _ in range(n_new):
            tok = int(np.argmax(logits[-1] if np.ndim(logits) > 1 else logits))
            logits = model.forward([tok], cache)
            n += 1
    return time.perf_counter() - t0, ttft or 0.0, n


def run_arm(arm: Arm, mm: MoeMap, trace: Trace | None, *, threshold: float, rnd: int, position: int,
            mode: str = "replay", prompts=None, n_new: int = 0) -> RoundResult:
    store = ExpertStore(arm.path, mm=mm, **arm.options())
    try:
        model = None
        if mode == "decode":
            from mbolt.engine import load_model

            model = load_model(arm.path, expert_source=store)
        quiet = wait_quiet(arm.path)  # the previous arm's readahead must not overlap this arm
        ev = evict_model(mm, threshold)  # every shard of a split set
        if mode == "decode" and ev.resident_after == ev.resident_after:
            # the engine maps the file: its dense weights stay resident; the experts must not
            ev.resident_after = expert_resident_share(mm)
            ev.proven = ev.resident_after <= threshold
            ev.note = ev.note or "decode: resident share measured over the expert tensors"
        store.reset_counters()
        if mode == "replay":
            layers = np.array([l.index for l in mm.moe_layers])
            wall, ttft = _replay_arm(store, trace, layers)
            tokens = trace.n_tokens
        else:
            wall, ttft, tokens = _decode_arm(model, prompts, n_new)
        c = store.snapshot()
    finally:
        store.close()
    rejected = bool(ev.resident_after == ev.resident_after and ev.resident_after > threshold)
    return RoundResult(arm.name, rnd, position, ev.resident_before, ev.resident_after, ev.proven, rejected,
                       tokens, wall, c.io_time, ttft, c.reads, c.bytes, c.useful_bytes, c.device_bytes, c.hits,
                       c.misses, c.major_faults, ev.note, c.ops, quiet.get("inflight_at_start"), quiet["waited_s"])


# ---- the harness ----


def summarise(arms: list[Arm], rounds: list[RoundResult], metric: str, seed: int = 0) -> list[dict]:
    base = arms[0].name
    ok = [r for r in rounds if not r.rejected]
    by = {(r.arm, r.round): r for r in ok}
    n_rounds = max((r.round for r in rounds), default=-1) + 1
    out = []
    for a in arms:
        rs = [r for r in ok if r.arm == a.name]
        if not rs:
            out.append({"arm": a.name, "rounds": 0})
            continue
        tok = np.array([r.tokens for r in rs], float)
        val = np.array([getattr(r, metric) for r in rs]) / tok
        ratios = []
        for k in range(n_rounds):
            b, x = by.get((base, k)), by.get((a.name, k))
            if b and x and getattr(x, metric) > 0:
                ratios.append((getattr(b, metric) / b.tokens) / (getattr(x, metric) / x.tokens))
        ratios = np.array(ratios)
        io = np.array([r.io_s for r in rs])
        by_ = np.array([r.bytes for r in rs], float)
        dev = [r.device_bytes for r in rs if r.device_bytes is not None]
        ci = bootstrap_ci(ratios, seed=seed)
        out.append({
            "arm": a.name,
            "rounds": len(rs),
            f"{metric}_per_token_ms_median": float(np.median(val) * 1e3),
            "io_ms_per_token_median": float(np.median(io / tok) * 1e3),
            "wall_ms_per_token_median": float(np.median([r.wall_s / r.tokens for r in rs]) * 1e3),
            "reads_per_token": float(np.median([r.reads / r.tokens for r in rs])),
            "mb_per_token": float(np.median(by_ / tok) / 1e6),
            "device_mb_per_token": float(np.median(np.array(dev) / tok[: len(dev)]) / 1e6) if dev else None,
            "mb_per_s": float(np.median(by_ / np.maximum(io, 1e-12)) / 1e6),
            "tokens_per_s": float(np.median([r.tokens / r.wall_s for r in rs])),
            "ttft_ms_median": float(np.median([r.ttft_s for r in rs]) * 1e3),
            "hit_rate": float(np.median([r.hits / max(r.hits + r.misses, 1) for r in rs])),
            "resident_max": float(max(r.resident_after for r in rs)),
            "speedup_vs_baseline_median": float(np.median(ratios)) if ratios.size else None,
            "speedup_ci95": list(ci),
            "per_round_speedup": ratios.tolist(),
        })
    return out


def flag_identical(arms: list[Arm], rounds: list[RoundResult], layouts: dict[str, str], perms: dict[str, bytes]) -> list[str]:
    """Arms that should differ in what they read but report identical counters."""
    flags = []
    counters = {}
    for a in arms:
        rs = sorted((r for r in rounds if r.arm == a.name), key=lambda r: r.round)
        counters[a.name] = tuple((r.reads, r.bytes, r.hits) for r in rs)
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            if a.control_of == b.name or b.control_of == a.name:
                if counters[a.name] != counters[b.name] and a.mode != "os":
                    flags.append(f"A/A control {a.name} vs {b.name}: counters differ (the same arm is not deterministic)")
                continue
            same_file_pattern = perms.get(a.path) == perms.get(b.path) and layouts.get(a.path) == layouts.get(b.path)
            same_reader = (a.gap, a.direct, a.mode, a.cache_slots, a.resident_frac) == \
                (b.gap, b.direct, b.mode, b.cache_slots, b.resident_frac)
            if counters[a.name] == counters[b.name] and not (same_file_pattern and same_reader) and a.mode != "os":
                flags.append(f"{a.name} and {b.name} should read differently but report identical counters "
                             f"(same code ran twice?)")
            if a.path == b.path and a.options() == b.options():
                flags.append(f"{a.name} and {b.name} are the same arm (same file, same options)")
    return flags


AA_TOLERANCE = 0.03  # DESIGN.md: an A/A control (same file, same options) lands within +-3%


def aa_row(summary: list[dict]) -> dict | None:
    """The A/A control's summary row (None when the run had none or it has no valid rounds)."""
    return next((s for s in summary if s["arm"].endswith("(A/A)")
                 and s.get("speedup_vs_baseline_median") is not None), None)


def run_ab(arms: list[Arm], *, trace: Trace | None = None, mode: str = "replay", rounds: int = 5,
           threshold: float = 0.01, aa: bool = True, name: str = "ab", prompts=None, n_new: int = 16,
           seed: int = 0, progress=None, prereg: dict | None = None, trace_path: str = "",
           tokens_per_round: int = 0, aa_tolerance: float = AA_TOLERANCE) -> AbResult:
    """Run every arm `rounds` times in alternating order (see the module docstring).

    `tokens_per_round` > 0 (replay): round r replays the next slice of that many held-out tokens
    (cycling), so many short rounds spread the neighbours' bursts of I/O over all arms; every
    arm of a round reads the same tokens. 0: every round replays the whole trace.
    """
    if len(arms) < 1:
        raise MboltError("ab needs at least one arm")
    if mode not in ("replay", "decode"):
        raise MboltError(f"mode must be replay or decode, not {mode!r}")
    if mode == "replay" and trace is None:
        raise MboltError("replay mode needs --replay held.mbtrace")
    if mode == "decode" and not prompts:
        raise MboltError("decode mode needs prompts")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        # make names unique
        for i, a in enumerate(arms):
            a.name = default_arm_name(a) if names.count(a.name) > 1 else a.name
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            arms = [replace(a, name=f"{a.name}#{i}") for i, a in enumerate(arms)]
    if aa:
        arms = list(arms) + [replace(arms[0], name=f"{arms[0].name} (A/A)", control_of=arms[0].name)]
    info = check_same_model(arms)
    mm0 = info[arms[0].path][0]
    if trace is not None:
        check_compatible(trace, mm0, trace_path or "trace")
    layouts = {p: lay for p, (m, lay) in info.items()}
    perms = {p: m.route_map.perm.tobytes() for p, (m, _) in info.items()}
    results: list[RoundResult] = []
    metric = "io_s" if mode == "replay" else "wall_s"
    total = rounds * len(arms)
    done = 0
    for r in range(rounds):
        order = list(range(len(arms))) if r % 2 == 0 else list(reversed(range(len(arms))))
        tr_r = trace
        if trace is not None and tokens_per_round and tokens_per_round < trace.n_tokens:
            idx = (r * tokens_per_round + np.arange(tokens_per_round)) % trace.n_tokens
            mask = np.zeros(trace.n_tokens, bool)
            mask[idx] = True
            tr_r = trace.select(mask)
        for pos, i in enumerate(order):
            a = arms[i]
            res = run_arm(a, info[a.path][0], tr_r, threshold=threshold, rnd=r, position=pos, mode=mode,
                          prompts=prompts, n_new=n_new)
            results.append(res)
            done += 1
            if progress:
                progress(done, total, res)
    flags = flag_identical(arms, results, layouts, perms)
    rejected = [r for r in results if r.rejected]
    if rejected:
        flags.append(f"{len(rejected)} arm-rounds rejected: resident share above {100 * threshold:.1f}% after eviction")
    cold = all(r.cold_proven for r in results)
    notes = []
    if not cold:
        bad = next(r for r in results if not r.cold_proven)
        notes.append(f"eviction could not be proven ({bad.note}): this run is NOT cold")
    summary = summarise(arms, results, metric, seed)
    aa = aa_row(summary)
    if aa is not None:
        dev = aa["speedup_vs_baseline_median"] - 1.0
        if abs(dev) > aa_tolerance:
            flags.append(f"A/A control off by {100 * dev:+.1f}% (tolerance {100 * aa_tolerance:.0f}%): differences "
                         f"between arms of this run smaller than the noise are not evidence")
    arm_dicts = []
    for a in arms:
        mm, lay = info[a.path]
        rm = mm.route_map
        arm_dicts.append({**asdict(a), "layout": lay, "plan_method": rm.method, "fingerprint": mm.fingerprint,
                          "file_size": mm.header.file_size, "read_pattern": read_pattern(mm, a, lay)})
    tinfo = {}
    if trace is not None:
        tinfo = {"path": trace_path, "tokens": trace.n_tokens, "n_layers": trace.n_layers,
                 "n_experts": trace.n_experts, "k": trace.k, "fingerprint": trace.fingerprint}
    if tokens_per_round:
        tinfo["tokens_per_round"] = int(tokens_per_round)
    return AbResult(name, mode, arm_dicts, results, summary, flags, cold, environment(arms[0].path), tinfo,
                    metric, arms[0].name, prereg, None, notes)


# ---- pre-registration ----


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_result(path: str | os.PathLike, result: AbResult) -> Path:
    from mbolt.core.atomic import json_default, write_text_atomic

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(p, json.dumps(result.to_dict(), indent=1, default=json_default) + "\n")
    return p


def load_prompt_ids(model_path: str, prompts_path=None, n: int = 2) -> list[list[int]]:
    """Token ids of the first `n` prompts (the tracer's prompt files: jsonl or text lines)."""
    from mbolt.engine.tokenizer import Tokenizer
    from mbolt.core.header import read_header

    from mbolt.core.prompts import prompt_texts

    texts = prompt_texts(prompts_path, n)
    tok = Tokenizer.from_header(read_header(model_path))
    out = [tok.encode(t)[:64] for t in texts[:n]]
    if not out or not all(out):
        raise MboltError("decode: no usable prompts")
    return out
