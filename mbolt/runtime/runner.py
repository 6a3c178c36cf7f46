"""One llama.cpp model and context (through llama-cpp-python's low-level API), and the eval callback.

Routing is read with the scheduler's eval callback (`cb_eval`): we answer ask=True only for
tensors named `ffn_moe_topk-N`; when such a tensor is computed we read, for each token row j,
k int32 expert ids at `data + j * nb[1]`. The tensor is a view of the first k columns of an
argsort over ALL experts, so rows are strided by nb[1] = n_expert * 4, not k * 4.
During prefill llama.cpp runs the last layer only for the tokens whose logits are requested,
so that layer's topk has fewer rows than the batch (we record what it computed).
"""

from __future__ import annotations

import ctypes
import enum
import os
import re
from pathlib import Path

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.kernel_file import is_kernel_file
from mbolt.runtime.binding import (GGML_TYPE_I32, NAME_OFFSET, TENSOR_OFFSETS, GgmlTensor, captured_log,
                                   check_tensor_layout, lib, quiet, set_fields)
from mbolt.runtime.memory import DEFAULT_CTX, DEFAULT_UBATCH, ContextMemory, context_params, parse_log
from mbolt.runtime.native import TOPK_PREFIX, WAIT_BITS, WAIT_NODES

_TOPK = re.compile(rb"^" + re.escape(TOPK_PREFIX) + rb"(\d+)$")
_WAIT_HEADS = tuple(WAIT_NODES)


class Phase(enum.Enum):
    """What a llama_decode is, as the driver tells the runtime (runtime.streamer)."""

    LOAD = "load"  # before the first step
    PROMPT = "prompt pass"  # up to n_batch tokens of one sequence's prompt (or turn)
    DECODE = "decode step"  # one token of each live sequence (several rows: a batched step)


class ContextFull(MboltError):
    """The tokens of a conversation do not fit the context."""


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
        self.buffer: int | None = None  # the ggml_backend_buffer that holds the graph's nodes (the compute buffer)
        self._cb = L.ggml_backend_sched_eval_callback(self._eval_cb)
        self.filter = topk_filter(self._cb, TENSOR_OFFSETS)  # names compared in C, when it builds
        self.native = self.filter is not None
        self.on_wait = None  # on_wait(layer, role): a layer's gate or up matmul computed (share_waits)
        self.waits: np.ndarray | None = None

    def fields(self) -> dict:
        """The llama_context_params fields that install it (before the context is created)."""
        if self.filter is not None:
            return {"cb_eval": self.filter.cb, "cb_eval_user_data": self.filter.user_data}
        return {"cb_eval": self._cb, "cb_eval_user_data": None}

    def install(self, cp) -> None:
        set_fields(cp, **self.fields())

    def share_waits(self, waits: np.ndarray, on_wait) -> None:
        """Also ask about native.WAIT_NODES while their layer's bit (native.WAIT_BITS) is set in
        `waits` (uint8 [n_layers], shared with the C filter): once such a node is computed,
        `on_wait(layer, role)` is called before the graph goes on."""
        self.waits, self.on_wait = waits, on_wait
        if self.filter is not None:
            self.filter.share_waits(waits)

    def raise_error(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _eval_cb(self, t_ptr, ask, user):
        # called for every graph node (only for ffn_moe_topk-N behind the native filter): compare
        # the name's first bytes before building anything
        head = ctypes.string_at(t_ptr + NAME_OFFSET, len(TOPK_PREFIX))
        if head != TOPK_PREFIX:
            if self.on_wait is not None and head.startswith(_WAIT_HEADS):
                return self._wait_node(t_ptr, ask)
            return not ask
        t = GgmlTensor.from_address(t_ptr)
        m = _TOPK.match(t.name)
        if ask:
            return m is not None
        if m is not None and t.type == GGML_TYPE_I32:
            try:
                self._computed(t_ptr, t, int(m.group(1)))
            except BaseException as e:  # raised again by raise_error(); an exception cannot cross C
                self.error = e
                return False
        return True

    def _wait_node(self, t_ptr: int, ask: bool) -> bool:
        name = GgmlTensor.from_address(t_ptr).name
        head = next(h for h in WAIT_NODES if name.startswith(h))
        role, digits = WAIT_NODES[head], name[len(head):]
        on = digits.isdigit() and int(digits) < len(self.waits) and bool(self.waits[int(digits)] & WAIT_BITS[role])
        if ask:
            return on  # the graph is split here only while the bit is set
        if not on:
            return True
        try:
            self.on_wait(int(digits), role)
        except BaseException as e:  # raised again by raise_error(); an exception cannot cross C
            self.error = e
            return False
        return True

    def _computed(self, t_ptr: int, t, layer: int) -> None:
        check_tensor_layout(t_ptr, t)
        if self.buffer is None and t.buffer:
            self.buffer = int(t.buffer)  # a node of the graph: it lives in the scheduler's compute buffer
        k, n = int(t.ne[0]), int(t.ne[1])
        stride = int(t.nb[1]) // 4
        rows = np.empty((n, k), dtype=np.int32)
        if n:
            # rows are strided (a view of an argsort over every expert): one copy of the block
            flat = np.ctypeslib.as_array((ctypes.c_int32 * ((n - 1) * stride + k)).from_address(int(t.data)))
            rows[:] = np.lib.stride_tricks.as_strided(flat, (n, k), (stride * 4, 4))
        if self.capture:
            self.routing.setdefault(layer, []).append(rows)
        if self.on_topk is not None:
            self.on_topk(layer, rows)


class Hooks:
    """What a runner tells of each llama_decode (`LlamaRunner.hooks`): the runtime and whoever watches
    the steps (a routing recorder), told in that order."""

    def __init__(self, parts):
        self.parts = parts

    def begin(self, phase, n_rows: int) -> None:
        for h in self.parts:
            h.begin(phase, n_rows)

    def end(self) -> None:
        for h in self.parts:
            h.end()

    def on_topk(self, layer: int, rows) -> None:
        for h in self.parts:
            h.on_topk(layer, rows)


class LlamaRunner:
    """One llama.cpp model + context on the CPU, with routing capture.

    f32_kv: keep the KV cache in F32 and flash attention off, so attention is plain float32 math
    (llama.cpp's default F16 cache rounds K/V to 11-bit mantissas; parity tests use F32).
    """

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = DEFAULT_CTX, n_threads: int | None = None,
                 f32_kv: bool = True, capture: bool = True, n_batch: int = DEFAULT_UBATCH, on_topk=None,
                 load_mode: str | None = None, vocab_only: bool = False, flash_attn: bool | None = None,
                 all_logits: bool | None = None, n_seq: int = 1, model: int | None = None):
        """vocab_only: load the tokenizer alone (no tensors, no context): `tokenize` works, `eval` does not.
        n_batch: tokens per llama_decode, one graph each (n_ubatch = n_batch). flash_attn: default on,
        off with f32_kv (plain float32 attention). all_logits: eval(all_logits=True) is allowed (the
        compute buffer then holds n_batch rows of logits; default: with f32_kv, the parity setup).
        n_seq: sequences of n_ctx tokens each (a server's slots), decoded together by `decode_step`.
        model: a llama_model already loaded (runtime.kernel_load), used instead of loading `path`
        and not freed here (its loader owns it).
        `hooks` (set later: the runtime) is told what each llama_decode is before it runs
        (`begin(phase, n_rows)`) and that it is done (`end()`)."""
        L = self.L = lib()
        quiet(L)
        L.llama_backend_init()
        from mbolt.core.gguf_set import open_model_header

        # llama.cpp opens a split set from its first shard: check the set, hand it shard 1
        header = open_model_header(path)
        path = self.path = Path(header.path)
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
        self.owns_model = model is None
        if model is None and is_kernel_file(header):
            model = self._load_kernel_vocab(L, mp) if vocab_only else None
            self.owns_model = True
            if model is None:
                raise MboltError(f"{path}: a kernel-layout file (mbolt repack): llama.cpp loads it through the "
                                 "streaming runtime only (runtime.kernel_stream)")
        self.model = L.llama_model_load_from_file(str(path).encode(), mp) if model is None else model
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
                            f32_kv=f32_kv, all_logits=self.all_logits, n_seq=n_seq)
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
        self.n_seq = int(n_seq)
        self.n_ctx = int(L.llama_n_ctx(self.ctx)) // self.n_seq  # cells of one sequence
        self.n_batch = min(int(n_batch), int(L.llama_n_batch(self.ctx)))  # llama.cpp caps it at n_ctx
        self.batch = L.llama_batch_init(max(self.n_batch, self.n_seq), 0, 1)
        self.pos = [0] * self.n_seq  # tokens each sequence holds
        self.hooks = None

    def _load_kernel_vocab(self, L, mp):
        """The tokenizer of a kernel-layout file, from its stand-in header (runtime.kernel_load)."""
        from mbolt.core.kernel_file import read_kernel
        from mbolt.runtime.kernel_load import stand_in

        with stand_in(read_kernel(self.path)) as p:
            return L.llama_model_load_from_file(p.encode(), mp)

    # ---- use ----

    @property
    def n_past(self) -> int:
        return self.pos[0]

    def reset(self, seq: int | None = None) -> None:
        """Forget a sequence's tokens (every sequence's when None)."""
        mem = self.L.llama_get_memory(self.ctx)
        if seq is None:
            self.L.llama_memory_clear(mem, True)
            self.pos = [0] * self.n_seq
        else:
            self.truncate(seq, 0)

    def truncate(self, seq: int, n: int) -> bool:
        """Keep the first `n` tokens of a sequence (a follow-up turn reuses that prefix); False when
        llama.cpp cannot cut it there (a recurrent state keeps no earlier positions)."""
        if n < self.pos[seq]:
            ok = bool(self.L.llama_memory_seq_rm(self.L.llama_get_memory(self.ctx), seq, n, -1))
            self.pos[seq] = n
            return ok
        return True

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        for _ in range(2):
            buf = (self.L.llama_token * n_max)()
            n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            n_max = -n  # llama.cpp says how many tokens it needs
        raise MboltError(f"{self.path}: llama.cpp could not tokenize a text of {len(raw)} bytes")

    def _decode(self, phase: Phase, n: int) -> None:
        """One llama_decode of the batch's first n rows, the runtime told before and after."""
        b = self.batch
        b.n_tokens = n
        if self.hooks is not None:
            self.hooks.begin(phase, n)
        rc = self.L.llama_decode(self.ctx, b)
        if self.tap is not None:
            self.tap.raise_error()
        if rc != 0:
            raise MboltError(f"llama_decode failed with code {rc}")
        if self.hooks is not None:
            self.hooks.end()

    def _logits(self, i: int) -> np.ndarray:
        p = self.L.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).astype(np.float32)

    def eval(self, tokens, all_logits: bool = False, seq: int = 0, phase: Phase = Phase.PROMPT) -> np.ndarray:
        """Decode tokens of one sequence at its next positions, in passes of n_batch: a prompt (or
        a turn), or one token as a decode step (`phase`). Logits of the last token (or all) as float32."""
        tokens = [int(t) for t in tokens]
        if all_logits and not self.all_logits:
            raise MboltError("eval(all_logits=True) needs a LlamaRunner built with all_logits=True")
        if self.pos[seq] + len(tokens) > self.n_ctx:
            raise ContextFull(f"the {self.pos[seq] + len(tokens)} tokens of this conversation do not fit the llama.cpp "
                              f"context of {self.n_ctx} tokens: give a larger --ctx-size/-c")
        if self.tap is not None:
            self.tap.routing = {}
        outs = []
        for s in range(0, len(tokens), self.n_batch):
            chunk = tokens[s: s + self.n_batch]
            last_chunk = s + self.n_batch >= len(tokens)
            wants = [all_logits or (last_chunk and i == len(chunk) - 1) for i in range(len(chunk))]
            self._fill([(seq, t, w) for t, w in zip(chunk, wants)])
            self._decode(phase, len(chunk))
            outs += [self._logits(i) for i, w in enumerate(wants) if w]
            self.pos[seq] += len(chunk)
        return np.stack(outs) if all_logits else outs[-1]

    def _fill(self, rows) -> None:
        """Rows (sequence, token, logits wanted) into the batch, each at its sequence's next
        position (a sequence's rows in order)."""
        b, nxt = self.batch, {}
        for i, (seq, tok, want) in enumerate(rows):
            p = nxt.get(seq, self.pos[seq])
            nxt[seq] = p + 1
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tok), p, 1, bool(want)
            b.seq_id[i][0] = seq

    def _check_room(self, needs: list[tuple[int, int]]) -> None:
        """Each (sequence, new tokens) fits the sequence's context."""
        for s, n in needs:
            if self.pos[s] + n > self.n_ctx:
                raise ContextFull(f"sequence {s} holds {self.pos[s]} tokens: the llama.cpp context of {self.n_ctx} "
                                  "tokens is full")

    def decode_step(self, feeds: list[tuple[int, int]], want_logits: bool = True) -> list[np.ndarray]:
        """One decode step of several sequences in one llama_decode: `feeds` (sequence, token),
        one token each; the logits of each, in order (output i of the step is row i: a sampler
        can read it from the context instead, `want_logits=False`)."""
        if len(feeds) > self.n_seq or len({s for s, _ in feeds}) != len(feeds):
            raise MboltError(f"a decode step takes one token of each of at most {self.n_seq} sequences")
        self._check_room([(s, 1) for s, _ in feeds])
        self._fill([(s, tok, True) for s, tok in feeds])
        self._decode(Phase.DECODE, len(feeds))
        for s, _ in feeds:
            self.pos[s] += 1
        return [self._logits(i) for i in range(len(feeds))] if want_logits else []

    def mixed_pass(self, seq: int, chunk: list[int], feeds: list[tuple[int, int]]) -> None:
        """A prompt pass with decode rows in it (llama-server's mixed batch): the next `chunk`
        tokens of sequence `seq`'s prompt (an output at its last row, row len(chunk) - 1), then one
        token of each replying sequence in `feeds` (outputs at rows len(chunk) + j), in one
        llama_decode. The runtime sees a prompt pass: the union of every row's experts
        read with the pass's long reads, so a reply waits for no more than this pass. On an error
        (an abort) no sequence advances and whatever the graph wrote of these rows is removed."""
        rows = [(seq, t, i == len(chunk) - 1) for i, t in enumerate(chunk)]
        rows += [(s, t, True) for s, t in feeds]
        if not chunk or len(rows) > self.n_batch or seq in {s for s, _ in feeds}:
            raise MboltError(f"a mixed pass takes 1..{self.n_batch - len(feeds)} prompt tokens of a sequence that is "
                             "not decoding beside it")
        self._check_room([(seq, len(chunk)), *((s, 1) for s, _ in feeds)])
        self._fill(rows)
        try:
            self._decode(Phase.PROMPT, len(rows))
        except BaseException:
            mem = self.L.llama_get_memory(self.ctx)
            for s in [seq, *(s for s, _ in feeds)]:
                self.L.llama_memory_seq_rm(mem, s, self.pos[s], -1)
            raise
        self.pos[seq] += len(chunk)
        for s, _ in feeds:
            self.pos[s] += 1

    @property
    def native_filter(self) -> bool:
        return self.tap is not None and self.tap.native

    def topk(self) -> dict[int, np.ndarray]:
        """Routing of the last eval: layer -> int32 [n_rows, k] (rows in token order)."""
        return {li: np.concatenate(blocks) for li, blocks in self.tap.routing.items()}

    def close(self) -> None:
        L = self.L
        tap = getattr(self, "tap", None)
        if tap is not None and tap.filter is not None:
            tap.filter.stop_drops()  # the C filter's drop thread ended before the mapping goes
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None) and self.owns_model:
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
