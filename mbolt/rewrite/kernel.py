"""The kernel layout: a GGUF whose weights are stored as llama.cpp's CPU backend holds them after
repacking (core/repack.py), so that a reader can put them straight into the repack buffer with no
CPU work, and the stock file can be given back bit for bit.

A kernel-layout file is the source with three changes:
- every tensor llama.cpp would repack in the target build is stored repacked (same size, same
  place in the order), everything else byte for byte;
- `general.architecture` is `mbolt-kernel`, so that stock llama.cpp refuses the file ("unknown
  model architecture") instead of computing with rearranged bytes; the real one is
  `mbolt.kernel.architecture`;
- tensors start on 4 KiB (O_DIRECT reads of whole experts where their size allows), and
  `mbolt.kernel.*` records the build it was made for, the layout of each repacked tensor, and the
  source's header bytes, size and SHA-256, which `restore_stock` and `verify_kernel` check.

One file on disk: the stock GGUF is `restore_stock` away, so the source may be deleted once
`mbolt verify SRC OUT` has proven the round trip. A split set is not taken (yet): one file in,
one file out.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFValueType as V, Keys

from mbolt.core.atomic import atomic_output, check_output
from mbolt.core.errors import MboltError
from mbolt.core.header import GGUFHeader, TensorInfo, encode_header_start, encode_kv, encode_tensor_info, \
    read_header
from mbolt.core.kernel_file import KERNEL_ARCH, P, VERSION, KernelFile, copied_kvs, is_kernel_file, read_kernel
from mbolt.core.repack import Build, RepackType, layout_of, repack, unrepack

ALIGN = 4096
CHUNK = 64 << 20  # bytes per read-transform-write step: memory stays flat whatever the model

Progress = Callable[[int, int], None]


@dataclass
class KernelResult:
    src: str
    dst: str
    build: str
    repacked: dict[str, int] = field(default_factory=dict)  # layout -> tensors
    repacked_bytes: int = 0
    kept: dict[str, int] = field(default_factory=dict)  # matrix type with no repacked kernel here -> tensors
    kept_names: list[str] = field(default_factory=list)
    size: int = 0
    sha256: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# ---- writing ----


def _kvs(src: GGUFHeader, head: bytes, build: Build, layouts: dict[str, RepackType], sha: str) -> list[bytes]:
    names = list(layouts)
    return copied_kvs(src, head, KERNEL_ARCH, drop=(Keys.General.ALIGNMENT,)) + [
        encode_kv(Keys.General.ALIGNMENT, V.UINT32, ALIGN),
        encode_kv(P + "version", V.UINT32, VERSION),
        encode_kv(P + "architecture", V.STRING, str(src.get(Keys.General.ARCHITECTURE))),
        encode_kv(P + "build", V.STRING, build.name),
        encode_kv(P + "tensors", V.ARRAY, names, V.STRING),
        encode_kv(P + "layouts", V.ARRAY, [layouts[n].name for n in names], V.STRING),
        encode_kv(P + "source.header", V.ARRAY, np.frombuffer(head, np.uint8), V.UINT8),
        encode_kv(P + "source.size", V.UINT64, src.file_size),
        encode_kv(P + "source.sha256", V.STRING, sha)]


def _in_file_order(h: GGUFHeader) -> list[TensorInfo]:
    return sorted(h.tensors, key=lambda t: t.data_offset)


def _gap(src: GGUFHeader, fd: int, pos: int, end: int) -> bytes:
    """The source's bytes in [pos, end) between two tensors (or after the header), which must be
    zeros: a restore writes zeros there."""
    gap = os.pread(fd, end - pos, pos) if end > pos else b""
    padding = gap[max(0, src.header_size - pos):]  # the header itself is not padding
    if padding.strip(b"\0"):
        raise MboltError(f"{src.path}: non-zero bytes between tensors (at byte {max(pos, src.header_size)}): a "
                         f"restore could not give this file back bit for bit")
    return gap


def _row_chunk(t: TensorInfo, lay: RepackType | None) -> int:
    """Bytes per step: whole groups of 8 rows for a repacked tensor."""
    if lay is None:
        return CHUNK
    group = t.nbytes // (int(np.prod(t.ne[1:])) // 8)
    return max(group, CHUNK // group * group)


def write_kernel(src: str | os.PathLike, dst: str | os.PathLike, build: Build, *, force: bool = False,
                 progress: Progress | None = None) -> KernelResult:
    """Write `dst`, the kernel layout of `src` for `build`, in one pass over the source: its
    SHA-256 (recorded, so that a restore proves itself) is taken as it is read, and the header,
    whose length does not depend on the hash, is written last."""
    src, dst = Path(src), Path(dst)
    h = read_header(src)
    if h.get(Keys.Split.LLM_KV_SPLIT_COUNT) is not None and h.get_int(Keys.Split.LLM_KV_SPLIT_COUNT) > 1:
        raise MboltError(f"{src}: a shard of a split set; `mbolt repack` takes one file (merge the set with "
                         f"llama.cpp's gguf-split --merge first)")
    if is_kernel_file(h):
        raise MboltError(f"{src}: already a kernel-layout file")
    check_output(dst, kind="gguf-mbolt", inputs=[src], force=force)
    layouts = {t.name: lay for t in h.tensors if (lay := layout_of(t.name, t.ne, t.type, build))}
    res = KernelResult(str(src), str(dst), build.name)
    for t in h.tensors:
        lay = layouts.get(t.name)
        if lay:
            res.repacked[lay.name] = res.repacked.get(lay.name, 0) + 1
            res.repacked_bytes += t.nbytes
        elif t.name.endswith(".weight") and len(t.ne) >= 2 and t.type.name not in ("F32", "F16", "BF16"):
            res.kept[t.type.name] = res.kept.get(t.type.name, 0) + 1
            res.kept_names.append(t.name)
    order = _in_file_order(h)
    offsets, pos = {}, 0
    for t in order:
        pos = -(-pos // ALIGN) * ALIGN
        offsets[t.name] = pos
        pos += t.nbytes

    def header(sha: str) -> bytes:
        kvs = _kvs(h, head, build, layouts, sha)
        return encode_header_start(len(h.tensors), len(kvs), h.version) + b"".join(kvs) + b"".join(
            encode_tensor_info(t.name, t.ne, t.type, offsets[t.name]) for t in h.tensors)

    fd = os.open(src, os.O_RDONLY)
    try:
        head = os.pread(fd, h.header_size, 0)
        data_start = -(-len(header("0" * 64)) // ALIGN) * ALIGN
        sha, pos, done, total = hashlib.sha256(), 0, 0, sum(t.nbytes for t in h.tensors)
        with atomic_output(dst, force=True) as out:
            for t in order:
                sha.update(_gap(h, fd, pos, t.data_offset))
                lay = layouts.get(t.name)
                out.seek(data_start + offsets[t.name])
                step = _row_chunk(t, lay)
                for off in range(0, t.nbytes, step):
                    b = os.pread(fd, min(step, t.nbytes - off), t.data_offset + off)
                    sha.update(b)
                    out.write(repack(np.frombuffer(b, np.uint8), lay, t.ne[0]).tobytes() if lay else b)
                    done += len(b)
                    if progress:
                        progress(done, total)
                pos = t.data_offset + t.nbytes
            sha.update(_gap(h, fd, pos, h.file_size))
            out.truncate(out.tell())
            res.size = out.tell()
            res.sha256 = sha.hexdigest()
            out.seek(0)
            first = header(res.sha256)  # a hex SHA-256 is 64 characters: the length reserved above
            out.write(first + bytes(data_start - len(first)))
    finally:
        os.close(fd)
    return res


# ---- reading back ----


def stock_chunks(k: KernelFile, fd: int, progress: Progress | None = None):
    """The stock file's bytes in order, as a stream of chunks (header, zero padding, tensors)."""
    src, h = k.source, k.header
    by_name = {t.name: t for t in h.tensors}
    yield k.source_header
    pos, total, done = src.header_size, sum(t.nbytes for t in src.tensors), 0
    for t in _in_file_order(src):
        if t.data_offset > pos:
            yield bytes(t.data_offset - pos)
        lay, at = k.layouts.get(t.name), by_name[t.name].data_offset
        step = _row_chunk(t, lay)
        for off in range(0, t.nbytes, step):
            b = os.pread(fd, min(step, t.nbytes - off), at + off)
            if len(b) != min(step, t.nbytes - off):
                raise MboltError(f"{h.path}: tensor {t.name} ends past the end of the file")
            yield unrepack(np.frombuffer(b, np.uint8), lay, t.ne[0]).tobytes() if lay else b
            done += len(b)
            if progress:
                progress(done, total)
        pos = t.data_offset + t.nbytes
    if k.source_size > pos:
        yield bytes(k.source_size - pos)


def restore_stock(path: str | os.PathLike, dst: str | os.PathLike, progress: Progress | None = None) -> dict:
    """Write the stock GGUF a kernel-layout file was made from; it appears only if its SHA-256 is
    the recorded one. Never over an existing file: a model there is not ours to replace."""
    k = read_kernel(path)
    if Path(dst).exists():
        raise MboltError(f"{dst}: exists; restore to a new path (a model is never replaced)")
    check_output(dst, kind="gguf-model", inputs=[Path(path)])
    sha = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        with atomic_output(dst, force=True) as out:
            for b in stock_chunks(k, fd, progress):
                sha.update(b)
                out.write(b)
            if sha.hexdigest() != k.source_sha256:
                raise MboltError(f"{path}: the restored bytes' SHA-256 {sha.hexdigest()[:16]}... is not the "
                                 f"recorded {k.source_sha256[:16]}...: the file is damaged (nothing written)")
    finally:
        os.close(fd)
    return {"src": str(path), "dst": str(dst), "size": k.source_size, "sha256": k.source_sha256}


def verify_kernel(src: str | os.PathLike, path: str | os.PathLike, progress: Progress | None = None) -> dict:
    """Prove that `path` gives `src` back bit for bit: its restored stream against src's bytes,
    chunk by chunk (the first differing byte is named), and both against the recorded SHA-256."""
    k = read_kernel(path)
    src = Path(src)
    size = src.stat().st_size
    with open(src, "rb") as f:
        if size != k.source_size or f.read(len(k.source_header)) != k.source_header:
            raise MboltError(f"{path}: was not made from {src} (the recorded source header or size differs)")
    sha = hashlib.sha256()
    pos, first = 0, None
    fd = os.open(path, os.O_RDONLY)
    try:
        with open(src, "rb") as f:
            for b in stock_chunks(k, fd, progress):
                sha.update(b)
                ref = f.read(len(b))
                if first is None and ref != b:
                    n = min(len(ref), len(b))
                    i = int(np.argmax(np.frombuffer(ref[:n], np.uint8) != np.frombuffer(b[:n], np.uint8))) \
                        if ref[:n] != b[:n] else n
                    first = pos + i
                pos += len(b)
    finally:
        os.close(fd)
    same = first is None and pos == size
    return {"src": str(src), "out": str(path), "identical": same, "first_difference": first,
            "size": size, "restored_size": pos, "sha256_recorded": k.source_sha256,
            "sha256_restored": sha.hexdigest(), "sha256_ok": sha.hexdigest() == k.source_sha256,
            "build": k.build, "repacked_tensors": len(k.layouts)}


def layout_record(path: str | os.PathLike) -> dict:
    """What `inspect` shows of a kernel-layout file."""
    k = read_kernel(path)
    count: dict[str, int] = {}
    for lay in k.layouts.values():
        count[lay.name] = count.get(lay.name, 0) + 1
    return {"architecture": k.architecture, "build": k.build, "layouts": count,
            "source_size": k.source_size, "source_sha256": k.source_sha256}

