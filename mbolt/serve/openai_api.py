"""OpenAI's chat and completions APIs: every request field honoured or refused, and the response
shapes (whole, and the server-sent chunks).

Every field of the `openai` package's CompletionCreateParams (chat and text) is in one of three
sets: implemented; accepted because it does not change the output (`user`, `metadata`, ...);
refused with a 400 naming it (`param`) when set to anything but its no-op value. A field in none
of them (and not one of llama-server's sampling extensions) is a 400 too: a request is never
answered as if a field it carries were honoured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mbolt.serve import schema as S
from mbolt.serve import tools as T
from mbolt.serve.scheduler import SAMPLING_DEFAULTS, RequestError

_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "repeat_penalty": (0.0, 10.0),
            "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
_SAMPLING = set(_NUMBERS) | {"top_k", "seed", "ignore_eos"}  # with llama-server's extensions
_COMMON = {"model", "stream", "stream_options", "stop", "max_tokens", "n", "return_tokens"} | _SAMPLING
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                         "response_format"}
TEXT_FIELDS = _COMMON | {"prompt"}
# accepted: they label or route a request and do not change its output
NO_EFFECT = {"user", "safety_identifier", "metadata", "prompt_cache_key"}
# refused unless absent, null or the value that asks for nothing (the reason is the message)
_NOOP = {"logprobs": (False,), "store": (False,), "modalities": (["text"],), "service_tier": ("auto", "default"),
         "best_of": (1,), "echo": (False,), "logit_bias": ({},)}
REFUSED = {
    "logprobs": "logprobs are not available from this runtime",
    "top_logprobs": "logprobs are not available from this runtime",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "functions": "functions (deprecated) are not supported: use tools",
    "function_call": "function_call (deprecated) is not supported: use tool_choice",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "reasoning_effort is not supported",
    "verbosity": "verbosity is not supported", "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported", "store": "stored completions are not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
    "prompt_cache_options": "prompt_cache_options is not supported",
    "service_tier": "service_tier must be auto or default", "best_of": "best_of must be 1",
    "echo": "echo is not supported", "suffix": "suffix (insertion) is not supported",
}
CHAT_REFUSED = {"logprobs", "top_logprobs", "logit_bias", "audio", "modalities", "functions", "function_call",
                "prediction", "reasoning_effort", "verbosity", "web_search_options", "moderation", "store",
                "prompt_cache_retention", "prompt_cache_options", "service_tier"}
TEXT_REFUSED = {"logprobs", "logit_bias", "best_of", "echo", "suffix"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class Request:
    """A validated request: what the scheduler and the response shapes need."""

    stream: bool
    include_usage: bool
    sampling: dict
    stop: list[str]
    max_tokens: int | None
    return_tokens: bool = False
    messages: list[dict] = field(default_factory=list)
    prompt: str | list[int] | None = None
    tools: list[dict] | None = None  # offered to the template (None under tool_choice none)
    tool_choice: str | dict | None = None
    parallel: bool = True
    forced: list[dict] | None = None  # required / named: the tools a grammar makes the reply call
    json_schema: dict | None = None  # response_format json_schema
    json_object: bool = False


def check_fields(body: dict, allowed: set[str], refused: set[str], what: str) -> None:
    for k, v in body.items():
        if k in allowed or k in NO_EFFECT or v is None:
            continue
        if k in refused:
            if any(type(v) is type(n) and v == n for n in _NOOP.get(k, ())):  # False is not 0 here
                continue
            raise RequestError(f"{k}: {REFUSED[k]}", k, "unsupported_parameter")
        raise RequestError(f"{k}: not a field of the {what} API", k, "unknown_parameter")


def sampling(body: dict) -> dict:
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
    v = body.get("ignore_eos")
    if v is not None:
        if not isinstance(v, bool):
            raise RequestError("ignore_eos must be a boolean", "ignore_eos")
        out["ignore_eos"] = v
    return out


def stop_strings(v, name: str = "stop", most: int = 4) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and len(v) <= most and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise RequestError(f"{name} must be a string or a list of at most {most} strings", name)


def positive_int(v, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"{name} must be a positive integer", name)
    return v


def _flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise RequestError("stream_options must be an object with include_usage", "stream_options")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError("n must be 1 (one choice per request)", "n")
    return stream, bool(opts.get("include_usage", True))


def _text(content, where: str, kinds=("text",)) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in kinds:
                raise RequestError(f"{where}.content[{j}]: only {' and '.join(kinds)} parts are supported "
                                   f"(not {kind!r})", "messages")
            text = p.get("text") if kind == "text" else p.get("refusal")
            if not isinstance(text, str):
                raise RequestError(f"{where}.content[{j}] has no string {kind}", "messages")
            out.append(text)
        return "".join(out)
    raise RequestError(f"{where}.content must be a string or a list of text parts", "messages")


def messages(body: dict) -> list[dict]:
    """The conversation as chat templates take it (developer as system; tool calls' arguments
    as objects)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a string role", "messages")
        role = m["role"]
        if role not in ROLES:
            raise RequestError(f"{where}.role {role!r} is not one of {', '.join(sorted(ROLES))}", "messages")
        extra = set(k for k, v in m.items() if v is not None) - {"role", "content", "name", "tool_calls",
                                                                  "tool_call_id", "refusal"}
        if extra:
            raise RequestError(f"{where}: {', '.join(sorted(extra))} is not supported", "messages")
        msg = {"role": "system" if role == "developer" else role,
               "content": _text(m.get("content"), where, ("text", "refusal") if role == "assistant" else ("text",))}
        if role == "user" and m.get("content") is None:
            raise RequestError(f"{where}.content is missing", "messages")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(f"{where}: a tool message needs a string tool_call_id", "messages")
            msg["tool_call_id"] = m["tool_call_id"]
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls: a list, on assistant messages only", "messages")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                        fn.get("arguments", ""), str):
                    raise RequestError(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, "
                                       "arguments}}}}", "messages")
            msg["tool_calls"] = T.template_tool_calls(calls)
        out.append(msg)
    return out


def function_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}]: only function tools are supported", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name) or name in seen:
            raise RequestError(f"tools[{i}].function.name must be a unique name of 1-64 letters, digits, _ or -",
                               "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if params is not None:
            check_schema(params, f"tools[{i}].function.parameters", "tools")
        seen.add(name)
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def tool_choice(choice, tools: list[dict] | None, param: str = "tool_choice") -> tuple[str, list[dict] | None]:
    """('none' | 'auto' | 'required' | 'named', the tools a forced reply may call)."""
    names = [t["function"]["name"] for t in tools or []]
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto"):
        return (choice if tools else "none"), None
    if choice == "required":
        if not tools:
            raise RequestError("tool_choice required needs tools", param)
        return "required", tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", param)
        return "named", [t for t in tools if t["function"]["name"] == name]
    raise RequestError("tool_choice must be none, auto, required or {type: function, function: {name}}", param)


def _response_format(body: dict, r: Request) -> None:
    rf = body.get("response_format")
    if rf is None:
        return
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return
    if kind not in ("json_object", "json_schema"):
        raise RequestError("response_format.type must be text, json_object or json_schema", "response_format")
    if r.forced or r.tool_choice == "auto":
        raise RequestError("response_format JSON and tools in one request are not supported (send "
                           "tool_choice none)", "response_format")
    if kind == "json_object":
        r.json_object = True
        return
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise RequestError("response_format.json_schema must be an object with a name", "response_format")
    schema = js.get("schema", {})
    if not isinstance(schema, dict) or not isinstance(js.get("strict", False), (bool, type(None))):
        raise RequestError("response_format.json_schema.schema must be a JSON schema object", "response_format")
    check_schema(schema, "response_format.json_schema.schema", "response_format")
    r.json_schema = schema


def chat_request(body: dict) -> Request:
    check_fields(body, CHAT_FIELDS, CHAT_REFUSED, "chat completions")
    stream, include_usage = _flags(body)
    r = Request(stream, include_usage, sampling(body), stop_strings(body.get("stop")),
                positive_int(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens"),
                body.get("return_tokens") is True, messages=messages(body))
    tools = function_tools(body)
    choice, r.forced = tool_choice(body.get("tool_choice"), tools)
    r.tool_choice = choice
    r.tools = tools if choice != "none" else None
    ptc = body.get("parallel_tool_calls", True)
    if not isinstance(ptc, (bool, type(None))):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    r.parallel = ptc is not False
    _response_format(body, r)
    if r.sampling.get("ignore_eos") and (r.tools or r.json_object or r.json_schema is not None):
        # a call or a JSON document ends where the model ends it: past it the reply would run on
        raise RequestError("ignore_eos cannot be combined with tools or response_format", "ignore_eos")
    return r


def text_request(body: dict) -> Request:
    check_fields(body, TEXT_FIELDS, TEXT_REFUSED, "completions")
    stream, include_usage = _flags(body)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    ok = (isinstance(p, str) and p) or (isinstance(p, list) and p and all(
        isinstance(t, int) and not isinstance(t, bool) for t in p))
    if not ok:
        raise RequestError("prompt must be a non-empty string (or one string in a list, or a list of token ids)",
                           "prompt")
    return Request(stream, include_usage, sampling(body), stop_strings(body.get("stop")),
                   positive_int(body.get("max_tokens"), "max_tokens"), body.get("return_tokens") is True, prompt=p)


def grammar_of(r: Request, fmt: str) -> str | None:
    """The GBNF that constrains the reply, if the request asks for one."""
    if r.json_object:
        return T.json_object_grammar()
    param = "tools" if r.forced else "response_format"
    try:  # the schemas were checked with the request: a failure here is the converter's
        if r.forced:  # a named function is called once; required may call several (parallel_tool_calls)
            return T.tool_grammar(r.forced, fmt, r.parallel and r.tool_choice == "required")
        if r.json_schema is not None:
            return T.schema_grammar(r.json_schema)
    except Exception as e:
        raise RequestError(f"{param}: the JSON schema cannot be turned into a grammar: {e}", param) from None
    return None


def check_schema(schema: dict, where: str, param: str) -> None:
    """A 400 naming the first keyword of a request's JSON schema that the reply's grammar cannot
    honour, and where it is (a JSON pointer into the schema)."""
    try:
        S.check(schema)
    except S.Refused as e:
        raise RequestError(f"{where}: {e}", param, "unsupported_parameter") from None


# ---- response shapes ----


def finish_reason(end: dict, calls: list) -> str:
    """llama-server's rule (server_task_result_cmpl_final::to_json_oaicompat_chat): "length" when
    the reply ran into its limit, even with a call in it (cut short); else "tool_calls" when it
    has calls."""
    if end["finish_reason"] == "length":
        return "length"
    if calls:
        return "tool_calls"
    return "stop" if end["finish_reason"] == "cancelled" else end["finish_reason"]


def call_dict(c: T.ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class Shape:
    """OpenAI's response shapes for one request (chat.completion or text_completion)."""

    def __init__(self, kind: str, rid: str, created: int, model: str):
        self.kind, self.rid, self.created, self.model = kind, rid, created, model

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, end: dict, calls: list | None = None) -> dict:
        fin = finish_reason(end, calls)
        if self.kind == "chat":
            msg = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                msg["tool_calls"] = [call_dict(c) for c in calls]
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": fin}
            return {**self._head("chat.completion"), "choices": [choice], "usage": end["usage"]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}
        return {**self._head("text_completion"), "choices": [choice], "usage": end["usage"]}

    def chunk(self, delta: dict | str | None, finish: str | None = None) -> dict:
        if self.kind == "chat":
            d = {"content": delta} if isinstance(delta, str) else (delta or {})
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]}

    def call_start(self, index: int, c: T.ToolCall) -> dict:
        """A call's first delta, sent as soon as its name is known: index, id, type and name."""
        return self.chunk({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                           "function": {"name": c.name, "arguments": ""}}]})

    def call_args(self, index: int, piece: str) -> dict:
        """A piece of a call's arguments, as the model writes them."""
        return self.chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"), "choices": [],
                "usage": usage}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
