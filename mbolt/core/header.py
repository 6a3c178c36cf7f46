"""Strict reader of a GGUF header: metadata, tensor infos and where the data section starts.

gguf-py's GGUFReader is the reference, but it maps the whole file, parses every vocabulary
string into numpy fields (slow on 150k-token vocabularies) and reports a truncated file as a
numpy reshape error. This reader parses only the header, keeps each value's GGUF type (so a
rewriter can write it back unchanged) and names what is wrong when a file is damaged.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from mbolt.core.errors import MboltError

GGUF_MAGIC = b"GGUF"
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NP = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}


@dataclass
class KV:
    key: str
    type: GGUFValueType
    value: object  # python scalar, str, numpy array (numeric arrays) or list[str]
    sub_type: GGUFValueType | None = None  # element type of arrays
    span: tuple[int, int] = (0, 0)  # [start, end) bytes of this key/value pair in the file (copied verbatim by the rewriter)


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the innermost (contiguous) dimension
    type: GGMLQuantizationType
    offset: int  # relative to the data section
    nbytes: int
    data_offset: int  # absolute offset in its file
    file: int = 0  # index of the file holding the data in GGUFHeader.paths (a shard of a split set)

    @property
    def type_name(self) -> str:
        return self.type.name


@dataclass
class GGUFHeader:
    path: Path
    version: int
    kv: dict[str, KV]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # absolute offset of the data section
    header_size: int  # bytes of magic + KV + tensor infos (before alignment padding)
    file_size: int
    fingerprint: str = field(default="")  # sha256 of the header bytes (hex, first 16 bytes); of a set: core.gguf_set
    shards: list["GGUFHeader"] = field(default_factory=list)  # a split set's shard headers ([] = one file)

    @property
    def paths(self) -> list[Path]:
        """The files holding the model: the shards of a split set in order, or the one file."""
        return [s.path for s in self.shards] if self.shards else [self.path]

    def get(self, key: str, default=None):
        kv = self.kv.get(key)
        return default if kv is None else kv.value

    def get_int(self, key: str, default: int = 0) -> int:
        """An integer metadata value (MboltError naming the key if it is a string, float, array)."""
        from mbolt.core.checks import as_int

        kv = self.kv.get(key)
        return default if kv is None else as_int(kv.value, f"{self.path}: {key}")

    def tensor(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    def __post_init__(self):
        self._by_name = {t.name: t for t in self.tensors}


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise MboltError(f"{self.path}: truncated GGUF header (reading {what} at byte {self.pos})")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        if n > len(self.buf):
            raise MboltError(f"{self.path}: corrupt GGUF header ({what}: string length {n})")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType, what: str):
        if vtype == GGUFValueType.STRING:
            return self.string(what), None
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype], what), None
        if vtype == GGUFValueType.ARRAY:
            sub = self._vtype(self.scalar("<I", what), what)
            n = self.scalar("<Q", what)
            # every element takes at least one byte (a string at least 8): refuse a count the
            # rest of the file cannot hold before looping over it
            if n * (8 if sub == GGUFValueType.STRING else 1) > len(self.buf) - self.pos:
                raise MboltError(f"{self.path}: corrupt GGUF header ({what}: array of {n} elements "
                                 f"in {len(self.buf) - self.pos} remaining bytes)")
            if sub == GGUFValueType.STRING:
                return [self.string(what) for _ in range(n)], sub
            if sub in _NP:
                dt = np.dtype(_NP[sub]).newbyteorder("<")
                raw = self.take(n * dt.itemsize, what)
                return np.frombuffer(raw, dtype=dt).copy(), sub
            raise MboltError(f"{self.path}: unsupported nested array in {what}")
        raise MboltError(f"{self.path}: unknown value type {vtype} in {what}")

    def _vtype(self, raw: int, what: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise MboltError(f"{self.path}: corrupt GGUF header ({what}: value type {raw})") from None


class MappedFile:
    """A read-only map of a whole file and a uint8 view of it (`buf`), for readers that slice
    tensors straight out of the page cache."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        self.buf = None
        try:
            self.mm.close()
        except BufferError:  # numpy views still alive; the GC closes it later
            pass


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and validate a GGUF header; every tensor's data must lie inside the file."""
    path = Path(path)
    if not path.is_file():
        raise MboltError(f"{path}: " + ("is a directory, expected a GGUF file" if path.is_dir() else "no such file"))
    size = path.stat().st_size
    if size < 24:
        raise MboltError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise MboltError(f"{path}: not a GGUF file (bad magic)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return parse_header(buf, path, size)
    finally:
        buf.close()


def parse_header(buf, path: Path, size: int) -> GGUFHeader:
    c = _Cursor(buf, path)
    c.take(4, "magic")
    version = c.scalar("<I", "version")
    if version not in (2, 3):
        raise MboltError(f"{path}: unsupported GGUF version {version}")
    n_tensors = c.scalar("<Q", "tensor count")
    n_kv = c.scalar("<Q", "metadata count")
    # a KV pair takes >= 12 bytes, a tensor info >= 24: counts the file cannot hold are damage
    if n_tensors > 10_000_000 or n_kv > 10_000_000:
        raise MboltError(f"{path}: corrupt GGUF header (tensor count {n_tensors}, kv count {n_kv})")
    if 24 + 12 * n_kv + 24 * n_tensors > size:
        raise MboltError(f"{path}: truncated GGUF header ({n_kv} metadata pairs and {n_tensors} tensor infos "
                         f"need at least {24 + 12 * n_kv + 24 * n_tensors} bytes, the file has {size})")
    kv: dict[str, KV] = {}
    for i in range(n_kv):
        start = c.pos
        key = c.string(f"metadata key #{i}")
        vtype = c._vtype(c.scalar("<I", key), key)
        value, sub = c.value(vtype, key)
        if key in kv:  # llama.cpp and gguf-py refuse such a file: which value counts is undefined
            raise MboltError(f"{path}: metadata key {key} appears twice")
        kv[key] = KV(key, vtype, value, sub, (start, c.pos))
    infos = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = c.string(f"tensor info #{i}")
        if name in seen:
            raise MboltError(f"{path}: tensor {name} appears twice")
        seen.add(name)
        n_dims = c.scalar("<I", name)
        if n_dims > 4:
            raise MboltError(f"{path}: tensor {name} has {n_dims} dimensions")
        ne = tuple(c.scalar("<Q", name) for _ in range(n_dims))
        raw_type = c.scalar("<I", name)
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise MboltError(f"{path}: tensor {name} has unknown ggml type {raw_type}") from None
        offset = c.scalar("<Q", name)
        infos.append((name, ne, ttype, offset))
    header_size = c.pos
    alignment = 32
    if Keys.General.ALIGNMENT in kv:
        from mbolt.core.checks import as_int

        alignment = as_int(kv[Keys.General.ALIGNMENT].value, f"{path}: {Keys.General.ALIGNMENT}")
    if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 30:
        raise MboltError(f"{path}: invalid {Keys.General.ALIGNMENT} {alignment}")
    data_offset = -(-header_size // alignment) * alignment
    tensors = []
    for name, ne, ttype, offset in infos:
        if ttype not in GGML_QUANT_SIZES:
            raise MboltError(f"{path}: tensor {name} has ggml type {ttype.name} of unknown size")
        block, type_size = GGML_QUANT_SIZES[ttype]
        # Python ints: an int64 product wraps (ne = (2**32, 2**32) would give 0 bytes)
        n_el = math.prod(int(x) for x in ne)
        if ne and ne[0] % block:
            raise MboltError(f"{path}: tensor {name} row of {ne[0]} is not a multiple of the {ttype.name} block ({block})")
        nbytes = n_el // block * type_size
        start = data_offset + offset
        if start + nbytes > size:
            raise MboltError(
                f"{path}: tensor {name} ends past the end of the file "
                f"(needs byte {start + nbytes}, file has {size}: truncated?)"
            )
        tensors.append(TensorInfo(name, ne, ttype, offset, nbytes, start))
    fp = hashlib.sha256(bytes(buf[:header_size])).hexdigest()[:32]
    return GGUFHeader(path, version, kv, tensors, alignment, data_offset, header_size, size, fp)


# ---- writing: the same encoding, for the writers (synth, reorder) ----


def encode_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def encode_kv(key: str, vtype: GGUFValueType, value, sub: GGUFValueType | None = None) -> bytes:
    """One metadata pair, byte for byte as `read_header` parses it."""
    out = encode_str(key) + struct.pack("<I", int(vtype))
    if vtype == GGUFValueType.STRING:
        return out + encode_str(value)
    if vtype == GGUFValueType.ARRAY:
        out += struct.pack("<IQ", int(sub), len(value))
        if sub == GGUFValueType.STRING:
            return out + b"".join(encode_str(x) for x in value)
        return out + np.asarray(value).astype(np.dtype(_NP[sub]).newbyteorder("<"), copy=False).tobytes()
    return out + struct.pack(_SCALAR[vtype], value)


def encode_tensor_info(name: str, ne, ttype: GGMLQuantizationType, offset: int) -> bytes:
    return encode_str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, int(ttype), offset)


def encode_header_start(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return GGUF_MAGIC + struct.pack("<IQQ", version, n_tensors, n_kv)
