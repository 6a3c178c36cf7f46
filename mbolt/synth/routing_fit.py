"""Fitting routing to a profile by simulation: what `synth --routing-like` plants, computed on
calibration text exactly as llama.cpp will compute it (gguf/routing_like.py builds the weights).

The model (gguf/routing_like.py has the weights that realise it). Each token id t has a random
unit code zeta_t in a D-dim latent space. Layer 0's attention adds, per used head h, the code of
the token `lag_h` places back, rotated by a random orthogonal R_h and weighted LAG_WEIGHT (the
head-1 output also carries `share` times the code unrotated). The latent state of a token is then

    z_t = zeta_t + sum_h M_h sum_j a_h(t, j) zeta_j,   M_h = LAG_WEIGHT R_h (+ share I for lag 1),

with a_h the causal softmax of the head's RoPE score (peaked at its lag, `head_scores`). Distinct
rotations make the lags independent codes, so z_t is close to a hash of the last few tokens: a
byte-level vocabulary then still routes each position differently (routing fixed by the token id
gave pair lifts far above a real model's). `share` makes neighbours' states alike: the overlap knob.

Reuse (a `ReuseTarget`: LRU hit rates of a real trace and its consecutive overlap). A real model
keeps using a narrow set of experts for a whole passage: in BigMoeOnEdge's Qwen3-30B-A3B trace
the overlap with the token 2..20 places back stays at 0.25-0.29 of k (lag 1: 0.38, the 128-token
heat of the passage alone: 0.24), so lag heads, which reach MAX_LAGS tokens, cannot give its LRU
hits at 51 slots (lag-1 share alone tops out near 0.26 / 0.39 / 0.62 at 16 / 27 / 51 slots against
0.61 / 0.76 / 0.90). A window head adds `gain` times the attention-weighted mean of the codes of
the passage (unrotated, so it is common to neighbours): its score WINDOW_KERNEL * mean cos(d
theta_p) over the rotary pairs slower than THETA_MIN (down to WINDOW_THETA) falls like a power of
the distance, then flat at e^-WINDOW_KERNEL, so it averages about 25 tokens whatever the context
length (a stationary state: a flatter kernel would average ever more tokens of a long prompt).
`gain` is fitted (share 0) so that top-k of the target's k reproduces the LRU curve and the
overlap in 128-token windows of the calibration text, each window a cold cache, as the trace
(the overlap alone at another expert count: routing_reuse.ReuseTarget).

Every MoE layer reads z through its own loadings A [E, D] and a per-expert bias b (heat):
logit_e = b_e + A_e . z. A = S Q + lam N: S from the profile's pairs (the top RANK eigenvectors
of the log-lift matrix, so experts of a strong pair respond to the same directions), Q a random
rotation per synthetic layer (layers that share a profile layer still route differently), N
random loadings (every expert varies; lam sets how much of the pair structure shows).

Fitted on the calibration tokens (prompts.jsonl lines 0-99; 100+ stay unseen): b so every
expert's selection rate matches the profile's heat share x k (a Jacobi step per expert: the
quantile of the logit each one needs to enter the top-k); lam per layer so the median lift of the
pairs in the profile's cut matches the profile's (a lower rank where even lam -> 0 falls short);
`share` (once, on two layers) so consecutive overlap / heat overlap reaches the target
(core/routing_stats.py defines both). The fit is deterministic: same seed and profile, same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mbolt.core.routing_stats import cut_lifts, cut_summary, set_counts
from mbolt.synth.routing_reuse import (ReuseTarget, consecutive_overlap, mean_reuse, reuse_error, reuse_stats,
                                      window_starts)

CALIB_PROMPTS = 100  # the first lines of mbolt/data/prompts.jsonl calibrate; the rest stay unseen
MAX_LAGS = 4  # heads of layer 0 that carry context (lags 1..4)
LAG_WEIGHT = 1.0
KERNEL = 32.0  # attention score at a head's lag; its neighbours get ~2% of its weight (head_dim 128)
THETA_MIN = 0.1  # rotary pairs slower than this barely tell neighbours apart: left out of the kernel
FIT_TOKENS = 8192  # tokens the bias fit sorts per step
LAM0, LAM_RANGE = 0.3, (0.03, 8.0)  # random loadings; 0 would leave experts without pairs a constant logit
RANK = 32  # directions of the pair structure: enough for the profiles' pairs (more reproduced no more of them)
LIFT_TOL = 0.04  # |log(median lift / target)| the lam search stops at
SHARE_MAX = 3.0
WINDOW_KERNEL = 12.0  # the window head's score at distance 0 (see module doc; 8 grows with context, 16 is shorter)
WINDOW_THETA = 1e-4  # the slowest rotary pair of the window kernel
GAIN0, GAIN_RANGE = 16.0, (0.5, 200.0)  # the window gain's first guess (Qwen3's trace at k=6: ~18) and bounds
MIN_WINDOW_PAIRS = 4
BYTE_MERGES = [(32, ord("t")), (ord("h"), ord("e")), (ord("i"), ord("n")), (32, ord("a"))]  # vocabulary.py's


def byte_tokens(text: str) -> np.ndarray:
    """Token ids of the built-in byte-level vocabulary (gguf/vocabulary.py: id = byte, then one id
    per merge). Its merges never cross a GPT-2 pre-token boundary and never feed each other, so
    applying them in rank order to the whole text gives llama.cpp's ids."""
    ids = list(text.encode("utf-8"))
    for rank, (a, b) in enumerate(BYTE_MERGES):
        out, i = [], 0
        while i < len(ids):
            if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                out.append(256 + rank)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        ids = out
    return np.asarray(ids, dtype=np.int64)


def calibration_tokens(n_prompts: int = CALIB_PROMPTS) -> list[np.ndarray]:
    from mbolt.core.prompts import read_prompts
    from mbolt.data import PROMPTS, path

    return [t for t in (byte_tokens(p.text) for p in read_prompts(path(PROMPTS))[:n_prompts]) if len(t)]


@dataclass
class Heads:
    """The context heads of layer 0: lags, rotations, and the RoPE geometry that shapes them.
    A head reads the first `carried` coordinates of the codes (its value head is that wide at
    most) and writes them into the whole latent space through its own random rotation."""

    lags: np.ndarray  # [n] the distance each head looks back
    rot: np.ndarray  # [n, D, carried] orthonormal columns
    theta: np.ndarray  # [n_rot / 2] rotary frequencies
    pairs: np.ndarray  # indices of the rotary pairs the kernel uses
    # the window head's rotary pairs (empty: no window head); it is head len(lags)
    window_pairs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def carried(self) -> int:
        return self.rot.shape[2]

    @property
    def window(self) -> bool:
        return len(self.window_pairs) > 0

    def mix(self, share: float, gain: float = 0.0) -> np.ndarray:
        """[heads, D, carried] M_h: what each head writes per unit of the code it reads (the
        window head, last: `gain` times the code as is)."""
        m = LAG_WEIGHT * self.rot.copy()
        eye = np.eye(*m.shape[1:])
        m[0] += share * eye
        return np.concatenate([m, gain * eye[None]]) if self.window else m

    def scores(self, n: int) -> np.ndarray:
        """[heads, n] attention score at distance 0..n-1: KERNEL * mean cos((d - lag) theta_p) over
        the fast pairs; the window head's WINDOW_KERNEL * mean cos(d theta_p) over its own."""
        d = np.arange(n)[None, :, None] - self.lags[:, None, None]
        lag = KERNEL * np.cos(d * self.theta[self.pairs][None, None, :]).mean(axis=2)
        if not self.window:
            return lag
        win = WINDOW_KERNEL * np.cos(np.arange(n)[:, None] * self.theta[self.window_pairs][None, :]).mean(axis=1)
        return np.concatenate([lag, win[None]])


def window_pairs(theta: np.ndarray) -> np.ndarray:
    """The window kernel's rotary pairs: slower than THETA_MIN, down to WINDOW_THETA, leaving the
    slowest pair out (the window head's query puts its surplus there: no key reads it)."""
    wp = np.flatnonzero((theta < THETA_MIN) & (theta >= WINDOW_THETA))
    return wp[wp != len(theta) - 1]


def make_heads(n_heads: int, n_rot: int, rope_base: float, D: int, carried: int, rng, window: bool = False) -> Heads:
    """Lag heads 1..n (n = MAX_LAGS at most), then the window head when `window` (one head fewer
    for the lags)."""
    theta = rope_base ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    pairs = np.flatnonzero(theta >= THETA_MIN)
    n = min(MAX_LAGS, n_heads - window)
    rot = np.stack([np.linalg.qr(rng.standard_normal((D, D)))[0][:, :carried] for _ in range(n)])
    wp = window_pairs(theta) if window else np.zeros(0, np.int64)
    return Heads(np.arange(1, n + 1), rot, theta, pairs, wp)


def head_context(tokens: list[np.ndarray], codes: np.ndarray, heads: Heads) -> np.ndarray:
    """[heads, N, carried]: per head, the attention-weighted carried codes sum_j a_h(t, j) zeta_j
    of every token of the concatenated sequences (causal softmax within a sequence, as llama.cpp
    computes it). The weights depend on the distance only: a causal convolution (by FFT) over
    the cumulative sum of the weights."""
    from scipy.signal import fftconvolve

    n_max = max(len(t) for t in tokens)
    scores = heads.scores(n_max)
    w = np.exp(scores - scores.max(axis=1, keepdims=True))  # [heads, n]
    den = np.cumsum(w, axis=1)
    c = heads.carried
    out = np.empty((len(w), sum(len(t) for t in tokens), c))
    at = 0
    for t in tokens:
        n = len(t)
        x = codes[t, :c]
        for h in range(len(w)):
            out[h, at:at + n] = fftconvolve(w[h, :n, None], x, axes=0)[:n] / den[h, :n, None]
        at += n
    return out


def latent(tokens_flat: np.ndarray, codes: np.ndarray, ctx: np.ndarray, mix: np.ndarray) -> np.ndarray:
    """[N, D] z_t = zeta_t + sum_h M_h ctx_h(t)."""
    z = codes[tokens_flat].copy()
    for h in range(len(mix)):
        z += ctx[h] @ mix[h].T
    return z.astype(np.float32)


def pair_structure(pairs: np.ndarray, E: int, rank: int) -> np.ndarray:
    """[E, rank] loadings whose Gram matrix is the best rank-`rank` PSD fit to the profile's log
    lifts (unlisted pairs: lift 1), columns by decreasing eigenvalue."""
    M = np.zeros((E, E))
    if len(pairs):
        i, j = pairs[:, 0].astype(int), pairs[:, 1].astype(int)
        M[i, j] = M[j, i] = np.log(np.maximum(pairs[:, 3], 1e-3))
    w, V = np.linalg.eigh(M)
    top = np.argsort(w)[::-1][:rank]
    S = V[:, top] * np.sqrt(np.clip(w[top], 0, None))[None, :]
    return np.pad(S, ((0, 0), (0, rank - S.shape[1])))


@dataclass
class Loadings:
    """A layer's loadings before the fit: A(rank, lam) = (S[:, :rank] Q, normalised) + lam N."""

    S: np.ndarray  # [E, r] pair_structure
    Q: np.ndarray  # [D, D] random rotation of the latent space (this layer's own)
    N: np.ndarray  # [E, D] random loadings, mean row norm 1

    def __call__(self, rank: int, lam: float) -> np.ndarray:
        D = self.Q.shape[0]
        S = np.pad(self.S[:, :rank], ((0, 0), (0, D - min(rank, self.S.shape[1])))) @ self.Q
        S /= max(math.sqrt((S ** 2).sum(axis=1).mean()), 1e-12)
        return (S + lam * self.N).astype(np.float32)


def make_loadings(pairs: np.ndarray, E: int, D: int, rng: np.random.Generator) -> Loadings:
    N = rng.standard_normal((E, D))
    return Loadings(pair_structure(pairs, E, min(RANK, D)), np.linalg.qr(rng.standard_normal((D, D)))[0],
                    N / math.sqrt((N ** 2).sum(axis=1).mean()))


def topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-logits, k - 1, axis=1)[:, :k]


def fit_bias(raw: np.ndarray, rate: np.ndarray, k: int, b: np.ndarray | None = None, iters: int = 10,
             tol: float = 0.01) -> np.ndarray:
    """Per-expert biases b with which top-k of raw + b selects expert e at `rate[e]` (sum = k).

    Jacobi steps: for each expert, the logit it needs to enter a token's top-k (the k-th largest
    of the others) minus its own, and b_e = the rate[e]-quantile of that over the tokens (at most
    FIT_TOKENS of them, evenly spaced: the sort is the cost)."""
    if len(raw) > FIT_TOKENS:
        raw = raw[np.linspace(0, len(raw) - 1, FIT_TOKENS).astype(np.int64)]
    n, E = raw.shape
    b = np.zeros(E, np.float32) if b is None else b.astype(np.float32)
    at = np.clip((rate * n).astype(np.int64), 0, n - 1)
    for _ in range(iters):
        lg = raw + b
        part = -np.partition(-lg, [k - 1, k], axis=1)
        kth, k1 = part[:, k - 1:k], part[:, k:k + 1]
        sel = lg >= kth
        if np.abs(sel.mean(axis=0) - rate).sum() / k < tol:
            break
        need = np.ascontiguousarray((np.where(sel, k1, kth) - raw).T)  # [E, n]
        b = np.array([np.partition(need[e], at[e])[at[e]] if rate[e] > 0 else need[e].min() - 1.0
                      for e in range(E)], np.float32)
    return b


def simulate(z: np.ndarray, A: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    return topk(z @ A.T + b, k)


def layer_stats(sel: np.ndarray, seq: np.ndarray, E: int, k: int) -> dict:
    """The profile-cut statistics of simulated selections, plus consecutive overlap over
    neighbours of the same sequence."""
    heat, counts = set_counts(sel, E)
    n = len(sel)
    st = cut_summary(heat, cut_lifts(counts, heat, n), n, k)
    ov = consecutive_overlap(sel, seq, E)
    st["overlap"] = ov
    st["overlap_vs_heat"] = ov / st["heat_overlap"] if ov is not None and st["heat_overlap"] else None
    return st


@dataclass
class LayerFit:
    A: np.ndarray  # [E, D] loadings (logit std 1 on the calibration tokens)
    b: np.ndarray  # [E] biases
    lam: float
    rank: int
    stats: dict  # simulated on the calibration tokens


def fit_layer(z: np.ndarray, seq: np.ndarray, load: Loadings, rate: np.ndarray, k: int, target_lift: float | None,
              lam: float = LAM0, steps: int = 5, b: np.ndarray | None = None, rank: int = 0) -> LayerFit:
    """Biases for the heat; lam (secant steps in log-log) for the median cut lift, at rank RANK
    and, when even the least random loadings fall short of the target, at half that rank (fewer,
    sharper directions: higher lifts, fewer of the profile's own pairs reproduced), down to 8."""
    E = len(rate)
    best = None
    rank = rank or load.S.shape[1]
    while True:
        tried: list[tuple[float, float]] = []
        for _ in range(steps if target_lift else 1):
            A = load(rank, lam)
            raw = z @ A.T
            scale = float(raw.std()) or 1.0
            A, raw = A / scale, raw / scale
            b = fit_bias(raw, rate, k, b)
            st = layer_stats(topk(raw + b, k), seq, E, k)
            med = st["cut_lift_p50"]
            err = abs(math.log(med / target_lift)) if (target_lift and med) else 0.0
            if best is None or err < best[0]:
                best = (err, LayerFit(A, b, lam, rank, st))
            if not target_lift or med is None or err < LIFT_TOL:
                return best[1]
            tried.append((math.log(lam), math.log(med)))
            slope = -0.5  # the median lift falls as the random loadings grow
            if len(tried) >= 2 and tried[-1][0] != tried[-2][0]:
                slope = min((tried[-1][1] - tried[-2][1]) / (tried[-1][0] - tried[-2][0]), -0.05)
            nxt = float(np.clip(math.exp(tried[-1][0] + (math.log(target_lift) - tried[-1][1]) / slope), *LAM_RANGE))
            if nxt == lam:  # at a bound
                break
            lam = nxt
        if med >= target_lift or rank <= 8 or lam != LAM_RANGE[0]:
            return best[1]
        rank, lam = rank // 2, LAM0


def probe_fits(z: np.ndarray, probes: list[tuple], seq: np.ndarray, k: int, bs: list) -> list[LayerFit]:
    """The probe layers (loadings, rate) fitted at lam = LAM0, each from its last biases `bs`
    (updated: the next knob's fit starts from them)."""
    fits = [fit_layer(z, seq, load, rate, k, None, b=b) for (load, rate), b in zip(probes, bs)]
    bs[:] = [f.b for f in fits]
    return fits


def fit_share(z_of, probes: list[tuple], seq: np.ndarray, k: int, target: float) -> tuple[float, float, float]:
    """(share, overlap / heat overlap reached, its slope in the share): secant steps on the mean
    over the probe layers (loadings, rate) at lam = LAM0; the overlap grows with the share of the
    previous token's code."""
    bs: list = [None] * len(probes)

    def measure(share):
        return float(np.mean([f.stats["overlap_vs_heat"] or 1.0 for f in probe_fits(z_of(share), probes, seq, k, bs)]))

    pts = [(0.0, measure(0.0))]
    if pts[0][1] >= target:
        return pts[0] + (0.0,)
    share, slope = 0.5, 0.0
    for _ in range(5):
        pts.append((share, measure(share)))
        (s0, v0), (s1, v1) = pts[-2], pts[-1]
        slope = (v1 - v0) / (s1 - s0) if s1 != s0 else slope
        if abs(v1 / target - 1) < 0.01:
            break
        share = float(np.clip(s1 + (target - v1) / slope, 0.0, SHARE_MAX)) if slope > 0 else SHARE_MAX
    return min(pts, key=lambda p: abs(p[1] / target - 1)) + (slope,)


def fit_gain(z_of, probes: list[tuple], seq: np.ndarray, k: int, target: ReuseTarget,
             starts: np.ndarray) -> tuple[float, float, float]:
    """(gain, reuse_error reached, its slope in log gain): secant steps on the mean over the probe
    layers (loadings, rate; biases for the model's k, reuse at the target's k) at lam = LAM0;
    reuse grows with the gain of the window head."""
    bs: list = [None] * len(probes)

    def measure(gain):
        z = z_of(gain)
        stats = [reuse_stats(topk(z @ f.A.T + f.b, target.k), seq, len(f.b), target, starts)
                 for f in probe_fits(z, probes, seq, k, bs)]
        return reuse_error(mean_reuse(stats), target, len(probes[0][1]))

    pts: list[tuple[float, float]] = []
    gain, slope = GAIN0, 0.0
    for _ in range(6):
        pts.append((gain, measure(gain)))
        if abs(pts[-1][1]) < 0.01:
            break
        if len(pts) >= 2 and pts[-1][0] != pts[-2][0]:
            (g0, e0), (g1, e1) = pts[-2], pts[-1]
            slope = (e1 - e0) / (math.log(g1) - math.log(g0))
        step = -pts[-1][1] / slope if slope > 0 else (0.4 if pts[-1][1] < 0 else -0.4)
        gain = float(np.clip(pts[-1][0] * math.exp(np.clip(step, -1.5, 1.5)), *GAIN_RANGE))
    return min(pts, key=lambda p: abs(p[1])) + (slope,)


@dataclass
class ModelFit:
    share: float
    overlap_vs_heat: float  # at the fitted share, mean over the layers (calibration)
    layers: list[LayerFit]  # one per target, in order
    gain: float = 0.0  # the window head's (0: no reuse target)
    reuse: dict | None = None  # reuse_stats, mean over the layers (calibration)


def fit_model(targets: list[tuple[np.ndarray, np.ndarray]], k: int, codes: np.ndarray, heads: Heads,
              rng: np.random.Generator, overlap_target: float | None, progress=None,
              reuse: ReuseTarget | None = None) -> ModelFit:
    """targets: per synthetic MoE layer, (heat [E] of its profile layer, its pairs [P, 4]). With
    `reuse` (heads with a window head) the window gain is fitted to it and share is 0; else share
    is fitted to `overlap_target` (consecutive overlap / heat overlap)."""
    tokens = calibration_tokens()
    flat = np.concatenate(tokens)
    seq = np.repeat(np.arange(len(tokens)), [len(t) for t in tokens])
    ctx = head_context(tokens, codes, heads)
    E, D = len(targets[0][0]), codes.shape[1]
    loads = [(make_loadings(pairs, E, D, rng), heat / heat.sum() * k,
              float(np.median(pairs[:, 3])) if len(pairs) else None) for heat, pairs in targets]
    probes = [loads[i][:2] for i in sorted({0, len(loads) // 2})]
    if reuse is not None:
        starts = window_starts(seq, reuse.window)
        z_of = lambda g: latent(flat, codes, ctx, heads.mix(0.0, g))  # noqa: E731
        knob, _, slope = fit_gain(z_of, probes, seq, k, reuse, starts)

        def reached(z, layers):
            for f in layers:
                f.stats["reuse"] = reuse_stats(topk(z @ f.A.T + f.b, reuse.k), seq, E, reuse, starts)
            return reuse_error(mean_reuse([f.stats["reuse"] for f in layers]), reuse, E)
        step = lambda x, err: float(np.clip(x * math.exp(-err / slope), *GAIN_RANGE))  # noqa: E731
    else:
        z_of = lambda s: latent(flat, codes, ctx, heads.mix(s))  # noqa: E731
        knob, _, slope = fit_share(z_of, probes, seq, k, overlap_target)

        def reached(z, layers):
            return float(np.mean([f.stats["overlap_vs_heat"] or 1.0 for f in layers])) / overlap_target - 1
        step = lambda x, err: float(np.clip(x - err * overlap_target / slope, 0.0, SHARE_MAX))  # noqa: E731
    z = z_of(knob)
    layers = []
    for i, (load, rate, med) in enumerate(loads):
        layers.append(fit_layer(z, seq, load, rate, k, med))
        if progress:
            progress(i + 1, len(loads))
    err = reached(z, layers)
    if slope > 0 and abs(err) > 0.03:
        # the probes are two layers: one step on the mean over all of them (biases refitted)
        k2 = step(knob, err)
        z2 = z_of(k2)
        again = [fit_layer(z2, seq, load, rate, k, None, lam=f.lam, b=f.b, rank=f.rank)
                 for (load, rate, _), f in zip(loads, layers)]
        err2 = reached(z2, again)
        if abs(err2) < abs(err):
            knob, layers, err = k2, again, err2
        elif reuse is not None:
            reached(z, layers)  # the kept layers' own reuse statistics
    ratio = float(np.mean([f.stats["overlap_vs_heat"] or 1.0 for f in layers]))
    if reuse is None:
        return ModelFit(knob, ratio, layers)
    return ModelFit(0.0, ratio, layers, knob, mean_reuse([f.stats["reuse"] for f in layers]))
