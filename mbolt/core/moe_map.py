"""The MoE map of a GGUF: which tensors are indexed by expert, and where each expert's bytes are.

Found by name pattern and shape (a dimension equal to `{arch}.expert_count`), never by a
per-architecture table, so new MoE families work as long as they keep llama.cpp's naming.
Every expert-indexed tensor has the expert as its outermost dimension (ne[-1]), so expert e is
one contiguous slice at `data_offset + e * slice_bytes`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from functools import cached_property

from gguf import Keys

from mbolt.core.checks import MAX_EXPERTS, n_layers_of
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import open_model_header
from mbolt.core.header import GGUFHeader, TensorInfo
from mbolt.core.hparams import ShapeNumbers, check_hparams
from mbolt.core.packed import PAGE, read_packed
from mbolt.core.routemap import read_route_map

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# suffix after "blk.N." -> role. Weights of the routed experts, then small expert-indexed tensors.
ROLES = {
    "ffn_gate_exps.weight": "gate",
    "ffn_up_exps.weight": "up",
    "ffn_down_exps.weight": "down",
    "ffn_gate_up_exps.weight": "gate_up",
    "ffn_gate_inp.weight": "router",
    "ffn_gate_inp.bias": "router_bias",
    "exp_probs_b.bias": "probs_bias",
    "ffn_gate_exps.bias": "gate_bias",
    "ffn_up_exps.bias": "up_bias",
    "ffn_down_exps.bias": "down_bias",
    "ffn_gate_up_exps.bias": "gate_up_bias",
    "ffn_exps_packed": "packed",  # packed layout: one I8 blob per layer (see core/packed.py)
}
WEIGHT_ROLES = ("gate", "up", "down", "gate_up")  # the big slices an engine streams
# llama.cpp's order of the expert matmuls (swiglu(gate, up) puts the gate's first, then down). Reads
# are issued in this order whatever the file's: llama.cpp's converter writes down before gate and up
USE_ORDER = {"gate": 0, "gate_up": 0, "up": 1, "down": 2}


@dataclass
class ExpertTensor:
    name: str
    role: str  # one of ROLES' values, or "unknown" (expert-indexed but not understood)
    type: str  # ggml type name
    ne: tuple[int, ...]
    data_offset: int  # absolute file offset of expert 0's slice
    nbytes: int
    slice_bytes: int
    aligned: bool  # every slice starts on a 4 KiB boundary
    why: str = ""  # for "unknown": what is not understood
    stride: int = 0  # bytes between positions; 0 = slice_bytes (a real tensor). Packed: the slot size
    container: str = ""  # packed layout: the blob tensor holding this virtual tensor ("" = real tensor)
    file: int = 0  # index of the file holding it in MoeMap.paths (a shard of a split set)

    def slice_offset(self, expert: int) -> int:
        """File offset of the slice at POSITION `expert` (original id only in a stock file)."""
        return self.data_offset + expert * (self.stride or self.slice_bytes)


@dataclass
class MoeLayer:
    index: int
    dense: bool  # a layer with a plain FFN (no routed experts)
    experts: list[ExpertTensor] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)  # shared-expert tensors: not routed, never permuted

    def role(self, role: str) -> ExpertTensor | None:
        return next((t for t in self.experts if t.role == role), None)

    @property
    def weights(self) -> list[ExpertTensor]:
        """The routed weight tensors in file order (what an engine reads per expert)."""
        return sorted((t for t in self.experts if t.role in WEIGHT_ROLES), key=lambda t: (t.file, t.data_offset))

    def tensor_columns(self) -> list[list[int]]:
        """The columns of `weights` that each tensor holds (a packed blob holds every role),
        tensors in llama.cpp's use order (USE_ORDER)."""
        groups: dict[str, list[int]] = {}
        rank: dict[str, int] = {}
        for i, t in enumerate(self.weights):
            key = t.container or t.name
            groups.setdefault(key, []).append(i)
            rank[key] = min(rank.get(key, 9), USE_ORDER.get(t.role, 3))
        return [groups[k] for k in sorted(groups, key=lambda k: rank[k])]

    @property
    def expert_bytes(self) -> int:
        return sum(t.slice_bytes for t in self.weights)

    @property
    def slot_padding(self) -> int:
        """Bytes of padding after each expert's slot in a packed layer (0 otherwise): a reader
        reads through them."""
        w = self.weights
        return max(0, w[0].stride - self.expert_bytes) if w and w[0].container else 0


@dataclass
class MoeMap:
    path: str
    arch: str
    n_layers: int
    n_experts: int
    n_used: int
    layers: list[MoeLayer]
    header: GGUFHeader
    numbers: ShapeNumbers  # the tensor-shaping hyperparameters, checked against the tensors

    @property
    def fingerprint(self) -> str:
        """The header fingerprint; of a split set, the set's (core.gguf_set)."""
        return self.header.fingerprint

    @property
    def paths(self) -> list[str]:
        """The files of the model (a split set's shards in order, or the one file)."""
        return [str(p) for p in self.header.paths]

    @cached_property
    def route_map(self):
        """The file's route map (identity for a stock file), read once from the header."""
        return read_route_map(self.header)

    @property
    def source_fingerprint(self) -> str:
        """The fingerprint of the original model: a rewritten file carries its source's."""
        return self.header.get("mbolt.source.fingerprint", self.header.fingerprint)

    @property
    def moe_layers(self) -> list[MoeLayer]:
        return [layer for layer in self.layers if not layer.dense]

    def unknown(self) -> list[ExpertTensor]:
        return [t for layer in self.layers for t in layer.experts if t.role == "unknown"]

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "arch": self.arch,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "n_used": self.n_used,
            "fingerprint": self.fingerprint,
            "source_fingerprint": self.source_fingerprint,
            "layout": self.header.get("mbolt.layout", "stock"),
            "file_size": self.header.file_size,
            "files": [
                {"path": str(s.path), "size": s.file_size, "n_tensors": len(s.tensors), "fingerprint": s.fingerprint}
                for s in (self.header.shards or [self.header])
            ],
            "layers": [
                {
                    "index": layer.index,
                    "dense": layer.dense,
                    "expert_bytes": layer.expert_bytes,
                    "tensors": [
                        {
                            "name": t.name, "role": t.role, "type": t.type, "ne": list(t.ne),
                            "slice_bytes": t.slice_bytes, "offset": t.data_offset,
                            "aligned_4k": t.aligned, "file": t.file, **({"why": t.why} if t.why else {}),
                            **({"stride": t.stride, "container": t.container} if t.container else {}),
                        }
                        for t in layer.experts
                    ],
                    "shared": layer.shared,
                }
                for layer in self.layers
            ],
        }


def _is_expertish(suffix: str) -> bool:
    return "shexp" not in suffix and ("exps" in suffix or "exp_probs" in suffix or suffix.startswith("ffn_gate_inp."))


def _packed_virtuals(blob: TensorInfo, pl, n_experts: int, path) -> list[ExpertTensor]:
    """The routed weight tensors stored inside a packed blob, as virtual tensors with a stride."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if pl is None:
        raise MboltError(f"{path}: tensor {blob.name} has no mbolt.packed.* metadata for its layer")
    if blob.nbytes != pl.slot_bytes * n_experts:
        raise MboltError(f"{path}: tensor {blob.name} is {blob.nbytes} bytes, metadata says {n_experts} x {pl.slot_bytes}")
    out = []
    for r in pl.roles:
        suffix = _BLK.match(r.name).group(2) if _BLK.match(r.name) else r.name
        role = ROLES.get(suffix, "unknown")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(r.type)]
        if not r.ne or r.ne[-1] != n_experts or math.prod(r.ne) // block * type_size != r.slice_bytes * n_experts:
            raise MboltError(f"{path}: packed layout metadata: {r.name} of shape {list(r.ne)} does not match "
                             f"its slice of {r.slice_bytes} bytes x {n_experts} experts")
        start = blob.data_offset + r.offset
        aligned = start % PAGE == 0 and pl.slot_bytes % PAGE == 0
        out.append(ExpertTensor(
            r.name, role, GGMLQuantizationType(r.type).name, r.ne, start, r.slice_bytes * n_experts,
            r.slice_bytes, aligned, "" if role != "unknown" else "packed role mbolt does not know",
            stride=pl.slot_bytes, container=blob.name, file=blob.file,
        ))
    return out


def moe_map(src: str | os.PathLike | GGUFHeader, kernel_ok: bool = False) -> MoeMap:
    """Build the MoE map of a GGUF file or split set (given any shard); raises MboltError for
    non-MoE or damaged files and incomplete or mixed sets. A kernel-layout file (`mbolt repack`)
    is refused unless `kernel_ok` (the runtime, which streams it: the map of the model it holds,
    its tensors where the file holds them)."""
    header = src if isinstance(src, GGUFHeader) else open_model_header(src)
    path = header.path
    arch = header.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise MboltError(f"{path}: no {Keys.General.ARCHITECTURE} in the metadata")
    from mbolt.core.kernel_file import KERNEL_ARCH, read_kernel, stock_view

    if arch == KERNEL_ARCH and kernel_ok:
        return moe_map(stock_view(read_kernel(path)))
    if arch == KERNEL_ARCH:  # its weights are laid out for llama.cpp's kernels, not for reading as stock
        raise MboltError(f"{path}: a kernel-layout file ({header.get('mbolt.kernel.build')}, written by mbolt "
                         f"repack): `mbolt repack --restore` gives the stock file back for this command")
    count_key, used_key = Keys.LLM.EXPERT_COUNT.format(arch=arch), Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)
    n_experts = header.get_int(count_key)
    n_used = header.get_int(used_key)
    n_layers = n_layers_of(header)
    if n_experts <= 1:
        raise MboltError(f"{path}: not a MoE model ({count_key} is {n_experts or 'missing'})")
    if n_experts > MAX_EXPERTS:
        raise MboltError(f"{path}: {count_key} is {n_experts} (at most {MAX_EXPERTS} supported)")
    if n_used <= 0 or n_used > n_experts:
        raise MboltError(f"{path}: {used_key} is {n_used}, expected 1..{n_experts}")
    # the numbers against the tensors before anything is built from them (one line naming both)
    numbers = check_hparams(header, arch, n_experts, n_layers, n_used)
    by_layer: dict[int, list[TensorInfo]] = {}
    for t in header.tensors:
        m = _BLK.match(t.name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(t)
    packed = read_packed(header)
    layers = []
    for i in range(n_layers):
        layer = MoeLayer(i, dense=True)
        for t in by_layer.get(i, []):
            suffix = _BLK.match(t.name).group(2)
            if "shexp" in suffix:
                layer.shared.append(t.name)
                continue
            if not _is_expertish(suffix):
                continue
            role = ROLES.get(suffix, "unknown")
            why = "" if role != "unknown" else "expert-indexed tensor of a kind mbolt does not know"
            if not t.ne or t.ne[-1] != n_experts:
                role, why = "unknown", f"outermost dimension {t.ne[-1] if t.ne else None} != expert_count {n_experts}"
            slice_bytes = t.nbytes // n_experts
            aligned = t.data_offset % PAGE == 0 and slice_bytes % PAGE == 0
            layer.experts.append(
                ExpertTensor(t.name, role, t.type_name, t.ne, t.data_offset, t.nbytes, slice_bytes, aligned, why,
                             file=t.file)
            )
            if role == "packed":
                layer.experts.extend(_packed_virtuals(t, packed.get(i), n_experts, path))
        layer.dense = not any(t.role in WEIGHT_ROLES for t in layer.experts)
        layers.append(layer)
    if all(layer.dense for layer in layers):
        raise MboltError(f"{path}: not a MoE model (no ffn_*_exps tensors with {n_experts} experts)")
    return MoeMap(str(path), arch, n_layers, n_experts, n_used, layers, header, numbers)
