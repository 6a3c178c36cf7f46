"""llama-cpp-python's high-level `Llama` with mbolt's streaming runtime attached.

`Llama` brings the chat template machinery, the samplers, prefix reuse of the KV cache between
turns and OpenAI-shaped text; the runtime (runtime.streamer) works inside llama.cpp's eval
callback, whoever drives the decoding. `Llama` builds its own model and context parameters from
`llama_model_default_params()` and `llama_context_default_params()` while it is constructed, so
repacking off, the eval callback and one output per micro-batch have to be in those defaults
then (`_defaults`); rebuilding its context afterwards would hold two KV caches.

`open_llm` plans the budget before anything is loaded (a budget that cannot hold the model's
dense weights, the KV cache of the context and one step's experts is one error line), loads, then
holds the dense weights and sizes the expert cache. `plain=True` is the same server over plain
llama.cpp (mapped, no repacking, no callback): what the runtime is measured against.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from mbolt.core.errors import MboltError
from mbolt.runtime.memory import DEFAULT_UBATCH, captured_log, parse_log

_PATCH = threading.Lock()


@contextmanager
def _defaults(model_fields: dict, context_fields: dict):
    """llama_model_default_params / llama_context_default_params return ours while `Llama` is built."""
    import llama_cpp.llama_cpp as C

    from mbolt.runtime.runner import set_fields

    orig_m, orig_c = C.llama_model_default_params, C.llama_context_default_params

    def model_params():
        p = orig_m()
        set_fields(p, **model_fields)
        return p

    def context_params():
        p = orig_c()
        set_fields(p, **context_fields)
        return p

    with _PATCH:
        C.llama_model_default_params, C.llama_context_default_params = model_params, context_params
        try:
            yield
        finally:
            C.llama_model_default_params, C.llama_context_default_params = orig_m, orig_c


@dataclass
class Counters:
    """What the server did (cumulative), for /metrics and the page."""

    requests: int = 0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    last_decode_tokens_per_s: float = 0.0  # of the reply under way, else of the last one

    def to_dict(self) -> dict:
        return asdict(self)


def _llama_class():
    from mbolt.runtime.runner import _lib

    L = _lib()

    class StreamingLlama(L.Llama):
        """`Llama` that times its prompt and decode evaluations and counts generated tokens."""

        def eval(self, tokens):
            t0 = time.perf_counter()
            super().eval(tokens)
            dt = time.perf_counter() - t0
            c = self.mbolt_counters
            if self._mbolt_prompt:  # the first evaluation of a request is its prompt (its new part)
                self._mbolt_prompt = False
                c.prompt_tokens += len(tokens)
                c.prompt_s += dt
            else:
                c.decode_tokens += len(tokens)
                c.decode_s += dt
                self._mbolt_reply_s += dt
                self._mbolt_reply_n += len(tokens)
                c.last_decode_tokens_per_s = self._mbolt_reply_n / self._mbolt_reply_s  # live during a reply

        def sample(self, *a, **kw):
            token = super().sample(*a, **kw)
            if not L.llama_vocab_is_eog(self._model.vocab, token):
                self.mbolt_tokens.append(int(token))
            return token

        @property
        def mbolt_generated(self) -> int:
            return len(self.mbolt_tokens)

        def begin_request(self) -> None:
            self._mbolt_prompt = True
            self._mbolt_reply_s, self._mbolt_reply_n = 0.0, 0
            self.mbolt_tokens = []
            self.mbolt_counters.requests += 1

        def end_request(self) -> None:
            pass

    return StreamingLlama


@dataclass
class Loaded:
    """A model ready to serve: `llm` (a Llama), the runtime (None for plain llama.cpp), and what
    the budget line says."""

    llm: object
    runtime: object | None
    abort: object
    n_ctx: int
    n_ubatch: int
    budget: int | None
    budget_from: str
    tap: object | None = None

    def close(self) -> None:
        try:
            self.llm.close()
        finally:
            if self.runtime is not None:
                self.runtime.close()


def open_llm(path, *, ram: str | int | None = None, n_ctx: int | None = None, n_ubatch: int = DEFAULT_UBATCH,
             n_threads: int | None = None, plain: bool = False, on_topk=None) -> Loaded:
    """Load `path` for serving: mbolt's runtime with the budget (`ram`, else the cgroups' limit,
    else available memory), or plain llama.cpp. `on_topk(layer, rows)` also sees every
    selection (recording the routing of served traffic)."""
    import os

    from mbolt.core.memlimit import budget as find_budget
    from mbolt.core.moe_map import moe_map
    from mbolt.runtime.memory import resolve_ctx
    from mbolt.runtime.native import AbortFlag
    from mbolt.runtime.runner import TopkTap, _lib, _quiet

    L = _lib()
    mm = moe_map(path)
    runtime = None
    limit, where = (None, "") if plain else find_budget(ram)
    if plain:
        import warnings

        n_ctx, warning = resolve_ctx(n_ctx, mm)
        if warning:
            warnings.warn(warning, stacklevel=2)
        model_path = mm.paths[0]
    else:
        from mbolt.runtime.streamer import StreamRuntime

        runtime = StreamRuntime(path, mm=mm, budget=limit, qd=4, asynchronous=True, n_ctx=n_ctx, n_ubatch=n_ubatch)
        n_ctx, n_ubatch, model_path = runtime.n_ctx, runtime.n_ubatch, runtime.model_path
    try:
        hooks = [f for f in (runtime.on_topk if runtime else None, on_topk) if f is not None]
        tap = None
        cfields = {"n_outputs_max": 1}
        if hooks:
            def both(layer, rows):
                for f in hooks:
                    f(layer, rows)

            tap = TopkTap(L, both)
            cfields.update(tap.fields())
        threads = n_threads or max(1, os.cpu_count() or 1)
        _quiet(L)
        with _defaults({"use_extra_bufts": False, "n_gpu_layers": 0}, cfields), captured_log(L) as lines:
            llm = _llama_class()(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch,
                                 n_threads=threads, n_threads_batch=threads, flash_attn=True, use_mmap=True,
                                 verbose=False)
        llm.mbolt_counters = Counters()
        llm.begin_request()
        llm.mbolt_counters.requests = 0
        abort = AbortFlag(L)
        L.llama_set_abort_callback(llm.ctx, abort.cb, abort.data)
        if runtime is not None:
            runtime.attach(parse_log(lines, n_ubatch, True))
            runtime.make_cold()
    except BaseException:
        if runtime is not None:
            runtime.close()
        raise
    if llm.n_ctx() < 1:
        raise MboltError(f"{path}: llama.cpp made no context")
    return Loaded(llm, runtime, abort, llm.n_ctx(), n_ubatch, limit, where, tap)
