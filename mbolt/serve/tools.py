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
reply with a grammar (GBNF from the JSON-schema converter of schema_grammar.py) that spells calls
in the family's format, so the reply is a call. `response_format` json_object / json_schema do
the same with llama-cpp-python's JSON grammar or the schema's. Every schema keyword is honoured
or refused (schema.py).
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
        """The arguments as an object; {} when they are not one (a call cut by max_tokens), as
        llama-server's to_json_anthropic makes them."""
        try:
            args = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return args if isinstance(args, dict) else {}


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


_WS = " \t\r\n"


def call_head(s: str, names: set[str], keys: tuple[str, ...] = ("arguments",)) -> tuple[str, int] | bool | None:
    """Where the arguments begin in `s`, the text of a call object so far: (name, index of the
    arguments' `{`) once `s` reads `{"name": "<an offered tool>", "arguments": {`; None while it
    may still; False when it cannot (then the block is judged whole at its end)."""
    i, name = 0, ""
    for step in ("{", '"name"', ":", '"', None, ",", tuple(f'"{k}"' for k in keys), ":", "{"):
        if step is None:  # the name, up to its closing quote
            j = s.find('"', i)
            if j < 0:
                return False if "\\" in s[i:] else None
            name, i = s[i:j], j + 1
            if name not in names:
                return False
            continue
        while i < len(s) and s[i] in _WS:
            i += 1
        lits, rest = (step if isinstance(step, tuple) else (step,)), s[i:]
        hit = next((lit for lit in lits if rest.startswith(lit)), None)
        if hit is None:
            return None if any(lit.startswith(rest) for lit in lits) else False
        i += len(hit)
    return name, i - 1


class ToolStream:
    """Model text in, events out as soon as each is certain: ("text", str); a call as ("start",
    ToolCall) when its name is known, ("args", str) for each piece of its arguments as the model
    writes them, ("end", ToolCall) when it is whole or the reply ends inside it. Text that may be
    the start of a call is held back until it is a call or is not.

    A hermes block streams once it reads `{"name": "<an offered tool>", "arguments": {` (the order
    the tool grammar writes and llama.cpp's parser expects): from there it is a call and its
    arguments are the model's own text of that object, as llama-server sends them. Any other block,
    and the llama3 and mistral formats, are judged whole at their end (one start, args, end)."""

    def __init__(self, fmt: str, names: set[str], parallel: bool = True):
        self.fmt, self.names, self.parallel = fmt, set(names), parallel
        self.buf = ""
        self.in_call = False
        self.started = False  # llama3: only a reply that starts with a call is one
        self.n_calls = 0
        self.after_call = False  # the whitespace between calls is not text
        self._open_block()

    def _open_block(self) -> None:
        self.body = ""  # a hermes block's text after its opening tag, until its call streams
        self.call: ToolCall | None = None  # the call now streaming
        self.whole = False  # the block did not begin like a call: judged at its closing tag
        self.args_open = False
        self.depth, self.in_str, self.esc = 0, False, False

    def _done_calling(self) -> bool:
        return not self.parallel and self.n_calls > 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        return self._trim(self._feed(text))

    def _trim(self, parts: list[tuple[str, object]]) -> list[tuple[str, object]]:
        out = []
        for k, d in parts:
            if k == "end":
                self.after_call = True
            elif k == "text" and self.after_call:
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
                self.buf = self.buf[i + len(opener):]
                self.in_call = True
                self._open_block()
            if self.fmt == MISTRAL:  # the list runs to the end of the reply
                self.body += self.buf
                self.buf = ""
                break
            if not self._hermes(out):
                break
        return out

    def _hermes(self, out: list) -> bool:
        """Take the buffered text of an open hermes block; True when the block has ended."""
        closer = _CLOSE[HERMES]
        if self.call is None:
            self.body += self.buf
            self.buf = ""
            if not self.whole:
                head = call_head(self.body, self.names)
                if head is None:
                    return False
                if head is False:
                    self.whole = True
                else:
                    self.call = ToolCall(head[0], "")
                    self.args_open = True
                    self.body, self.buf = self.body[:head[1]], self.body[head[1]:]
                    out.append(("start", self.call))
            if self.whole:
                j = self.body.find(closer)
                if j < 0:
                    return False
                block, self.buf = self.body[:j], self.body[j + len(closer):]
                self.in_call = False
                self._open_block()
                out += self._block(_OPEN[HERMES] + block + closer)
                return True
        if self.args_open:
            piece, rest = self._scan_args(self.buf)
            self._args(piece, out)
            self.buf = rest or ""
            if rest is None:
                return False
            self.args_open = False
        j = self.buf.find(closer)  # after the arguments: the object's `}`, then the closing tag
        if j < 0:
            return False
        self.buf = self.buf[j + len(closer):]
        out += self._end_call()
        return True

    def _scan_args(self, text: str) -> tuple[str, str | None]:
        """The part of `text` inside the arguments object and what follows it (None while the
        object is still open): strings and their escapes are skipped, brackets counted."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return text[:i + 1], text[i + 1:]
        return text, None

    def _args(self, piece: str, out: list) -> None:
        if piece:
            self.call.arguments += piece
            out.append(("args", piece))

    def _end_call(self) -> list[tuple[str, object]]:
        c, self.in_call = self.call, False
        self._open_block()
        self.n_calls += 1
        return [("end", c)]

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
        out: list[tuple[str, object]] = []
        for c in calls:
            out += [("start", c), ("args", c.arguments), ("end", c)]
        return out

    def finish(self, cut: bool = False) -> list[tuple[str, object]]:
        """What is left at the end of the reply. A streaming call ends with the arguments written
        so far (`cut`: the reply ran into max_tokens, and they may not be whole JSON), as
        llama-server ends it; a block cut before its call's name is whole, or a cut opening tag,
        is dropped, as llama-server drops it; any other open block (its closing tag cut by an
        end-of-generation token) is judged as it stands."""
        out: list[tuple[str, object]] = []
        if self.call is not None:
            if self.args_open:
                piece, _ = self._scan_args(self.buf)
                self._args(piece, out)
            self.buf = ""
            return self._trim(out + self._end_call())
        block, self.buf = self.body + self.buf, ""
        if cut and self.fmt == HERMES:  # what is held is (the start of) a call without a name
            self.in_call = False
            self._open_block()
            return []
        if self.in_call:
            self.in_call = False
            self._open_block()
            return self._trim(self._block(_OPEN.get(self.fmt, "") + block))
        return self._trim([("text", block)] if block else [])


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
    return "".join(d for k, d in parts if k == "text"), [d for k, d in parts if k == "end"]


# ---- grammars ----


def _literal(s: str) -> str:
    return json.dumps(s)  # a GBNF literal is a JSON-escaped string


def schema_grammar(schema: dict) -> str:
    """GBNF for one JSON value matching `schema`; schema.Refused names a keyword it cannot honour."""
    from mbolt.serve.schema_grammar import schema_grammar as grammar

    return grammar(schema)


def json_object_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def tool_grammar(tools: list[dict], fmt: str, parallel: bool) -> str:
    """GBNF for a reply that is one call (or, parallel, one or more) of these tools, spelled in
    the family's format. `tools` are OpenAI function tools ({"type": "function", "function": {...}})."""
    from mbolt.serve.schema_grammar import Converter, call_grammar

    args_key = "parameters" if fmt == LLAMA3 else "arguments"
    c = Converter()
    call = call_grammar(c, [(t["function"]["name"], t["function"].get("parameters")) for t in tools], args_key, "call")
    if fmt == HERMES:
        block = f'{_literal("<tool_call>" + chr(10))} {call} {_literal(chr(10) + "</tool_call>")}'
        root = f"{block} ({_literal(chr(10))} {block})*" if parallel else block
    elif fmt == MISTRAL:
        root = f'{_literal("[TOOL_CALLS][")} {call} ' + (f'("," space {call})* ' if parallel else "") + '"]"'
    else:  # llama3: one call (its template takes one per message)
        root = call
    return c.format_grammar() + f"\nroot ::= {root}"


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
