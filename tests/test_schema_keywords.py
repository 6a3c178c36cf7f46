"""Every JSON-schema keyword honoured or refused (issue 55), through a real `mbolt serve` and the
official `openai` and `anthropic` clients.

The battery: 32 schemas, 20 replies each at temperature 1, every reply validated by `jsonschema`
(formats by its format checker). The model is test_serve's tiny random-weight qwen3moe with the
synthetic byte-level vocabulary (262 tokens: llama.cpp's grammar sampler checks every token of the
vocabulary at every step, 40-70 ms a step for a real 151k-token vocabulary on a busy 2-core machine) and Qwen2.5's
chat template; its random weights write any bytes the grammar lets through, which is the harshest
test a grammar can get. Strings in the battery are bounded (maxLength, pattern, format, enum): a
random model never closes a free string, nor ends an additional property's key (those keys are
judged in test_schema_grammar.py). Refusals: every keyword the grammar does not honour is a 400 that names
it and where it is, in both APIs' JSON-output and tool paths.
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import needs_llama
from test_serve import CHAT_MODEL, KEY, Server

pytestmark = needs_llama
QWEN25 = Path(__file__).parent / "data" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
ASK = [{"role": "user", "content": "Reply in JSON."}]
S = lambda n=6: {"type": "string", "maxLength": n}  # noqa: E731

BATTERY = [
    {"type": "integer", "minimum": 0, "maximum": 150},  # the issue's example
    {"type": "integer", "minimum": -40, "maximum": -3},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "integer", "minimum": 1000},
    {"type": "integer", "maximum": -9999},
    {"type": "integer", "minimum": 2.5, "maximum": 7.5},
    {"type": ["integer", "null"], "minimum": 5, "maximum": 9},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"},
    {"type": "string", "pattern": r"^(cat|dog)s?$"},
    {"type": "string", "pattern": r'^a"b\\c$'},
    {"type": "string", "pattern": r"^[^a-z]{1,4}\.x?$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"enum": ["red", "green", 3, None, [1, 2]]},
    {"const": {"k": [True, 1.5]}},
    {"type": "string", "enum": ["a", "b", 7]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"const": "x"}]},
    {"type": "object", "properties": {"name": S(), "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": S(3)}, "required": ["b"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                      "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"], "additionalProperties": False}},
     "required": ["id", "meta"], "additionalProperties": False},
    {"type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"},
                                      "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}},
     "required": ["pet"], "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                            "required": ["kind"], "additionalProperties": False}}},
    {"type": "object", "properties": {"v": {"$ref": "#/definitions/small"}}, "required": ["v"],
     "definitions": {"small": {"type": "integer", "minimum": -2, "maximum": 2}}},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "format": "date"},
               {"type": "null"}]},
    {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}, "x": {"type": "integer", "maximum": 0}},
                "required": ["t", "x"], "additionalProperties": False},
               {"type": "object", "properties": {"t": {"const": "b"}, "y": {"type": "boolean"}},
                "required": ["t", "y"], "additionalProperties": False}]},
    {"oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 10, "maximum": 20}]},
    {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer", "minimum": 3, "maximum": 4}},
                                          "required": ["b"]}],
     "$defs": {"base": {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}}},
    {"title": "Annotated", "description": "annotations constrain nothing", "$schema":
     "https://json-schema.org/draft/2020-12/schema", "$comment": "x", "type": "object",
     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3, "default": 1, "examples": [2],
                          "description": "a small number", "deprecated": False}}, "required": ["n"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                                      "score": {"type": "number"}}, "required": ["when", "tags"]},
]


def byte_chat_model(tmp: Path) -> Path:
    """test_serve's model with the synthetic byte-level vocabulary and Qwen2.5's chat template
    (a header of the vocabulary's tokenizer entries and the template, borrowed by synth)."""
    from gguf import GGUFValueType

    from mbolt.core.header import encode_header_start, encode_kv, read_header
    from mbolt.synth.synth import write_synth

    plain = tmp / "bytes.gguf"
    write_synth(plain, CHAT_MODEL)
    h, raw = read_header(plain), plain.read_bytes()
    kvs = [raw[kv.span[0]:kv.span[1]] for k, kv in h.kv.items() if k.startswith("tokenizer.")]
    kvs.append(encode_kv("tokenizer.chat_template", GGUFValueType.STRING, QWEN25.read_text()))
    vocab = tmp / "bytes-vocab.gguf"
    vocab.write_bytes(encode_header_start(0, len(kvs)) + b"".join(kvs))
    model = tmp / "bytes-chat.gguf"
    write_synth(model, dataclasses.replace(CHAT_MODEL, vocab=str(vocab)))
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keywords")
    # one llama.cpp thread: this model's steps are too small to share, and spinning threads on a busy
    # machine took 100x longer
    s = Server(byte_chat_model(tmp), tmp, "--parallel", "4", "--queue", "16", "--threads", "1")
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def _validate(value, schema):
    import jsonschema

    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_battery_every_reply_validates(server):
    """32 schemas x 20 replies at temperature 1 through the openai client, 4 at a time."""
    import jsonschema

    assert len(BATTERY) >= 30
    for schema in BATTERY:  # the battery itself is made of valid schemas
        jsonschema.Draft202012Validator.check_schema(schema)
    c = server.client(timeout=120)

    def reply(args):
        i, seed = args
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": BATTERY[i], "strict": True}}
        r = c.chat.completions.create(model="m", messages=ASK, max_tokens=160, temperature=1.0, seed=seed,
                                      response_format=fmt)
        return i, seed, r.choices[0].finish_reason, r.choices[0].message.content

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(reply, [(i, seed) for i in range(len(BATTERY)) for seed in range(20)]))
    seconds = time.monotonic() - t0
    bad = []
    for i, seed, finish, content in replies:
        try:
            assert finish == "stop", f"finish_reason {finish}"
            _validate(json.loads(content), BATTERY[i])
        except Exception as e:  # all of them, then one assertion that shows each
            bad.append(f"schema {i} seed {seed}: {content!r}: {str(e).splitlines()[0]}")
    print(f"\n{len(replies)} replies in {seconds:.1f} s")
    assert not bad, "\n".join(bad)


def test_anthropic_output_config_format_validates(server):
    import anthropic

    c = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    schema = BATTERY[21]
    for seed in range(3):
        m = c.messages.create(model="m", max_tokens=160, messages=ASK,  # 2.x clients take no temperature
                              extra_body={"temperature": 1.0,
                                          "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        assert m.stop_reason == "end_turn"
        _validate(json.loads(m.content[0].text), schema)


def test_forced_tool_call_honours_integer_ranges(server):
    """A tool's parameters go through the same converter: a forced call's arguments validate."""
    params = BATTERY[21]
    tools = [{"type": "function", "function": {"name": "person", "parameters": params}}]
    c = server.client()
    for seed in range(3):
        r = c.chat.completions.create(model="m", messages=ASK, tools=tools, max_tokens=160, temperature=1.0,
                                      seed=seed, tool_choice={"type": "function", "function": {"name": "person"}})
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "person"
        _validate(json.loads(calls[0].function.arguments), params)


# ---- refused: (schema, the keyword named, the JSON pointer named) ----

REFUSED = [
    ({"type": "integer", "multipleOf": 5}, "multipleOf", "#"),
    ({"type": "number", "minimum": 0}, "minimum", "#"),
    ({"type": "number", "exclusiveMaximum": 1.5}, "exclusiveMaximum", "#"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems", "#"),
    ({"type": "array", "contains": {"const": 1}}, "contains", "#"),
    ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "patternProperties", "#"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {}}, "if", "#"),
    ({"not": {"type": "string"}}, "not", "#"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "#"),
    ({"type": "object", "minProperties": 1}, "minProperties", "#"),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "email"}}}, "format", "#/properties/when"),
    ({"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string", "format": "uri"}}}},
     "format", "#/properties/x/items"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required", "#"),
    ({"type": "string", "pattern": "^a$", "maxLength": 3}, "maxLength", "#"),
    ({"type": "string", "pattern": r"^(?=a)\w+$"}, "pattern", "#"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, "oneOf", "#"),
    ({"type": "object", "properties": {"v": {"$ref": "https://example.com/s.json"}}}, "$ref", "#/properties/v"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames", "#"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, "prefixItems", "#"),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "#"),
    ({"$defs": {"a": {"type": "string", "maxContains": 2}}, "$ref": "#/$defs/a"}, "maxContains", "#/$defs/a"),
]


@pytest.mark.parametrize("schema,keyword,path", REFUSED)
def test_openai_refuses_with_the_keyword_and_where(server, schema, keyword, path):
    import openai

    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=ASK, max_tokens=8, response_format=fmt)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "response_format", err
    assert f"'{keyword}' at {path}" in err["message"] and "response_format.json_schema.schema" in err["message"], err
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "arg": schema}}}}]
    with pytest.raises(openai.BadRequestError) as e:  # tool_choice auto: the tools are checked all the same
        c.chat.completions.create(model="m", messages=ASK, max_tokens=8, tools=tools)
    err = e.value.body
    inner = "#/properties/arg" + path[1:]
    assert err["param"] == "tools" and f"'{keyword}' at {inner}" in err["message"], err
    assert "tools[0].function.parameters" in err["message"], err


@pytest.mark.parametrize("schema,keyword,path", REFUSED)
def test_anthropic_refuses_with_the_keyword_and_where(server, schema, keyword, path):
    import anthropic

    c = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"arg": schema}}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="m", max_tokens=8, messages=ASK, tools=[tool])
    inner = "#/properties/arg" + path[1:]
    msg = e.value.body["error"]["message"]
    assert e.value.status_code == 400 and f"'{keyword}' at {inner}" in msg and "tools.0.input_schema" in msg, msg
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="m", max_tokens=8, messages=ASK,
                          extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    msg = e.value.body["error"]["message"]
    assert f"'{keyword}' at {path}" in msg and "output_config.format.schema" in msg, msg


def test_annotations_are_accepted(server):
    schema = {"title": "T", "description": "d", "$comment": "c", "examples": [{}], "default": {}, "type": "object",
              "properties": {"a": {"type": "boolean", "title": "A", "readOnly": True, "writeOnly": False}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = server.client().chat.completions.create(model="m", messages=ASK, max_tokens=64, response_format=fmt)
    assert r.choices[0].finish_reason in ("stop", "length")
