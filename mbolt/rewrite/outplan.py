"""The output of a rewrite, planned before any byte is copied: the source's logical tensors (packed
blobs expanded), the route map's metadata, every output tensor's place (layout, alignment, shard)
and the copy operations that fill it, and each shard's header."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, Keys

from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import SET_ID_KEY, split_vaddr, vaddr
from mbolt.core.header import encode_header_start, encode_kv, encode_tensor_info
from mbolt.core.moe_map import PAGE, WEIGHT_ROLES, MoeMap
from mbolt.core.packed import (PACK_PAD_MAX, PackedLayer, PackedRole, packed_kvs, packed_name, size_label,
                                slot_stride)
from mbolt.core.routemap import ROUTE_MAP_VERSION

SPLIT = 16 << 20  # copy ranges are cut to this size (progress granularity, readahead steps)

# ---- the logical tensors of a file (packed blobs expanded into their virtual tensors) ----


@dataclass
class LTensor:
    name: str
    ne: tuple[int, ...]
    type: GGMLQuantizationType
    nbytes: int
    data_offset: int  # virtual (core.gguf_set.vaddr: file << 48 | offset); expert-indexed: position 0's slice
    layer: int = -1  # >= 0 for expert-indexed tensors
    role: str = ""  # moe_map role of an expert-indexed tensor; "" for a plain tensor
    slice_bytes: int = 0
    stride: int = 0
    container: str = ""  # packed blob holding this virtual tensor

    @property
    def expert_indexed(self) -> bool:
        return self.layer >= 0

    def at(self, position: int) -> int:
        return self.data_offset + position * self.stride


def logical_tensors(m: MoeMap) -> list[LTensor]:
    """Every tensor of the model as the stock file would have it, in file (info) order."""
    experts = {x.name: (layer.index, x) for layer in m.layers for x in layer.experts if not x.container}
    virtual: dict[str, list] = {}
    for layer in m.layers:
        for x in layer.weights:
            if x.container:
                virtual.setdefault(x.container, []).append((layer.index, x))
    out = []
    for t in m.header.tensors:
        if t.name in virtual:
            for li, x in virtual[t.name]:
                out.append(LTensor(x.name, tuple(x.ne), GGMLQuantizationType[x.type], x.nbytes, vaddr(x.file, x.data_offset),
                                   li, x.role, x.slice_bytes, x.stride, x.container))
        elif t.name in experts:
            li, x = experts[t.name]
            out.append(LTensor(t.name, tuple(t.ne), t.type, t.nbytes, vaddr(t.file, t.data_offset), li, x.role,
                               x.slice_bytes, x.slice_bytes))
        else:
            out.append(LTensor(t.name, tuple(t.ne), t.type, t.nbytes, vaddr(t.file, t.data_offset)))
    return out


# ---- GGUF header encoding ----


_KIND = {"i32": GGUFValueType.INT32, "u32": GGUFValueType.UINT32, "u64": GGUFValueType.UINT64,
         "f32": GGUFValueType.FLOAT32, "str": GGUFValueType.STRING}


def route_map_kvs(layout: str, perm: np.ndarray, heat: np.ndarray, method: str, source_fp: str,
                  packed: list[PackedLayer]) -> list[bytes]:
    A, S = GGUFValueType.ARRAY, GGUFValueType.STRING
    kvs = [
        encode_kv("mbolt.version", GGUFValueType.UINT32, ROUTE_MAP_VERSION),
        encode_kv("mbolt.layout", S, layout),
        encode_kv("mbolt.n_layers", GGUFValueType.UINT32, perm.shape[0]),
        encode_kv("mbolt.n_experts", GGUFValueType.UINT32, perm.shape[1]),
        encode_kv("mbolt.perm", A, perm.reshape(-1).astype(np.int32), GGUFValueType.INT32),
        encode_kv("mbolt.heat", A, heat.reshape(-1).astype(np.float32), GGUFValueType.FLOAT32),
        encode_kv("mbolt.source.fingerprint", S, source_fp),
        encode_kv("mbolt.plan.method", S, method),
    ]
    if packed:
        for key, (kind, value) in packed_kvs(packed).items():
            kvs.append(encode_kv(key, A, value, _KIND[kind]))
    return kvs


# ---- output plan ----


@dataclass
class OutTensor:
    name: str
    ne: tuple[int, ...]
    type: GGMLQuantizationType
    pieces: list[tuple[int | None, int]]  # (source virtual offset or None for zeros, length), in order
    offset: int = 0  # relative to the data section of its shard, set by place_tensors
    file: int = 0  # output shard

    @property
    def src_file(self) -> int:
        return next(split_vaddr(s)[0] for s, _ in self.pieces if s is not None)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.pieces)


@dataclass
class ReorderResult:
    src: str
    dst: str
    layout: str
    method: str
    bytes_written: int
    seconds: float
    copy_ops: int
    copy_mode: str  # "copy_file_range" or "buffered"
    identity: bool
    n_moe_layers: int
    alignment: list[str] = field(default_factory=list)  # what is 4 KiB aligned and what is not
    removed_stale: list[str] = field(default_factory=list)
    sidecar: str = ""
    fingerprint: str = ""
    source_fingerprint: str = ""
    files: list[str] = field(default_factory=list)  # the output's files (a set's shards in order)

    @property
    def throughput(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"throughput_bytes_s": self.throughput}


def plan_output(m: MoeMap, perm: np.ndarray, layout: str, align: int | None = None,
                ) -> tuple[list[OutTensor], list[PackedLayer], list[str]]:
    """The output tensors (each a list of source byte ranges), the packed metadata and
    alignment notes. `perm` [n_layers, E] names original expert ids per output position;
    `align` (None: 4 KiB where cheap) pads packed slots and sets general.alignment."""
    A = out_alignment(m, align)
    unit = align or PAGE
    in_pos = m.route_map.pos
    tensors = logical_tensors(m)
    notes: list[str] = []
    out: list[OutTensor] = []
    packed: list[PackedLayer] = []
    done_layers: set[int] = set()
    slice_ok, slice_bad, slot_ok, slot_bad = [], [], [], []
    weights_by_layer: dict[int, list[LTensor]] = {}
    for t in tensors:
        if t.role in WEIGHT_ROLES:
            weights_by_layer.setdefault(t.layer, []).append(t)

    def src_positions(layer: int) -> np.ndarray:  # input position of each output position's expert
        return in_pos[layer][perm[layer]]

    for t in tensors:
        if not t.expert_indexed:
            out.append(OutTensor(t.name, t.ne, t.type, [(t.data_offset, t.nbytes)]))
            continue
        q = src_positions(t.layer)
        if layout == "packed" and t.role in WEIGHT_ROLES:
            if t.layer in done_layers:
                continue
            done_layers.add(t.layer)
            ws = sorted(weights_by_layer[t.layer], key=lambda w: w.data_offset)
            raw = sum(w.slice_bytes for w in ws)
            stride, granule = slot_stride(raw, align)
            pl = PackedLayer(t.layer, stride)
            off = 0
            for w in ws:
                if len(w.ne) > 4:
                    raise MboltError(f"{m.path}: tensor {w.name} has {len(w.ne)} dimensions")
                pl.roles.append(PackedRole(w.name, int(w.type), w.ne, off, w.slice_bytes))
                off += w.slice_bytes
            pieces = []
            for p in range(len(q)):
                for w in ws:
                    pieces.append((w.at(int(q[p])), w.slice_bytes))
                if stride > raw:
                    pieces.append((None, stride - raw))
            packed.append(pl)
            out.append(OutTensor(packed_name(t.layer), (stride, len(q)), GGMLQuantizationType.I8, pieces))
            if granule == size_label(unit):
                slot_ok.append((t.layer, stride, stride - raw))
            else:
                slot_bad.append((t.layer, raw, granule))
            continue
        pieces = [(t.at(int(q[p])), t.slice_bytes) for p in range(len(q))]
        is_weight = t.role in WEIGHT_ROLES
        out.append(OutTensor(t.name, t.ne, t.type, pieces))
        if is_weight:
            (slice_ok if t.slice_bytes % unit == 0 else slice_bad).append((t.name, t.slice_bytes))
    u = size_label(unit)
    notes.append(f"every tensor starts {size_label(A)} aligned (general.alignment {A})")
    if slice_ok:
        notes.append(f"{len(slice_ok)} expert tensors: every slice {u} aligned")
    if slice_bad:
        name, sb = slice_bad[0]
        notes.append(f"{len(slice_bad)} expert tensors: slices not {u} aligned (e.g. {name}: {sb} B, not a "
                     f"multiple of {u}); only their first slice is (a tensor's slices are back to back)")
    if slot_ok:
        pads = sorted({pad for _, _, pad in slot_ok})
        notes.append(f"{len(slot_ok)} packed layers: every expert slot {u} aligned (slot {slot_ok[0][1]} B"
                     + (f", {pads[-1]} B padding per slot at most)" if pads[-1] else ", no padding)"))
    if slot_bad:
        layer, raw, granule = slot_bad[0]
        notes.append(f"{len(slot_bad)} packed layers: expert slots NOT {u} aligned (e.g. layer {layer}: "
                     f"{raw} B per expert; padding would cost more than {PACK_PAD_MAX:.0%})"
                     + (f"; {granule} aligned" if granule else ""))
    return out, packed, notes


def out_alignment(m: MoeMap, align: int | None) -> int:
    """general.alignment of the output: the source's, raised to `align` (default 4 KiB), so every
    tensor (so every expert tensor) starts aligned."""
    return max(m.header.alignment, align or PAGE)


def place_tensors(tensors: list[OutTensor], alignment: int) -> int:
    """Assign relative offsets; returns the data section size.

    llama.cpp requires tensors back to back in info order, each padded to general.alignment
    (any other offset is rejected), so 4 KiB alignment comes from general.alignment = 4096."""
    rel = 0
    for t in tensors:
        t.offset = rel
        rel += -(-t.nbytes // alignment) * alignment
    return rel


def copy_ops(tensors: list[OutTensor], data_start: list[int]) -> list[tuple[int, int, int]]:
    """(src, dst, length) virtual ranges in output order; contiguous neighbours merged (never
    across files: virtual offsets of two files are 2^48 apart)."""
    ops: list[list[int]] = []
    for t in tensors:
        dst = vaddr(t.file, data_start[t.file] + t.offset)
        for src, n in t.pieces:
            if src is not None and n:
                if ops and ops[-1][0] + ops[-1][2] == src and ops[-1][1] + ops[-1][2] == dst:
                    ops[-1][2] += n
                else:
                    ops.append([src, dst, n])
            dst += n
    return split_ops([tuple(o) for o in ops], SPLIT)


def split_ops(ops, most: int) -> list[tuple[int, int, int]]:
    """Cut ranges into pieces of at most `most` bytes (bounded readahead advice per piece)."""
    out = []
    for s, d, n in ops:
        for k in range(0, n, most):
            out.append((s + k, d + k, min(most, n - k)))
    return out


# ---- output shards ----


@dataclass
class SplitSpec:
    """How the output is cut into shards: like the input (default), one file, or by limits."""
    no_split: bool = False
    max_tensors: int = 0  # 0 = no limit
    max_size: int = 0  # bytes of tensor data per shard; 0 = no limit

    def check(self) -> None:
        if self.max_tensors < 0 or self.max_size < 0:
            raise MboltError("--split-max-tensors and --split-max-size must be >= 0")
        if self.no_split and (self.max_tensors or self.max_size):
            raise MboltError("--no-split cannot be combined with --split-max-tensors/--split-max-size")


def assign_shards(tensors: list[OutTensor], spec: SplitSpec, n_in: int) -> int:
    """Set every output tensor's shard (in order, none empty); returns the number of shards.
    A tensor is never cut, so a packed layer's blob never straddles shards."""
    if spec.max_tensors or spec.max_size:
        shard, count, size = 0, 0, 0
        for t in tensors:
            if count and ((spec.max_tensors and count >= spec.max_tensors)
                          or (spec.max_size and size + t.nbytes > spec.max_size)):
                shard, count, size = shard + 1, 0, 0
            t.file = shard
            count, size = count + 1, size + t.nbytes
        return shard + 1
    if spec.no_split or n_in <= 1:
        for t in tensors:
            t.file = 0
        return 1
    # the input's assignment: a tensor goes where its (first) source bytes are; renumbered so
    # that no shard is empty (a packed blob gathers a layer's weights into one shard)
    used = sorted({t.src_file for t in tensors})
    index = {f: i for i, f in enumerate(used)}
    last = 0
    for t in tensors:
        t.file = max(last, index[t.src_file])  # keep shards in tensor order
        last = t.file
    return len(used)


def split_kvs(no: int, count: int, n_tensors: int, set_id: str) -> list[bytes]:
    return [
        encode_kv(Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16, no),
        encode_kv(Keys.Split.LLM_KV_SPLIT_COUNT, GGUFValueType.UINT16, count),
        encode_kv(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, GGUFValueType.INT32, n_tensors),
        encode_kv(SET_ID_KEY, GGUFValueType.STRING, set_id),
    ]


def shard_headers(m: MoeMap, tensors: list[OutTensor], n_shards: int, model_kvs: list[bytes], A: int,
             version: int) -> tuple[list[bytes], list[int]]:
    """The header bytes of every output shard and the data start of each. Shard 1 carries the
    model's metadata and the route map; every shard of a set carries the split keys, a set id
    (readers refuse shards with different ids: a mix of two runs) and general.alignment."""
    by_shard = [[t for t in tensors if t.file == i] for i in range(n_shards)]
    set_id = ""
    if n_shards > 1:
        import hashlib

        h = hashlib.sha256(b"".join(model_kvs))
        for t in tensors:
            h.update(f"{t.name}:{t.file};".encode())
        set_id = h.hexdigest()[:32]
    heads, starts = [], []
    for i, ts in enumerate(by_shard):
        kvs = list(model_kvs) if i == 0 else [encode_kv(Keys.General.ALIGNMENT, GGUFValueType.UINT32, A)]
        if n_shards > 1:
            kvs += split_kvs(i, n_shards, len(tensors), set_id)
        place_tensors(ts, A)
        head = encode_header_start(len(ts), len(kvs), version) + b"".join(kvs) + b"".join(
            encode_tensor_info(t.name, t.ne, t.type, t.offset) for t in ts)
        heads.append(head)
        starts.append(-(-len(head) // A) * A)
    return heads, starts


def shard_sizes(tensors: list[OutTensor], starts: list[int], A: int) -> list[int]:
    sizes = list(starts)
    for t in tensors:
        sizes[t.file] = max(sizes[t.file], starts[t.file] + t.offset + -(-t.nbytes // A) * A)
    return sizes
