"""`synth --routing-like PROFILE`: routing planted to look like a real model's.

Planted routing (gguf/routing.py) routes by topic groups; its statistics are unlike a real
model's (pair lifts far higher, neighbouring tokens sharing fewer experts than chance). Here a
profile (a `RoutingTarget`: per-layer heat and strong pairs, as in the original mbolt's
co-activation JSON, or measured from a trace by layout/stats.py) is planted instead:

* per-layer heat: a per-expert router bias, fitted so every expert's selection rate is the
  profile's heat share x k;
* its pair structure: router loadings on a latent space whose Gram matrix follows the profile's
  log lifts, diluted by random loadings until the median lift of the pairs in the profile's cut
  is the profile's (per layer);
* neighbouring tokens: layer 0's attention adds the codes of the previous MAX_LAGS tokens (one
  head per lag, each with its own rotation);
* reuse from token to token: with a `reuse` target (a real trace's LRU hit rates and consecutive
  overlap, gguf/routing_reuse.py; a profile has no token order, so BigMoeOnEdge's Qwen3-30B-A3B
  figures by default) a window head adds `gain` times the mean code of the last ~25 tokens, the
  gain fitted so that top-k at the trace's k reproduces them (routing_fit.py's module doc says
  why a window and not lags). A trace given as the profile keeps the older knob: part of the
  previous token's code as is (`share`, fitted so that consecutive overlap / heat overlap reaches
  the trace's own ratio, `overlap_vs_heat`).

gguf/routing_fit.py holds the model and the fit: everything is simulated on calibration text
(mbolt/data/prompts.jsonl lines 0-99) as llama.cpp computes it, so lines 100+ are unseen text.

Geometry. Directions of the hidden space (orthonormal): m (every token has TOKEN_B of it, so a
router row's m part is a per-expert bias) and a D-dim latent space L, D = min(LATENT_MAX, E,
(hidden - 1) / 2). A token's embedding is sqrt(H) (TOKEN_B m + TOKEN_L zeta_t + rest), zeta_t its
unit code in L. Layer 0's heads: q = k = constant vectors read off m (with q/k RMSNorm the score
is then exact), built on the rotary pairs faster than THETA_MIN so that head h's score peaks at
distance lag_h (q is k turned by lag_h x theta_p per pair; the window head: `_units`); v reads the first min(D, head_dim)
code coordinates; o writes them back into L through the head's mix (routing_fit.Heads). The
attention of every other layer is zero, so every router reads the same latent state.
Router row e of a layer: (b_e / TOKEN_B m + A_e / TOKEN_L in L) / sqrt(H): logit = (b_e + A_e . z)
/ |state|, a common positive factor per token that top-k ignores.

Layers. Synthetic MoE layer j of m takes profile layer P[round(j (n - 1) / (m - 1))] of the n
layers the profile lists (relative depth kept; first and last map to first and last; a model with
more layers than the profile repeats layers, each with its own latent rotation).
Experts: expert e of the model is expert e of the profile (same count required); k may differ
(rates are heat shares x the model's k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.synth.routing import PROBS_BIAS_STD, rng_for
from mbolt.synth.routing_fit import (KERNEL, MIN_WINDOW_PAIRS, THETA_MIN, WINDOW_KERNEL, ModelFit, fit_model,
                                    make_heads, window_pairs)
from mbolt.synth.routing_reuse import ReuseTarget, load_reuse

TOKEN_B, TOKEN_L = 0.3, 0.8  # shares of a token embedding along m and in the latent space
LATENT_MAX = 512
OVERLAP_VS_HEAT = 1.22  # granite3moe (mbolt/data), decode: consecutive overlap / heat overlap, mean over layers
# plain GQA attention and softmax routers; qwen2moe's q/k/v biases would move the planted state
LIKE_ARCHS = ("qwen3moe", "olmoe", "mixtral")
NEOX_ARCHS = ("qwen3moe", "olmoe")  # llama.cpp's rope type per arch; mixtral (llama) is NORM
MIN_PAIRS = 4  # rotary pairs the heads' kernel needs to peak at one distance (head_dim 64 at base 1e6 has 6)


@dataclass
class RoutingTarget:
    """What a profile says, in its own layers: heat [L, E] counts over n_tokens, pairs per layer
    [P, 4] (i, j, count, lift) in the profile's cut, and the reuse to reach: a trace's own overlap
    ratio (`overlap_vs_heat`), else a `reuse` target (BigMoeOnEdge's Qwen3-30B-A3B unless given)."""

    source: str
    n_experts: int
    k: int
    n_tokens: int
    heat: np.ndarray
    pairs: list[np.ndarray]
    overlap_vs_heat: float | None = None
    reuse: ReuseTarget | None = None
    fits: dict = field(default_factory=dict, repr=False, compare=False)  # cached fits per geometry

    def __post_init__(self):
        if self.overlap_vs_heat is None and self.reuse is None:
            from mbolt.data import QWEN3_30B_REUSE, path

            self.reuse = load_reuse(path(QWEN3_30B_REUSE))  # a profile has no token order of its own

    def layers(self) -> np.ndarray:
        return np.flatnonzero(self.heat.sum(axis=1) > 0)


def layer_map(n_moe: int, listed: np.ndarray) -> list[int]:
    """The profile layer of each synthetic MoE layer (see module doc)."""
    n = len(listed)
    if n_moe == 1:
        return [int(listed[n // 2])]
    return [int(listed[round(j * (n - 1) / (n_moe - 1))]) for j in range(n_moe)]


def latent_dim(cfg) -> int:
    return min(LATENT_MAX, cfg.n_experts, (cfg.hidden - 1) // 2)


def check(cfg) -> None:
    """What --routing-like needs of the rest of the config (a one-line MboltError otherwise)."""
    t = cfg.routing_like
    where = f"--routing-like {t.source}"
    if cfg.arch not in LIKE_ARCHS:
        raise MboltError(f"{where}: builds plain GQA attention ({', '.join(LIKE_ARCHS)}), not {cfg.arch}")
    if cfg.n_experts != t.n_experts:
        raise MboltError(f"{where}: the profile has {t.n_experts} experts per layer, the model {cfg.n_experts} "
                         f"(give --experts {t.n_experts})")
    if cfg.vocab:
        raise MboltError(f"{where}: fitted on the built-in byte vocabulary's tokens; drop --vocab")
    if cfg.context:
        raise MboltError(f"{where}: plants its own context attention; drop --context")
    if (cfg.hidden - 1) // 2 < 8:
        raise MboltError(f"{where}: hidden ({cfg.hidden}) must be >= 17 (a latent space of 8 dims or more)")
    fast = int((cfg.rope_base ** (-2.0 * np.arange(cfg.n_rot // 2) / cfg.n_rot) >= THETA_MIN).sum())
    if fast < MIN_PAIRS:
        raise MboltError(f"{where}: the context heads need {MIN_PAIRS} rotary pairs faster than {THETA_MIN} rad/token, "
                         f"head_dim {cfg.head_dim} (rope dims {cfg.n_rot}, base {cfg.rope_base:g}) has {fast}: "
                         f"use head_dim 64 or more")
    if not len(t.layers()):
        raise MboltError(f"{where}: the profile records no routing")
    if t.reuse is not None:
        if cfg.n_heads < 2:
            raise MboltError(f"{where}: the reuse needs 2 attention heads or more (a lag head and a window head)")
        theta = cfg.rope_base ** (-2.0 * np.arange(cfg.n_rot // 2) / cfg.n_rot)
        if len(window_pairs(theta)) < MIN_WINDOW_PAIRS:
            raise MboltError(f"{where}: the window head needs {MIN_WINDOW_PAIRS} rotary pairs slower than {THETA_MIN} "
                             f"rad/token, rope dims {cfg.n_rot} at base {cfg.rope_base:g} have "
                             f"{len(window_pairs(theta))}: use head_dim 64 or more")
        if t.reuse.k > cfg.n_experts:
            raise MboltError(f"{where}: the reuse target's top-{t.reuse.k} is more than the model's {cfg.n_experts} experts")


class RoutingLike:
    """The planting of a RoutingTarget: what synth.py asks of a planting (embeddings, groups,
    token_topic, router, probs_bias, attention, context_norm), plus kv() and summary()."""

    def __init__(self, cfg, vocab_size: int):
        from threadpoolctl import threadpool_limits

        check(cfg)
        # one BLAS thread: on a loaded 2-core machine OpenBLAS's threads spin against each other
        # (a 512 x 512 eigh took 3.9 s with them, 0.04 s without)
        with threadpool_limits(1, user_api="blas"):
            self._plant(cfg, vocab_size)

    def _plant(self, cfg, vocab_size) -> None:
        self.cfg, self.H, self.V = cfg, cfg.hidden, vocab_size
        t: RoutingTarget = cfg.routing_like
        H, E, D = cfg.hidden, cfg.n_experts, latent_dim(cfg)
        rng = rng_for(cfg.seed, "routing-like")
        basis, _ = np.linalg.qr(rng.standard_normal((H, 1 + D)))
        self.common, self.latent = basis[:, 0], basis[:, 1:]  # [H], [H, D]
        codes = rng.standard_normal((vocab_size, D))
        self.codes = codes / np.linalg.norm(codes, axis=1, keepdims=True)
        rest = rng.standard_normal((vocab_size, H))
        rest -= (rest @ basis) @ basis.T
        rest /= np.linalg.norm(rest, axis=1, keepdims=True)
        rest *= math.sqrt(1 - TOKEN_B**2 - TOKEN_L**2)
        emb = TOKEN_B * self.common + TOKEN_L * self.codes @ self.latent.T + rest
        self.embeddings = (emb * math.sqrt(H)).astype(np.float32)
        self.heads = make_heads(cfg.n_heads, cfg.n_rot, cfg.rope_base, D, min(D, cfg.head_dim), rng,
                                window=t.reuse is not None)
        moe = list(range(cfg.dense_layers, cfg.n_layers))
        self.profile_layer = dict(zip(moe, layer_map(len(moe), t.layers())))
        key = (cfg.seed, H, E, cfg.n_used, cfg.n_heads, cfg.head_dim, cfg.n_rot, cfg.rope_base, tuple(moe), vocab_size)
        if key not in t.fits:
            targets = [(t.heat[self.profile_layer[i]], t.pairs[self.profile_layer[i]]) for i in moe]
            t.fits[key] = fit_model(targets, cfg.n_used, self.codes, self.heads, rng, t.overlap_vs_heat,
                                    reuse=t.reuse)
        self.fit: ModelFit = t.fits[key]
        self.layer_fit = dict(zip(moe, self.fit.layers))
        self.groups = np.full((cfg.n_layers, E), -1, dtype=np.int32)  # no planted groups
        self.token_topic = np.full(vocab_size, -1, dtype=np.int64)

    def router(self, layer: int) -> np.ndarray:
        f = self.layer_fit[layer]
        rows = np.outer(f.b / TOKEN_B, self.common) + (f.A / TOKEN_L) @ self.latent.T
        return (rows / math.sqrt(self.H)).astype(np.float32)

    def probs_bias(self, layer: int) -> np.ndarray:
        return rng_for(self.cfg.seed, f"blk.{layer}.exp_probs_b").standard_normal(self.cfg.n_experts) * PROBS_BIAS_STD

    def _units(self) -> tuple[np.ndarray, np.ndarray]:
        """Unit k vector and the unit q vector of every head (before scaling), over one head's dims.
        With a window head k is half on the lag heads' pairs and half on the window's (so every
        score carries 1/sqrt(2): `_kernel` makes up for it), and the window head's q reads its
        pairs at WINDOW_KERNEL / KERNEL of its norm, the rest on the slowest pair, which no key
        reads (its score is then WINDOW_KERNEL * mean cos: a lower peak than the lag heads')."""
        cfg, h = self.cfg, self.heads
        d, half = cfg.head_dim, cfg.n_rot // 2

        def dims(p):  # the two dims of rotary pairs p
            return (p, p + half) if cfg.arch in NEOX_ARCHS else (2 * p, 2 * p + 1)

        p = h.pairs
        a, b = dims(p)
        k = np.zeros(d)
        k[a] = 1 / math.sqrt(len(p))
        q = np.zeros((cfg.n_heads, d))
        for i in range(cfg.n_heads):
            lag = h.lags[min(i, len(h.lags) - 1)]  # heads past the lags: lag-1 queries, no output
            q[i, a] = np.cos(lag * h.theta[p]) / math.sqrt(len(p))
            q[i, b] = -np.sin(lag * h.theta[p]) / math.sqrt(len(p))
        if h.window:
            w, _ = dims(h.window_pairs)
            k[w] = 1 / math.sqrt(len(w))
            k /= math.sqrt(2)
            part = WINDOW_KERNEL / KERNEL
            q[len(h.lags)] = 0
            q[len(h.lags), w] = part / math.sqrt(len(w))
            q[len(h.lags), dims(np.array([half - 1]))[0]] = math.sqrt(1 - part**2)
        return k, q

    def _kernel(self) -> float:
        """The score scale that gives the lag heads KERNEL at their lag (see _units)."""
        return KERNEL * (math.sqrt(2) if self.heads.window else 1.0)

    @staticmethod
    def zero_attention(layer: int) -> bool:
        """Every layer's attention but layer 0's is all zeros (every router reads one latent state)."""
        return layer != 0

    def attention(self, layer: int):
        """(q [n_heads d, H], k [n_kv d, H], v [n_kv d, H], o [H, n_heads d]) of a layer: the
        context heads at layer 0, zeros elsewhere (numpy shapes: [out, in])."""
        cfg, H, d = self.cfg, self.H, self.cfg.head_dim
        q_w, kv_w = cfg.n_heads * d, cfg.n_kv_heads * d
        if self.zero_attention(layer):
            return np.zeros((q_w, H)), np.zeros((kv_w, H)), np.zeros((kv_w, H)), np.zeros((H, q_w))
        k_unit, q_units = self._units()
        # with q/k RMSNorm the scale is the norm weight's (context_norm); without, q.k = KERNEL sqrt(d)
        # exactly as <m, x> = TOKEN_B sqrt(H) at layer 0 (x = the token's embedding)
        norm = cfg.arch in ("qwen3moe", "olmoe")
        scale = 1 / TOKEN_B if norm else math.sqrt(self._kernel() * math.sqrt(d)) / (TOKEN_B * math.sqrt(H))
        q = np.concatenate([np.outer(u, self.common) for u in q_units]) * scale
        k = np.tile(np.outer(k_unit, self.common), (cfg.n_kv_heads, 1)) * scale
        c = self.heads.carried
        v1 = np.zeros((d, H))
        v1[:c] = self.latent[:, :c].T / (math.sqrt(H) * TOKEN_L)  # reads the first c code coordinates
        o = np.zeros((H, q_w))
        for i, m in enumerate(self.heads.mix(self.fit.share, self.fit.gain)):
            o[:, i * d:i * d + c] = math.sqrt(H) * TOKEN_L * self.latent @ m
        return q, k, np.tile(v1, (cfg.n_kv_heads, 1)), o

    def context_norm(self) -> float:
        """q/k norm weight: the score at a head's lag is KERNEL after the norm (d/|pairs| per pair)."""
        return math.sqrt(self._kernel() / math.sqrt(self.cfg.head_dim)) if self.cfg.arch in ("qwen3moe", "olmoe") else 1.0

    def summary(self) -> dict:
        """The fit: profile layers used, share, window gain, and the calibration statistics (means
        over layers; `reuse`: at the reuse target's k, beside the target)."""
        st = [f.stats for f in self.fit.layers]

        def mean(key):
            vals = [s[key] for s in st if s[key] is not None]
            return float(np.mean(vals)) if vals else None

        t = self.cfg.routing_like
        reuse = None if t.reuse is None else {"target": dict(vars(t.reuse)), "calibration": self.fit.reuse}
        return {"source": t.source, "profile_layers": list(self.profile_layer.values()),
                "share": self.fit.share, "gain": self.fit.gain, "lam": [f.lam for f in self.fit.layers],
                "calibration": {key: mean(key) for key in ("entropy_norm", "top10_share", "cut_lift_p50",
                                                           "overlap", "overlap_vs_heat")}, "reuse": reuse}

    def kv(self) -> list[bytes]:
        from gguf import GGUFValueType

        from mbolt.core.header import encode_kv

        s = self.summary()
        return [encode_kv("mbolt.synth.routing_like", GGUFValueType.STRING, s["source"]),
                encode_kv("mbolt.synth.routing_like.share", GGUFValueType.FLOAT32, s["share"]),
                encode_kv("mbolt.synth.routing_like.gain", GGUFValueType.FLOAT32, s["gain"]),
                encode_kv("mbolt.synth.routing_like.layers", GGUFValueType.ARRAY,
                          [int(x) for x in s["profile_layers"]], GGUFValueType.INT32)]
