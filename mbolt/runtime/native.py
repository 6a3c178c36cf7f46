"""The eval callback's name filter in C.

llama.cpp's scheduler asks the eval callback about every graph node (thousands per token), and
a Python callback costs about a microsecond per question even when it only compares a name: on a
small warm model that was 0.59x of plain llama.cpp's decode speed (results/
llama_stream_s64k_warm.json). This filter answers every question in C (yes for the nodes named
``ffn_moe_topk-N``) and hands only those nodes, once computed, to the Python callback.

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
#include <string.h>

typedef bool (*eval_cb)(void * t, bool ask, void * user);

struct mbolt_filter { eval_cb python; long name_offset; };

/* ggml_backend_sched_eval_callback: the scheduler asks about every node (ask), then hands over
   the ones we asked for once computed; only computed ffn_moe_topk-N nodes reach Python */
bool mbolt_topk_filter(void * t, bool ask, void * user) {
    const struct mbolt_filter * f = (const struct mbolt_filter *) user;
    if (strncmp((const char *) t + f->name_offset, "PREFIX", PREFIX_LEN) != 0) {
        return !ask;
    }
    if (ask) {
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
    _fields_ = [("python", ctypes.c_void_p), ("name_offset", ctypes.c_long)]


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
    `python_cb` (a ggml_backend_sched_eval_callback object, kept alive here)."""

    def __init__(self, lib: ctypes.CDLL, python_cb, name_offset: int):
        self.python_cb = python_cb
        self.user = _Filter(ctypes.cast(python_cb, ctypes.c_void_p).value, name_offset)
        self.cb = ctypes.cast(lib.mbolt_topk_filter, type(python_cb))
        self.user_data = ctypes.cast(ctypes.pointer(self.user), ctypes.c_void_p)


def topk_filter(python_cb, name_offset: int) -> TopkFilter | None:
    """The native filter around `python_cb`, or None when no C compiler is available."""
    lib = _library()
    return None if lib is None else TopkFilter(lib, python_cb, name_offset)


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
