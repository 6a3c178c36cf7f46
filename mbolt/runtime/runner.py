"""llama.cpp (through llama-cpp-python's low-level API) as a routing tracer and parity oracle.

Routing is read with the scheduler's eval callback (`cb_eval`): we answer ask=True only for
tensors named `ffn_moe_topk-N`; when such a tensor is computed we read, for each token row j,
k int32 expert ids at `data + j * nb[1]`. The tensor is a view of the first k columns of an
argsort over ALL experts, so rows are strided by nb[1] = n_expert * 4, not k * 4.
During prefill llama.cpp runs the last layer only for the tokens whose logits are requested,
so that layer's topk has fewer rows than the batch (we record what it computed).
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.runtime.memory import (DEFAULT_CTX, DEFAULT_UBATCH, ContextMemory, captured_log, context_params,
                                       parse_log)
from mbolt.runtime.native import TOPK_PREFIX

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
_TOPK = re.compile(rb"^" + re.escape(TOPK_PREFIX) + rb"(\d+)$")


class ContextFull(MboltError):
    """The tokens of a conversation do not fit the context."""


class GgmlTensor(ctypes.Structure):
    """Prefix of `struct ggml_tensor` (include/ggml.h of the installed package)."""

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


BINDING_VERSION = "0.3.36"  # the ggml_tensor prefix below is this release's include/ggml.h
_NAME_OFFSET = GgmlTensor.name.offset


def _lib():
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


_GGML = None


def check_tensor_layout(t_ptr: int, t: GgmlTensor) -> None:
    """Self-test of the ggml_tensor prefix against libggml's own accessors, once per process: a
    binding whose struct differs would have us read expert ids from the wrong bytes."""
    global _GGML
    if _GGML is not None:
        return
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    for name, res in (("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p),
                      ("ggml_nelements", ctypes.c_int64)):
        getattr(lib, name).restype = res
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    ne = 1
    for x in t.ne:
        ne *= int(x)
    if (lib.ggml_get_name(t_ptr) != t.name or (lib.ggml_get_data(t_ptr) or 0) != (t.data or 0)
            or lib.ggml_nelements(t_ptr) != ne):
        raise MboltError("llama.cpp's ggml_tensor layout differs from the one mbolt reads (name, data or shape "
                         f"disagree with libggml's accessors): llama-cpp-python {BINDING_VERSION} is required")
    _GGML = lib


_LOG_CB = None


def _quiet(L) -> None:
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = L.llama_log_callback(lambda level, text, user: None)
        L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


class TopkTap:
    """The eval callback: llama.cpp's scheduler asks it about every graph node; it answers yes for
    `ffn_moe_topk-N` (in C, runtime.native, when a compiler is at hand), and once such a node
    is computed reads each token row j of k int32 expert ids at `data + j * nb[1]` (the tensor is a
    view of an argsort over every expert: rows are strided) and hands them to `on_topk(layer,
    rows)`, before layer N's expert matmuls run. With `capture` it also keeps them (`routing`).
    An exception cannot cross C: it is kept, the graph is stopped, and `raise_error` raises it."""

    def __init__(self, L, on_topk=None, capture: bool = False):
        from mbolt.runtime.native import topk_filter

        self.on_topk, self.capture = on_topk, capture
        self.routing: dict[int, list[np.ndarray]] = {}  # layer -> row blocks [n, k] of the last eval
        self.error: BaseException | None = None
        self._cb = L.ggml_backend_sched_eval_callback(self._eval_cb)
        self._filter = topk_filter(self._cb, _NAME_OFFSET)  # names compared in C, when it builds
        self.native = self._filter is not None

    def fields(self) -> dict:
        """The llama_context_params fields that install it (before the context is created)."""
        if self._filter is not None:
            return {"cb_eval": self._filter.cb, "cb_eval_user_data": self._filter.user_data}
        return {"cb_eval": self._cb, "cb_eval_user_data": None}

    def install(self, cp) -> None:
        set_fields(cp, **self.fields())

    def raise_error(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _eval_cb(self, t_ptr, ask, user):
        # called for every graph node (only for ffn_moe_topk-N behind the native filter): compare
        # the name's first bytes before building anything
        if ctypes.string_at(t_ptr + _NAME_OFFSET, len(TOPK_PREFIX)) != TOPK_PREFIX:
            return not ask
        t = GgmlTensor.from_address(t_ptr)
        m = _TOPK.match(t.name)
        if ask:
            return m is not None
        if m is not None and t.type == GGML_TYPE_I32:
            check_tensor_layout(t_ptr, t)
            k, n = int(t.ne[0]), int(t.ne[1])
            stride = int(t.nb[1]) // 4
            rows = np.empty((n, k), dtype=np.int32)
            if n:
                # rows are strided (a view of an argsort over every expert): one copy of the block
                flat = np.ctypeslib.as_array((ctypes.c_int32 * ((n - 1) * stride + k)).from_address(int(t.data)))
                rows[:] = np.lib.stride_tricks.as_strided(flat, (n, k), (stride * 4, 4))
            layer = int(m.group(1))
            if self.capture:
                self.routing.setdefault(layer, []).append(rows)
            if self.on_topk is not None:
                try:
                    self.on_topk(layer, rows)
                except BaseException as e:  # raised again by raise_error(); an exception cannot cross C
                    self.error = e
                    return False
        return True


class LlamaRunner:
    """One llama.cpp model + context on the CPU, with routing capture.

    f32_kv: keep the KV cache in F32 and flash attention off, so attention is plain float32 math
    (llama.cpp's default F16 cache rounds K/V to 11-bit mantissas; parity tests use F32).
    """

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = DEFAULT_CTX, n_threads: int | None = None,
                 f32_kv: bool = True, capture: bool = True, n_batch: int = DEFAULT_UBATCH, on_topk=None,
                 load_mode: str | None = None, vocab_only: bool = False, flash_attn: bool | None = None,
                 all_logits: bool | None = None):
        """vocab_only: load the tokenizer alone (no tensors, no context): `tokenize` works, `eval` does not.
        n_batch: tokens per llama_decode, one graph each (n_ubatch = n_batch). flash_attn: default on,
        off with f32_kv (plain float32 attention). all_logits: eval(all_logits=True) is allowed (the
        compute buffer then holds n_batch rows of logits; default: with f32_kv, the parity setup)."""
        L = self.L = _lib()
        _quiet(L)
        L.llama_backend_init()
        from mbolt.core.gguf_set import open_model_header

        # llama.cpp opens a split set from its first shard: check the set, hand it shard 1
        path = self.path = Path(open_model_header(path).path)
        mp = L.llama_model_default_params()
        # weights on the host: the runtime reads them through the file's mapping
        set_fields(mp, vocab_only=vocab_only, n_gpu_layers=0)
        if load_mode is not None:
            # "mmap": tensors point into llama.cpp's mapping of the file (what streaming needs)
            set_fields(mp, load_mode={"mmap": L.LLAMA_LOAD_MODE_MMAP, "none": L.LLAMA_LOAD_MODE_NONE}[load_mode])
            if load_mode == "mmap":
                # no extra buffer types: the CPU backend would otherwise repack Q4_0/IQ4_NL/...
                # weights into its own anonymous buffers at load time, so the expert matmuls never
                # touch the mapped file and streaming would read for nothing
                set_fields(mp, use_extra_bufts=False)
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise MboltError(f"{path}: llama.cpp could not load the model")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.ctx = self.batch = None
        self.memory: ContextMemory | None = None
        if vocab_only:
            return
        threads = n_threads or max(1, os.cpu_count() or 1)
        self.flash_attn = (not f32_kv) if flash_attn is None else bool(flash_attn)
        self.all_logits = f32_kv if all_logits is None else bool(all_logits)
        cp = context_params(L, n_ctx=n_ctx, n_ubatch=n_batch, flash_attn=self.flash_attn, n_threads=threads,
                            f32_kv=f32_kv, all_logits=self.all_logits)
        self.tap = None
        if capture or on_topk is not None:
            # on_topk(layer, rows [n, k] int32 positions): called at ffn_moe_topk-N, before layer N's
            # expert matmuls run (the streaming engine reads the experts there)
            self.tap = TopkTap(L, on_topk, capture)
            self.tap.install(cp)
        with captured_log(L) as lines:
            self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise MboltError(f"{path}: llama.cpp could not create a context of {n_ctx} tokens")
        # what llama.cpp allocated, as it logged it (the KV cache, the compute buffer)
        self.memory = parse_log(lines, n_batch, self.flash_attn)
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.n_batch = min(int(n_batch), int(L.llama_n_batch(self.ctx)))  # llama.cpp caps it at n_ctx
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.n_past = 0

    # ---- use ----

    def reset(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        for _ in range(2):
            buf = (self.L.llama_token * n_max)()
            n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, False)
            if n >= 0:
                return list(buf[:n])
            n_max = -n  # llama.cpp says how many tokens it needs
        raise MboltError(f"{self.path}: llama.cpp could not tokenize a text of {len(raw)} bytes")

    def eval(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Decode tokens at positions n_past..; logits of the last token (or all) as float32."""
        L = self.L
        tokens = [int(t) for t in tokens]
        if all_logits and not self.all_logits:
            raise MboltError("eval(all_logits=True) needs a LlamaRunner built with all_logits=True")
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFull(f"the {self.n_past + len(tokens)} tokens of this conversation do not fit the llama.cpp "
                              f"context of {self.n_ctx} tokens: give a larger --ctx-size/-c")
        if self.tap is not None:
            self.tap.routing = {}
        outs = []
        for s in range(0, len(tokens), self.n_batch):
            chunk = tokens[s: s + self.n_batch]
            last_chunk = s + self.n_batch >= len(tokens)
            b = self.batch
            b.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = bool(all_logits or (last_chunk and i == len(chunk) - 1))
            rc = L.llama_decode(self.ctx, b)
            if self.tap is not None:
                self.tap.raise_error()
            if rc != 0:
                raise MboltError(f"llama_decode failed with code {rc}")
            for i in range(len(chunk)):
                if b.logits[i]:
                    p = L.llama_get_logits_ith(self.ctx, i)
                    outs.append(np.ctypeslib.as_array(p, shape=(self.n_vocab,)).astype(np.float32))
            self.n_past += len(chunk)
        return np.stack(outs) if all_logits else outs[-1]

    @property
    def native_filter(self) -> bool:
        return self.tap is not None and self.tap.native

    def topk(self) -> dict[int, np.ndarray]:
        """Routing of the last eval: layer -> int32 [n_rows, k] (rows in token order)."""
        return {li: np.concatenate(blocks) for li, blocks in self.tap.routing.items()}

    def close(self) -> None:
        L = self.L
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
