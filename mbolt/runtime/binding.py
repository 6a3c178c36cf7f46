"""Every tie of the runtime to one llama-cpp-python release, in one place.

Checked against llama-cpp-python 0.3.36 (its vendored llama.cpp): another release is refused at
the first use (`lib`), and tests/test_llama_binding.py fails loudly on one. What ties us to it:
- the prefix of `struct ggml_tensor` (include/ggml.h) read through ctypes at `ffn_moe_topk-N`,
  self-checked once per process against libggml's own accessors (`check_tensor_layout`);
- the sizes of a context's KV cache and compute buffer, which llama.cpp only logs (`log_sizes`);
- the parameter structs' field names (`set_fields` refuses a name a struct does not have);
- the library's path (libggml-base.so beside the package), and the ggml_backend_buffer of the
  graph's nodes (its base and size by libggml's accessors: the compute buffer, `buffer_span`).
Nothing else in mbolt reads llama-cpp-python's private names.
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from contextlib import contextmanager
from pathlib import Path

from mbolt.core.errors import MboltError

BINDING_VERSION = "0.3.36"
GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26


class GgmlTensor(ctypes.Structure):
    """Prefix of `struct ggml_tensor` (include/ggml.h of llama-cpp-python 0.3.36)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


NAME_OFFSET = GgmlTensor.name.offset
TENSOR_OFFSETS = {k: getattr(GgmlTensor, k).offset for k in ("name", "type", "ne", "nb", "data")}


def lib():
    """The llama_cpp module, refusing a release other than BINDING_VERSION."""
    try:
        import llama_cpp
    except ImportError:
        raise MboltError("llama-cpp-python is not installed: pip install 'mbolt-moe[llama]'") from None
    have = getattr(llama_cpp, "__version__", "?")
    if have != BINDING_VERSION:
        raise MboltError(f"llama-cpp-python {have} is installed; mbolt reads llama.cpp's tensors through the "
                         f"ggml_tensor layout of {BINDING_VERSION}: pip install 'llama-cpp-python=={BINDING_VERSION}'")
    return llama_cpp


def set_fields(struct, **values) -> None:
    """Set fields of a llama.cpp parameter struct, refusing a name the struct does not have (ctypes
    would store it as a plain attribute that llama.cpp never sees)."""
    known = {f[0] for f in type(struct)._fields_}
    for k, v in values.items():
        if k not in known:
            raise MboltError(f"llama-cpp-python {BINDING_VERSION}: {type(struct).__name__} has no field {k!r}")
        setattr(struct, k, v)


_GGML = None  # libggml-base, opened by ggml_library
_LAYOUT_CHECKED = False


def ggml_library() -> ctypes.CDLL:
    """libggml-base beside the package with the accessors the layout check calls, opened once
    (a process that gives up root opens it first: the path may be one it cannot read after)."""
    global _GGML
    if _GGML is None:
        import llama_cpp

        g = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        for name, res in (("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p),
                          ("ggml_nelements", ctypes.c_int64), ("ggml_backend_buffer_get_base", ctypes.c_void_p),
                          ("ggml_backend_buffer_get_size", ctypes.c_size_t)):
            getattr(g, name).restype = res
            getattr(g, name).argtypes = [ctypes.c_void_p]
        _GGML = g
    return _GGML


def check_tensor_layout(t_ptr: int, t: GgmlTensor) -> None:
    """Self-test of the ggml_tensor prefix against libggml's own accessors, once per process: a
    binding whose struct differs would have us read expert ids from the wrong bytes."""
    global _LAYOUT_CHECKED
    if _LAYOUT_CHECKED:
        return
    g = ggml_library()
    ne = 1
    for x in t.ne:
        ne *= int(x)
    if (g.ggml_get_name(t_ptr) != t.name or (g.ggml_get_data(t_ptr) or 0) != (t.data or 0)
            or g.ggml_nelements(t_ptr) != ne):
        raise MboltError("llama.cpp's ggml_tensor layout differs from the one mbolt reads (name, data or shape "
                         f"disagree with libggml's accessors): llama-cpp-python {BINDING_VERSION} is required")
    _LAYOUT_CHECKED = True


def buffer_span(buffer: int) -> tuple[int, int]:
    """(base address, bytes) of a ggml_backend_buffer (a tensor's `buffer`), by libggml's accessors."""
    g = ggml_library()
    return int(g.ggml_backend_buffer_get_base(buffer) or 0), int(g.ggml_backend_buffer_get_size(buffer))


_LOG_LOCK = threading.Lock()
_KEEP: list = []  # ctypes callbacks llama.cpp may still call: never collected


def quiet(L) -> None:
    """Silence llama.cpp's log (process-wide)."""
    cb = L.llama_log_callback(lambda level, text, user: None)
    _KEEP.append(cb)
    L.llama_log_set(cb, ctypes.c_void_p(0))


@contextmanager
def captured_log(L):
    """llama.cpp's log lines while the block runs (the log sink is process-wide: one at a time);
    afterwards the log is silent again."""
    lines: list[str] = []
    buf: list[str] = []

    def sink(level, text, user):
        buf.append(text.decode("utf-8", errors="replace"))
        if buf[-1].endswith("\n"):
            lines.extend("".join(buf).splitlines())
            buf.clear()

    cb = L.llama_log_callback(sink)
    silent = L.llama_log_callback(lambda level, text, user: None)
    _KEEP.extend((cb, silent))
    with _LOG_LOCK:
        L.llama_log_set(cb, ctypes.c_void_p(0))
        try:
            yield lines
        finally:
            L.llama_log_set(silent, ctypes.c_void_p(0))
            _KEEP[:] = [cb, silent]  # the newest pair stays referenced; older ones are no longer installed


_SIZE = re.compile(r"^(llama_kv_cache|llama_memory_recurrent): size = +([\d.]+) MiB")
_COMPUTE = re.compile(r"compute buffer size = +([\d.]+) MiB")
_OUTPUT = re.compile(r"output buffer size = +([\d.]+) MiB")
_NCTX = re.compile(r"^llama_context: n_ctx += (\d+)")


def _mib(text: str) -> int:
    """A size llama.cpp printed as %.2f MiB, rounded up to what it can have been."""
    return math.ceil((float(text) + 0.005) * 2**20)


def log_sizes(lines: list[str]) -> dict[str, int]:
    """What llama.cpp logged while it created a context (real or simulated): n_ctx (cells) and
    the bytes of its KV cache (and recurrent state), compute buffers and output buffer."""
    out = {"n_ctx": 0, "kv_bytes": 0, "compute_bytes": 0, "output_bytes": 0}
    for line in lines:
        if m := _SIZE.match(line):
            out["kv_bytes"] += _mib(m.group(2))
        elif m := _COMPUTE.search(line):
            out["compute_bytes"] += _mib(m.group(1))
        elif m := _OUTPUT.search(line):
            out["output_bytes"] += _mib(m.group(1))
        elif m := _NCTX.match(line):
            out["n_ctx"] = int(m.group(1))
    return out


def token_text(L, vocab, token: int) -> str:
    """A token's text as the vocabulary stores it (what chat templates call bos_token/eos_token)."""
    if token < 0:
        return ""
    raw = L.llama_vocab_get_text(vocab, int(token))
    return raw.decode("utf-8", errors="replace") if raw else ""
