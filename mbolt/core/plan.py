"""plan.json: per layer the expert order a rewritten file will use, plus what it was built from.

`save_plan` / `load_plan` mirror each other; `load_plan` validates every layer (a permutation
of 0..E-1) and, given a model's shape, the layer and expert counts. Perms always name ORIGINAL
expert ids, so a plan applies to a stock file and to any file mbolt rewrote from it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mbolt.core.atomic import json_default, write_text_atomic
from mbolt.core.errors import MboltError
from mbolt.core.routemap import check_perm, inverse_perm

MIN_TRAIN_TOKENS = 2
FORMAT = "mbolt.plan"
PERMS_FORMAT = "mbolt.perms"  # the original mbolt's perms.json, as mbolt writes it (the original has no format key)
VERSION = 1


@dataclass
class Plan:
    method: str
    n_layers: int
    n_experts: int
    perm: np.ndarray  # int32 [n_layers, E]: perm[l, p] = original expert id at position p
    heat: np.ndarray  # float64 [n_layers, E]: training heat per ORIGINAL expert id
    meta: dict = field(default_factory=dict)  # split, phase, k, fingerprint, groups, timing...

    @property
    def pos(self) -> np.ndarray:
        """pos[l, e] = position of original expert e."""
        return inverse_perm(self.perm)

    def to_dict(self) -> dict:
        groups = self.meta.get("groups") or [None] * self.n_layers
        meta = {k: v for k, v in self.meta.items() if k != "groups"}
        return {
            "format": FORMAT,
            "version": VERSION,
            "method": self.method,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "fingerprint": self.meta.get("fingerprint", ""),
            "meta": meta,
            "layers": [
                {"layer": l, "perm": self.perm[l].tolist(), "heat": self.heat[l].tolist(),
                 **({"groups": groups[l]} if groups[l] is not None else {})}
                for l in range(self.n_layers)
            ],
        }


def validate_plan(plan: Plan, where: str = "plan", n_layers: int | None = None, n_experts: int | None = None) -> None:
    if n_layers is not None and plan.n_layers != n_layers:
        raise MboltError(f"{where}: plan has {plan.n_layers} layers, model has {n_layers}")
    if n_experts is not None and plan.n_experts != n_experts:
        raise MboltError(f"{where}: plan has {plan.n_experts} experts per layer, model has {n_experts}")
    check_perm(plan.perm, plan.n_layers, plan.n_experts, where)


def save_plan(path: str | os.PathLike, plan: Plan) -> Path:
    validate_plan(plan)
    write_text_atomic(path, json.dumps(plan.to_dict(), default=json_default) + "\n")
    return Path(path)


def perms_as_plan(d: dict, where: str) -> dict:
    """The original mbolt's perms.json ({n_layers, n_expert, n_tokens, layers: [{layer,
    clique_perm, chain_perm, heat_perm, heat}]}) as a plan dict: each layer's order is its
    ``perm`` when mbolt wrote the file (the plan's own method), else the original's suggested
    ``chain_perm``."""
    extra = d.get("mbolt") if isinstance(d.get("mbolt"), dict) else {}
    layers = []
    for l, rec in enumerate(d["layers"]):
        if not isinstance(rec, dict):
            raise MboltError(f"{where}: layer {l}: record is a {type(rec).__name__}, expected an object")
        key = "perm" if "perm" in rec else "chain_perm"
        if key not in rec:
            raise MboltError(f"{where}: layer {l}: no chain_perm")
        layers.append({"layer": rec.get("layer", l), "perm": rec[key], "heat": rec.get("heat", [])
                       or [0] * len(rec[key])})
    method = extra.get("method") if isinstance(extra.get("method"), str) else "perms:chain"
    return {"format": FORMAT, "version": VERSION, "method": method, "n_layers": d.get("n_layers"),
            "n_experts": d.get("n_expert"), "fingerprint": str(extra.get("fingerprint", "")),
            "meta": {"from": "perms.json"}, "layers": layers}


def load_plan(path: str | os.PathLike, n_layers: int | None = None, n_experts: int | None = None) -> Plan:
    from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_range, read_json

    where = str(path)
    d = read_json(path, "plan file")
    if isinstance(d, dict) and d.get("format", PERMS_FORMAT) == PERMS_FORMAT and isinstance(d.get("layers"), list) and d["layers"] \
            and isinstance(d["layers"][0], dict) and "chain_perm" in d["layers"][0]:
        d = perms_as_plan(d, where)
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise MboltError(f"{where}: not an mbolt plan nor a perms.json (format field missing)")
    if d.get("version") != VERSION:
        raise MboltError(f"{where}: unsupported plan version {d.get('version')}")
    L = check_range(d.get("n_layers"), f"{where}: n_layers", 1, MAX_LAYERS)
    E = check_range(d.get("n_experts"), f"{where}: n_experts", 1, MAX_EXPERTS)
    layers = d.get("layers")
    if not isinstance(layers, list) or len(layers) != L:
        raise MboltError(f"{where}: header says {L} layers, file has "
                         f"{len(layers) if isinstance(layers, list) else 'no layer list'}")
    try:
        perm = np.zeros((L, E), np.int32)
        heat = np.zeros((L, E))
        groups = []
        for l, rec in enumerate(layers):
            if not isinstance(rec, dict):
                raise MboltError(f"{where}: layer {l}: record is a {type(rec).__name__}, expected an object")
            if rec.get("layer", l) != l:
                raise MboltError(f"{where}: layer record {l} is labelled layer {rec.get('layer')!r}")
            p = np.asarray(rec.get("perm"))
            if p.shape != (E,) or (p.size and not np.issubdtype(p.dtype, np.integer)):
                raise MboltError(f"{where}: layer {l}: perm has {p.size} entries, expected {E} integers")
            if p.size and (p.min() < 0 or p.max() >= E):
                raise MboltError(f"{where}: layer {l}: perm has an expert id outside 0..{E - 1}")
            perm[l] = p
            h = np.asarray(rec.get("heat", np.zeros(E)), dtype=np.float64)
            if h.shape != (E,):
                raise MboltError(f"{where}: layer {l}: heat has {h.size} entries, expected {E}")
            heat[l] = h
            groups.append(rec.get("groups"))
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise MboltError(f"{where}: malformed plan ({e!r})") from None
    meta = d.get("meta") or {}
    if not isinstance(meta, dict):
        raise MboltError(f"{where}: meta is not an object")
    meta = dict(meta)
    meta["fingerprint"] = d.get("fingerprint", meta.get("fingerprint", ""))
    if any(g is not None for g in groups):
        meta["groups"] = groups
    plan = Plan(str(d.get("method", "")), L, E, perm, heat, meta)
    validate_plan(plan, where, n_layers, n_experts)
    return plan


