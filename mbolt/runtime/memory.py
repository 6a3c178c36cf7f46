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

import os

from dataclasses import dataclass

from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.runtime.binding import GGML_TYPE_F32, buffer_span, captured_log, lib, log_sizes, set_fields

DEFAULT_CTX = 4096  # llama-server's --ctx-size default is the model's; ours is a size every budget can name
CTX_PAD = 256  # llama.cpp pads a sequence's context to this many cells
DEFAULT_UBATCH = 512  # llama.cpp's default micro-batch
STREAM_UBATCH = 2048  # the streaming runtime's, one sequence: see default_ubatch


def default_ubatch(streaming: bool, n_seq: int = 1) -> int:
    """Tokens per prompt pass when none is asked for. The streaming runtime with one sequence takes
    2048: each pass reads the experts its tokens select, nearly the whole layer, so a 2,000-token
    prompt reads them once instead of four times, and since the compute buffer is given back after
    the prompt a larger pass costs decode no slots (q72 at 40%, results/ubatch_q72.json: TTFT 0.80x,
    decode 1.02x, 1.05x the warm compute). Plain llama.cpp keeps llama.cpp's 512, and so do batched
    sequences: a newcomer's pass holds up every running reply for its length."""
    return STREAM_UBATCH if streaming and n_seq == 1 else DEFAULT_UBATCH


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


def parse_log(lines: list[str], n_ubatch: int, flash_attn: bool) -> ContextMemory:
    """The sizes llama.cpp logged while it created a context (real or simulated)."""
    return ContextMemory(n_ubatch=n_ubatch, flash_attn=flash_attn, **log_sizes(lines))


def context_params(L, *, n_ctx: int, n_ubatch: int, flash_attn: bool, n_threads: int, f32_kv: bool = False,
                   all_logits: bool = False, n_seq: int = 1):
    """llama_context_params as mbolt runs every context: n_batch = n_ubatch (one graph per llama_decode),
    flash attention as given (the same in every arm: it changes the buffer and the tokens), and one
    output per sequence of a micro-batch unless every token's logits are wanted (a prompt's logits
    for all of its tokens would take n_ubatch x n_vocab x 4 B of compute buffer: 1.2 GB at 2048
    tokens of a 150k vocabulary). `n_seq` sequences (a server's slots) of `n_ctx` tokens each: the
    KV cache holds n_seq x n_ctx cells, split between them (not unified)."""
    cp = L.llama_context_default_params()
    set_fields(cp, n_ctx=int(n_ctx) * int(n_seq), n_batch=int(n_ubatch), n_ubatch=int(n_ubatch), n_threads=n_threads,
               n_threads_batch=n_threads, n_seq_max=int(n_seq), kv_unified=False,
               flash_attn_type=L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if not all_logits:
        set_fields(cp, n_outputs_max=int(n_seq))
    if f32_kv:
        set_fields(cp, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    return cp


_SIMULATED: dict = {}


def simulate(path: str, n_ctx: int, n_ubatch: int = DEFAULT_UBATCH, *, flash_attn: bool = True,
             f32_kv: bool = False, n_seq: int = 1) -> ContextMemory:
    """llama.cpp's own sizes for `n_seq` sequences of `n_ctx` tokens and `n_ubatch`-token passes over
    the model at `path` (its memory-fit pass: nothing allocated)."""
    try:
        st = os.stat(path)  # a file by its inode too: a kernel-layout file's stand-in is a memfd whose path recurs
    except OSError as e:
        raise MboltError(f"{path}: {e.strerror}") from None
    key = (str(path), st.st_ino, st.st_mtime_ns, int(n_ctx), int(n_ubatch), bool(flash_attn), bool(f32_kv), int(n_seq))
    if key in _SIMULATED:
        return _SIMULATED[key]
    L = lib()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    # no_alloc needs a load that maps nothing: metadata only
    set_fields(mp, n_gpu_layers=0, no_alloc=True, load_mode=L.LLAMA_LOAD_MODE_NONE, use_extra_bufts=False)
    with captured_log(L) as lines:
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise MboltError(f"{path}: llama.cpp could not read the model's metadata")
        try:
            cp = context_params(L, n_ctx=n_ctx, n_ubatch=n_ubatch, flash_attn=flash_attn, n_threads=1, f32_kv=f32_kv,
                                n_seq=n_seq)
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
    kv = mm.header.kv.get(Keys.LLM.CONTEXT_LENGTH.format(arch=mm.arch))
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


COMPUTE_SLACK = 64 << 10  # a buffer's size against the one llama.cpp logged (printed to 0.01 MiB)


def give_back(buffer: int, compute_bytes: int) -> bool:
    """Give a context's compute buffer's pages back to the system (MADV_DONTNEED): its bytes are
    scratch (every graph writes a node before it reads it), a page touched again comes back zeroed,
    and a decode step's small graph, laid out from the buffer's start, touches only its own part.
    `buffer`: the ggml_backend_buffer of a graph node (runner.TopkTap.buffer); False (nothing done)
    unless it is as large as the compute buffer llama.cpp logged."""
    import ctypes

    from mbolt.core.pagecache import MADV_DONTNEED, MADV_NOHUGEPAGE, PAGE, libc

    base, size = buffer_span(buffer)
    if not base or abs(size - compute_bytes) > COMPUTE_SLACK:
        return False
    a, b = -(-base // PAGE) * PAGE, (base + size) // PAGE * PAGE
    if b <= a:
        return True
    # Small pages from here on: where the buffer's memory may take transparent huge pages (THP
    # "always", or a heap range numpy had advised MADV_HUGEPAGE for an array before it was freed),
    # a decode step's 250 KiB brings back whole 2 MiB pages (12 MiB measured). A kernel without THP
    # refuses the advice: nothing to undo then.
    libc().madvise(ctypes.c_void_p(a), b - a, MADV_NOHUGEPAGE)
    if libc().madvise(ctypes.c_void_p(a), b - a, MADV_DONTNEED) != 0:
        raise MboltError(f"madvise(MADV_DONTNEED) of llama.cpp's compute buffer failed (errno {ctypes.get_errno()})")
    return True
