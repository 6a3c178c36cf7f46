"""Tool calls and JSON output: the grammars that constrain a reply, and the parser that turns a
model's tool-call text into calls (whole, or piece by piece as it streams).

The tools reach the model through its own chat template (`tokenizer.chat_template` renders
`tools`, assistant `tool_calls` and `tool` messages); what the model writes back depends on the
family, told by the template's text:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
  (Qwen2.5, Qwen3, QwQ, Hermes 2/3 and many more; also the default when the template says nothing)
- `llama3`: the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3), maybe after
  `<|python_tag|>`
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral Nemo)

A call is valid when it parses, names an offered tool and its arguments are a JSON object; text
that is not a valid call stays text. `tool_choice` required or a named function constrains the
reply with a grammar (GBNF from llama-cpp-python's JSON-schema converter) that spells calls in
the family's format, so the reply is a call. `response_format` json_object / json_schema do the
same with llama-cpp-python's JSON grammar or the schema's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_OPEN = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]"}
_CLOSE = {HERMES: "</tool_call>"}
_PYTHON_TAG = "<|python_tag|>"


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template teaches (hermes when it does not tell)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<tool_call>" in t:
        return HERMES
    if '"parameters"' in t and ("<|python_tag|>" in t or "ipython" in t):
        return LLAMA3
    return HERMES


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


def _call_of(obj, names: set[str], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_in(body: str, fmt: str, names: set[str]) -> list[ToolCall] | None:
    """The calls one block of model text spells (None: not valid calls)."""
    body = body.strip()
    if fmt == LLAMA3 and body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        if fmt != LLAMA3 or ";" not in body:
            return None
        try:  # Llama 3.2 separates parallel calls with ';'
            obj = [json.loads(part) for part in body.split(";") if part.strip()]
        except json.JSONDecodeError:
            return None
    objs = obj if isinstance(obj, list) and fmt != HERMES else [obj]
    calls = [_call_of(o, names, "parameters" if fmt == LLAMA3 else "arguments") for o in objs]
    return calls if calls and all(c is not None for c in calls) else None


class ToolStream:
    """Model text in, ("text", str) and ("call", ToolCall) out, as soon as each is certain: text
    that may be the start of a call is held back until it is a call or is not."""

    def __init__(self, fmt: str, names: set[str], parallel: bool = True):
        self.fmt, self.names, self.parallel = fmt, set(names), parallel
        self.buf = ""
        self.in_call = False
        self.started = False  # llama3: only a reply that starts with a call is one
        self.n_calls = 0
        self.after_call = False  # the whitespace between calls is not text

    def _done_calling(self) -> bool:
        return not self.parallel and self.n_calls > 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        return self._trim(self._feed(text))

    def _trim(self, parts: list[tuple[str, object]]) -> list[tuple[str, object]]:
        out = []
        for k, d in parts:
            if k == "call":
                self.after_call = True
            elif self.after_call:
                d = d.lstrip()
                if not d:
                    continue
                self.after_call = False
            out.append((k, d))
        return out

    def _feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        out: list[tuple[str, object]] = []
        if self.fmt == LLAMA3:  # a call is the whole reply: held to the end when it starts like one
            if not self.started:
                head = self.buf.lstrip()
                if not head or (_PYTHON_TAG.startswith(head) and head != _PYTHON_TAG):
                    return out  # may still become the tag
                self.started = True
                self.in_call = head.startswith("{") or head.startswith(_PYTHON_TAG)
            if not self.in_call:
                out.append(("text", self.buf))
                self.buf = ""
            return out
        while self.buf:
            if not self.in_call:
                if self._done_calling():
                    out.append(("text", self.buf))
                    self.buf = ""
                    break
                opener = _OPEN[self.fmt]
                i = self.buf.find(opener)
                if i < 0:
                    keep = held_prefix(self.buf, opener)
                    if len(self.buf) > keep:
                        out.append(("text", self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    break
                if i:
                    out.append(("text", self.buf[:i]))
                self.buf = self.buf[i:]
                self.in_call = True
            closer = _CLOSE.get(self.fmt)
            if closer is None:  # mistral: the list runs to the end of the reply
                break
            j = self.buf.find(closer)
            if j < 0:
                break
            block, self.buf = self.buf[:j + len(closer)], self.buf[j + len(closer):]
            self.in_call = False
            out += self._block(block)
        return out

    def _block(self, block: str) -> list[tuple[str, object]]:
        opener, closer = _OPEN.get(self.fmt, ""), _CLOSE.get(self.fmt, "")
        body = block
        if opener and body.startswith(opener):
            body = body[len(opener):]
        if closer and body.endswith(closer):
            body = body[:-len(closer)]
        calls = _calls_in(body, self.fmt, self.names)
        if calls is None:
            return [("text", block)]
        if not self.parallel:
            calls = calls[:1]
        self.n_calls += len(calls)
        return [("call", c) for c in calls]

    def finish(self) -> list[tuple[str, object]]:
        """What is left at the end of the reply: a call still open (the closing tag may be cut
        by an end-of-generation token), or text."""
        block, self.buf = self.buf, ""
        if not block:
            return []
        if self.in_call:
            self.in_call = False
            return self._trim(self._block(block))
        return self._trim([("text", block)])


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_reply(text: str, fmt: str, names: set[str], parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """A whole reply: its text (calls removed) and its calls."""
    s = ToolStream(fmt, names, parallel)
    parts = s.feed(text) + s.finish()
    return "".join(d for k, d in parts if k == "text"), [d for k, d in parts if k == "call"]


# ---- grammars ----


def _converter():
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def _grammar(c, extra: str = "") -> str:
    """The converter's rules (and ours): its string character rule lets raw control characters
    into strings, which JSON forbids (llama.cpp's own converter excludes them, as here)."""
    return c.format_grammar().replace(_LOOSE_CHAR, _JSON_CHAR) + extra


def _literal(s: str) -> str:
    return json.dumps(s)  # a GBNF literal is a JSON-escaped string


def schema_grammar(schema: dict) -> str:
    """GBNF for one JSON value matching `schema` (llama-cpp-python's converter of llama.cpp's
    json-schema-to-grammar)."""
    c = _converter()
    schema = c.resolve_refs(schema, "request")
    c.visit(schema, "")
    return _grammar(c)


def json_object_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def tool_grammar(tools: list[dict], fmt: str, parallel: bool) -> str:
    """GBNF for a reply that is one call (or, parallel, one or more) of these tools, spelled in
    the family's format. `tools` are OpenAI function tools ({"type": "function", "function": {...}})."""
    args_key = "parameters" if fmt == LLAMA3 else "arguments"
    alts = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                              args_key: t["function"].get("parameters") or {"type": "object"}},
             "required": ["name", args_key]} for t in tools]
    c = _converter()
    schema = c.resolve_refs(alts[0] if len(alts) == 1 else {"anyOf": alts}, "tools")
    call = c.visit(schema, "call")
    if fmt == HERMES:
        block = f'{_literal("<tool_call>" + chr(10))} {call} {_literal(chr(10) + "</tool_call>")}'
        root = f"{block} ({_literal(chr(10))} {block})*" if parallel else block
    elif fmt == MISTRAL:
        root = f'{_literal("[TOOL_CALLS][")} {call} ' + (f'("," space {call})* ' if parallel else "") + '"]"'
    else:  # llama3: one call (its template takes one per message)
        root = call
    return _grammar(c, f"\nroot ::= {root}")


# ---- the conversation back into the template ----


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """Assistant tool_calls as chat templates take them (transformers' convention): arguments
    as an object, not OpenAI's JSON string."""
    out = []
    for c in calls:
        fn = dict(c["function"])
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
