"""llama.cpp's repacked weight layout, as plain numpy: this build's choice per tensor, and the
exact forward and inverse byte transforms.

llama.cpp's CPU backend copies Q4_0/Q4_K/IQ4_NL/MXFP4 (and, with AVX-512, Q2_K) matrices into its
repack buffer at load, interleaving the blocks of 8 consecutive rows so that its SIMD kernels read
them in one pass (ggml/src/ggml-cpu/repack.cpp: `ggml_repack_get_optimal_repack_type` picks the
layout from the CPU features the library was built for, `repack_*_bl` and `make_block_*x8` move the
bytes). The transforms are pure rearrangements (Q4_0 also flips each nibble's top bit), size
preserving and invertible, so a file can store weights repacked and still give the stock bytes
back bit for bit. A group of 8 rows never straddles two experts (an expert has a multiple of 8
rows, or the tensor is not repacked), so expert e keeps the byte range [e*slice, (e+1)*slice).

The choice mirrors llama-cpp-python 0.3.36's vendored ggml on x86; tests compare every repacked
byte with what llama.cpp itself holds in its buffer after a default load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from mbolt.core.errors import MboltError

ROWS = 8  # rows interleaved per group, for every x86 layout


@dataclass(frozen=True)
class RepackType:
    """One of llama.cpp's repacked layouts (its tensor_traits instance name)."""

    name: str  # "q4_K_8x8": source type, rows interleaved, bytes taken per row at a time
    type: Q
    forward: Callable[[np.ndarray], np.ndarray]  # (groups, 8, block) uint8 -> (groups, 8 * block)
    inverse: Callable[[np.ndarray], np.ndarray]  # (groups, 8 * block) uint8 -> (groups, 8, block)


def _chunks(qs: np.ndarray, width: int = 8) -> np.ndarray:
    """qs of 8 rows (g, 8, n) -> chunk-major (g, n): chunk c of row r lands at (c * 8 + r) * width."""
    g, r, n = qs.shape
    return qs.reshape(g, r, n // width, width).transpose(0, 2, 1, 3).reshape(g, r * n)


def _unchunks(flat: np.ndarray, n: int, width: int = 8) -> np.ndarray:
    g = flat.shape[0]
    return flat.reshape(g, n // width, ROWS, width).transpose(0, 2, 1, 3).reshape(g, ROWS, n)


def _scale_first(head: int, qs_xor: int = 0):
    """Layouts of a per-block scale (`head` bytes) then 16 quant bytes: Q4_0, IQ4_NL, MXFP4."""

    def forward(b: np.ndarray) -> np.ndarray:
        qs = _chunks(b[:, :, head:])
        return np.concatenate([b[:, :, :head].reshape(len(b), -1), qs ^ np.uint8(qs_xor)], axis=1)

    def inverse(f: np.ndarray) -> np.ndarray:
        heads = f[:, :ROWS * head].reshape(len(f), ROWS, head)
        qs = _unchunks(f[:, ROWS * head:] ^ np.uint8(qs_xor), f.shape[1] // ROWS - head)
        return np.concatenate([heads, qs], axis=2)

    return forward, inverse


# Q4_K: d(2) dmin(2) scales(12) qs(128). The 12 scale bytes hold 8 sub-block scales s and mins m
# of 6 bits (get_scale_min_k4); Q4_Kx8 regroups them per sub-block across the 8 rows.
def _q4k_unpack_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.empty(sc.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(s)
    s[..., :4], m[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    s[..., 4:] = ((sc[..., 0:4] & 192) >> 2) | (sc[..., 8:12] & 15)
    m[..., 4:] = ((sc[..., 4:8] & 192) >> 2) | ((sc[..., 8:12] & 240) >> 4)
    return s, m


def _q4k_pack_scales(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The inverse of _q4k_unpack_scales over the last axis: 8 scales + 8 mins -> 12 bytes."""
    return np.concatenate([s[..., :4] | ((s[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                           (s[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)


def _q4k_forward(b: np.ndarray) -> np.ndarray:
    g = len(b)
    s, m = _q4k_unpack_scales(b[:, :, 4:16])  # (g, row, sub-block)
    # sub-block k's 12 bytes: rows 0-3 of s and m (6 bits, rows 4-7's top 2 bits above), then
    # rows 4-7's low 4 bits of s and m. The row axis is the last one here, as the code packs it.
    s, m = s.transpose(0, 2, 1), m.transpose(0, 2, 1)  # (g, sub-block, row)
    scales = _q4k_pack_scales(s, m).reshape(g, 96)
    return np.concatenate([b[:, :, 0:2].reshape(g, 16), b[:, :, 2:4].reshape(g, 16), scales,
                           _chunks(b[:, :, 16:])], axis=1)


def _q4k_inverse(f: np.ndarray) -> np.ndarray:
    g = len(f)
    s, m = _q4k_unpack_scales(f[:, 32:128].reshape(g, 8, 12))  # (g, sub-block, row)
    scales = _q4k_pack_scales(s.transpose(0, 2, 1), m.transpose(0, 2, 1))  # (g, row, 12)
    return np.concatenate([f[:, 0:16].reshape(g, 8, 2), f[:, 16:32].reshape(g, 8, 2), scales,
                           _unchunks(f[:, 128:], 128)], axis=2)


# Q2_K: scales(16) qs(64) d(2) dmin(2); Q2_Kx8: d[8] dmin[8] scales[128] qs[512], where scale byte
# 16a + 2r + b is row r's scale 2a + b.
def _q2k_forward(b: np.ndarray) -> np.ndarray:
    g = len(b)
    scales = b[:, :, 0:16].reshape(g, 8, 8, 2).transpose(0, 2, 1, 3).reshape(g, 128)
    return np.concatenate([b[:, :, 80:82].reshape(g, 16), b[:, :, 82:84].reshape(g, 16), scales,
                           _chunks(b[:, :, 16:80])], axis=1)


def _q2k_inverse(f: np.ndarray) -> np.ndarray:
    g = len(f)
    scales = f[:, 32:160].reshape(g, 8, 8, 2).transpose(0, 2, 1, 3).reshape(g, 8, 16)
    return np.concatenate([scales, _unchunks(f[:, 160:], 64), f[:, 0:16].reshape(g, 8, 2),
                           f[:, 16:32].reshape(g, 8, 2)], axis=2)


LAYOUTS = {r.name: r for r in (
    RepackType("q4_0_8x8", Q.Q4_0, *_scale_first(2, 0x88)),
    RepackType("iq4_nl_8x8", Q.IQ4_NL, *_scale_first(2)),
    RepackType("mxfp4_8x8", Q.MXFP4, *_scale_first(1)),
    RepackType("q4_K_8x8", Q.Q4_K, _q4k_forward, _q4k_inverse),
    RepackType("q2_K_8x8", Q.Q2_K, _q2k_forward, _q2k_inverse),
)}

# ggml_repack_get_optimal_repack_type on x86: the CPU feature each layout needs
_NEEDS = {"q4_0_8x8": "AVX2", "iq4_nl_8x8": "AVX2", "mxfp4_8x8": "AVX2", "q4_K_8x8": "AVX2", "q2_K_8x8": "AVX512"}


@dataclass(frozen=True)
class Build:
    """The CPU backend a repacked file is made for: the features its choice depends on."""

    features: frozenset[str]

    @property
    def name(self) -> str:
        isa = "AVX-512" if "AVX512" in self.features else "AVX2" if "AVX2" in self.features else "no AVX2"
        return f"llama.cpp CPU, x86 {isa}"

    def layout_for(self, t: Q) -> RepackType | None:
        for name, need in _NEEDS.items():
            if LAYOUTS[name].type == t and need in self.features:
                return LAYOUTS[name]
        return None


def features_on(system_info: str) -> set[str]:
    """The features llama.cpp's `llama_print_system_info()` says are on ("AVX2 = 1 | AVX512 = 0")."""
    return {k for k, v in re.findall(r"([A-Z0-9_]+) = (\d+)", system_info) if v != "0"}


def build_of(system_info: str) -> Build:
    """A Build from llama.cpp's `llama_print_system_info()` ("AVX2 = 1 | AVX512 = 1 | REPACK = 1")."""
    on = features_on(system_info)
    if "REPACK" not in on:
        return Build(frozenset())  # built without GGML_CPU_REPACK: nothing is repacked
    return Build(frozenset(on))


def this_build() -> Build:
    """The installed llama.cpp's choice (llama-cpp-python's library)."""
    try:
        import llama_cpp
    except ImportError:
        raise MboltError("repacking follows the installed llama.cpp build: install mbolt-moe[llama], "
                         "or name the target with --isa avx2|avx512") from None
    info = llama_cpp.llama_print_system_info()
    return build_of(info.decode() if isinstance(info, bytes) else str(info))


def build_named(isa: str) -> Build:
    isa = isa.lower().replace("-", "")
    if isa not in ("avx2", "avx512"):
        raise MboltError(f"--isa {isa}: expected avx2 or avx512")
    return Build(frozenset({"REPACK", "AVX2"} | ({"AVX512"} if isa == "avx512" else set())))


_NO_REPACK = re.compile(r"^(token_embd|per_layer_token_embd)\.weight$")  # GET_ROWS, not a matmul


def layout_of(name: str, ne: tuple[int, ...], t: Q, build: Build) -> RepackType | None:
    """The layout llama.cpp gives this tensor in `build`, None if it stays as in the file.

    Its loader offers the repack buffer to the weights of matrix products (2-D MUL_MAT, 3-D
    MUL_MAT_ID); the layout then needs rows in groups of 8 (ne[1] % 8) and, for the 8-byte
    interleave, rows of a multiple of 8 elements."""
    if not name.endswith(".weight") or _NO_REPACK.match(name) or len(ne) not in (2, 3):
        return None
    r = build.layout_for(t)
    if r is None or ne[1] % ROWS or ne[0] % 8:
        return None
    return r


def _groups(data: np.ndarray, r: RepackType, n_row_blocks: int) -> np.ndarray:
    block = GGML_QUANT_SIZES[r.type][1]
    if data.size % (ROWS * n_row_blocks * block):
        raise MboltError(f"{r.name}: {data.size} bytes are not whole groups of {ROWS} rows")
    # (row groups, 8 rows, blocks per row, block) -> one group of 8 blocks per column
    return data.reshape(-1, ROWS, n_row_blocks, block).transpose(0, 2, 1, 3).reshape(-1, ROWS, block)


def repack(data: np.ndarray, r: RepackType, row_elements: int) -> np.ndarray:
    """Stock bytes (whole rows of `row_elements`) -> the repacked bytes llama.cpp holds."""
    nb = row_elements // GGML_QUANT_SIZES[r.type][0]
    return r.forward(_groups(np.ascontiguousarray(data, dtype=np.uint8).reshape(-1), r, nb)).reshape(-1)


def unrepack(data: np.ndarray, r: RepackType, row_elements: int) -> np.ndarray:
    """The inverse of `repack`: the stock bytes again, bit for bit."""
    block = GGML_QUANT_SIZES[r.type][1]
    nb = row_elements // GGML_QUANT_SIZES[r.type][0]
    flat = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, ROWS * block)
    rows = r.inverse(flat).reshape(-1, nb, ROWS, block).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(rows).reshape(-1)
