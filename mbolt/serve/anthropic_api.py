"""Anthropic's Messages API on the same scheduler: requests turned into the conversation the chat
template takes, the response shapes, the streamed event sequence and the error shape.

A request's content blocks map onto the OpenAI-style messages the template renders: `system`
(a string or text blocks) is the system message, `tool_use` blocks are an assistant message's
tool_calls, `tool_result` blocks are `tool` messages. Fields the API defines that change nothing
here (`metadata`, `service_tier`, `cache_control`) are accepted; `output_config.format` (a JSON
schema) constrains the reply as OpenAI's `response_format` does; `temperature`, `top_p` and
`top_k` (gone from the 2.x client's parameters) are honoured when sent; anything else is a 400.
"""

from __future__ import annotations

import json

from mbolt.serve import openai_api as O
from mbolt.serve import tools as T
from mbolt.serve.scheduler import SAMPLING_DEFAULTS, RequestError

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "output_config"}
NO_EFFECT = {"metadata", "service_tier", "cache_control"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice"}


def _err(message: str, param: str | None = None):
    return RequestError(message, param)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for k, v in body.items():
        if k in allowed or k in NO_EFFECT:
            continue
        if k == "thinking" and isinstance(v, dict) and v.get("type") == "disabled":
            continue
        raise _err(f"{k}: not supported by this server", k)


def _text_blocks(v, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        out = []
        for j, b in enumerate(v):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise _err(f"{where}[{j}]: only text blocks are supported here")
            out.append(b["text"])
        return "".join(out)
    raise _err(f"{where} must be a string or a list of text blocks")


def _blocks(m: dict, i: int) -> list[dict]:
    c = m.get("content")
    if isinstance(c, str):
        return [{"type": "text", "text": c}]
    if not isinstance(c, list):
        raise _err(f"messages.{i}.content must be a string or a list of content blocks")
    for j, b in enumerate(c):
        if not isinstance(b, dict):
            raise _err(f"messages.{i}.content.{j} must be a content block")
    return c


def messages(body: dict) -> list[dict]:
    """The conversation as chat templates take it."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _err("messages: a non-empty list of {role, content} is required", "messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _err(f"messages.{i}.role must be user or assistant", "messages")
        text, calls = [], []
        for j, b in enumerate(_blocks(m, i)):
            kind, where = b.get("type"), f"messages.{i}.content.{j}"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not isinstance(
                        b.get("input"), dict):
                    raise _err(f"{where}: a tool_use block needs id, name and an input object")
                calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"],
                                                                              "arguments": b["input"]}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _err(f"{where}: a tool_result block needs a tool_use_id")
                if text:  # text before a result is a turn of its own
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text_blocks(b.get("content", ""), f"{where}.content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " + result) if b.get("is_error") else result})
            else:
                raise _err(f"{where}: a {kind!r} block is not supported in a {m['role']} message")
        if m["role"] == "assistant":
            msg = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _err("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(
                t.get("input_schema"), dict):
            raise _err(f"tools.{i}: only custom tools with an input_schema are supported (no server tools)", "tools")
        extra = set(t) - {"name", "description", "input_schema", "type", "cache_control"}
        if extra:
            raise _err(f"tools.{i}: {', '.join(sorted(extra))} is not supported", "tools")
        O.check_schema(t["input_schema"], f"tools.{i}.input_schema", "tools")  # named as this API names it
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return O.function_tools({"tools": out})


def _choice(body: dict, tools: list[dict] | None) -> tuple[str, list[dict] | None, bool]:
    tc = body.get("tool_choice")
    if tc is None:
        return (*O.tool_choice(None, tools), True)
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise _err("tool_choice.type must be auto, any, tool or none", "tool_choice")
    parallel = not tc.get("disable_parallel_tool_use", False)
    kind = tc["type"]
    oc = {"auto": "auto", "none": "none", "any": "required"}.get(kind) or {"type": "function",
                                                                           "function": {"name": tc.get("name")}}
    return (*O.tool_choice(oc, tools), parallel)


def _sampling(body: dict) -> dict:
    out = dict(SAMPLING_DEFAULTS)
    for k in ("temperature", "top_p"):
        v = body.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise _err(f"{k} must be a number in [0, 1]", k)
            out[k] = float(v)
    v = body.get("top_k")
    if v is not None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _err("top_k must be a non-negative integer", "top_k")
        out["top_k"] = v
    return out


def _output_format(body: dict, r: O.Request) -> None:
    """output_config.format (structured outputs): the reply's text is JSON matching the schema."""
    oc = body.get("output_config")
    if oc is None:
        return
    if not isinstance(oc, dict) or set(oc) - {"format", "effort"} or oc.get("effort") is not None:
        raise _err("output_config: only format is supported here (not effort)", "output_config")
    fmt = oc.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or set(fmt) != {"type", "schema"} or fmt["type"] != "json_schema" or \
            not isinstance(fmt["schema"], dict):
        raise _err("output_config.format must be {type: json_schema, schema: {...}}", "output_config")
    if r.forced or r.tool_choice == "auto":
        raise _err("output_config.format and tools in one request are not supported (send tool_choice none)",
                   "output_config")
    O.check_schema(fmt["schema"], "output_config.format.schema", "output_config")
    r.json_schema = fmt["schema"]


def message_request(body: dict, count_only: bool = False) -> O.Request:
    _check_fields(body, COUNT_FIELDS if count_only else FIELDS)
    if not isinstance(body.get("model"), str):
        raise _err("model: a string is required", "model")
    if count_only:
        max_tokens = None
    elif body.get("max_tokens") is None:
        raise _err("max_tokens: a positive integer is required", "max_tokens")
    else:
        max_tokens = O.positive_int(body.get("max_tokens"), "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _err("stream must be a boolean", "stream")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _err("stop_sequences must be a list of non-empty strings", "stop_sequences")
    r = O.Request(stream, False, _sampling(body), list(stop), max_tokens, messages=messages(body))
    tools = _tools(body)
    r.tool_choice, r.forced, r.parallel = _choice(body, tools)
    r.tools = tools if r.tool_choice != "none" else None
    _output_format(body, r)
    return r


# ---- response shapes ----

def stop_reason(end: dict, calls: list, matched: str | None) -> str:
    """llama-server's rule (server_task_result_cmpl_final::to_json_anthropic): "max_tokens" when
    the reply ran into its limit, even with a call in it (cut short)."""
    if end["finish_reason"] == "length" and matched is None:
        return "max_tokens"
    if calls:
        return "tool_use"
    if matched is not None:
        return "stop_sequence"
    return "max_tokens" if end["finish_reason"] == "length" else "end_turn"


def tool_use_id(c: T.ToolCall) -> str:
    return "toolu_" + c.id[len("call_"):]


def tool_use(c: T.ToolCall) -> dict:
    return {"type": "tool_use", "id": tool_use_id(c), "name": c.name, "input": c.input}


def usage(end: dict) -> dict:
    # as Anthropic counts (and llama-server): the prompt is input_tokens + cache_read_input_tokens
    cached = end["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": end["usage"]["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "output_tokens": end["usage"]["completion_tokens"]}


def head(mid: str, model: str) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model}


def whole(mid: str, model: str, text: str, calls: list, end: dict, matched: str | None) -> dict:
    content = ([{"type": "text", "text": text}] if text else []) + [tool_use(c) for c in calls]
    return {**head(mid, model), "content": content, "stop_reason": stop_reason(end, calls, matched),
            "stop_sequence": matched, "usage": usage(end)}


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


class Events:
    """Anthropic's stream for one message: blocks opened and closed as text and calls come."""

    def __init__(self, mid: str, model: str):
        self.mid, self.model = mid, model
        self.index = -1
        self.open: str | None = None  # the kind of the block now open

    def start(self, input_tokens: int) -> bytes:
        msg = {**head(self.mid, self.model), "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return event("message_start", {"message": msg}) + event("ping", {})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", {"index": self.index})

    def text(self, s: str) -> bytes:
        out = b""
        if self.open != "text":
            out += self._close()
            self.index += 1
            self.open = "text"
            out += event("content_block_start", {"index": self.index, "content_block": {"type": "text", "text": ""}})
        return out + event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": s}})

    def call_start(self, c: T.ToolCall) -> bytes:
        """A tool_use block opened as soon as the call's name is known (input {}, as Anthropic
        and llama-server send it); its input follows as input_json_delta pieces."""
        out = self._close()
        self.index += 1
        block = {"type": "tool_use", "id": tool_use_id(c), "name": c.name, "input": {}}
        self.open = "tool_use"
        return out + event("content_block_start", {"index": self.index, "content_block": block})

    def call_args(self, piece: str) -> bytes:
        return event("content_block_delta", {"index": self.index,
                                             "delta": {"type": "input_json_delta", "partial_json": piece}})

    def call_end(self) -> bytes:
        return self._close()

    def end(self, end: dict, calls: list, matched: str | None) -> bytes:
        return self._close() + event("message_delta", {
            "delta": {"stop_reason": stop_reason(end, calls, matched), "stop_sequence": matched},
            "usage": usage(end)}) + event("message_stop", {})
