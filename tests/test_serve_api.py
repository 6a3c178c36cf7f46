"""`mbolt serve`'s APIs for agents (issue 34): tools, JSON output, every field honoured or refused,
the Anthropic Messages API, the key and /metrics; driven by the official `openai` and
`anthropic` clients against a real server process.

The model is a tiny random-weight qwen3moe with llama.cpp's Qwen2 test vocabulary and Qwen2.5's
real chat template (tests/data/chat_templates, from llama.cpp's models/templates), which renders
tools, assistant tool calls and tool results. Its free text is gibberish, so what is asserted on
content comes from grammar-constrained output (a forced tool call, a JSON schema) or is shape:
the parsed call's name and arguments validated (jsonschema) against the tool's schema, the prompt
a tool result makes compared with the template rendered by jinja2 here and tokenized by
llama.cpp, status codes and error shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import needs_llama, require_vocab
from test_serve import KEY, VOCAB, Server, llama_tokens, write_chat_model

pytestmark = needs_llama
ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
QWEN25 = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
LLAMA31 = TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _with_template(vocab: Path, template: str, dest: Path) -> Path:
    """A copy of a vocabulary GGUF (no tensors) whose tokenizer.chat_template is `template`."""
    from gguf import GGUFValueType

    from mbolt.core.header import encode_kv, read_header

    h = read_header(vocab)
    a, b = h.kv["tokenizer.chat_template"].span
    raw = vocab.read_bytes()
    dest.write_bytes(raw[:a] + encode_kv("tokenizer.chat_template", GGUFValueType.STRING, template) + raw[b:])
    return dest


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    require_vocab(VOCAB)
    tmp = tmp_path_factory.mktemp("tools")
    vocab = _with_template(VOCAB, QWEN25.read_text(), tmp / "vocab.gguf")
    return write_chat_model(tmp / "tools.gguf", vocab)


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    s = Server(tool_model, tmp_path_factory.mktemp("served"))
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def _post(server, path, body: dict, headers: dict):
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _templated_ids(model, messages, tools) -> list[int]:
    """The conversation through the GGUF's template, rendered here with jinja2 (transformers'
    settings: trim_blocks, lstrip_blocks, tojson as json.dumps) and tokenized by llama.cpp."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    text = env.from_string(QWEN25.read_text()).render(messages=messages, tools=tools, add_generation_prompt=True)
    return llama_tokens(model, text)


def _check_call(name, arguments: str, tools=TOOLS):
    import jsonschema

    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


# ---- OpenAI ----


def _openai_call(c, stream: bool, **kw):
    """One chat request; returns (content, [(id, name, arguments)], finish_reason)."""
    if not stream:
        r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=160, **kw)
        m = r.choices[0].message
        return m.content, [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []], \
            r.choices[0].finish_reason
    text, calls, finish = [], {}, None
    for ch in c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=160, stream=True, **kw):
        for choice in ch.choices:
            text.append(choice.delta.content or "")
            for d in choice.delta.tool_calls or []:
                if d.id:  # the first delta of a call: index, id, name
                    assert d.index not in calls and d.function.name and d.type == "function"
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(text), [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_call_round_trip(server, tool_model, stream):
    c = server.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = _openai_call(c, stream, tool_choice=choice)
    assert finish == "tool_calls" and len(calls) >= 1 and not (content or "").strip()
    for cid, name, args in calls:
        assert cid.startswith("call_") and name == "get_weather"
        _check_call(name, args)
    # the result goes back through the template: the prompt is the template's rendering of it
    cid, name, args = calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": cid, "content": '{"temperature": 21}'}]
    r = c.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=6,
                                  temperature=0, extra_body={"return_tokens": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    want = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.loads(args)}}]},
        {"role": "tool", "content": '{"temperature": 21}'}]
    assert r.model_dump()["prompt_tokens"] == _templated_ids(tool_model, want, None)


def test_openai_required_gives_one_call_of_an_offered_tool(server):
    c = server.client()
    for stream in (False, True):
        content, calls, finish = _openai_call(c, stream, tool_choice="required", parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0][1] in ("get_weather", "get_time")
        _check_call(calls[0][1], calls[0][2])


def test_tools_reach_the_model_through_its_template(server, tool_model):
    r = server.client().chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1,
                                                extra_body={"return_tokens": True})
    assert r.model_dump()["prompt_tokens"] == _templated_ids(tool_model, ASK, TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")  # free text: shape only


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}


def test_json_schema_output_validates_every_time(server):
    import jsonschema

    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        r = c.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=1.0, seed=seed,
                                      response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"


def test_json_object_output_is_an_object(server):
    r = server.client().chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0.5, seed=1,
                                                response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # the grammar ended it (a long object may run out of tokens)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


CHAT_REFUSED = [("logprobs", True), ("top_logprobs", 2), ("logit_bias", {"11": 5}), ("audio", {"voice": "x"}),
                ("functions", [{"name": "f"}]), ("n", 2), ("reasoning_effort", "high"), ("prediction", {"x": 1}),
                ("web_search_options", {}), ("store", True), ("modalities", ["text", "audio"]), ("frobnicate", 1),
                ("response_format", {"type": "xml"}), ("tools", [{"type": "custom", "custom": {"name": "x"}}]),
                ("tool_choice", "required"), ("parallel_tool_calls", "yes")]


@pytest.mark.parametrize("field, value", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_unsupported_chat_fields_are_400_naming_them(server, field, value):
    status, body = _post(server, "/v1/chat/completions", {"messages": ASK, field: value},
                         {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["param"] == field and body["error"]["message"], body


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("echo", True), ("logprobs", 1), ("best_of", 2),
                                          ("tools", [])])
def test_unsupported_completion_fields_are_400_naming_them(server, field, value):
    status, body = _post(server, "/v1/completions", {"prompt": "hi", field: value}, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["param"] == field, body


def test_fields_that_ask_for_nothing_are_accepted(server):
    r = server.client().chat.completions.create(model="m", messages=ASK, max_tokens=2, logprobs=False, store=False,
                                                user="u1", metadata={"k": "v"}, service_tier="auto", n=1)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_role_openai_does_not_define_is_400(server):
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "root", "content": "obey"}]},
                         {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["param"] == "messages" and "root" in body["error"]["message"]


# ---- the key and /metrics ----


def test_the_key_and_metrics(server):
    assert server.request("GET", "/metrics", key=None)[0] == 401
    assert server.request("GET", "/favicon.ico", key=None)[0] == 204
    status, body = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2}, {"x-api-key": KEY})
    assert status == 200 and body["object"] == "chat.completion"
    assert _post(server, "/v1/chat/completions", {"messages": ASK}, {"x-api-key": "nope"})[0] == 401
    status, body = _post(server, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": ASK}, {"x-api-key": "no"})
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, body = _post(server, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": ASK},
                         {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["type"] == "message"
    req = urllib.request.Request(server.base + "/metrics", headers={"x-api-key": KEY})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("mbolt_budget_bytes", "mbolt_decode_tokens", "mbolt_requests", "mbolt_queue_length"):
        assert name in fams, sorted(fams)
    ttft = {s.name: s.value for s in fams["mbolt_time_to_first_token_seconds"].samples}
    assert fams["mbolt_time_to_first_token_seconds"].type == "histogram"
    assert ttft["mbolt_time_to_first_token_seconds_count"] >= 2 and ttft["mbolt_time_to_first_token_seconds_sum"] > 0
    assert fams["mbolt_time_per_output_token_seconds"].type == "histogram"


# ---- Anthropic ----


def _anthropic(server, **kw):
    import anthropic

    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, **kw)


A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_round_trip(server, stream):
    import jsonschema

    c = _anthropic(server)
    # room for the whole call at any temperature (a call cut by max_tokens ends max_tokens, as llama-server's)
    kw = dict(model="m", max_tokens=160, messages=ASK, tools=A_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        kinds = []
        with c.messages.stream(**kw) as s:
            for ev in s:
                kinds.append(ev.type if ev.type != "content_block_delta" else ev.delta.type)
            msg = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert {"content_block_start", "input_json_delta", "content_block_stop", "message_delta"} <= set(kinds)
    else:
        msg = c.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    follow = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": "21 degrees"}]}]
    reply = c.messages.create(model="m", max_tokens=8, messages=follow, tools=A_TOOLS)
    assert reply.role == "assistant" and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # Anthropic's count: the prompt is input_tokens + cache_read_input_tokens (the first turn's prefix reused)
    prompt = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    assert prompt > msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    n = c.messages.count_tokens(model="m", messages=follow, tools=A_TOOLS).input_tokens
    assert n == prompt


def test_anthropic_text_stop_sequence_and_system(server):
    """A forced call's grammar makes the reply begin `<tool_call>\\n{`, then `"name"`: a stop
    sequence on `"name"` stops it there; what came before stays text (not a valid call)."""
    c = _anthropic(server)
    msg = c.messages.create(model="m", max_tokens=32, messages=ASK, tools=A_TOOLS, system="Be brief.",
                            tool_choice={"type": "any"}, stop_sequences=['"name"'],
                            extra_body={"temperature": 0.7, "top_k": 20})  # the 2.x client no longer sends them
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == '"name"'
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text.rstrip() == "<tool_call>\n{"
    plain = c.messages.create(model="m", max_tokens=3, system=[{"type": "text", "text": "Be brief."}], messages=ASK)
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.usage.output_tokens <= 3
    with c.messages.stream(model="m", max_tokens=3, messages=ASK) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text")


@pytest.mark.parametrize("body, what", [
    ({"model": "m", "messages": ASK}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": ASK, "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "root", "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
    ({"model": "m", "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools"),
])
def test_anthropic_bad_requests_are_400_in_anthropics_shape(server, body, what):
    status, got = _post(server, "/v1/messages", body, {"x-api-key": KEY})
    assert status == 400 and got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert what in got["error"]["message"]


def test_the_agent_example_runs(server):
    # greedy: sampled, this random-weight model may chain parallel calls past --max-tokens (the
    # grammar allows any number), and the first turn would end cut, with no call to run
    p = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "agent_anthropic.py"), "--base-url",
                        server.base, "--api-key", KEY, "--tool-choice", "any", "--max-turns", "2", "--max-tokens", "200",
                        "--system-tokens", "150", "--temperature", "0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "tool call: " in p.stdout and "tool result:" in p.stdout and "reply:" in p.stdout
    assert "from the cache" in p.stdout  # each turn's usage.cache_read_input_tokens


def test_the_agent_example_starts_from_its_cached_prefix_after_a_restart(tool_model, tmp_path):
    """Issue 55's worked agent: three tools and a long system prompt, run twice against `mbolt serve
    --prompt-cache`, the server restarted in between; the second run's first request evaluates only
    what follows the cached prefix (its last user turn), as each reply's usage says."""
    cache, runs = tmp_path / "cache", []
    for i in range(2):
        (tmp_path / f"s{i}").mkdir()
        srv = Server(tool_model, tmp_path / f"s{i}", "--prompt-cache", str(cache), "-c", "4096")
        try:
            p = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "agent_anthropic.py"), "--base-url",
                                srv.base, "--api-key", KEY, "--tool-choice", "any", "--max-turns", "2",
                                "--max-tokens", "200", "--system-tokens", "1000", "--json", "--temperature", "0"],
                               capture_output=True, text=True, timeout=600)
        finally:
            err = srv.stop()
        assert p.returncode == 0, p.stderr
        assert "Traceback" not in err, err
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, again = runs[0]["turns"][0], runs[1]["turns"][0]
    assert first["cache_read_input_tokens"] == 0 and first["calls"]  # cold, and a call (tool_choice any)
    total = again["input_tokens"] + again["cache_read_input_tokens"]
    assert total == first["input_tokens"]  # the same request
    assert again["cache_read_input_tokens"] > 0.9 * total  # everything up to the question came from the disk
    assert again["input_tokens"] < 40  # the question's own tokens (and the template's around them)


# ---- the parser and the grammar, without a server ----


def test_tool_calls_in_each_family_format_and_text_that_is_not_a_call():
    from mbolt.serve.tools import HERMES, LLAMA3, MISTRAL, ToolStream, parse_reply, tool_format

    names = {"get_weather"}
    assert tool_format(QWEN25.read_text()) == HERMES and tool_format(LLAMA31.read_text()) == LLAMA3
    text, calls = parse_reply('ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                              HERMES, names)
    assert text == "ok " and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    for bad in ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "<tool_call>\n{not json\n</tool_call>",
                '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', "<tool_c"):
        assert parse_reply(bad, HERMES, names) == (bad, [])
    text, calls = parse_reply('{"name": "get_weather", "parameters": {"city": "Lima"}}', LLAMA3, names)
    assert text == "" and json.loads(calls[0].arguments) == {"city": "Lima"}
    assert parse_reply('{"answer": 42}', LLAMA3, names) == ('{"answer": 42}', [])
    text, calls = parse_reply('[TOOL_CALLS][{"name": "get_weather", "arguments": {}}, {"name": "get_weather", '
                              '"arguments": {"city": "Oslo"}}]', MISTRAL, names, parallel=False)
    assert text == "" and len(calls) == 1
    s, out = ToolStream(HERMES, names), []  # one character at a time: text is let out before the call is whole
    for ch in 'hi<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>':
        out += s.feed(ch)
    out += s.finish()
    assert "".join(d for k, d in out if k == "text") == "hi" and [k for k, _ in out][-1] == "end"


def test_the_tool_grammar_takes_only_calls():
    """Each family's call grammar is one llama.cpp's grammar parser takes (what it forces is
    checked on the server: every forced call parses and validates)."""
    from llama_cpp.llama_grammar import LlamaGrammar

    from mbolt.serve.tools import HERMES, LLAMA3, MISTRAL, tool_grammar

    for fmt in (HERMES, LLAMA3, MISTRAL):
        g = tool_grammar(TOOLS, fmt, parallel=True)
        LlamaGrammar.from_string(g, verbose=False)  # llama.cpp parses it
        assert "get_weather" in g and "get_time" in g and "root ::=" in g


def test_llama31_template_renders_a_tool_round_trip():
    """Llama 3.1's real template takes the conversation mbolt builds (arguments as an object,
    no tool_calls key on plain messages) through llama-cpp-python's formatter."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from mbolt.serve.openai_api import messages

    conv = messages({"messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"}]})
    f = Jinja2ChatFormatter(template=LLAMA31.read_text(), eos_token="<|eot_id|>", bos_token="<|begin_of_text|>")
    prompt = f(messages=conv, tools=TOOLS).prompt
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in prompt
    # the template writes a tool result with tojson (a string is iterable): quoted, as in transformers
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"21"<|eot_id|>' in prompt and '"get_time"' in prompt
