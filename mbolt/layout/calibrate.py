"""Profile-calibrated synthetic traces: token expert sets that match a published co-activation
profile (`coactivation_*.json` from the original mbolt: per-layer heat and strongest pairs).

Sampler (per layer, per token, k distinct experts): the first expert by a base weight b_e, each
next one with probability proportional to b_e * exp(sum over already chosen s of A[s, e]),
A = 0 for unpublished pairs. b and A (started at log lift) are fitted by iterative proportional
fitting on a sample so every expert's selection rate matches the published heat and every
published pair's co-activation count matches its published count. `match_report`
says how well it worked: heat entropy per layer and lift percentiles of the published pairs,
published vs sampled.

Also `structured_trace`: planted-group or structure-free traces with a chosen heat skew (the
null control: with `structure="none"` no order should beat `heat` on held-out tokens).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.trace import DECODE, Trace
from mbolt.layout.profile import Profile, entropy_bits, load_profile


# ---------------------------------------------------------------- sampler


def _log_lift(pairs: np.ndarray, E: int) -> np.ndarray:
    A = np.zeros((E, E))
    if len(pairs):
        i, j = pairs[:, 0].astype(int), pairs[:, 1].astype(int)
        A[i, j] = A[j, i] = np.log(np.maximum(pairs[:, 3], 1e-6))
    return A


def sample_sets(b: np.ndarray, A: np.ndarray, gamma: float, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n token sets of k distinct experts (see module doc). Returns int16 [n, k]."""
    E = len(b)
    expA = np.exp(gamma * A).astype(np.float32)
    w = np.tile((np.asarray(b) / max(np.max(b), 1e-300)).astype(np.float32), (n, 1))  # weight per token x expert
    out = np.zeros((n, k), np.int64)
    rows = np.arange(n)
    cdf = np.empty_like(w)
    for r in range(k):
        np.cumsum(w, axis=1, out=cdf)
        total = cdf[:, -1]
        u = rng.random(n, dtype=np.float32) * total * np.float32(1 - 1e-6)
        # first expert whose cumulative weight exceeds u: always one with positive weight
        e = np.minimum((cdf <= u[:, None]).sum(axis=1), E - 1)
        out[:, r] = e
        w[rows, e] = 0.0
        if r < k - 1:
            if gamma:
                w *= expA[e]
            w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-30)
    return out.astype(np.int16)


def _pair_counts(sets: np.ndarray, pairs: np.ndarray, E: int) -> np.ndarray:
    x = np.zeros((len(sets), E), np.float32)
    x[np.arange(len(sets))[:, None], sets] = 1.0
    C = x.T @ x
    return C[pairs[:, 0].astype(int), pairs[:, 1].astype(int)].astype(np.float64), np.diag(C).astype(np.float64)


def fit_layer(heat: np.ndarray, pairs: np.ndarray, k: int, n_tokens: int, *, n_fit: int = 4000,
              rng: np.random.Generator, iters: int = 16, eta_b: float = 0.5,
              eta_a: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """Fit base weights b and pair log-weights A (initialised to log lift) by iterative
    proportional fitting, so the sampled heat and every published pair's count match."""
    E = len(heat)
    target = heat / max(n_tokens, 1)  # selection rate per expert (sums to k)
    A = _log_lift(pairs, E)
    b = np.where(target > 0, target, 0.0)
    if len(pairs):
        i, j = pairs[:, 0].astype(int), pairs[:, 1].astype(int)
        want = pairs[:, 2] / max(n_tokens, 1) * n_fit
    probe = pairs if len(pairs) else np.zeros((1, 4))
    for _ in range(iters):
        s = sample_sets(b, A, 1.0, k, n_fit, rng)
        pc, h = _pair_counts(s, probe, E)
        b = np.where(target > 0, b * (target / ((h + 0.5) / n_fit)) ** eta_b, 0.0)
        if len(pairs):
            step = eta_a * np.log((want + 1.0) / (pc + 1.0))
            A[i, j] += step
            A[j, i] += step
    return b, A


def synth_trace_like(profile: Profile | str | os.PathLike, n_tokens: int | None = None, seed: int = 0,
                     n_fit: int = 4000, progress=None) -> tuple[Trace, dict]:
    """A decode-only trace whose per-layer heat and strong-pair structure match `profile`."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    N = int(n_tokens or prof.n_tokens)
    if N < 1:
        raise MboltError("synth-trace: need at least one token")
    rng = np.random.default_rng(seed)
    ex = np.full((N, prof.n_layers, prof.k), -1, np.int16)  # layers the profile does not list: dense
    for l in prof.layers():
        if (prof.heat[l] > 0).sum() < prof.k:
            raise MboltError(f"{prof.path}: layer {l}: fewer than k={prof.k} experts ever selected")
        b, A = fit_layer(prof.heat[l], prof.pairs[l], prof.k, prof.n_tokens, n_fit=n_fit, rng=rng)
        for a in range(0, N, 20000):
            ex[a:a + 20000, l] = sample_sets(b, A, 1.0, prof.k, min(20000, N - a), rng)
        if progress:
            progress(l)
    trace = Trace(prof.n_layers, prof.n_experts, prof.k, ex, np.full(N, DECODE, np.uint8),
                  np.zeros(N, np.int32), np.arange(N, dtype=np.int32),
                  notes=[f"synthetic: calibrated to {Path(prof.path).name} ({prof.model}), seed {seed}"])
    return trace, match_report(trace, prof)


def match_report(trace: Trace, prof: Profile) -> dict:
    """Published vs sampled: heat entropy per layer, lift percentiles of the published pairs,
    the published pairs' summed count per token, and the heat correlation."""
    from mbolt.layout.coact import coactivation

    co = coactivation(trace)
    N = trace.n_tokens
    ent_pub, ent_smp, lift_pub, lift_smp, pc_pub, pc_smp, corr = [], [], [], [], [], [], []
    for l in prof.layers():
        ent_pub.append(entropy_bits(prof.heat[l]))
        ent_smp.append(entropy_bits(co.heat[l]))
        corr.append(float(np.corrcoef(prof.heat[l], co.heat[l])[0, 1]))
        p = prof.pairs[l]
        if not len(p):
            continue
        i, j = p[:, 0].astype(int), p[:, 1].astype(int)
        lift_pub.append(p[:, 3])
        lift_smp.append(co.lift(l)[i, j])
        pc_pub.append(p[:, 2].sum() / prof.n_tokens)
        pc_smp.append(co.counts[l][i, j].sum() / N)
    q = [10, 25, 50, 75, 90]
    lp = np.concatenate(lift_pub) if lift_pub else np.zeros(1)
    ls = np.concatenate(lift_smp) if lift_smp else np.zeros(1)
    return {
        "profile": Path(prof.path).name,
        "n_tokens": N,
        "heat_entropy_bits": {"published_mean": float(np.mean(ent_pub)), "sampled_mean": float(np.mean(ent_smp)),
                              "max_abs_diff": float(np.max(np.abs(np.subtract(ent_pub, ent_smp))))},
        "heat_corr_min": float(np.min(corr)),
        "pair_lift_percentiles": {"q": q, "published": np.percentile(lp, q).round(3).tolist(),
                                  "sampled": np.percentile(ls, q).round(3).tolist()},
        "published_pairs_count_per_token": {"published": float(np.mean(pc_pub)) if pc_pub else 0.0,
                                            "sampled": float(np.mean(pc_smp)) if pc_smp else 0.0},
    }


# ---------------------------------------------------------------- planted / null


def structured_trace(n_layers: int = 8, n_experts: int = 64, k: int = 8, n_tokens: int = 4000, *,
                     structure: str = "planted", n_groups: int = 8, strength: float = 0.6,
                     heat_skew: float = 1.0, seed: int = 0) -> Trace:
    """Synthetic routing: with `planted`, a share `strength` of each token's experts comes from one
    randomly chosen hidden group (groups are random sets, so stock order has no structure); the
    rest, and everything with `none`, is drawn by a Zipf-like heat (exponent `heat_skew`)."""
    if structure not in ("planted", "none"):
        raise MboltError(f"unknown structure {structure!r} (planted, none)")
    rng = np.random.default_rng(seed)
    ex = np.zeros((n_tokens, n_layers, k), np.int16)
    zero = np.zeros((n_experts, n_experts))
    for l in range(n_layers):
        heat = 1.0 / (1.0 + rng.permutation(n_experts)) ** heat_skew
        if structure == "none":
            ex[:, l] = sample_sets(heat, zero, 0.0, k, n_tokens, rng)
            continue
        groups = rng.permutation(n_experts).reshape(n_groups, -1) if n_experts % n_groups == 0 else \
            np.array_split(rng.permutation(n_experts), n_groups)
        n_in = int(round(strength * k))
        g = rng.integers(0, n_groups, n_tokens)
        for t in range(n_tokens):
            grp = np.asarray(groups[g[t]])
            a = rng.choice(grp, size=min(n_in, len(grp)), replace=False, p=heat[grp] / heat[grp].sum())
            w = heat.copy()
            w[a] = 0
            rest = rng.choice(n_experts, size=k - len(a), replace=False, p=w / w.sum())
            ex[t, l] = np.concatenate([a, rest])
    return Trace(n_layers, n_experts, k, ex, np.full(n_tokens, DECODE, np.uint8), np.zeros(n_tokens, np.int32),
                 np.arange(n_tokens, dtype=np.int32), notes=[f"synthetic: structure={structure} seed={seed}"])
