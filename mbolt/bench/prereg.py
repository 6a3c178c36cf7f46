"""Pre-registration: write the prediction and the decision rule down before measuring.

`prereg/NAME.toml`:

    name = "packed_tsp_64k_qd1"
    question = "Does packing + co-activation order cut cold I/O time at QD1, buffered?"
    mode = "replay"                      # replay | decode
    engine = "reference"                 # optional, decode: reference | llama.cpp
    trace = "${MBOLT_BENCH}/held.mbtrace"  # environment variables are expanded
    rounds = 7                           # optional: exactly this many rounds; without it the run is
                                         # adaptive: min_rounds, max_rounds, time_budget (s), precision
    seed = 0                             # optional: seed of the arm orders
    tokens_per_round = 0                 # optional: replay slices of this many tokens per round
    metric = "io_s"                      # io_s (replay) or wall_s (decode), per token
    baseline = "stock"                   # arm names
    treatment = "packed-tsp"
    predicted_speedup = 1.45             # baseline time / treatment time
    pass_threshold = 1.30                # PASS if the median of per-round speedups >= this
    [[arm]]
    name = "stock"
    file = "${MBOLT_BENCH}/stock.gguf"
    qd = 1
    direct = false

Its SHA-256 is recorded in `NAME.toml.lock` before the first run; a later run of an edited
file is refused (delete the lock only to start a new pre-registration, and say so).
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mbolt.core.atomic import write_text_atomic
from mbolt.bench.ab import file_sha256
from mbolt.bench.arms import Arm
from mbolt.bench.stats import aa_row, AA_TOLERANCE
from mbolt.core.errors import MboltError


@dataclass
class Prereg:
    path: str
    sha256: str
    name: str
    question: str
    mode: str
    trace: str | None
    rounds: int | None
    metric: str
    baseline: str
    treatment: str
    predicted_speedup: float
    pass_threshold: float
    arms: list[Arm]
    raw: dict
    min_rounds: int = 12
    max_rounds: int = 400
    time_budget: float = 600.0
    precision: float = 0.05
    seed: int = 0

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "name": self.name, "question": self.question,
                "metric": self.metric, "baseline": self.baseline, "treatment": self.treatment,
                "predicted_speedup": self.predicted_speedup, "pass_threshold": self.pass_threshold,
                "rounds": self.rounds, "mode": self.mode, "min_rounds": self.min_rounds,
                "max_rounds": self.max_rounds, "time_budget": self.time_budget, "precision": self.precision,
                "seed": self.seed}


def _expand(s: str) -> str:
    out = os.path.expandvars(s)
    if "$" in out:
        raise MboltError(f"prereg: unresolved variable in {s!r} (set it in the environment)")
    return out


def load_prereg(path: str | os.PathLike) -> Prereg:
    p = Path(path)
    from mbolt.core.checks import read_text

    text = read_text(p, "pre-registration")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MboltError(f"{p}: not valid TOML ({e})") from None
    need = ("name", "mode", "metric", "baseline", "treatment", "predicted_speedup", "pass_threshold", "arm")
    miss = [k for k in need if k not in raw]
    if miss:
        raise MboltError(f"{p}: missing {', '.join(miss)}")
    if raw["mode"] not in ("replay", "decode"):
        raise MboltError(f"{p}: mode {raw['mode']!r} is not replay or decode")
    if not isinstance(raw["arm"], list) or not raw["arm"]:
        raise MboltError(f"{p}: arm must be a list of [[arm]] tables")
    from mbolt.core.checks import check_range

    arms = []
    for i, a in enumerate(raw["arm"]):
        if not isinstance(a, dict) or "file" not in a or "name" not in a:
            raise MboltError(f"{p}: arm {i} needs name and file")
        arms.append(Arm(name=str(a["name"]), path=_expand(str(a["file"])),
                        gap=check_range(a.get("gap", 0), f"{p}: arm {i} gap", 0, 1 << 40),
                        io_threads=check_range(a.get("qd", 1), f"{p}: arm {i} qd", 1, 1024),
                        direct=bool(a.get("direct", False)), mode="os" if a.get("os") else "read",
                        cache_slots=check_range(a.get("cache", 0), f"{p}: arm {i} cache", 0, 1 << 20),
                        warm=bool(a.get("warm", False)), callback=bool(a.get("callback", False))))
    check_range(raw.get("rounds", 5), f"{p}: rounds", 1, 10_000)
    for k in ("predicted_speedup", "pass_threshold"):
        if not isinstance(raw[k], (int, float)) or isinstance(raw[k], bool) or raw[k] != raw[k]:
            raise MboltError(f"{p}: {k} is {raw[k]!r}: write the prediction down before the first run")
    names = [a.name for a in arms]
    for k in ("baseline", "treatment"):
        if raw[k] not in names:
            raise MboltError(f"{p}: {k} {raw[k]!r} is not one of the arms ({', '.join(names)})")
    if names[0] != raw["baseline"]:  # the harness compares every arm with the first
        arms.sort(key=lambda a: a.name != raw["baseline"])
    try:
        stop = dict(min_rounds=int(raw.get("min_rounds", 12)), max_rounds=int(raw.get("max_rounds", 400)),
                    time_budget=float(raw.get("time_budget", 600.0)), precision=float(raw.get("precision", 0.05)),
                    seed=int(raw.get("seed", 0)))
        rounds = int(raw["rounds"]) if "rounds" in raw else None
    except (TypeError, ValueError) as e:
        raise MboltError(f"{p}: rounds, min_rounds, max_rounds, time_budget, precision and seed are numbers ({e})") \
            from None
    return Prereg(str(p), file_sha256(p), raw["name"], raw.get("question", ""), raw["mode"],
                  _expand(raw["trace"]) if raw.get("trace") else None, rounds, raw["metric"],
                  raw["baseline"], raw["treatment"], float(raw["predicted_speedup"]), float(raw["pass_threshold"]),
                  arms, raw, **stop)


def lock_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".lock")


def check_and_lock(pr: Prereg) -> dict:
    """Refuse an edited pre-registration; lock a new one. Returns the lock record."""
    lp = lock_path(pr.path)
    if lp.exists():
        try:
            lock = json.loads(lp.read_text())
        except ValueError:
            raise MboltError(f"{lp}: damaged lock file") from None
        if lock.get("sha256") != pr.sha256:
            raise MboltError(f"{pr.path} was edited after its first run (hash {pr.sha256[:12]} vs locked "
                             f"{str(lock.get('sha256'))[:12]} at {lock.get('locked_at')}): refusing; "
                             f"a new prediction needs a new pre-registration file")
        lock["runs"] = int(lock.get("runs", 0)) + 1
    else:
        lock = {"sha256": pr.sha256, "locked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": 1}
    write_text_atomic(lp, json.dumps(lock, indent=1) + "\n")
    return lock


def verdict(pr: Prereg, summary: list[dict], aa_tolerance: float = AA_TOLERANCE) -> dict:
    """PASS/FAIL of the treatment's median of per-round speedups against the threshold;
    INCONCLUSIVE when the run's A/A control missed 1 by more than `aa_tolerance` (DESIGN.md:
    controls or it didn't happen), the threshold comparison still reported as `by_threshold`."""
    row = next((s for s in summary if s["arm"] == pr.treatment), None)
    if row is None or row.get("speedup_vs_baseline_median") is None:
        return {"verdict": "NO RESULT", "why": f"no valid rounds for {pr.treatment}"}
    got = row["speedup_vs_baseline_median"]
    ci = row.get("speedup_ci95")
    ok = got >= pr.pass_threshold
    aa = aa_row(summary, pr.baseline)
    aa_ok = aa is None or abs(aa["speedup_vs_baseline_median"] - 1.0) <= aa_tolerance
    return {
        "verdict": ("PASS" if ok else "FAIL") if aa_ok else "INCONCLUSIVE",
        "by_threshold": "PASS" if ok else "FAIL",
        "aa_control": None if aa is None else aa["speedup_vs_baseline_median"],
        "aa_within_tolerance": aa_ok,
        "measured_speedup": got,
        "speedup_definition": "median of per-round ratios",
        "ratio_of_medians": row.get("ratio_of_medians"),
        "ci95": list(ci) if ci else None,
        "pass_threshold": pr.pass_threshold,
        "predicted_speedup": pr.predicted_speedup,
        "prediction_error": got / pr.predicted_speedup - 1,
        "prediction_in_ci": None if not ci else ci[0] <= pr.predicted_speedup <= ci[1],
    }
