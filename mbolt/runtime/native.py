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
when every expert is cached, stamps their last use as the LRU's admit would and returns: Python
sees only selections with a miss. Its counts (`take_counts`) are added to the store's after each step.

It is compiled once with the system C compiler into ``$XDG_CACHE_HOME/mbolt`` (the file name
carries a hash of the source; the tensor-name offset is passed at run time). Without a compiler `topk_filter`
returns None and the runner keeps the Python callback (slower, same routing).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

TOPK_PREFIX = b"ffn_moe_topk-"  # the graph nodes whose computed values are the selected experts

SOURCE = r"""
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef bool (*eval_cb)(void * t, bool ask, void * user);

/* what the filter needs of a ggml_tensor (offsets from the binding's layout, checked there) and
   the expert cache's state, shared with Python (numpy arrays) */
struct mbolt_filter {
    eval_cb python;
    long name_offset, type_offset, ne_offset, nb_offset, data_offset;
    int32_t fast;            /* 1: a computed selection whose experts are all cached is answered here */
    int32_t n_layers, n_experts;
    const int32_t * perm;    /* [n_layers * n_experts]: position in the file -> original expert id */
    uint8_t * cached;        /* [n_layers * n_experts] by original id: in the slot cache */
    int64_t * stamp;         /* [n_layers * n_experts] by original id: last use (core.lru.ArrayLru) */
    int64_t * clock;         /* the stamps' counter */
    uint8_t * seen;          /* [n_layers]: the layers whose selection was computed this step */
    int64_t fast_layers;     /* selections answered here (cumulative) */
    int64_t fast_experts;    /* distinct experts those selections used (cumulative) */
};

/* every id of the computed selection (rows of k int32, strided) is a cached expert: make them the
   most recently used in row order, then rank order (what core.lru's admit does), and go on
   without Python */
static bool all_cached(struct mbolt_filter * f, const char * t, int layer) {
    if (!f->fast || layer < 0 || layer >= f->n_layers || *(const int *) (t + f->type_offset) != 26 /* I32 */) {
        return false;
    }
    const int64_t * ne = (const int64_t *) (t + f->ne_offset);
    const size_t * nb = (const size_t *) (t + f->nb_offset);
    const char * data = *(char * const *) (t + f->data_offset);
    const int64_t k = ne[0], n = ne[1];
    const int32_t * perm = f->perm + (int64_t) layer * f->n_experts;
    const uint8_t * cached = f->cached + (int64_t) layer * f->n_experts;
    for (int64_t j = 0; j < n; j++) {
        const int32_t * row = (const int32_t *) (data + j * nb[1]);
        for (int64_t i = 0; i < k; i++) {
            if (row[i] < 0 || row[i] >= f->n_experts || !cached[perm[row[i]]]) {
                return false;
            }
        }
    }
    int64_t * stamp = f->stamp + (int64_t) layer * f->n_experts;
    const int64_t start = *f->clock;
    int64_t distinct = 0;  /* a batched step's rows share experts: the union is what the store counts */
    for (int64_t j = 0; j < n; j++) {
        const int32_t * row = (const int32_t *) (data + j * nb[1]);
        for (int64_t i = 0; i < k; i++) {
            int64_t * s = stamp + perm[row[i]];
            distinct += *s <= start;
            *s = ++*f->clock;
        }
    }
    f->fast_layers += 1;
    f->fast_experts += distinct;
    return true;
}

/* ggml_backend_sched_eval_callback: the scheduler asks about every node (ask), then hands over
   the ones we asked for once computed; only computed ffn_moe_topk-N nodes with an uncached expert
   reach Python */
bool mbolt_topk_filter(void * t, bool ask, void * user) {
    struct mbolt_filter * f = (struct mbolt_filter *) user;
    const char * name = (const char *) t + f->name_offset;
    if (strncmp(name, "PREFIX", PREFIX_LEN) != 0) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    const int layer = atoi(name + PREFIX_LEN);
    if (f->seen != NULL && layer >= 0 && layer < f->n_layers) {
        f->seen[layer] = 1;
    }
    if (all_cached(f, (const char *) t, layer)) {
        return true;
    }
    return f->python(t, ask, NULL);
}

/* ggml_abort_callback: llama.cpp's CPU backend asks it between graph nodes; a set flag stops the
   graph (a server's client went away in the middle of a prompt) */
bool mbolt_abort_flag(void * data) {
    return *(volatile int *) data != 0;
}
""".replace("PREFIX_LEN", str(len(TOPK_PREFIX))).replace("PREFIX", TOPK_PREFIX.decode())


class _Filter(ctypes.Structure):
    _fields_ = [("python", ctypes.c_void_p), ("name_offset", ctypes.c_long), ("type_offset", ctypes.c_long),
                ("ne_offset", ctypes.c_long), ("nb_offset", ctypes.c_long), ("data_offset", ctypes.c_long),
                ("fast", ctypes.c_int32), ("n_layers", ctypes.c_int32), ("n_experts", ctypes.c_int32),
                ("perm", ctypes.c_void_p), ("cached", ctypes.c_void_p), ("stamp", ctypes.c_void_p),
                ("clock", ctypes.c_void_p), ("seen", ctypes.c_void_p), ("fast_layers", ctypes.c_int64),
                ("fast_experts", ctypes.c_int64)]


_LIB: ctypes.CDLL | None | bool = False  # False: not tried yet; None: no compiler


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mbolt"


def _library() -> ctypes.CDLL | None:
    global _LIB
    if _LIB is not False:
        return _LIB
    _LIB = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tag = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    so = _cache_dir() / f"topk_filter-{tag}.so"
    try:
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
                src, out = Path(tmp) / "f.c", Path(tmp) / "f.so"
                src.write_text(SOURCE)
                subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], check=True,
                               capture_output=True, timeout=120)
                os.replace(out, so)  # complete or not at all; a concurrent build writes the same bytes
        _LIB = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        _LIB = None
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
        self.user_data = ctypes.cast(ctypes.pointer(self.user), ctypes.c_void_p)
        self._arrays: tuple = ()

    def share_cache(self, perm, cached, stamp, clock) -> None:
        """The expert cache's arrays (numpy, C-contiguous: perm int32 [L, E] positions -> original
        ids, cached uint8 and stamp int64 [L, E] by original id, clock int64 [1]), read and
        stamped by the C filter in fast steps (`fast`)."""
        import numpy as np

        perm = np.ascontiguousarray(perm, np.int32)
        for a, dt in ((cached, np.uint8), (stamp, np.int64), (clock, np.int64)):
            if a.dtype != dt or not a.flags.c_contiguous:
                raise ValueError("the expert cache's arrays must be C-contiguous uint8/int64")
        u = self.user
        u.n_layers, u.n_experts = perm.shape
        self.seen = np.zeros(perm.shape[0], np.uint8)
        u.perm, u.cached, u.stamp, u.clock, u.seen = (a.ctypes.data for a in (perm, cached, stamp, clock, self.seen))
        self._arrays = (perm, cached, stamp, clock, self.seen)  # alive as long as C may read them

    @property
    def fast(self) -> bool:
        return bool(self.user.fast)

    @fast.setter
    def fast(self, on: bool) -> None:
        self.user.fast = int(bool(on and self._arrays))

    def take_counts(self) -> tuple[set[int], int, int]:
        """(layers whose selection was computed, selections answered in C, experts they used)
        since the last call."""
        import numpy as np

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
