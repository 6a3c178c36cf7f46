"""What a llama.cpp context will hold, known before it is created: its KV cache and its compute
buffer for a context size and a micro-batch, and the context size a model allows.

llama.cpp has a memory-fit pass of its own: a model loaded with `no_alloc` reads the metadata
only, and a context created on it allocates nothing but logs what it would allocate (the KV cache
and recurrent state from the hyperparameters, the compute buffer of the largest graph). `simulate`
runs that pass (about 10 ms on a synthetic model, a few hundred on a 150k-token vocabulary) and
reads its log, so every architecture llama.cpp runs (GQA, sliding windows, MLA, recurrent layers)
is sized by llama.cpp's own rules, and nothing is allocated.

Why both matter under a memory limit: the KV cache is cleared when the context is created (it is
resident from the first moment: created too large inside a cgroup, a context is OOM-killed, not
refused), and the compute buffer's pages become resident during the first prompt and stay.
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from mbolt.core.errors import MboltError

DEFAULT_CTX = 4096  # llama-server's --ctx-size default is the model's; ours is a size every budget can name
CTX_PAD = 256  # llama.cpp pads a sequence's context to this many cells
DEFAULT_UBATCH = 512  # llama.cpp's default micro-batch


@dataclass(frozen=True)
class ContextMemory:
    """Bytes a llama.cpp context takes beyond the model's weights."""

    n_ctx: int  # cells, after llama.cpp's padding
    n_ubatch: int
    flash_attn: bool
    kv_bytes: int  # KV cache and recurrent state: allocated and cleared (resident) at creation
    compute_bytes: int  # scratch of the largest graph (an n_ubatch-token pass): resident once a prompt ran
    output_bytes: int  # logits of the outputs

    @property
    def total(self) -> int:
        return self.kv_bytes + self.compute_bytes + self.output_bytes


_SIZE = re.compile(r"^(llama_kv_cache|llama_memory_recurrent): size = +([\d.]+) MiB")
_COMPUTE = re.compile(r"compute buffer size = +([\d.]+) MiB")
_OUTPUT = re.compile(r"output buffer size = +([\d.]+) MiB")
_NCTX = re.compile(r"^llama_context: n_ctx += (\d+)")
_FA = re.compile(r"^llama_context: flash_attn += (\w+)")


def _mib(text: str) -> int:
    """A size llama.cpp printed as %.2f MiB, rounded up to what it can have been."""
    return math.ceil((float(text) + 0.005) * 2**20)


def parse_log(lines: list[str], n_ubatch: int, flash_attn: bool) -> ContextMemory:
    """The sizes llama.cpp logged while it created a context (real or simulated)."""
    kv = compute = output = 0
    n_ctx = 0
    for line in lines:
        if m := _SIZE.match(line):
            kv += _mib(m.group(2))
        elif m := _COMPUTE.search(line):
            compute += _mib(m.group(1))
        elif m := _OUTPUT.search(line):
            output += _mib(m.group(1))
        elif m := _NCTX.match(line):
            n_ctx = int(m.group(1))
    return ContextMemory(n_ctx=n_ctx, n_ubatch=n_ubatch, flash_attn=flash_attn, kv_bytes=kv,
                         compute_bytes=compute, output_bytes=output)


_LOG_LOCK = threading.Lock()
_KEEP: list = []  # ctypes callbacks llama.cpp may still call: never collected


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
    quiet = L.llama_log_callback(lambda level, text, user: None)
    _KEEP.extend((cb, quiet))
    with _LOG_LOCK:
        L.llama_log_set(cb, ctypes.c_void_p(0))
        try:
            yield lines
        finally:
            L.llama_log_set(quiet, ctypes.c_void_p(0))
            _KEEP[:] = [cb, quiet]  # the newest pair stays referenced; older ones are no longer installed


def context_params(L, *, n_ctx: int, n_ubatch: int, flash_attn: bool, n_threads: int, f32_kv: bool = False,
                   all_logits: bool = False):
    """llama_context_params as mbolt runs every context: n_batch = n_ubatch (one graph per llama_decode),
    flash attention as given (the same in every arm: it changes the buffer and the tokens), and one
    output per micro-batch unless every token's logits are wanted (a prompt's logits for all of its
    tokens would take n_ubatch x n_vocab x 4 B of compute buffer: 1.2 GB at 2048 tokens of a
    150k vocabulary)."""
    from mbolt.runtime.runner import GGML_TYPE_F32, set_fields

    cp = L.llama_context_default_params()
    set_fields(cp, n_ctx=int(n_ctx), n_batch=int(n_ubatch), n_ubatch=int(n_ubatch), n_threads=n_threads,
               n_threads_batch=n_threads,
               flash_attn_type=L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if not all_logits:
        set_fields(cp, n_outputs_max=1)
    if f32_kv:
        set_fields(cp, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    return cp


_SIMULATED: dict = {}


def simulate(path: str, n_ctx: int, n_ubatch: int = DEFAULT_UBATCH, *, flash_attn: bool = True,
             f32_kv: bool = False) -> ContextMemory:
    """llama.cpp's own sizes for a context of `n_ctx` tokens and `n_ubatch`-token passes over
    the model at `path` (its memory-fit pass: nothing allocated)."""
    key = (str(path), int(n_ctx), int(n_ubatch), bool(flash_attn), bool(f32_kv))
    if key in _SIMULATED:
        return _SIMULATED[key]
    from mbolt.runtime.runner import _lib, set_fields

    L = _lib()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    # no_alloc needs a load that maps nothing: metadata only
    set_fields(mp, n_gpu_layers=0, no_alloc=True, load_mode=L.LLAMA_LOAD_MODE_NONE, use_extra_bufts=False)
    with captured_log(L) as lines:
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise MboltError(f"{path}: llama.cpp could not read the model's metadata")
        try:
            cp = context_params(L, n_ctx=n_ctx, n_ubatch=n_ubatch, flash_attn=flash_attn, n_threads=1, f32_kv=f32_kv)
            ctx = L.llama_init_from_model(model, cp)
            if not ctx:
                raise MboltError(f"{path}: llama.cpp could not plan a context of {n_ctx} tokens")
            L.llama_free(ctx)
        finally:
            L.llama_model_free(model)
    mem = parse_log(lines, n_ubatch, flash_attn)
    if not mem.n_ctx:
        raise MboltError(f"{path}: llama.cpp's memory-fit pass logged no context size (a llama.cpp build whose "
                         "log mbolt does not read)")
    _SIMULATED[key] = mem
    return mem


def train_ctx(mm) -> int | None:
    """The context the model was trained for (`{arch}.context_length`), None when the file has none."""
    kv = mm.header.kv.get(f"{mm.arch}.context_length")
    try:
        v = int(kv.value) if kv is not None else 0
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


def resolve_ctx(requested: int | None, mm) -> tuple[int, str | None]:
    """(context size, warning or None): the request (default DEFAULT_CTX), capped by the model's
    training context."""
    n = int(requested or DEFAULT_CTX)
    if n < 1:
        raise MboltError(f"--ctx-size must be at least 1, got {n}")
    train = train_ctx(mm)
    if train and n > train:
        return train, (f"--ctx-size {n} is beyond the {train} tokens {mm.paths[0]} was trained for: "
                       f"using {train}")
    return n, None


def largest_ctx(fits, upper: int) -> int:
    """The largest context size (a multiple of CTX_PAD, at most `upper`) for which `fits(n_ctx)`
    holds, 0 if none does. `fits` must be monotone (a larger context never takes less memory)."""
    lo, hi = 0, upper // CTX_PAD
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CTX_PAD):
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_PAD
