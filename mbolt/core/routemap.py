"""The route map of a rewritten GGUF: which original expert sits at which position.

`reorder` writes it twice: as `mbolt.*` metadata inside the GGUF and as a JSON sidecar
(`out.gguf.mbolt.json`) for engines that do not read GGUF metadata. A stock file has the
identity route map. `expert_ranges` turns a MoE map plus its route map into the byte ranges of
every expert, by ORIGINAL expert id, for stock, reorder and packed files alike: the streaming
store, the evaluator and the verifier all locate experts through it.

Keys (DESIGN.md; compatible with the original mbolt where they overlap):
  mbolt.version (u32), mbolt.layout ("reorder" | "packed"), mbolt.n_layers (u32),
  mbolt.n_experts (u32), mbolt.perm (i32 [n_layers*E], perm[l*E + p] = original id at
  position p; identity for dense layers), mbolt.heat (f32 [n_layers*E], per position),
  mbolt.source.fingerprint (str), mbolt.plan.method (str), and for packed files the
  mbolt.packed.* keys of core/packed.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import Keys

from mbolt.core.checks import MAX_EXPERTS, n_layers_of
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import open_model_header, split_vaddr, vaddr
from mbolt.core.header import GGUFHeader

ROUTE_MAP_VERSION = 1
ROUTE_MAP_KEYS = ("mbolt.version", "mbolt.layout", "mbolt.n_layers", "mbolt.n_experts", "mbolt.perm",
                  "mbolt.heat", "mbolt.source.fingerprint", "mbolt.plan.method")


def is_route_map_key(key: str) -> bool:
    """Keys `reorder` owns (rewritten on every run); other mbolt.* keys (e.g. mbolt.synth.*) are kept."""
    return key in ROUTE_MAP_KEYS or key.startswith("mbolt.packed.")


LAYOUTS = ("stock", "reorder", "packed")
SIDECAR_SUFFIX = ".mbolt.json"


@dataclass
class RouteMap:
    layout: str  # "stock" | "reorder" | "packed"
    perm: np.ndarray  # int32 [n_layers, E]: perm[l, p] = original expert id stored at position p
    heat: np.ndarray  # float32 [n_layers, E], per position (zeros when unknown)
    method: str  # plan method ("stock" for a stock file)
    source_fingerprint: str  # fingerprint of the original (stock) file's header
    version: int = ROUTE_MAP_VERSION

    @property
    def n_layers(self) -> int:
        return int(self.perm.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.perm.shape[1])

    @cached_property
    def pos(self) -> np.ndarray:
        """int32 [n_layers, E]: pos[l, e] = position of original expert e (computed once)."""
        return inverse_perm(self.perm)

    @property
    def is_identity(self) -> bool:
        return bool((self.perm == np.arange(self.n_experts, dtype=np.int32)).all())

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "layout": self.layout,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "method": self.method,
            "source_fingerprint": self.source_fingerprint,
            "perm": self.perm.tolist(),
            "heat": [[float(x) for x in row] for row in self.heat],
        }


def identity_perm(n_layers: int, n_experts: int) -> np.ndarray:
    """int32 [n_layers, E]: every layer in stock order."""
    return np.tile(np.arange(n_experts, dtype=np.int32), (n_layers, 1))


def inverse_perm(perm: np.ndarray) -> np.ndarray:
    """pos[l, e] = position of expert e in perm[l] (the one inverse of a perm table)."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm, dtype=np.int32)
    rows = np.arange(perm.shape[0])[:, None]
    inv[rows, perm] = np.arange(perm.shape[1], dtype=np.int32)[None, :]
    return inv


def check_perm(perm: np.ndarray, n_layers: int, n_experts: int, where: str) -> np.ndarray:
    """Validate an [n_layers, E] array of per-layer permutations (the one perm rule); returns it
    as int32. Shape errors name the model's counts; a bad layer names the missing or repeated ids."""
    perm = np.asarray(perm)
    if perm.ndim != 2 or perm.shape[1] != n_experts:
        got = perm.shape[1] if perm.ndim == 2 else f"shape {perm.shape}"
        raise MboltError(f"{where}: {got} experts per layer, the model has {n_experts}")
    if perm.shape[0] != n_layers:
        raise MboltError(f"{where}: {perm.shape[0]} layers, the model has {n_layers}")
    ok = np.sort(perm, axis=1) == np.arange(n_experts)[None, :]
    bad = np.flatnonzero(~ok.all(axis=1))
    if bad.size:
        l = int(bad[0])
        ids = sorted(set(range(n_experts)) ^ set(perm[l].tolist()))[:5]
        raise MboltError(f"{where}: layer {l} is not a permutation of 0..{n_experts - 1} "
                         f"(missing or repeated: {ids})")
    return perm.astype(np.int32)


def _model_shape(header: GGUFHeader) -> tuple[int, int]:
    key = Keys.LLM.EXPERT_COUNT.format(arch=header.get(Keys.General.ARCHITECTURE))
    n_experts = header.get_int(key)
    if not 0 <= n_experts <= MAX_EXPERTS:  # it sizes the route map
        raise MboltError(f"{header.path}: {key} is {n_experts} (at most {MAX_EXPERTS} supported)")
    return n_layers_of(header), n_experts


def read_route_map(src) -> RouteMap:
    """The route map of a GGUF (identity with layout "stock" for a file mbolt did not write); `src`
    is a path, a GGUFHeader or an opened model (core.moe_map.MoeMap, whose map is read once)."""
    if hasattr(src, "route_map"):
        return src.route_map
    header = src if isinstance(src, GGUFHeader) else open_model_header(src)
    path = header.path
    n_layers, n_experts = _model_shape(header)
    layout = header.get("mbolt.layout")
    if layout is None:
        ident = identity_perm(n_layers, n_experts)
        return RouteMap("stock", ident, np.zeros((n_layers, n_experts), np.float32), "stock", header.fingerprint, 0)
    if layout not in LAYOUTS[1:]:
        raise MboltError(f"{path}: unknown mbolt.layout {layout!r}")
    version = header.get_int("mbolt.version", 0)
    if version > ROUTE_MAP_VERSION:
        raise MboltError(f"{path}: route map version {version} is newer than this mbolt ({ROUTE_MAP_VERSION})")
    ml, me = header.get_int("mbolt.n_layers", -1), header.get_int("mbolt.n_experts", -1)
    if (ml, me) != (n_layers, n_experts):
        raise MboltError(f"{path}: route map is for {ml} layers x {me} experts, the model has {n_layers} x {n_experts}")
    perm = header.get("mbolt.perm")
    if not isinstance(perm, np.ndarray) or perm.dtype.kind not in "iu" or len(perm) != n_layers * n_experts:
        got = "missing" if perm is None else (f"{len(perm)} entries" if isinstance(perm, (np.ndarray, list))
                                              else f"a {type(perm).__name__}")
        raise MboltError(f"{path}: mbolt.perm is {got}, expected {n_layers * n_experts} integers")
    perm = check_perm(np.asarray(perm).reshape(n_layers, n_experts), n_layers, n_experts, f"{path}: mbolt.perm")
    heat = header.get("mbolt.heat")
    if not isinstance(heat, np.ndarray) or heat.dtype.kind not in "iuf" or len(heat) != n_layers * n_experts:
        heat = np.zeros((n_layers, n_experts), np.float32)
    heat = np.asarray(heat, np.float32).reshape(n_layers, n_experts)
    src_fp = header.get("mbolt.source.fingerprint")
    if not isinstance(src_fp, str) or not src_fp:
        raise MboltError(f"{path}: rewritten file without mbolt.source.fingerprint")
    method = header.get("mbolt.plan.method", "")
    return RouteMap(layout, perm, heat, method if isinstance(method, str) else "", src_fp, version)


def expert_ranges(moemap, layer) -> np.ndarray:
    """int64 [E, n_roles, 2] of an opened model (core.moe_map.MoeMap; this module sits below it, so
    its functions take one untyped) and one layer (a MoeLayer or its index): (start, size) of every
    expert's slice of every routed weight tensor, indexed by ORIGINAL expert id, roles in
    `layer.weights` order. The start is a virtual offset (core.gguf_set.vaddr: file index << 48 |
    offset in that file), the plain absolute offset for a one-file model; `split_vaddr` gives
    (file, offset).

    Works for stock, reorder and packed files and split sets (a dense layer gives [E, 0, 2]).
    """
    layer = moemap.layers[layer] if isinstance(layer, (int, np.integer)) else layer
    pos = moemap.route_map.pos[layer.index].astype(np.int64)
    weights = layer.weights
    out = np.empty((moemap.n_experts, len(weights), 2), np.int64)
    for r, w in enumerate(weights):
        out[:, r, 0] = vaddr(w.file, w.data_offset) + pos * (w.stride or w.slice_bytes)
        out[:, r, 1] = w.slice_bytes
    return out


# ---- JSON sidecar ----


def sidecar_path(gguf_path: str | os.PathLike) -> Path:
    p = Path(gguf_path)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def sidecar_dict(moemap) -> dict:
    """Everything an engine needs to locate experts without parsing GGUF metadata."""
    rm = moemap.route_map
    h = moemap.header
    layers = []
    for layer in moemap.moe_layers:
        layers.append({
            "index": layer.index,
            "tensors": [
                {
                    "name": w.name, "role": w.role, "type": w.type, "ne": list(w.ne),
                    "data_offset": w.data_offset, "slice_bytes": w.slice_bytes,
                    "stride": w.stride or w.slice_bytes, "file": w.file,
                    **({"container": w.container} if w.container else {}),
                }
                for w in layer.weights
            ],
        })
    return {
        "format": "mbolt.routemap",
        **rm.to_dict(),
        "file": Path(moemap.path).name,
        "files": [Path(p).name for p in moemap.paths],  # a tensor's "file" indexes this list
        "file_size": h.file_size,
        "fingerprint": h.fingerprint,  # of the GGUF (or set) this sidecar describes: readers check it
        "arch": moemap.arch,
        "n_used": moemap.n_used,
        "how_to_locate": "slice of original expert e in a tensor of layer l starts at "
        "data_offset + pos[l][e] * stride, where pos is the inverse of perm[l]; or read expert_map",
        "layers": layers,
        "expert_map": expert_map_dict(moemap),  # the same map `mbolt expert-map` writes (docs/expert_map.md)
    }


EXPERT_MAP_VERSION = 1


def expert_map_dict(moemap) -> dict:
    """The expert map for engines (docs/expert_map.md): for every MoE layer and ORIGINAL expert,
    the byte ranges [file, offset, bytes] of its slice in each routed weight tensor (one per
    projection; a packed file's projections lie side by side in one slot), with the tensor types,
    the file's alignment and the route map. Plain `pread` of a range gives the expert's bytes,
    whatever the layout (stock, reorder, packed) or the number of shards."""
    rm = moemap.route_map
    layers = []
    for layer in moemap.moe_layers:
        R = expert_ranges(moemap, layer)
        files, offs = split_vaddr(R[..., 0])
        layers.append({
            "layer": layer.index,
            "projections": [w.role for w in layer.weights],
            "types": [w.type for w in layer.weights],
            "perm": rm.perm[layer.index].tolist(),
            "experts": [[[int(files[e, r]), int(offs[e, r]), int(R[e, r, 1])] for r in range(R.shape[1])]
                        for e in range(R.shape[0])],
        })
    return {"format": "mbolt.expert-map", "version": EXPERT_MAP_VERSION, "layout": rm.layout,
            "files": [Path(p).name for p in moemap.paths], "fingerprint": moemap.header.fingerprint,
            "source_fingerprint": rm.source_fingerprint, "alignment": moemap.header.alignment,
            "arch": moemap.arch, "n_layers": moemap.n_layers, "n_experts": moemap.n_experts,
            "n_used": moemap.n_used, "layers": layers}


def read_sidecar(path: str | os.PathLike, fingerprint: str | None = None) -> RouteMap:
    """Read a JSON sidecar back into a RouteMap (validated). With `fingerprint` (the GGUF's),
    a sidecar written for another file is refused: the GGUF and its sidecar are one unit."""
    from mbolt.core.checks import MAX_EXPERTS, MAX_LAYERS, check_range, read_json

    p = Path(path)
    d = read_json(p, "mbolt route-map sidecar")
    try:
        if not isinstance(d, dict) or d.get("format", "mbolt.routemap") != "mbolt.routemap":
            raise MboltError(f"{p}: not an mbolt route-map sidecar (no format mbolt.routemap)")
        if fingerprint is not None and d.get("fingerprint") != fingerprint:
            raise MboltError(f"{p}: describes another file (fingerprint {str(d.get('fingerprint'))[:12]}, the GGUF "
                             f"beside it has {fingerprint[:12]}): stale sidecar, rewrite the model")
        n_layers = check_range(d["n_layers"], f"{p}: n_layers", 0, MAX_LAYERS)
        n_experts = check_range(d["n_experts"], f"{p}: n_experts", 1, MAX_EXPERTS)
        perm = np.asarray(d["perm"])
        if perm.dtype.kind not in "iu":
            raise MboltError(f"{p}: perm is not a table of integers")
        perm = check_perm(perm, n_layers, n_experts, f"{p}: perm")
        heat = np.asarray(d.get("heat") or np.zeros((n_layers, n_experts)), np.float32)
        if heat.shape != perm.shape:
            raise MboltError(f"{p}: heat is {heat.shape}, expected {perm.shape}")
        layout, src_fp = d["layout"], d["source_fingerprint"]
        if layout not in LAYOUTS or not isinstance(src_fp, str):
            raise MboltError(f"{p}: layout {layout!r} / source_fingerprint {src_fp!r} not understood")
        method = d.get("method", "")
        return RouteMap(layout, perm, heat, method if isinstance(method, str) else "", src_fp,
                        check_range(d.get("version", 0), f"{p}: version", 0, ROUTE_MAP_VERSION))
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise MboltError(f"{p}: not a valid mbolt route-map sidecar ({e!r})") from None
