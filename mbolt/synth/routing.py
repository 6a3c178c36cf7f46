"""Planted routing: topics, token embeddings, expert groups and router rows of a synthetic model.

Planted routing (structure="planted")
-------------------------------------
The router of a layer sees `x = RMSNorm(h)` of the residual stream `h`. Attention and expert
outputs are kept small (output projections scaled by 1/sqrt(n_layers)), so `h` stays close to
the token embedding at every layer, and routing is a function of the token embedding direction:

* `n_groups` topic directions `u_g` (orthonormal) and one common direction `m`. Every token id
  gets a topic `g(t)`; its embedding is `sqrt(H) * (a*u_g(t) + b*m + c*n_t)` with a random unit
  `n_t` (a=0.6, b=0.3, c=sqrt(1-a^2-b^2)): tokens of a topic point the same way.
* Per layer the experts are dealt into `n_groups` groups by a random permutation (groups are
  scattered over expert ids, so stock order is not already optimal). Expert e of group G(e)
  gets the router row `v_e / sqrt(H)` with
  `v_e = (TOPIC_GAIN * strength / a) * u_G(e) + INDIVIDUAL * sqrt(H) * r_e + (bias_e / b) * m`,
  `r_e` a random unit vector. For a token of topic g the logits are then about
  `TOPIC_GAIN*strength*[G(e) == g] + bias_e + INDIVIDUAL*N(0,1)`: the token picks its k
  experts mostly inside its topic's group (co-activation), with the individual term deciding
  which members. `strength` 0 leaves only the individual and bias terms.
* Heat: `bias_e = heat_skew * (HEAT_EXPERT * z_e + HEAT_GROUP * z_G(e))` with z ~ N(0,1), through
  the common direction m (every token has the same component b along m), so it acts as a
  per-expert logit bias: some experts and some groups are hotter. heat_skew 0 = flat.
* structure="none" (the null control): router rows are iid Gaussian (`NONE_SCALE` logit std)
  plus the same heat bias; embeddings are unchanged, but nothing ties groups to topics.

* context > 0 (opt-in; default 0 keeps routing a function of the token id, apart from small
  attention noise): attention is built to look at the recent tokens (q = k = a constant vector
  read off m, so the score depends only on the distance through RoPE) and to add `context` times
  their topics, plus a random projection of the rest of them, to the residual stream. Routing
  then depends on the token and its recent context: more distinct expert sets per token id, and
  co-activation across the groups of neighbouring topics (weaker group coherence).
  Also with fast_random (the attention matrices are then real, the experts random).

The planted groups are recorded in the file (`mbolt.synth.groups`: int32 [n_layers*E] group id of
every expert, -1 for dense layers) so tests and benchmarks can score a plan against the truth.

Sigmoid-gated families (glm4moe, deepseek2) select by sigmoid(logit) + exp_probs_b: sigmoid is
monotone, so the same router rows pick the same groups; exp_probs_b is a small per-expert bias
(`probs_bias`), like the selection bias of the real models.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

# Planted-routing constants (see module docstring).
TOPIC_A, TOPIC_B = 0.6, 0.3
TOPIC_GAIN = 8.0  # logit bonus of the token's own group at strength 1
INDIVIDUAL = 1.5  # std of the per-expert, per-token logit term
HEAT_EXPERT, HEAT_GROUP = 1.5, 1.0
NONE_SCALE = 3.0  # logit std of iid router rows (structure="none")
CONTEXT_NOISE = 0.5  # context attention: weight of the non-topic part of the context
KERNEL = 24.0  # context attention: score at distance 0 (recency sharpness)
PROBS_BIAS_STD = 0.02  # exp_probs_b: per-expert selection bias (after the sigmoid)


def rng_for(seed: int, *parts) -> np.random.Generator:
    """The generator of one named thing of a model: same seed and name, same numbers."""
    key = [seed & 0xFFFFFFFF] + [zlib.crc32(str(p).encode()) for p in parts]
    return np.random.default_rng(key)


class PlantedRouting:
    """Topic directions, embeddings [V, H], expert groups [n_layers, E] and router rows of a config."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.H, self.V = cfg, cfg.hidden, vocab_size
        G, H = cfg.groups, cfg.hidden
        rng = rng_for(cfg.seed, "topics")
        n_dirs = G + 1
        basis = rng.standard_normal((H, n_dirs))
        if n_dirs <= H:
            basis, _ = np.linalg.qr(basis)  # orthonormal topic directions + common direction
        else:
            basis /= np.linalg.norm(basis, axis=0, keepdims=True)
        self.topic_dirs = basis[:, :G].T  # [G, H]
        self.common = basis[:, G]
        self.token_topic = rng.integers(0, G, self.V)
        noise = rng.standard_normal((self.V, H))
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        c = math.sqrt(1 - TOPIC_A**2 - TOPIC_B**2)
        emb = TOPIC_A * self.topic_dirs[self.token_topic] + TOPIC_B * self.common + c * noise
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        self.embeddings = (emb * math.sqrt(H)).astype(np.float32)  # [V, H]
        self.groups = np.full((cfg.n_layers, cfg.n_experts), -1, dtype=np.int32)
        for layer in range(cfg.dense_layers, cfg.n_layers):
            order = rng_for(cfg.seed, "groups", layer).permutation(cfg.n_experts)
            self.groups[layer, order] = np.arange(cfg.n_experts) % G

    def router(self, layer: int) -> np.ndarray:
        """[E, H] router rows of a MoE layer (see module docstring)."""
        cfg, H, E = self.cfg, self.H, self.cfg.n_experts
        rng = rng_for(cfg.seed, "router", layer)
        group = self.groups[layer]
        z_e = rng.standard_normal(E)
        z_g = rng.standard_normal(cfg.groups)
        bias = cfg.heat_skew * (HEAT_EXPERT * z_e + HEAT_GROUP * z_g[group])
        r = rng.standard_normal((E, H))
        if cfg.structure == "none":
            v = NONE_SCALE * r  # iid rows: logit = <v, x>/sqrt(H) ~ N(0, NONE_SCALE^2) as |x| = sqrt(H)
        else:
            r /= np.linalg.norm(r, axis=1, keepdims=True)
            v = (TOPIC_GAIN * cfg.strength / TOPIC_A) * self.topic_dirs[group] + INDIVIDUAL * math.sqrt(H) * r
        v = v + (bias / TOPIC_B)[:, None] * self.common[None, :]
        return (v / math.sqrt(H)).astype(np.float32)

    def probs_bias(self, layer: int) -> np.ndarray:
        """[E] exp_probs_b of a MoE layer: a small selection bias added after the sigmoid."""
        return rng_for(self.cfg.seed, f"blk.{layer}.exp_probs_b").standard_normal(self.cfg.n_experts) * PROBS_BIAS_STD

    def context_attention(self, layer: int):
        """Per-head blocks of an attention that looks at recent tokens and adds their topics.

        q = k = a constant per-head vector (read off the common direction m that every token
        carries), so the score depends only on the distance i - j through RoPE: the sum of
        cos(theta_p * (i - j)) over the rotary pairs peaks at distance 0 and decays over the
        recent tokens (KERNEL = score at distance 0). v holds the topic coordinates of a token;
        o writes `context` times the attention-weighted topics of the context back into the
        residual stream, so routing depends on the token and on its recent context.
        Returns (q/k block [d, H], v block [d, H], o block [H, d]); see context_norm.
        """
        cfg, H, d = self.cfg, self.H, self.cfg.head_dim
        G = min(cfg.groups, d)
        unit = np.full(d, 1 / math.sqrt(d))
        if cfg.arch in ("qwen3moe", "olmoe"):  # q/k RMSNorm: its weight (context_norm) sets the scale
            qk = np.outer(unit, self.common) / TOPIC_B
        else:  # |q|^2 / sqrt(d) = KERNEL, with <m, x> = TOPIC_B * sqrt(H)
            qk = np.outer(unit, self.common) * math.sqrt(KERNEL * math.sqrt(d)) / (TOPIC_B * math.sqrt(H))
        # v: the token's topic coordinates (~ TOPIC_A * onehot) and a random projection of the
        # rest of it (so the context also moves which members of a group are picked)
        rng = rng_for(cfg.seed, "context", layer)
        proj = rng.standard_normal((d - G, H)) / math.sqrt(H)
        v = np.concatenate([self.topic_dirs[:G], proj]) / math.sqrt(H)
        o = np.concatenate([self.topic_dirs[:G].T, proj.T * math.sqrt(H / (d - G or 1)) * CONTEXT_NOISE], axis=1)
        o *= cfg.context * math.sqrt(H) / cfg.n_heads
        return qk, v, o

    def attention(self, layer: int):
        """(q, k, v, o) matrices of the context attention (numpy shapes [out, in]): the per-head
        blocks of context_attention, every head alike."""
        n, n_kv = self.cfg.n_heads, self.cfg.n_kv_heads
        qk, v, o = self.context_attention(layer)
        return np.tile(qk, (n, 1)), np.tile(qk, (n_kv, 1)), np.tile(v, (n_kv, 1)), np.tile(o, (1, n))

    def context_norm(self) -> float:
        """q/k norm weight of the context attention: |q|^2 / sqrt(d) = KERNEL after the norm."""
        return math.sqrt(KERNEL / math.sqrt(self.cfg.head_dim)) if self.cfg.arch in ("qwen3moe", "olmoe") else 1.0
