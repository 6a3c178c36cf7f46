"""The eval callback's filter in C: the hot path of a cached expert.

llama.cpp's scheduler asks the eval callback about every graph node (thousands per token), and
a Python callback costs about a microsecond per question even when it only compares a name: on a
small warm model that was 0.59x of plain llama.cpp's decode speed (results/
llama_stream_s64k_warm.json). This filter answers every question in C (yes for the nodes named
``ffn_moe_topk-N``) and hands only those nodes, once computed, to the Python callback.

A computed selection costs Python about 35 us even when the callback does nothing (the ctypes
trampoline, the GIL, building the rows), and the runtime's own work on a layer whose experts are
all cached (the LRU's update, counters) as much again: on a 16-layer toy model with everything
cached that was 0.2 ms per layer and token, where llama.cpp's split of the graph at the node costs
about 10 us. So in decode steps (`fast`) the filter itself checks the selection against the expert
cache's arrays (core.lru.ArrayLru: in the cache, by original id through the route map's perm) and,
when every expert is cached, stamps their last use (core/lru.c, the LRU's own code) and returns:
Python sees only selections with a miss. Its counts (`take_counts`) are added to the store's after
each step.

Under a budget (asynchronous reads, no pins) the filter answers a decode layer with misses too
(`with_misses`): the LRU's admit (core/lru.c) on the same arrays, the misses' slices merged per
tensor and submitted with WILLNEED, the victims unmapped and dropped. In Python that layer cost
about 200 us on q72 (the LRU's admit, the merge in numpy, a mincore per cached expert, one drop per
victim through ctypes): about 20 ms of a 35 ms token, on the path between the selection and the
matmuls. In C it costs the syscalls alone. Python keeps the path when a step selects more
experts than the cache holds, and `StreamRuntime(native_misses=False)` keeps it always (the A/B).

The C source is `native.c` beside this file, with `drops.c` (the thread that drops a decode
layer's victims behind it), `native.h` (what the two share) and the expert cache rule itself,
core/lru.c (`mbolt_lru_admit`, the one rule core.lru.ArrayLru binds too: both of the filter's
paths call it, so the C filter and Python's store cannot disagree on a victim).

It is compiled once with the system C compiler into ``$XDG_CACHE_HOME/mbolt`` (core.clib: the file
name carries a hash of the source; the tensor-name offset is passed at run time). Without a
compiler `topk_filter` returns None and the runner keeps the Python callback (slower, same routing).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np

from mbolt.core import lru
from mbolt.core.clib import load_c_library
from mbolt.core.errors import MboltError

PAGE = mmap.PAGESIZE

TOPK_PREFIX = b"ffn_moe_topk-"  # the graph nodes whose computed values are the selected experts
# nodes besides the selection that reach Python while their layer's bit is set in the shared
# `waits` array (share_waits; the graph is split there only then):
# - the expert matmuls before the last, in llama.cpp's order (build_moe_ffn: gate, up, then down):
#   once one is computed, the next one's rows must be there (runtime.kernel_stream reads behind them);
# - a layer's first node (its attention's norm): the layer before it is done with its experts, and
#   a prompt pass's reads of this layer can start under its attention (runtime.arm.BudgetedArm)
WAIT_NODES = {b"ffn_moe_gate-": "gate", b"ffn_moe_up-": "up", b"attn_norm-": "start"}
BEHIND, START = 1, 2  # the bits of `waits`
WAIT_BITS = {"gate": BEHIND, "up": BEHIND, "start": START}

_HERE = Path(__file__).parent
SOURCES = {"native.h": (_HERE / "native.h").read_text(),  # what the two files share
           "native.c": ((_HERE / "native.c").read_text()
                        .replace("PREFIX_LEN", str(len(TOPK_PREFIX))).replace("PREFIX", TOPK_PREFIX.decode())),
           "drops.c": (_HERE / "drops.c").read_text(),
           **lru.C_SOURCES}  # the expert cache rule (core/lru.c), which native.c calls


class _Filter(ctypes.Structure):
    _fields_ = [("python", ctypes.c_void_p), ("name_offset", ctypes.c_long), ("type_offset", ctypes.c_long),
                ("ne_offset", ctypes.c_long), ("nb_offset", ctypes.c_long), ("data_offset", ctypes.c_long),
                ("fast", ctypes.c_int32), ("n_layers", ctypes.c_int32), ("n_experts", ctypes.c_int32),
                ("perm", ctypes.c_void_p), ("cached", ctypes.c_void_p), ("stamp", ctypes.c_void_p),
                ("clock", ctypes.c_void_p), ("seen", ctypes.c_void_p), ("fast_layers", ctypes.c_int64),
                ("fast_experts", ctypes.c_int64), ("misses", ctypes.c_void_p), ("keys", ctypes.c_void_p),
                ("marks", ctypes.c_void_p), ("waits", ctypes.c_void_p)]


MISS_COUNTS = ("layers", "experts", "hits", "misses", "reads", "bytes", "useful", "io_ns", "reclaimed", "victims",
               "errors", "drop_ns")


class _Misses(ctypes.Structure):
    _fields_ = ([("slots", ctypes.c_int32), ("n_roles", ctypes.c_int32)]
                + [(k, ctypes.c_void_p) for k in ("r_file", "r_off", "r_len", "fds", "map_lo", "map_off", "map_len",
                                                  "ra_step", "visible")]
                + [("merge_gap", ctypes.c_int64)]
                + [(k, ctypes.c_void_p) for k in ("count", "read_mark", "sel", "in_sel", "runs", "vec")]
                + [("vec_pages", ctypes.c_int64)] + [(k, ctypes.c_int64) for k in MISS_COUNTS]
                + [("drop_behind", ctypes.c_int32), ("use_order", ctypes.c_int32), ("dropper", ctypes.c_void_p)])


_LIB: ctypes.CDLL | None | bool = False  # False: not tried yet; None: no compiler


def _library() -> ctypes.CDLL | None:
    global _LIB
    if _LIB is False:
        _LIB = load_c_library("topk_filter", SOURCES)
    return _LIB


class TopkFilter:
    """cb_eval and cb_eval_user_data for llama_context_params: the C filter in front of
    `python_cb` (a ggml_backend_sched_eval_callback object, kept alive here). `offsets`: where the
    name, type, ne, nb and data fields sit in a ggml_tensor (runtime.binding)."""

    def __init__(self, lib: ctypes.CDLL, python_cb, offsets: dict[str, int]):
        self.python_cb = python_cb
        self.user = _Filter(ctypes.cast(python_cb, ctypes.c_void_p).value,
                            *(offsets[k] for k in ("name", "type", "ne", "nb", "data")))
        self.cb = ctypes.cast(lib.mbolt_topk_filter, type(python_cb))
        self.lib = lib
        self.user_data = ctypes.cast(ctypes.pointer(self.user), ctypes.c_void_p)
        self._arrays: tuple = ()
        self.misses: _Misses | None = None

    def share_cache(self, perm, cached, stamp, clock) -> None:
        """The expert cache's arrays (numpy, C-contiguous: perm int32 [L, E] positions -> original
        ids, cached uint8 and stamp int64 [L, E] by original id, clock int64 [1]), read and
        stamped by the C filter in fast steps (`fast`)."""
        perm = np.ascontiguousarray(perm, np.int32)
        for a, dt in ((cached, np.uint8), (stamp, np.int64), (clock, np.int64)):
            if a.dtype != dt or not a.flags.c_contiguous:
                raise ValueError("the expert cache's arrays must be C-contiguous uint8/int64")
        u = self.user
        u.n_layers, u.n_experts = perm.shape
        self.seen = np.zeros(perm.shape[0], np.uint8)
        keys, marks = np.zeros(perm.shape[1], np.int64), np.zeros(perm.shape[1], np.uint8)  # the filter's scratch
        u.perm, u.cached, u.stamp, u.clock, u.seen, u.keys, u.marks = (
            a.ctypes.data for a in (perm, cached, stamp, clock, self.seen, keys, marks))
        self._arrays = (perm, cached, stamp, clock, self.seen, keys, marks)  # alive as long as C may read them

    def share_waits(self, waits: np.ndarray) -> None:
        """Ask llama.cpp about the WAIT_NODES too, while their layer's bit (WAIT_BITS) is set in
        `waits` (uint8 [n_layers], shared): computed, they reach Python."""
        if waits.dtype != np.uint8 or not waits.flags.c_contiguous:
            raise ValueError("waits must be a C-contiguous uint8 array")
        self._waits = waits
        self.user.waits = waits.ctypes.data

    def share_store_reads(self, store, pages, drop_behind: bool = True) -> None:
        """`share_reads` with a runtime.store.ExpertStore's LRU, descriptors and merge, and a
        runtime.pages.ExpertPages' slices and mappings (each file mapped once)."""
        self.share_reads(ranges=pages.slice_table(store.lru_cached.shape[0]), fds=store.fds, maps=pages.single_maps(),
                         ra_steps=store.willneed_steps, merge_gap=store.merge_gap, count=store.lru_count,
                         read_mark=store.read_mark, visible=[fp.residency_visible for fp in pages.files],
                         drop_behind=drop_behind, use_order=store.use_order)

    def share_reads(self, *, ranges: np.ndarray, fds: list[int], maps: list[tuple[int, int, int]],
                    ra_steps: list[int], merge_gap: int, count: np.ndarray, read_mark: np.ndarray,
                    visible: list[bool] | None = None, drop_behind: bool = True, use_order: bool = True) -> None:
        """Let the filter answer decode layers with misses too (`with_misses` in the C source):
        `ranges` int64 [L, E, roles, 3] (file, offset in it, length; length 0: no such role),
        per file its descriptor, llama.cpp's one mapping of it (address, file offset, length) and
        the most one WILLNEED reads and whether the kernel shows this user its residency (`visible`,
        default all: mincore is not asked where it would say every page is resident); the LRU's
        per-layer counts and the read marks (numpy, shared). `drop_behind`: the victims are dropped
        by a thread of the filter's while llama.cpp computes (`flush_drops` waits for them). `use_order`:
        misses read tensor by tensor in the roles' order of `ranges` (llama.cpp's use order), else by offset."""
        L, E, R, _ = ranges.shape
        n_files = len(fds)
        r_file = np.ascontiguousarray(ranges[..., 0], np.int32)
        r_off = np.ascontiguousarray(ranges[..., 1], np.int64)
        r_len = np.ascontiguousarray(ranges[..., 2], np.int64)
        if visible is not None and len(visible) != n_files:
            raise ValueError("visible names every file once")
        if (r_file < 0).any() or (r_file >= n_files).any():
            raise ValueError("a slice names a file the model does not have")
        longest = int(r_len.max()) if r_len.size else 0
        arrays = dict(r_file=r_file, r_off=r_off, r_len=r_len, fds=np.asarray(fds, np.int32),
                      map_lo=np.asarray([m[0] for m in maps], np.int64), map_off=np.asarray([m[1] for m in maps], np.int64),
                      map_len=np.asarray([m[2] for m in maps], np.int64), ra_step=np.asarray(ra_steps, np.int64),
                      visible=np.asarray([True] * n_files if visible is None else visible, np.uint8),
                      count=count, read_mark=read_mark, sel=np.zeros(2 * E, np.int32), in_sel=np.zeros(E, np.uint8),
                      runs=np.zeros(4 * E * max(R, 1), np.int64), vec=np.zeros(longest // PAGE + 2, np.uint8))
        for name in ("count", "read_mark"):
            a = arrays[name]
            if not a.flags.c_contiguous or a.shape[:1] != (L,):
                raise ValueError(f"{name} must be a C-contiguous array of the model's layers")
        self.stop_drops()
        m = self.misses = _Misses(slots=0, n_roles=R, merge_gap=int(merge_gap), vec_pages=longest // PAGE + 2,
                                  drop_behind=int(bool(drop_behind)), use_order=int(bool(use_order)), **{k: a.ctypes.data for k, a in arrays.items()})
        self._miss_arrays = arrays  # alive as long as C may read them
        self.user.misses = ctypes.addressof(m)

    @property
    def answers_misses(self) -> bool:
        return bool(self.user.misses)

    @property
    def slots(self) -> int:
        return int(self.misses.slots) if self.answers_misses else 0

    @slots.setter
    def slots(self, n: int) -> None:
        if self.answers_misses:
            self.misses.slots = int(n)

    def flush_drops(self) -> None:
        """Every victim queued for the drop thread dropped (after each llama_decode: Python never
        sees a drop in flight)."""
        if self.misses is not None and self.misses.dropper:
            self.lib.mbolt_drops_flush(ctypes.byref(self.misses))

    def stop_drops(self) -> None:
        """The drop thread's queue emptied and the thread ended: before llama.cpp's mapping or the
        descriptors go."""
        if self.misses is not None and self.misses.dropper:
            self.lib.mbolt_drops_stop(ctypes.byref(self.misses))

    def take_miss_counts(self, where: str) -> dict[str, int]:
        """What the decode layers with misses answered here did since the last call (the drops
        behind included: they are waited for first); a madvise, posix_fadvise or mincore call that
        failed in them is an error (`where`: the model's path)."""
        if not self.answers_misses:
            return {}
        self.flush_drops()
        m = self.misses
        out = {k: int(getattr(m, k)) for k in MISS_COUNTS}
        for k in MISS_COUNTS:
            setattr(m, k, 0)
        if out["errors"]:
            raise MboltError(f"{where}: {out['errors']} madvise/posix_fadvise/mincore call(s) failed in a decode "
                             "step's reads")
        return out

    @property
    def fast(self) -> bool:
        return bool(self.user.fast)

    @fast.setter
    def fast(self, on: bool) -> None:
        self.user.fast = int(bool(on and self._arrays))

    def take_counts(self) -> tuple[set[int], int, int]:
        """(layers whose selection was computed, selections answered in C, experts they used)
        since the last call."""
        u = self.user
        layers = set(np.flatnonzero(self.seen).tolist())
        self.seen[:] = 0
        out = (layers, u.fast_layers, u.fast_experts)
        u.fast_layers = u.fast_experts = 0
        return out


def topk_filter(python_cb, offsets: dict[str, int]) -> TopkFilter | None:
    """The native filter around `python_cb`, or None when no C compiler is available."""
    lib = _library()
    return None if lib is None else TopkFilter(lib, python_cb, offsets)


class AbortFlag:
    """llama.cpp's abort callback (llama_set_abort_callback) reading one int: `set()` stops the
    graph under way at its next node (llama_decode then fails, the tokens of that micro-batch are not
    kept), `clear()` lets the next one run. In C when a compiler is at hand (it is asked between
    every two nodes); otherwise a Python callback."""

    def __init__(self, L):
        self.value = ctypes.c_int(0)
        lib = _library()
        if lib is not None:
            self.cb = ctypes.cast(lib.mbolt_abort_flag, L.ggml_abort_callback)
        else:
            self.cb = L.ggml_abort_callback(lambda data: bool(self.value.value))
        self.data = ctypes.cast(ctypes.pointer(self.value), ctypes.c_void_p)

    def set(self) -> None:
        self.value.value = 1

    def clear(self) -> None:
        self.value.value = 0

    @property
    def is_set(self) -> bool:
        return bool(self.value.value)
