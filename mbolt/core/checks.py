"""Checks every reader applies to what it reads, before anything is allocated or looped over.

A few changed bytes must never make mbolt hang or allocate gigabytes: every count read from a
file is an integer (not a string, float or array), lies in a sane range, and whatever it sizes
is bounded by the file's own size. Byte counts are computed with Python ints (numpy int64
products wrap silently).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
from gguf import Keys

from mbolt.core.errors import MboltError

MAX_LAYERS = 4096  # real MoE models have < 100 layers; a larger count is a damaged file
MAX_EXPERTS = 32767  # expert ids are int16 in traces
MAX_CELLS = 1 << 28  # token x layer x k cells a reader may allocate (512 MiB of int16) at most


def as_int(value, where: str) -> int:
    """`value` as a Python int, or MboltError naming `where` (a string, array or bool is refused)."""
    if isinstance(value, (bool, np.bool_)):
        raise MboltError(f"{where}: is a boolean, expected an integer")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    shown = repr(value) if not isinstance(value, np.ndarray) else f"an array of {value.size}"
    raise MboltError(f"{where}: is {shown[:40]}, expected an integer")


def check_range(value, where: str, lo: int, hi: int) -> int:
    """`as_int(value)` in [lo, hi], or MboltError."""
    v = as_int(value, where)
    if not lo <= v <= hi:
        raise MboltError(f"{where}: {v} is out of range (expected {lo}..{hi})")
    return v


def check_cells(where: str, shape: tuple[int, ...], limit: int = MAX_CELLS) -> None:
    """Refuse an array of `shape` larger than `limit` elements (computed with Python ints)."""
    n = math.prod(int(x) for x in shape)
    if n > limit:
        dims = " x ".join(str(int(x)) for x in shape)
        raise MboltError(f"{where}: would need {dims} = {n:,} entries (limit {limit:,}): damaged file?")


def read_text(path: str | os.PathLike, what: str) -> str:
    """A UTF-8 text file's contents; missing, a directory, unreadable or not UTF-8 is one
    MboltError naming the file."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MboltError(f"{p}: {what} not found") from None
    except IsADirectoryError:
        raise MboltError(f"{p}: is a directory, expected a {what}") from None
    except OSError as e:
        raise MboltError(f"{p}: cannot read the {what}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise MboltError(f"{p}: not a readable {what} (byte {e.start} is not UTF-8)") from None


def read_json(path: str | os.PathLike, what: str = "JSON file"):
    """Parse a JSON file; any failure (missing, unreadable, not UTF-8, not JSON, nested too
    deep) is one MboltError naming the file."""
    p = Path(path)
    text = read_text(p, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MboltError(f"{p}: not a readable {what} (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise MboltError(f"{p}: not a readable {what} (nested too deeply)") from None


_LAYER = re.compile(r"^blk\.(\d+)\.")


def n_layers_of(header) -> int:
    """Layers of a model: `{arch}.block_count`, or one past the highest blk.N of its tensors when
    the key is missing. A layer index beyond block_count or MAX_LAYERS is a damaged file (and
    would make every per-layer loop run that long)."""
    key = Keys.LLM.BLOCK_COUNT.format(arch=header.get(Keys.General.ARCHITECTURE))
    block_count = header.get_int(key)
    if not 0 <= block_count <= MAX_LAYERS:
        raise MboltError(f"{header.path}: {key} is {block_count} (expected 1..{MAX_LAYERS})")
    top = -1
    for t in header.tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) > top:
            top = int(m.group(1))
            if top >= MAX_LAYERS or (block_count and top >= block_count):
                limit = f"{key} is {block_count}" if block_count else f"at most {MAX_LAYERS} layers"
                raise MboltError(f"{header.path}: tensor {t.name}: layer {top} is out of range ({limit})")
    return block_count or top + 1
