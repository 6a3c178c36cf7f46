"""Metadata of the `packed` layout: where each projection of each expert sits in its layer's blob.

A packed file stores each MoE layer's routed weights as one tensor `blk.N.ffn_exps_packed`
(type I8, ne = (slot_bytes, n_experts)): position p's slot starts at `p * slot_bytes` and holds
that expert's slices of every weight tensor back to back (gate|up|down or gate_up|down), in the
order of the source's `layer.weights`. The metadata below records, per packed layer and role,
the original tensor's name, type and shape and the role's offset inside a slot, so a reader can
rebuild the virtual `blk.N.ffn_*_exps.weight` tensors (`moe_map` does).

Keys (flat arrays, one entry per packed layer or per (layer, role) in layer order):
  mbolt.packed.layers       int32   [n_packed]        layer index
  mbolt.packed.slot_bytes   uint64  [n_packed]        bytes between consecutive positions
  mbolt.packed.n_roles      uint32  [n_packed]        weight tensors packed in the layer
  mbolt.packed.names        string  [n_entries]       original tensor name
  mbolt.packed.types        uint32  [n_entries]       ggml type
  mbolt.packed.n_dims       uint32  [n_entries]
  mbolt.packed.ne           uint64  [n_entries * 4]   shape, padded with 1
  mbolt.packed.offset       uint64  [n_entries]       offset of the role inside a slot
  mbolt.packed.slice_bytes  uint64  [n_entries]       bytes of one expert's slice of the role
llama.cpp does not load this layout (it has no ffn_*_exps tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType

from mbolt.core.checks import MAX_LAYERS
from mbolt.core.errors import MboltError

_GGML_TYPES = {int(t) for t in GGMLQuantizationType}
PACKED_SUFFIX = "ffn_exps_packed"
PAGE = 4096
PACK_PAD_MAX = 1 / 8  # pad a packed slot to 4 KiB (or 512 B) only if it costs at most this share
KEYS = ("layers", "slot_bytes", "n_roles", "names", "types", "n_dims", "ne", "offset", "slice_bytes")


def packed_name(layer: int) -> str:
    return f"blk.{layer}.{PACKED_SUFFIX}"


def slot_stride(expert_bytes: int, align: int | None = None) -> tuple[int, str]:
    """(slot bytes, alignment granule) of a packed slot holding `expert_bytes`: the one rule.

    By default a slot is padded to 4 KiB, else 512 B (O_DIRECT's sector), when the padding costs
    at most PACK_PAD_MAX of the expert; otherwise it is left unpadded (granule ""). An explicit
    `align` (`reorder --align`, e.g. 64 KiB for Windows unbuffered reads) always pads to it."""
    if align:
        return -(-expert_bytes // align) * align, size_label(align)
    for granule, what in ((PAGE, "4 KiB"), (512, "512 B")):
        stride = -(-expert_bytes // granule) * granule
        if stride - expert_bytes <= expert_bytes * PACK_PAD_MAX:
            return stride, what
    return expert_bytes, ""


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB" if n >= 1024 and not n % 1024 \
        else f"{n} B"


def check_align(align: int) -> int:
    """--align: a power of two from 32 B (GGUF's default) to 16 MiB (llama.cpp needs a power of two)."""
    if not 32 <= align <= 1 << 24 or align & (align - 1):
        raise MboltError(f"--align {align}: must be a power of two from 32 to {1 << 24} bytes (e.g. 4096, 65536)")
    return align


@dataclass
class PackedRole:
    name: str  # original tensor name, e.g. blk.3.ffn_gate_exps.weight
    type: int  # ggml type (GGMLQuantizationType value)
    ne: tuple[int, ...]
    offset: int  # inside a slot
    slice_bytes: int


@dataclass
class PackedLayer:
    layer: int
    slot_bytes: int
    roles: list[PackedRole] = field(default_factory=list)

    @property
    def tensor(self) -> str:
        return packed_name(self.layer)


def read_packed(header) -> dict[int, PackedLayer]:
    """The packed-layout metadata of a GGUF header ({} when the file is not packed)."""
    if header.get("mbolt.packed.layers") is None:
        return {}
    path = header.path
    try:
        v = {k: header.get(f"mbolt.packed.{k}") for k in KEYS}
        missing = [k for k, x in v.items() if x is None]
        if missing:
            raise MboltError(f"{path}: packed layout metadata incomplete (missing mbolt.packed.{missing[0]})")
        for k in ("layers", "slot_bytes", "n_roles", "types", "n_dims", "ne", "offset", "slice_bytes"):
            if not isinstance(v[k], np.ndarray) or v[k].dtype.kind not in "iu":
                raise MboltError(f"{path}: packed layout metadata: mbolt.packed.{k} is not an integer array")
        if not isinstance(v["names"], list):
            raise MboltError(f"{path}: packed layout metadata: mbolt.packed.names is not a string array")
        layers = np.asarray(v["layers"], np.int64)
        n_roles = np.asarray(v["n_roles"], np.int64)
        n_entries = sum(int(x) for x in n_roles)  # Python ints: cannot wrap
        if len(v["slot_bytes"]) != len(layers) or len(n_roles) != len(layers):
            raise MboltError(f"{path}: packed layout metadata: per-layer arrays differ in length")
        for k in ("names", "types", "n_dims", "offset", "slice_bytes"):
            if len(v[k]) != n_entries:
                raise MboltError(f"{path}: packed layout metadata: mbolt.packed.{k} has {len(v[k])} entries, expected {n_entries}")
        if len(v["ne"]) != 4 * n_entries:
            raise MboltError(f"{path}: packed layout metadata: mbolt.packed.ne has {len(v['ne'])} entries, expected {4 * n_entries}")
        out: dict[int, PackedLayer] = {}
        j = 0
        for i, layer in enumerate(layers):
            pl = PackedLayer(int(layer), int(v["slot_bytes"][i]))
            if not 0 <= pl.layer < MAX_LAYERS or pl.layer in out:
                raise MboltError(f"{path}: packed layout metadata: layer {pl.layer} is out of range or repeated")
            for _ in range(int(n_roles[i])):
                nd = int(v["n_dims"][j])
                name = str(v["names"][j])
                if not 1 <= nd <= 4:
                    raise MboltError(f"{path}: packed layout metadata: {name} has {nd} dimensions")
                if int(v["types"][j]) not in _GGML_TYPES:
                    raise MboltError(f"{path}: packed layout metadata: {name} has unknown ggml type {int(v['types'][j])}")
                ne = tuple(int(x) for x in v["ne"][4 * j:4 * j + nd])
                role = PackedRole(name, int(v["types"][j]), ne, int(v["offset"][j]), int(v["slice_bytes"][j]))
                if role.offset + role.slice_bytes > pl.slot_bytes:
                    raise MboltError(f"{path}: packed layout metadata: {role.name} ends past its slot in layer {layer}")
                pl.roles.append(role)
                j += 1
            out[pl.layer] = pl
        return out
    except (TypeError, ValueError) as e:
        raise MboltError(f"{path}: corrupt packed layout metadata ({e})") from None


def packed_kvs(layers: list[PackedLayer]) -> dict[str, tuple[str, object]]:
    """The mbolt.packed.* keys for `layers`: {key: (kind, value)} with kind 'i32'|'u32'|'u64'|'str'."""
    roles = [r for pl in layers for r in pl.roles]
    ne = np.ones((len(roles), 4), np.uint64)
    for i, r in enumerate(roles):
        if len(r.ne) > 4:
            raise MboltError(f"{r.name}: {len(r.ne)} dimensions")
        ne[i, :len(r.ne)] = r.ne
    return {
        "mbolt.packed.layers": ("i32", np.array([pl.layer for pl in layers], np.int32)),
        "mbolt.packed.slot_bytes": ("u64", np.array([pl.slot_bytes for pl in layers], np.uint64)),
        "mbolt.packed.n_roles": ("u32", np.array([len(pl.roles) for pl in layers], np.uint32)),
        "mbolt.packed.names": ("str", [r.name for r in roles]),
        "mbolt.packed.types": ("u32", np.array([r.type for r in roles], np.uint32)),
        "mbolt.packed.n_dims": ("u32", np.array([len(r.ne) for r in roles], np.uint32)),
        "mbolt.packed.ne": ("u64", ne.reshape(-1)),
        "mbolt.packed.offset": ("u64", np.array([r.offset for r in roles], np.uint64)),
        "mbolt.packed.slice_bytes": ("u64", np.array([r.slice_bytes for r in roles], np.uint64)),
    }
