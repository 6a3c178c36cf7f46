"""The kernel-layout file (written by `mbolt repack`, rewrite/kernel.py): what it records, read and
checked, and the stock header llama.cpp is given to load it.

A kernel-layout file is a GGUF whose tensors that llama.cpp's CPU backend repacks are stored
repacked (core/repack.py). Its `general.architecture` is `mbolt-kernel` so that stock llama.cpp
refuses it; `mbolt.kernel.*` records the real architecture, the build it was made for, each
repacked tensor's layout, and the source's header bytes, size and SHA-256 (the round trip).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as V, Keys

from mbolt.core.errors import MboltError
from mbolt.core.header import GGUFHeader, encode_header_start, encode_kv, encode_tensor_info, parse_header, \
    read_header
from mbolt.core.repack import LAYOUTS, Build, RepackType, layout_of

KERNEL_ARCH = "mbolt-kernel"
P = "mbolt.kernel."
VERSION = 1


@dataclass
class KernelFile:
    """What a kernel-layout file records about itself."""

    header: GGUFHeader
    architecture: str
    build: str
    layouts: dict[str, RepackType]  # tensor name -> its stored layout
    source: GGUFHeader  # the stock file's header, parsed from the recorded bytes
    source_header: bytes
    source_size: int
    source_sha256: str


def is_kernel_file(h: GGUFHeader) -> bool:
    return h.get(Keys.General.ARCHITECTURE) == KERNEL_ARCH


def read_kernel(path: str | os.PathLike) -> KernelFile:
    """A kernel-layout file's header and records, each checked against the others."""
    h = read_header(path)
    if not is_kernel_file(h):
        raise MboltError(f"{h.path}: not a kernel-layout file ({Keys.General.ARCHITECTURE} is "
                         f"{h.get(Keys.General.ARCHITECTURE)!r}; `mbolt repack` writes them)")
    version = h.get_int(P + "version")
    if version != VERSION:
        raise MboltError(f"{h.path}: {P}version {version}; this mbolt reads version {VERSION}")
    names, lays = h.get(P + "tensors", []), h.get(P + "layouts", [])
    if not isinstance(names, list) or not isinstance(lays, list) or len(names) != len(lays):
        raise MboltError(f"{h.path}: {P}tensors and {P}layouts must be string arrays of one length")
    layouts = {}
    for n, lay in zip(names, lays):
        t = h.tensor(n)
        if t is None:
            raise MboltError(f"{h.path}: {P}tensors names {n}, which the file does not have")
        if lay not in LAYOUTS or LAYOUTS[lay].type != t.type:
            raise MboltError(f"{h.path}: tensor {n} ({t.type.name}) is recorded in layout {lay!r}, "
                             f"which is not one of {t.type.name}'s ({', '.join(sorted(LAYOUTS))})")
        layouts[n] = LAYOUTS[lay]
    raw = h.get(P + "source.header")
    size = h.get_int(P + "source.size")
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or size < len(raw):
        raise MboltError(f"{h.path}: {P}source.header must be the source's header bytes (uint8) and "
                         f"{P}source.size at least their length")
    src_bytes = raw.tobytes()
    try:
        source = parse_header(src_bytes + bytes(8), Path(f"{h.path} ({P}source.header)"), size)
    except MboltError as e:
        raise MboltError(f"{h.path}: the recorded source header is damaged: {e}") from None
    _check_same_tensors(h, source)
    return KernelFile(h, str(h.get(P + "architecture")), str(h.get(P + "build")), layouts, source, src_bytes, size,
                      str(h.get(P + "source.sha256")))


def _check_same_tensors(h: GGUFHeader, source: GGUFHeader) -> None:
    if [(t.name, t.ne, t.type, t.nbytes) for t in h.tensors] != \
            [(t.name, t.ne, t.type, t.nbytes) for t in source.tensors]:
        raise MboltError(f"{h.path}: its tensors differ from those of the recorded source header")


def check_build(k: KernelFile, build: Build) -> None:
    """Refuse a file made for another build's repacked layouts, in one line naming both."""
    for t in k.header.tensors:
        have = k.layouts.get(t.name)
        want = layout_of(t.name, t.ne, t.type, build)
        if have != want:
            raise MboltError(
                f"{k.header.path}: made for {k.build} ({t.name} stored as "
                f"{have.name if have else t.type.name + ' unrepacked'}), but this llama.cpp is {build.name} "
                f"({want.name if want else 'keeps ' + t.type.name + ' unrepacked'}): remake it with `mbolt repack`, "
                f"or get the stock file back with `mbolt repack --restore`")


def copied_kvs(h: GGUFHeader, head: bytes, architecture: str, drop=()) -> list[bytes]:
    """`h`'s metadata pairs as its file holds them (`head`: its header bytes), with
    `general.architecture` set to `architecture` and none of the mbolt.kernel records nor the keys
    in `drop`: what both headers of the kernel layout keep of their source."""
    return [encode_kv(kv.key, V.STRING, architecture) if kv.key == Keys.General.ARCHITECTURE
            else head[kv.span[0]:kv.span[1]] for kv in h.kv.values()
            if not kv.key.startswith(P) and kv.key not in drop]


def stock_view(k: KernelFile) -> GGUFHeader:
    """The kernel-layout file's own header as the model it holds: the real architecture, every
    tensor where this file holds it (what the runtime reads experts from, runtime.kernel_stream),
    and the source's fingerprint (the same model as the stock file it was made from)."""
    from dataclasses import replace

    from mbolt.core.header import KV

    kv = {key: v for key, v in k.header.kv.items() if not key.startswith(P)}
    kv[Keys.General.ARCHITECTURE] = KV(Keys.General.ARCHITECTURE, V.STRING, k.architecture)
    return replace(k.header, kv=kv, fingerprint=k.source.fingerprint)


def llama_header(k: KernelFile) -> bytes:
    """The header llama.cpp loads a kernel-layout file with: its own keys and tensor infos (the
    same offsets), the real architecture, none of the mbolt.kernel records. Its data section is
    the kernel-layout file's, byte for byte."""
    h = k.header
    with open(h.path, "rb") as f:
        kvs = copied_kvs(h, f.read(h.header_size), k.architecture)
    return encode_header_start(len(h.tensors), len(kvs), h.version) + b"".join(kvs) + b"".join(
        encode_tensor_info(t.name, t.ne, t.type, t.offset) for t in h.tensors)
