"""Co-activation profiles: the original mbolt's exchange format (`coactivation_*.json`), read and
written.

The format (doramirdor/mbolt, results/colibri-119/; real examples in ../shared/data/mbolt/):
top level ``model``, ``quant``, ``n_layers``, ``n_expert_per_layer``, ``total_experts``, ``k``,
``n_decode_tokens``, ``flat_index``, ``definitions``; per layer ``layer``, ``heat`` (decode
tokens that selected each expert), ``pairs`` ``[i, j, count, lift]`` (count >= 5, lift >= 1.5,
top 2,000 per layer by count; lift = P(ij) / (P(i) P(j)) rounded to 2 decimals), ``clusters``,
``chain_order`` (``chain_order[p]`` = expert stored at slot p) and ``heat_entropy_bits``. It is
what colibri's community builds expert maps from (colibri#119).

`load_profile` reads it (the Qwen profiles and the GLM-5.2 overlay, which numbers MoE layers by
``moe_order``); `export_profile` writes it from a trace's decode tokens. The pairs are only the
strong structure, not every pair: a profile read back drives `synth-trace --like`, not a plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.trace import DECODE, Trace, select_phase

PAIR_MIN_COUNT = 5
PAIR_MIN_LIFT = 1.5
PAIR_TOP = 2000


@dataclass
class Profile:
    model: str
    n_layers: int
    n_experts: int
    k: int
    n_tokens: int
    heat: np.ndarray  # [L, E] counts over n_tokens (zeros on layers the profile does not list)
    pairs: list[np.ndarray]  # per layer float [P, 4]: i, j, count, lift
    chain_order: np.ndarray | None  # [L, E] published chain order, if every listed layer has one
    path: str = ""

    def layers(self) -> np.ndarray:
        """The layers the profile describes (some heat recorded)."""
        return np.flatnonzero(self.heat.sum(axis=1) > 0)


def load_profile(path: str | os.PathLike) -> Profile:
    where = str(path)
    from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_range, read_json

    d = read_json(path, "co-activation profile")
    if not isinstance(d, dict):
        raise MboltError(f"{where}: not a co-activation profile (not a JSON object)")
    try:
        # The Qwen profiles name n_layers, n_decode_tokens and each record's "layer"; the GLM-5.2
        # overlay lists MoE layers only ("moe_order"), counts tokens in profile_rows.decode_rows
        # and adds a fifth pair column (category support), which is not used here. A profile of a
        # model with dense layers (mbolt's export) lists only its MoE layers, by "layer".
        records = d["layers"]
        L = check_range(d.get("n_layers", len(records)), f"{where}: n_layers", 1, MAX_LAYERS)
        E = check_range(d["n_expert_per_layer"], f"{where}: n_expert_per_layer", 1, MAX_EXPERTS)
        k = check_range(d["k"], f"{where}: k", 1, E)
        n_tok = d["n_decode_tokens"] if "n_decode_tokens" in d else d["profile_rows"]["decode_rows"]
        N = check_range(n_tok, f"{where}: n_decode_tokens", 1, 1 << 26)
        if not isinstance(records, list) or not records:
            raise MboltError(f"{where}: no layer records")
        by = "layer" if all("layer" in r for r in records) else "moe_order"
        heat = np.zeros((L, E))
        pairs = [np.zeros((0, 4)) for _ in range(L)]
        chain = np.tile(np.arange(E), (L, 1))
        have_chain = True
        seen: set[int] = set()
        for rec in records:
            l = check_range(rec[by], f"{where}: layer record {by}", 0, L - 1)
            if l in seen:
                raise MboltError(f"{where}: layer {l} is listed twice")
            seen.add(l)
            h = np.asarray(rec["heat"], dtype=np.float64)
            if h.shape != (E,) or not np.isfinite(h).all() or (h < 0).any():
                raise MboltError(f"{where}: layer {l}: heat has {h.size} entries, expected {E} counts >= 0")
            heat[l] = h
            raw = rec.get("pairs") or []
            p = np.asarray([row[:4] for row in raw] or np.zeros((0, 4)), dtype=np.float64).reshape(-1, 4)
            if len(p) and (p[:, :2].min() < 0 or p[:, :2].max() >= E):
                raise MboltError(f"{where}: layer {l}: pair expert id outside 0..{E - 1}")
            pairs[l] = p
            co = rec.get("chain_order")
            if co is None or sorted(co) != list(range(E)):
                have_chain = False
            else:
                chain[l] = co
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise MboltError(f"{where}: malformed co-activation profile ({e!r})") from None
    return Profile(str(d.get("model", d.get("artifact", ""))), L, E, k, N, heat, pairs,
                   chain if have_chain else None, where)


def entropy_bits(h: np.ndarray) -> float:
    p = h[h > 0] / h.sum()
    return float(-(p * np.log2(p)).sum())


def strong_pairs(counts: np.ndarray, heat: np.ndarray, n_tokens: int) -> list[list]:
    """[i, j, count, lift] with i < j, count >= PAIR_MIN_COUNT and lift >= PAIR_MIN_LIFT, the
    PAIR_TOP largest counts (ties: lower i, then lower j), lift rounded to 2 decimals."""
    iu, ju = np.triu_indices(len(heat), 1)
    c = counts[iu, ju]
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = np.where(heat[iu] * heat[ju] > 0, c * n_tokens / (heat[iu] * heat[ju]), 0.0)
    keep = np.flatnonzero((c >= PAIR_MIN_COUNT) & (lift >= PAIR_MIN_LIFT))
    keep = keep[np.lexsort((ju[keep], iu[keep], -c[keep]))][:PAIR_TOP]
    return [[int(iu[x]), int(ju[x]), int(c[x]), round(float(lift[x]), 2)] for x in keep]


def model_labels(mm) -> tuple[str, str]:
    """(model, quant) for a profile: general.name (else the file name) and general.file_type's
    name (else the first routed tensor's type)."""
    from pathlib import Path

    import gguf

    name = mm.header.get(gguf.Keys.General.NAME)
    name = name if isinstance(name, str) and name else Path(mm.path).stem
    ft = mm.header.get(gguf.Keys.General.FILE_TYPE)
    try:
        quant = gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        quant = mm.moe_layers[0].weights[0].type if mm.moe_layers else ""
    return name, quant


def export_profile(trace: Trace, *, model: str = "", quant: str = "", progress=None, where: str = "trace") -> dict:
    """The trace's decode tokens as a co-activation profile in the original mbolt's format.

    Heat and pairs count every decode token; clusters are the groups `mbolt plan` records
    (greedy modularity up to 256 experts, spectral above), hottest first; chain_order is the
    original's chain (`mbolt-chain`) through those clusters."""
    from mbolt.layout.coact import coactivation
    from mbolt.layout.methods import order
    from mbolt.layout.plan import groups_method, layer_groups

    if not (np.asarray(trace.phase) == DECODE).any():
        raise MboltError(f"{where}: no decode tokens (the co-activation profile counts decode tokens only)")
    dec = select_phase(trace, "decode")
    co = coactivation(dec)
    groups = layer_groups(co, "auto", progress=progress)
    layers = []
    for l in co.layers:
        n = int(co.n_tokens[l])
        heat = co.heat[l]
        layers.append({
            "layer": int(l),
            "heat": [int(x) for x in heat],
            "pairs": strong_pairs(co.counts[l], heat, n),
            "clusters": groups[l],
            "chain_order": order(co.counts[l], heat, "mbolt-chain", clusters=groups[l]).tolist(),
            "heat_entropy_bits": round(entropy_bits(heat), 3),
        })
    E = trace.n_experts
    return {
        "model": model or "unknown",
        "quant": quant or "unknown",
        "n_layers": trace.n_layers,
        "n_expert_per_layer": E,
        "total_experts": trace.n_layers * E,
        "k": trace.k,
        "n_decode_tokens": dec.n_tokens,
        "flat_index": "gid = layer * n_expert_per_layer + expert_id",
        "definitions": {
            "heat": "count[e] = decode tokens where e is in the layer's top-k",
            "pairs": "[i, j, count, lift]; count = decode tokens where i and j both in the layer's top-k; "
                     "lift = P(ij)/(P(i)P(j)); within-layer only; thresholds count>=5, lift>=1.5, "
                     "top 2000/layer by count",
            "clusters": f"{groups_method(co, 'auto')} communities of the co-activation graph, heat-ordered "
                        "(all decode tokens of the trace)",
            "chain_order": "suggested adjacency order: within each cluster, greedy max-co-weight path from its "
                           "hottest expert; chain_order[p] = expert id stored at slot p",
            "layers": "only layers with recorded routing are listed (dense layers are not)",
        },
        "exported_by": "mbolt export-coact",
        "source_fingerprint": trace.fingerprint,
        "layers": layers,
    }
