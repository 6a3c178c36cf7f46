"""Figures from A/B results (`run_ab(...).to_dict()`): the paired same-round ratio the
pre-registrations define, plain's best readahead window, whether every arm decoded the same
tokens. Plain dicts in, numbers out: the benchmark scripts and their tests share one rule."""

from __future__ import annotations

import numpy as np

from mbolt.bench.stats import ci_note, median_ci


def row(d: dict, arm: str) -> dict:
    return next(r for r in d["summary"] if r["arm"] == arm)


def decode_rate(r: dict) -> float:
    return r["tokens"] / r["wall_s"]


def same_round_ratios(d: dict, a: str, b: str, key=decode_rate) -> list[float]:
    """Per round: key(a) / key(b) of the same round (valid rounds of both)."""
    by = {(r["arm"], r["round"]): r for r in d["rounds"] if not r["rejected"] and r["tokens"]}
    return [key(x) / key(by[(b, k)]) for (arm, k), x in sorted(by.items(), key=lambda kv: kv[0][1])
            if arm == a and (b, k) in by and key(by[(b, k)])]


def pair_ratio(d: dict, a: str, b: str, key=decode_rate) -> float | None:
    """Median over rounds of key(a) / key(b) in the same round."""
    xs = same_round_ratios(d, a, b, key)
    return float(np.median(xs)) if xs else None


def pair_stats(d: dict, a: str, b: str, key=decode_rate) -> dict:
    """The paired same-round ratio as the pre-registrations define it: per round a / b, their
    median, and the exact interval of that median (stats.median_ci; none below its round count,
    said in `ci_note`)."""
    xs = same_round_ratios(d, a, b, key)
    return {"arm": a, "over": b, "median": float(np.median(xs)) if xs else None, "rounds": xs,
            "ci95": median_ci(xs) if xs else None, "ci_note": ci_note(len(xs))}


def ttft_of(r: dict) -> float:
    return r["ttft_s"]


def best_window(swept: dict, metric: str = "decode_tokens_per_s") -> int:
    """The readahead at which plain's best arm did best (highest tok/s, lowest TTFT)."""
    sign = -1.0 if metric == "ttft_s" else 1.0
    return max(swept, key=lambda ra: max(sign * v[metric] for v in swept[ra]["arms"].values()))


def tokens_identical(*ds: dict) -> bool:
    hashes = {r["tokens_sha256"] for d in ds for r in d["rounds"] if not r["rejected"]}
    return len(hashes) == 1
