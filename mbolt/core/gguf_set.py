"""Split GGUF sets (`NAME-00001-of-0000N.gguf` ...) opened as one model.

Big models ship as sets: llama.cpp's `gguf-split` and gguf-py's `GGUFWriter(split_max_*=...)`
write every metadata pair into shard 1, the tensors spread over the shards in order, and in
every shard the keys `split.no` (u16, 0-based), `split.count` (u16) and `split.tensors.count`
(i32, the total). llama.cpp finds the other shards from shard 1's name.

`open_model_header(path)`, given one file or ANY shard of a set, returns one GGUFHeader for the
whole model: shard 1's metadata, every shard's tensors in order, each TensorInfo naming its
shard (`file`, an index into `header.paths`) and its absolute offset in that shard. The set is
checked first: every shard present, `split.no` = 0..N-1, the same `split.count` and
`split.tensors.count` everywhere and equal to the tensors found, no tensor twice, one set
identity (`mbolt.set.id`, written by `mbolt reorder` into every shard it writes: a shard of
another set, or an old shard beside new ones, is refused). A set written by gguf-split or
gguf-py has no such id: there a foreign shard is caught only when its split keys, tensor
names or architecture disagree (a shard of an identically shaped model is not detectable).

Fingerprint of a set: sha256 over "mbolt.set:" followed by every shard's header fingerprint
(in shard order, comma separated), hex, first 16 bytes. It changes when any shard's header
changes, like a one-file fingerprint does.

Byte readers address a set with "virtual" offsets, `vaddr(file, offset) = file << FILE_SHIFT |
offset`: merged reads never cross a file (the gap between files is 2^48 bytes) and `split_vaddr`
gives (file, offset) back. For a single file virtual offsets are plain offsets.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path

from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.core.header import GGUFHeader, read_header

SHARD_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
SPLIT_NO, SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
SET_ID_KEY = "mbolt.set.id"
FILE_SHIFT = 48
_MASK = (1 << FILE_SHIFT) - 1
MAX_SHARDS = 65535  # split.count is a u16


def is_set_key(key: str) -> bool:
    """Keys that describe the split, not the model (rewritten per shard by reorder, ignored by verify)."""
    return key in SPLIT_KEYS or key == SET_ID_KEY


def shard_name(prefix: str, i: int, n: int) -> str:
    """llama.cpp's `llama_split_path`: PREFIX-%05d-of-%05d.gguf, i 1-based."""
    return f"{prefix}-{i:05d}-of-{n:05d}.gguf"


def set_paths(out: str | os.PathLike, n: int) -> list[Path]:
    """Output paths of an n-shard set named after `out` (out.gguf -> out-00001-of-0000N.gguf ...)."""
    out = Path(out)
    if n <= 1:
        return [out]
    stem = out.name[:-5] if out.name.endswith(".gguf") else out.name
    return [out.with_name(shard_name(stem, i + 1, n)) for i in range(n)]


def set_fingerprint(shard_fingerprints: list[str]) -> str:
    return hashlib.sha256(("mbolt.set:" + ",".join(shard_fingerprints)).encode()).hexdigest()[:32]


def vaddr(file: int, offset: int) -> int:
    return (int(file) << FILE_SHIFT) | int(offset)


def split_vaddr(v):
    """(file, offset) of a virtual offset; of an integer array of them, two arrays (elementwise)."""
    if getattr(v, "ndim", 0) == 0:
        v = int(v)
    return v >> FILE_SHIFT, v & _MASK


def _int_key(h: GGUFHeader, key: str):
    v = h.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise MboltError(f"{h.path}: {key} is not an integer ({v!r})")
    return int(v)


def resolve_model_path(path: str | os.PathLike) -> Path:
    """`path`, or when no such file exists, shard 1 of the one set named after it (the name
    `mbolt reorder` was given: out.gguf -> out-00001-of-0000N.gguf)."""
    path = Path(path)
    if path.exists() or not path.name.endswith(".gguf"):
        return path
    import glob

    found = sorted(path.parent.glob(glob.escape(path.name[:-5]) + "-00001-of-[0-9][0-9][0-9][0-9][0-9].gguf"))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise MboltError(f"{path}: no such file, and {len(found)} sets are named after it "
                         f"({', '.join(p.name for p in found)}): give a shard's path")
    return path


def open_model_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the model at `path`: one file, or the whole set `path` is a shard of."""
    path = resolve_model_path(path)
    h = read_header(path)
    count = _int_key(h, SPLIT_COUNT)
    m = SHARD_RE.match(path.name)
    if count is None or count == 1:
        if m and int(m.group(3)) > 1:
            raise MboltError(f"{path}: named as shard {int(m.group(2))} of {int(m.group(3))} but has no split.count "
                             "metadata (not a shard of a split set)")
        return h
    if not 1 < count <= MAX_SHARDS:
        raise MboltError(f"{path}: split.count is {count}, expected 1..{MAX_SHARDS}")
    if not m:
        raise MboltError(f"{path}: shard of a {count}-file split set, but its name does not follow "
                         "NAME-0000I-of-0000N.gguf (llama.cpp finds the other shards by name)")
    if int(m.group(3)) != count:
        raise MboltError(f"{path}: name says {int(m.group(3))} shards, split.count says {count}")
    paths = [path.with_name(shard_name(m.group(1), i + 1, count)) for i in range(count)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise MboltError(f"{missing[0]}: missing shard {paths.index(missing[0]) + 1} of {count} of the set "
                         f"{m.group(1)}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return combine_shards([h if p == path else read_header(p) for p in paths])


def combine_shards(shards: list[GGUFHeader]) -> GGUFHeader:
    """Check that `shards` (headers in order) form one set and merge them into one header."""
    count = len(shards)
    first = shards[0]
    total = _int_key(first, SPLIT_TENSORS)
    set_id = first.get(SET_ID_KEY)
    seen: dict[str, int] = {}
    for i, s in enumerate(shards):
        no, n, tc = _int_key(s, SPLIT_NO), _int_key(s, SPLIT_COUNT), _int_key(s, SPLIT_TENSORS)
        if no != i:
            raise MboltError(f"{s.path}: split.no is {no}, expected {i} (shard {i + 1} of {count}): shard of another set?")
        if n != count:
            raise MboltError(f"{s.path}: split.count is {n}, shard 1 says {count}: shard of another set")
        if tc != total:
            raise MboltError(f"{s.path}: split.tensors.count is {tc}, shard 1 says {total}: shard of another set")
        if s.get(SET_ID_KEY) != set_id:
            raise MboltError(f"{s.path}: belongs to another set (mbolt.set.id {s.get(SET_ID_KEY)!r}, shard 1 has "
                             f"{set_id!r}): a mix of shards from different runs; rewrite the set")
        arch, first_arch = s.get(Keys.General.ARCHITECTURE), first.get(Keys.General.ARCHITECTURE)
        if i and arch is not None and arch != first_arch:
            raise MboltError(f"{s.path}: architecture {arch!r}, shard 1 has {first_arch!r}: shard of another set")
        for t in s.tensors:
            j = seen.setdefault(t.name, i)
            if j != i:
                raise MboltError(f"{s.path}: tensor {t.name} is also in shard {j + 1}: shard of another set?")
    n_found = sum(len(s.tensors) for s in shards)
    if total != n_found:
        raise MboltError(f"{first.path}: split.tensors.count is {total}, the {count} shards hold {n_found} tensors")
    tensors = [replace(t, file=i) for i, s in enumerate(shards) for t in s.tensors]
    return GGUFHeader(first.path, first.version, first.kv, tensors, first.alignment, first.data_offset,
                      first.header_size, sum(s.file_size for s in shards),
                      set_fingerprint([s.fingerprint for s in shards]), shards)
