"""Statistics of an A/B: per-round ratios and their exact interval of the median, the summary rows,
position and carry-over effects, the A/A control, and the stop rule (adaptive or fixed rounds)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mbolt.bench.arms import Arm, RoundResult

MIN_CI_ROUNDS = 10  # fewer rounds than this: no interval at all (3 rounds' min..max is not a CI)
CI_METHOD = "exact order-statistic interval of the median (binomial, coverage >= 95%)"


def median_ci(x, conf: float = 0.95, min_n: int = MIN_CI_ROUNDS) -> tuple[float, float] | None:
    """Distribution-free interval of the median: [x_(k), x_(n+1-k)] with the largest k such that
    P(Binomial(n, 1/2) <= k-1) <= (1-conf)/2, so it covers the true median with probability >=
    conf for any continuous distribution. None below `min_n` values."""
    v = np.sort(np.asarray(x, float))
    n = v.size
    if n < max(min_n, 1):
        return None
    from scipy.stats import binom

    alpha = (1.0 - conf) / 2
    # k = number of j in 0..n/2 with P(B <= j) <= alpha (binom.cdf is monotone in j)
    k = int(np.sum(binom.cdf(np.arange(n // 2 + 1), n, 0.5) <= alpha))
    if k == 0:
        return None
    return float(v[k - 1]), float(v[n - k])


def ci_note(n: int) -> str:
    return "" if n >= MIN_CI_ROUNDS else f"no interval: {n} rounds (an interval needs at least {MIN_CI_ROUNDS})"


@dataclass
class StopRule:
    """When a run stops. `rounds` set: exactly that many. Otherwise adaptive: at every check point
    (each `check_every` rounds, default one balanced block) from `min_rounds` on, stop once the
    A/A interval lies inside the tolerance and every treated arm's interval half-width is at most
    `precision` of its median; stop anyway at `max_rounds` or when `time_budget_s` is (about to be)
    spent."""
    rounds: int | None = None
    min_rounds: int = 12
    max_rounds: int = 400
    time_budget_s: float = 600.0
    precision: float = 0.05
    check_every: int = 0
    budget_at_checks: bool = True  # stop for time only at a check point (whole blocks stay balanced), when one
    # more check interval would overrun the budget; False: right after the round in which it was spent


def per_round_ratios(rounds: list[RoundResult], base: str, arm: str, metric: str) -> dict[int, float]:
    """Per round: baseline time per token / arm time per token (valid rounds of both only)."""
    by = {(r.arm, r.round): r for r in rounds if not r.rejected and r.tokens}
    out = {}
    for (name, k), x in by.items():
        b = by.get((base, k))
        if name == arm and b is not None and getattr(x, metric) > 0:
            out[k] = (getattr(b, metric) / b.tokens) / (getattr(x, metric) / x.tokens)
    return dict(sorted(out.items()))


def summarise(arms: list[Arm], rounds: list[RoundResult], metric: str, seed: int = 0) -> list[dict]:
    base = arms[0].name
    ok = [r for r in rounds if not r.rejected]
    out = []
    base_rs = [r for r in ok if r.arm == base and r.tokens]
    base_med = float(np.median([getattr(r, metric) / r.tokens for r in base_rs])) if base_rs else None
    for a in arms:
        rs = [r for r in ok if r.arm == a.name and r.tokens]
        if not rs:
            out.append({"arm": a.name, "rounds": 0, "speedup_vs_baseline_median": None, "speedup_ci95": None,
                        "median_of_ratios": None, "ratio_of_medians": None})
            continue
        tok = np.array([r.tokens for r in rs], float)
        val = np.array([getattr(r, metric) for r in rs]) / tok
        ratios = np.array(list(per_round_ratios(rounds, base, a.name, metric).values()))
        io = np.array([r.io_s for r in rs])
        by_ = np.array([r.bytes for r in rs], float)
        dev = [r.device_bytes for r in rs if r.device_bytes is not None]
        ci = median_ci(ratios)
        med_ratio = float(np.median(ratios)) if ratios.size else None
        out.append({
            "arm": a.name,
            "rounds": len(rs),
            f"{metric}_per_token_ms_median": float(np.median(val) * 1e3),
            "io_ms_per_token_median": float(np.median(io / tok) * 1e3),
            "wall_ms_per_token_median": float(np.median([r.wall_s / r.tokens for r in rs]) * 1e3),
            "non_io_ms_per_token_median": float(np.median([(r.wall_s - r.io_s) / r.tokens for r in rs]) * 1e3),
            "drop_ms_per_token_median": float(np.median([r.drop_s / r.tokens for r in rs]) * 1e3),
            "reads_per_token": float(np.median([r.reads / r.tokens for r in rs])),
            "mb_per_token": float(np.median(by_ / tok) / 1e6),
            "device_mb_per_token": float(np.median(np.array(dev) / tok[: len(dev)]) / 1e6) if dev else None,
            "mb_per_s": float(np.median(by_ / np.maximum(io, 1e-12)) / 1e6),
            "tokens_per_s": float(np.median([r.tokens / r.wall_s for r in rs])),
            "ttft_ms_median": float(np.median([r.ttft_s for r in rs]) * 1e3),
            "hit_rate": float(np.median([r.hits / max(r.hits + r.misses, 1) for r in rs])),
            "resident_max": float(max(r.resident_after for r in rs)),
            "median_of_ratios": med_ratio,
            "ratio_of_medians": base_med / float(np.median(val)) if base_med and np.median(val) > 0 else None,
            "speedup_vs_baseline_median": med_ratio,  # = median_of_ratios, the speedup of every table
            "speedup_ci95": list(ci) if ci else None,
            "ci_method": CI_METHOD,
            "ci_note": ci_note(ratios.size),
            "per_round_speedup": ratios.tolist(),
        })
    return out


def _deviation_columns(values: list, levels: list) -> np.ndarray:
    """Sum-to-zero (deviation) coding: one column per level but the last, which gets -1 everywhere;
    each coefficient is then that level's difference from the mean over levels."""
    X = np.zeros((len(values), max(len(levels) - 1, 0)))
    pos = {v: i for i, v in enumerate(levels)}
    for i, v in enumerate(values):
        j = pos[v]
        if j == len(levels) - 1:
            X[i, :] = -1.0
        else:
            X[i, j] = 1.0
    return X


def order_effects(rounds: list[RoundResult], metric: str) -> dict:
    """Position and carry-over effects, fitted together with arm and round (token slice) effects:

        log(time per token) = mean + arm + round + position + previous arm + noise

    (deviation coding: each effect is a level's difference from the mean over its levels, in %).
    A well-balanced design has effects near zero; a large one names what to suspect."""
    ok = [r for r in rounds if not r.rejected and r.tokens and getattr(r, metric) > 0 and r.prev_arm is not None]
    if len(ok) < 4:
        return {"estimable": False, "note": f"{len(ok)} usable arm-rounds: too few to estimate order effects"}
    y = np.log([getattr(r, metric) / r.tokens for r in ok])
    factors = {k: [getattr(r, attr) for r in ok] for k, attr in
               (("arm", "arm"), ("round", "round"), ("position", "position"), ("prev_arm", "prev_arm"))}
    levels = {k: sorted(set(v), key=str) for k, v in factors.items()}
    blocks = [np.ones((len(ok), 1))] + [_deviation_columns(factors[k], levels[k]) for k in factors]
    X = np.hstack(blocks)
    rank = np.linalg.matrix_rank(X)
    if rank < X.shape[1] or len(ok) <= X.shape[1]:
        return {"estimable": False, "n": len(ok), "parameters": int(X.shape[1]), "rank": int(rank),
                "note": "position and carry-over are confounded with the arms in this design (too few arms or "
                        "rounds): not estimable"}
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    dof = len(ok) - X.shape[1]
    sigma2 = float(resid @ resid / dof)
    cov = sigma2 * np.linalg.inv(X.T @ X)
    out = {"estimable": True, "n": len(ok), "parameters": int(X.shape[1]),
           "residual_sd_pct": float(100 * np.sqrt(sigma2)),
           "model": "log(time/token) = mean + arm + round + position + previous arm (deviation coding); "
                    "*_se_pct: standard errors"}
    col = 1
    for k in factors:
        L = levels[k]
        m = len(L) - 1
        if k in ("position", "prev_arm"):
            # each level's effect as a contrast of the coefficients (the last level: minus their sum)
            C = np.zeros((len(L), X.shape[1]))
            C[:m, col:col + m] = np.eye(m)
            C[m, col:col + m] = -1.0
            eff = C @ beta
            se = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", C, cov, C), 0.0))
            name = "carryover" if k == "prev_arm" else k
            out[f"{name}_pct"] = {str(lv): float(100 * (np.exp(e) - 1)) for lv, e in zip(L, eff)}
            out[f"{name}_se_pct"] = {str(lv): float(100 * v) for lv, v in zip(L, se)}
            out[f"{name}_log"] = {str(lv): (float(e), float(v)) for lv, e, v in zip(L, eff, se)}
        col += m
    big = [(k, lv, e, v) for k in ("position", "carryover") for lv, (e, v) in out.pop(f"{k}_log").items()]
    out["largest_pct"] = float(max(100 * abs(np.exp(e) - 1) for _, _, e, _ in big))
    # "significant": more than twice its standard error away from zero
    out["significant"] = [f"{k} {lv}: {100 * (np.exp(e) - 1):+.1f}% (se {100 * v:.1f}%)"
                          for k, lv, e, v in sorted(big, key=lambda t: -abs(t[2])) if abs(e) > 2 * v]
    return out


def non_io_per_read(rounds: list[RoundResult]) -> dict:
    """Time outside the timed reads, per token, against reads per token over every valid
    arm-round: (wall - io)/token = fixed + per_read * reads/token, least squares. In replay the
    store's bookkeeping around the reads (merging, job lists, dropping pages) is what is left
    outside io_s; a per-read slope is what a layout with fewer reads also saves outside I/O (the
    non-I/O term of `predict.decode_law`)."""
    ok = [r for r in rounds if not r.rejected and r.tokens]
    x = np.array([r.reads / r.tokens for r in ok], float)
    y = np.array([(r.wall_s - r.io_s) / r.tokens for r in ok], float)
    if len(ok) < 3 or np.ptp(x) == 0:
        return {"estimable": False, "note": "needs arms that differ in reads per token"}
    X = np.stack([np.ones_like(x), x], axis=1)
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    cov = float(resid @ resid / max(len(ok) - 2, 1)) * np.linalg.inv(X.T @ X)
    return {"estimable": True, "per_read_us": float(beta[1] * 1e6), "per_read_se_us": float(np.sqrt(cov[1, 1]) * 1e6),
            "fixed_ms_per_token": float(beta[0] * 1e3), "n": len(ok),
            "model": "(wall_s - io_s)/token = fixed + per_read * reads/token"}


def arm_identity(a: Arm) -> dict:
    """What makes an arm what it is: its file and every option (not its name)."""
    from dataclasses import asdict

    d = asdict(a)
    d.pop("name")
    d.pop("control_of")
    return d


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
            same_reader = arm_identity(a) | {"path": ""} == arm_identity(b) | {"path": ""}
            if counters[a.name] == counters[b.name] and not (same_file_pattern and same_reader) and a.mode != "os":
                flags.append(f"{a.name} and {b.name} should read differently but report identical counters "
                             f"(same code ran twice?)")
            if arm_identity(a) == arm_identity(b):
                flags.append(f"{a.name} and {b.name} are the same arm (same file, same options)")
    return flags


AA_TOLERANCE = 0.03  # DESIGN.md: an A/A control (same file, same options) lands within +-3%


def aa_row(summary: list[dict], baseline: str | None = None) -> dict | None:
    """The baseline's A/A control's summary row (None when the run had none or it has no valid
    rounds). Other arms may have A/A copies of their own: the baseline's is `baseline`'s, else the
    first row's, else the only one."""
    rows = [s for s in summary if s["arm"].endswith(" (A/A)") and s.get("speedup_vs_baseline_median") is not None]
    if not rows:
        return None
    for name in ([baseline] if baseline else []) + [summary[0]["arm"]]:
        hit = next((s for s in rows if s["arm"] == f"{name} (A/A)"), None)
        if hit is not None:
            return hit
    return rows[0] if baseline is None and len(rows) == 1 else None


def aa_ok(summary: list[dict], tolerance: float = AA_TOLERANCE) -> bool | None:
    """Whether the A/A control's median landed within the tolerance (None: no A/A control)."""
    aa = aa_row(summary)
    return None if aa is None else abs(aa["speedup_vs_baseline_median"] - 1.0) <= tolerance


def converged(summary: list[dict], baseline: str, precision: float, aa_tolerance: float = AA_TOLERANCE) -> str | None:
    """Why the run may stop (None: not yet): the A/A interval lies inside 1 +- tolerance and every
    treated arm's interval half-width is at most `precision` of its median."""
    why = []
    aa = next((s for s in summary if s["arm"].endswith("(A/A)")), None)
    if aa is not None:
        ci = aa.get("speedup_ci95")
        if ci is None or ci[0] < 1 - aa_tolerance or ci[1] > 1 + aa_tolerance:
            return None
        why.append(f"A/A interval {ci[0]:.3f}-{ci[1]:.3f} inside 1+-{aa_tolerance:g}")
    for s in summary:
        if s["arm"] == baseline or s is aa:
            continue
        ci, med = s.get("speedup_ci95"), s.get("median_of_ratios")
        if ci is None or not med or (ci[1] - ci[0]) / 2 > precision * med:
            return None
    why.append(f"every treated arm's interval half-width <= {100 * precision:g}% of its median")
    return "; ".join(why)


def stop_check(summary: list[dict], baseline: str, rounds_done: int, elapsed_s: float, rule: StopRule,
               block: int, aa_tolerance: float = AA_TOLERANCE) -> tuple[str, str] | None:
    """(reason, detail) when the run should stop after `rounds_done` rounds, else None.

    Fixed: after `rule.rounds`. Adaptive: the time budget after any round (with
    `budget_at_checks`: at a check point, when one more check interval would overrun it); at a
    check point (every `check_every` rounds, default one balanced block, from `min_rounds` on)
    convergence (`converged`); `max_rounds`."""
    if rule.rounds is not None:
        return ("fixed rounds", f"{rule.rounds} rounds as asked") if rounds_done >= rule.rounds else None
    budget = ("time budget", f"time budget of {rule.time_budget_s:.0f} s spent after {rounds_done} rounds "
                             "without converging")
    if elapsed_s >= rule.time_budget_s and not rule.budget_at_checks:
        return budget
    every = rule.check_every or block
    if rounds_done < rule.min_rounds or rounds_done % every:
        return None if rule.budget_at_checks or rounds_done < rule.max_rounds else \
            ("max rounds", f"{rule.max_rounds} rounds without converging")
    why = converged(summary, baseline, rule.precision, aa_tolerance)
    if why:
        return ("converged", f"after {rounds_done} rounds: {why}")
    if rounds_done >= rule.max_rounds:
        return ("max rounds", f"{rule.max_rounds} rounds without converging")
    if rule.budget_at_checks and elapsed_s + elapsed_s / rounds_done * every > rule.time_budget_s:
        return budget
    return None
