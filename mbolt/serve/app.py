"""`mbolt serve`: an OpenAI-compatible HTTP server over one `Scheduler` (a thin Starlette app).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed with server-sent events, or
not), GET /v1/models, /health, /metrics (Prometheus text), /stats (JSON for the page) and / (a chat
page with the runtime's live numbers). Why not llama-cpp-python's own `llama_cpp.server`: it builds
its `Llama` itself (the runtime has to go in while `Llama` is built), answers invalid JSON with a
500 and a chat without messages with a 200, and has no /health or /metrics (docs/serve.md).

Requests are validated here (one OpenAI-style error, 4xx, nothing run): invalid JSON, a body that
is not an object, missing or malformed `messages`/`prompt`, fields of the wrong type or range,
`max_tokens` beyond the context. The `model` field is accepted whatever it names, as llama-server
does. With an API key every endpoint but / and /health needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from importlib.resources import files

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mbolt.serve.scheduler import SAMPLING_DEFAULTS, Scheduler, Job, RequestError

RETRY_AFTER_S = 5


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


# ---- validation ----

_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "repeat_penalty": (0.0, 10.0),
            "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def _sampling(body: dict) -> dict:
    """The sampling fields of a request, type-checked, over llama-server's defaults."""
    out = dict(SAMPLING_DEFAULTS)
    for k, (lo, hi) in _NUMBERS.items():
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise RequestError(f"{k} must be a number in [{lo}, {hi}]", k)
        out[k] = float(v)
    for k in ("top_k", "seed"):
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RequestError(f"{k} must be a non-negative integer", k)
        out[k] = int(v)
    return out


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and len(v) <= 4 and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise RequestError("stop must be a string or a list of at most 4 strings", "stop")


def _max_tokens(body: dict) -> int | None:
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError("max_tokens must be a positive integer", "max_tokens")
    return v


def _flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("n must be 1 (one choice per request)", "n")
    return stream, bool(opts.get("include_usage", True))


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
            c = "".join(p["text"] for p in c)
        if c is not None and not isinstance(c, str):
            raise RequestError(f"messages[{i}].content must be a string", "messages")
        out.append({**m, "content": c or ""})
    return out


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise RequestError("prompt must be a non-empty string (or one string in a list, or a list of token ids)", "prompt")


# ---- the app ----


def create_app(engine: Scheduler, *, api_key: str | None = None, model_name: str = "model") -> Starlette:
    page = files("mbolt.serve").joinpath("page.html").read_text(encoding="utf-8")
    created = int(time.time())

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw or b"")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise RequestError(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    async def run(request: Request, kind: str):
        try:
            body = await body_of(request)
            stream, include_usage = _flags(body)
            sampling, stop, max_tokens = _sampling(body), _stop(body), _max_tokens(body)
            if kind == "chat":
                tokens, template_stop = engine.prepare_chat(_messages(body))
                stop = stop + [s for s in template_stop if s not in stop]
            else:
                tokens = engine.prepare_text(_prompt(body))
            n_new = engine.check_fits(tokens, max_tokens)
        except RequestError as e:
            return error(400, str(e), param=e.param, code=e.code)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(tokens, n_new, sampling, stop, lambda k, d: loop.call_soon_threadsafe(events.put_nowait, (k, d)))
        if not engine.submit(job):
            return error(503, f"the server is busy: {engine.max_queue} requests are waiting", "server_error",
                         code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        shape = _Shape(kind, rid, int(time.time()), model_name)
        if stream:
            return StreamingResponse(_sse(request, engine, job, events, shape, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, end = [], None
        try:
            while end is None:
                try:
                    k, d = await asyncio.wait_for(events.get(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(job)
                        return Response(status_code=499)
                    continue
                if k == "text":
                    text.append(d)
                elif k == "end":
                    end = d
                else:
                    return error(500, d, "server_error")
        except asyncio.CancelledError:
            engine.cancel(job)
            raise
        out = shape.whole("".join(text), end)
        if body.get("return_tokens") is True:  # llama-server's extension: the token ids, prompt and reply
            out["choices"][0]["tokens"] = end["tokens"]
            out["prompt_tokens"] = end["prompt_tokens"]
        return JSONResponse(out)

    async def chat(request: Request):
        return await run(request, "chat")

    async def completions(request: Request):
        return await run(request, "text")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "mbolt"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def stats(request: Request):
        return JSONResponse(engine.stats())

    async def metrics(request: Request):
        return PlainTextResponse(prometheus(engine.stats()), media_type="text/plain; version=0.0.4")

    async def index(request: Request):
        return HTMLResponse(page)

    async def favicon(request: Request):
        return Response(status_code=204)

    async def not_found(request: Request, exc):
        return error(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found")

    async def server_error(request: Request, exc):
        return error(500, f"{type(exc).__name__}: {exc}", "server_error")

    async def method_not_allowed(request: Request, exc):
        return error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")

    app = Starlette(routes=[
        Route("/", index), Route("/favicon.ico", favicon), Route("/health", health), Route("/v1/models", models), Route("/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]), Route("/completions", completions, methods=["POST"]),
        Route("/metrics", metrics), Route("/stats", stats),
    ], middleware=[Middleware(_ApiKey, key=api_key)] if api_key else [],
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error, Exception: server_error})
    return app


class _ApiKey:
    """Every endpoint but the page and /health needs `Authorization: Bearer KEY`."""

    OPEN = ("/", "/favicon.ico", "/health")

    def __init__(self, app, key: str):
        self.app, self.want = app, f"Bearer {key}".encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            if dict(scope.get("headers") or []).get(b"authorization", b"") != self.want:
                resp = error(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                             code="invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Shape:
    """OpenAI's response shapes for one request (chat.completion or text_completion)."""

    def __init__(self, kind: str, rid: str, created: int, model: str):
        self.kind, self.rid, self.created, self.model = kind, rid, created, model

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, end: dict) -> dict:
        fin = "stop" if end["finish_reason"] == "cancelled" else end["finish_reason"]
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": fin}
            return {**self._head("chat.completion"), "choices": [choice], "usage": end["usage"]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}
        return {**self._head("text_completion"), "choices": [choice], "usage": end["usage"]}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"), "choices": [],
                "usage": usage}


async def _sse(request: Request, engine: Scheduler, job: Job, events: asyncio.Queue, shape: _Shape,
               include_usage: bool):
    def line(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    done = False
    try:
        if shape.kind == "chat":
            yield line(shape.chunk("", first=True))
        while True:
            k, d = await events.get()
            if k == "text":
                yield line(shape.chunk(d))
            elif k == "end":
                fin = "stop" if d["finish_reason"] == "cancelled" else d["finish_reason"]
                yield line(shape.chunk(None, fin))
                if include_usage:
                    yield line(shape.usage_chunk(d["usage"]))
                break
            else:
                yield line({"error": {"message": d, "type": "server_error", "param": None, "code": None}})
                break
        yield b"data: [DONE]\n\n"
        done = True
    finally:
        if not done:  # the client went away (the response was cancelled): stop the work
            engine.cancel(job)


def prometheus(s: dict) -> str:
    """The engine's numbers in Prometheus' text format."""
    rows = [
        ("mbolt_budget_bytes", "gauge", "memory budget of the runtime", s.get("budget_bytes")),
        ("mbolt_dense_resident_bytes", "gauge", "dense weights held resident", s.get("dense_resident_bytes")),
        ("mbolt_expert_slots", "gauge", "expert cache slots per layer (decode)", s.get("expert_slots")),
        ("mbolt_expert_cache_hits_total", "counter", "decode: selected experts found in the cache", s.get("cache_hits")),
        ("mbolt_expert_cache_misses_total", "counter", "decode: selected experts read", s.get("cache_misses")),
        ("mbolt_read_bytes_total", "counter", "bytes this process read from the device", s.get("device_read_bytes")),
        ("mbolt_major_faults_total", "counter", "major page faults of this process", s.get("major_faults")),
        ("mbolt_prompt_tokens_total", "counter", "prompt tokens evaluated", s.get("prompt_tokens")),
        ("mbolt_prompt_seconds_total", "counter", "seconds spent evaluating prompts", s.get("prompt_s")),
        ("mbolt_decode_tokens_total", "counter", "tokens decoded", s.get("decode_tokens")),
        ("mbolt_decode_seconds_total", "counter", "seconds spent decoding", s.get("decode_s")),
        ("mbolt_requests_total", "counter", "requests run", s.get("requests")),
        ("mbolt_queue_length", "gauge", "requests waiting", s.get("queue_length")),
    ]
    out = []
    for name, kind, help_, v in rows:
        if v is None:
            continue
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(v):.17g}"]
    return "\n".join(out) + "\n"
