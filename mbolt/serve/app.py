"""`mbolt serve`: OpenAI- and Anthropic-compatible HTTP APIs over one `Scheduler` (a thin Starlette app).

Endpoints: POST /v1/chat/completions and /v1/completions (OpenAI; openai_api.py), POST /v1/messages
and /v1/messages/count_tokens (Anthropic; anthropic_api.py), each streamed with server-sent
events or not; GET /v1/models, /health, /metrics (Prometheus; metrics.py), /stats (JSON for the
page) and / (a chat page with the runtime's live numbers). Why not llama-cpp-python's own
`llama_cpp.server`: it builds its `Llama` itself (the runtime has to go in while `Llama` is
built), answers invalid JSON with a 500 and a chat without messages with a 200, and has no /health
or /metrics (docs/serve.md).

Requests are validated before anything runs (a 4xx in the API's own error shape): every field is
honoured or refused, never dropped. Tools reach the model through its chat template and its
tool-call text comes back as calls (tools.py); tool_choice required / a named tool and JSON output
constrain the reply with a grammar. With an API key every endpoint but /, /favicon.ico and /health
needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from importlib.resources import files

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mbolt.serve import anthropic_api as A
from mbolt.serve import openai_api as O
from mbolt.serve import tools as T
from mbolt.serve.metrics import CONTENT_TYPE, Clock, Metrics
from mbolt.serve.scheduler import Job, RequestError, Scheduler

RETRY_AFTER_S = 5
_ANTHROPIC = "/v1/messages"


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def anthropic_error(status: int, message: str, kind: str = "invalid_request_error",
                    headers: dict | None = None) -> JSONResponse:
    return JSONResponse(A.error_body(message, kind), status, headers=headers)


class _Busy(Exception):
    pass


class _Reply:
    """The text of a reply on its way out: the caller's stop sequences (matched here when the API
    must say which one stopped it) and the tool calls in it."""

    def __init__(self, tools: T.ToolStream | None, stops: list[str] | None = None):
        self.tools, self.stops = tools, stops or []
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self.matched is not None:
            return []
        if self.stops:
            self.held += text
            hits = [(self.held.find(s), s) for s in self.stops if s in self.held]
            if hits:
                i, self.matched = min(hits)
                text, self.held = self.held[:i], ""
            else:
                keep = max(T.held_prefix(self.held, s) for s in self.stops)
                text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return self.tools.feed(text) if self.tools else ([("text", text)] if text else [])

    def finish(self, end: dict) -> list[tuple[str, object]]:
        tail, self.held = self.held, ""
        out = [] if self.matched is not None or not tail else self.tools.feed(tail) if self.tools else [("text", tail)]
        return out + (self.tools.finish(cut=end.get("finish_reason") == "length") if self.tools else [])


def create_app(scheduler: Scheduler, *, api_key: str | None = None, model_name: str = "model") -> Starlette:
    page = files("mbolt.serve").joinpath("page.html").read_text(encoding="utf-8")
    created = int(time.time())
    metrics = Metrics(scheduler.stats)
    # the family's tool-call format, told by the chat template the scheduler renders
    fmt = T.tool_format(scheduler.chat_template)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw or b"")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise RequestError(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def prepare(r: O.Request, keep_stops: bool = True) -> Job:
        """The job of a validated chat request (not submitted): RequestError when it cannot run."""
        tokens, template_stop = scheduler.prepare_chat(r.messages, tools=r.tools)
        stop = (r.stop if keep_stops else []) + [s for s in template_stop if s not in r.stop]
        n_new = scheduler.check_fits(tokens, r.max_tokens)
        return Job(tokens, n_new, r.sampling, stop, None, grammar=O.grammar_of(r, fmt))

    def submit(job: Job) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.on_event = lambda k, d: loop.call_soon_threadsafe(events.put_nowait, (k, d))
        if not scheduler.submit(job):
            raise _Busy
        return events

    async def events_of(request: Request, job: Job, events: asyncio.Queue, poll: bool):
        """The job's events up to its end (or error); the work stops when the reader goes away."""
        clock, done = Clock(metrics), False
        try:
            while True:
                try:
                    k, d = await asyncio.wait_for(events.get(), 0.25)
                except asyncio.TimeoutError:
                    if poll and await request.is_disconnected():
                        raise ConnectionAbortedError from None
                    continue
                clock.saw(k, d)
                yield k, d
                if k != "text":
                    done = True
                    return
        finally:
            if not done:  # the client went away (or the response was cancelled): stop the work
                scheduler.cancel(job)

    def reply_of(r: O.Request, stops: list[str] | None = None) -> _Reply:
        names = {t["function"]["name"] for t in r.tools or []}
        return _Reply(T.ToolStream(fmt, names, r.parallel) if names else None, stops)

    async def collect(request: Request, job: Job, events: asyncio.Queue, reply: _Reply):
        """A whole reply: (text, calls, the end event); (None, None, None) when the client went
        away, (None, the error, None) when the job failed."""
        parts = []
        try:
            async for k, d in events_of(request, job, events, poll=True):
                if k == "text":
                    parts += reply.feed(d)
                    if reply.matched is not None:  # a stop sequence matched here: the rest is not wanted
                        scheduler.cancel(job)
                elif k == "error":
                    return None, d, None
                else:
                    parts += reply.finish(d)
                    return "".join(d for k, d in parts if k == "text"), [d for k, d in parts if k == "end"], d
        except ConnectionAbortedError:
            pass
        return None, None, None

    busy = f"the server is busy: {scheduler.max_queue} requests are waiting"

    # ---- OpenAI ----

    async def openai_run(request: Request, kind: str):
        try:
            body = await body_of(request)
            if kind == "chat":
                r = O.chat_request(body)
                job = prepare(r)
            else:
                r = O.text_request(body)
                tokens = scheduler.prepare_text(r.prompt)
                job = Job(tokens, scheduler.check_fits(tokens, r.max_tokens), r.sampling, r.stop, None)
            events = submit(job)
        except RequestError as e:
            return error(400, str(e), param=e.param, code=e.code)
        except _Busy:
            return error(503, busy, "server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        shape = O.Shape(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()),
                        model_name)
        reply = reply_of(r)
        if r.stream:
            return StreamingResponse(openai_stream(request, job, events, shape, reply, r.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, calls, end = await collect(request, job, events, reply)
        if end is None:
            return Response(status_code=499) if calls is None else error(500, calls, "server_error")
        out = shape.whole(text, end, calls)
        if r.return_tokens:  # llama-server's extension: the token ids, prompt and reply
            out["choices"][0]["tokens"] = end["tokens"]
            out["prompt_tokens"] = end["prompt_tokens"]
        return JSONResponse(out)

    async def openai_stream(request, job, events, shape: O.Shape, reply: _Reply, include_usage: bool):
        n_calls = 0

        def lines(parts) -> bytes:  # a call: its name as soon as it is known, then its arguments in pieces
            nonlocal n_calls
            out = b""
            for k, d in parts:
                if k == "text":
                    out += O.sse(shape.chunk(d)) if d else b""
                elif k == "start":
                    out += O.sse(shape.call_start(n_calls, d))
                    n_calls += 1
                elif k == "args" and d:
                    out += O.sse(shape.call_args(n_calls - 1, d))
            return out

        try:
            if shape.kind == "chat":
                yield O.sse(shape.chunk({"role": "assistant", "content": ""}))
            async for k, d in events_of(request, job, events, poll=False):
                if k == "text":
                    if out := lines(reply.feed(d)):
                        yield out
                elif k == "end":
                    yield lines(reply.finish(d))
                    yield O.sse(shape.chunk(None, O.finish_reason(d, [None] * n_calls)))
                    if include_usage:
                        yield O.sse(shape.usage_chunk(d["usage"]))
                else:
                    yield O.sse({"error": {"message": d, "type": "server_error", "param": None, "code": None}})
            yield b"data: [DONE]\n\n"
        finally:  # closed while it waits to send (the client left): the work stops (a no-op once ended)
            scheduler.cancel(job)

    async def chat(request: Request):
        return await openai_run(request, "chat")

    async def completions(request: Request):
        return await openai_run(request, "text")

    # ---- Anthropic ----

    async def messages(request: Request):
        try:
            r = A.message_request(await body_of(request))
            job = prepare(r, keep_stops=False)  # the stop sequences are matched here: the reply names the one
            events = submit(job)
        except RequestError as e:
            return anthropic_error(400, str(e))
        except _Busy:
            return anthropic_error(529, busy, "overloaded_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        mid = "msg_" + uuid.uuid4().hex[:24]
        reply = reply_of(r, r.stop)
        if r.stream:
            return StreamingResponse(anthropic_stream(request, job, events, mid, reply),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, calls, end = await collect(request, job, events, reply)
        if end is None:
            return Response(status_code=499) if calls is None else anthropic_error(500, calls, "api_error")
        return JSONResponse(A.whole(mid, model_name, text, calls, end, reply.matched))

    async def anthropic_stream(request, job, events, mid: str, reply: _Reply):
        ev, calls = A.Events(mid, model_name), []

        def out(parts) -> bytes:
            b = b""
            for k, d in parts:
                if k == "text":
                    b += ev.text(d) if d else b""
                elif k == "start":
                    b += ev.call_start(d)
                elif k == "args":
                    b += ev.call_args(d) if d else b""
                else:
                    calls.append(d)
                    b += ev.call_end()
            return b

        try:
            yield ev.start(len(job.tokens))
            async for k, d in events_of(request, job, events, poll=False):
                if k == "text":
                    b = out(reply.feed(d))
                    if reply.matched is not None:
                        scheduler.cancel(job)
                    if b:
                        yield b
                elif k == "end":
                    yield out(reply.finish(d)) + ev.end(d, calls, reply.matched)
                else:
                    yield A.event("error", {"error": {"type": "api_error", "message": d}})
        finally:
            scheduler.cancel(job)

    async def count_tokens(request: Request):
        try:
            r = A.message_request(await body_of(request), count_only=True)
            tokens, _ = scheduler.prepare_chat(r.messages, tools=r.tools)
        except RequestError as e:
            return anthropic_error(400, str(e))
        return JSONResponse({"input_tokens": len(tokens)})

    # ---- the rest ----

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "mbolt"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def stats(request: Request):
        return JSONResponse(scheduler.stats())

    async def metrics_text(request: Request):
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    async def index(request: Request):
        return HTMLResponse(page)

    async def favicon(request: Request):
        return Response(status_code=204)

    def failure(status: int, message: str, request: Request, code: str):
        if request.url.path.startswith(_ANTHROPIC):
            return anthropic_error(status, message, "not_found_error" if status == 404 else
                                   "api_error" if status >= 500 else "invalid_request_error")
        return error(status, message, "server_error" if status >= 500 else "invalid_request_error", code=code)

    async def not_found(request: Request, exc):
        return failure(404, f"no such endpoint: {request.method} {request.url.path}", request, "not_found")

    async def server_error(request: Request, exc):
        return failure(500, f"{type(exc).__name__}: {exc}", request, None)

    async def method_not_allowed(request: Request, exc):
        return failure(405, f"{request.method} is not allowed on {request.url.path}", request, "method_not_allowed")

    app = Starlette(routes=[
        Route("/", index), Route("/favicon.ico", favicon), Route("/health", health), Route("/v1/models", models),
        Route("/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]), Route("/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/metrics", metrics_text), Route("/stats", stats),
    ], middleware=[Middleware(_ApiKey, key=api_key)] if api_key else [],
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error, Exception: server_error})
    return app


class _ApiKey:
    """Every endpoint but the page, its icon and /health needs the key: `Authorization: Bearer
    KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), compared in constant time."""

    OPEN = ("/", "/favicon.ico", "/health")

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode("utf-8")

    def _ok(self, headers: dict) -> bool:
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN and not self._ok(dict(scope.get("headers") or [])):
            msg = "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)"
            resp = (anthropic_error(401, msg, "authentication_error") if scope["path"].startswith(_ANTHROPIC)
                    else error(401, msg, "authentication_error", code="invalid_api_key"))
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)
