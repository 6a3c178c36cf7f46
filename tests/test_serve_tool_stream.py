"""Tool calls streamed as llama-server streams them (issue 55, part 3), driven by the official
`openai` and `anthropic` clients against a real `mbolt serve` on a tiny synthetic model.

The model's free text is gibberish, so every call here is forced (tool_choice named) and decoded
greedily (temperature 0): the grammar makes the reply a call, and two requests with the same
prompt write the same tokens, so a streamed reply can be checked against a non-streamed one.

What llama-server does, read in its code (llama.cpp 0c1e570, vendored by llama-cpp-python 0.3.36):
- streaming: `task_result_state::update_chat_msg` re-parses the reply after each token and sends
  the diff (`common_chat_msg_diff::compute_diffs`): a call's id and name once the parser has read
  the whole name, then its arguments as the model writes them;
- a reply that runs into max_tokens (`STOP_TYPE_LIMIT`) ends with finish_reason "length" /
  stop_reason "max_tokens" even when it holds a call (`to_json_oaicompat_chat`,
  `to_json_anthropic`); its final parse is lenient (`common_chat_peg_parse`, flags LENIENT), so
  a call cut after its name is kept with the arguments written so far (test-chat.cpp's
  `message_assist_call_cutoff_args`: `{"arg`), Anthropic's input is {} when they do not parse,
  and a block cut before its name is whole is neither content nor a call (the name is `atomic`).
"""

from __future__ import annotations

import json

import pytest

from conftest import needs_llama
from test_serve import KEY, Server
from test_serve_api import A_TOOLS, ASK, TOOLS, WEATHER, tool_model  # noqa: F401  (a fixture)

NAMED = {"type": "function", "function": {"name": "get_weather"}}
A_NAMED = {"type": "tool", "name": "get_weather"}
GREEDY = {"temperature": 0}  # the 2.x anthropic client has no temperature argument: sent in the body


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):  # noqa: F811
    s = Server(tool_model, tmp_path_factory.mktemp("served"))
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def _anthropic(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)


def _openai_whole(server, max_tokens: int):
    r = server.client().chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                max_tokens=max_tokens, temperature=0)
    return r.choices[0]


def _openai_stream(server, max_tokens: int):
    """The chunks' deltas in order: ("content", text) | ("call", delta) for each tool_calls delta;
    and the finish_reason."""
    seen, finish = [], None
    for ch in server.client().chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                      max_tokens=max_tokens, temperature=0, stream=True):
        for choice in ch.choices:
            if choice.delta.content:
                seen.append(("content", choice.delta.content))
            for d in choice.delta.tool_calls or []:
                seen.append(("call", d))
            finish = choice.finish_reason or finish
    return seen, finish


def _anthropic_events(server, max_tokens: int) -> list:
    with _anthropic(server).messages.create(model="m", max_tokens=max_tokens, messages=ASK, tools=A_TOOLS,
                                            tool_choice=A_NAMED, extra_body=GREEDY, stream=True) as events:
        return list(events)


def _json_or_none(s: str):
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None


@needs_llama
def test_openai_streams_the_name_first_then_the_arguments_in_pieces(server):
    whole = _openai_whole(server, 64)
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    want = whole.message.tool_calls[0].function.arguments
    seen, finish = _openai_stream(server, 64)
    assert finish == "tool_calls" and not [d for k, d in seen if k == "content"]
    deltas = [d for k, d in seen if k == "call"]
    first = deltas[0]  # the name (with id and type) before any of the arguments
    assert first.index == 0 and first.function.name == "get_weather" and first.type == "function"
    assert first.id and not first.function.arguments
    rest = deltas[1:]
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    pieces = [d.function.arguments for d in rest]
    assert len(pieces) > 1 and all(pieces)  # written as generated, not in one piece
    assert json.loads("".join(pieces)) == json.loads(want)
    assert "".join(pieces) == want  # the model's own text, both ways
    WEATHER_KEYS = set(WEATHER["properties"])
    assert set(json.loads(want)) <= WEATHER_KEYS


@needs_llama
def test_anthropic_streams_a_tool_use_block_then_input_json_deltas(server):
    whole = _anthropic(server).messages.create(model="m", max_tokens=64, messages=ASK, tools=A_TOOLS,
                                               tool_choice=A_NAMED, extra_body=GREEDY)
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and len(uses) == 1 and [b.type for b in whole.content] == ["tool_use"]
    events = _anthropic_events(server, 64)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert start.content_block.input == {} and start.content_block.id.startswith("toolu_")
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" and e.index == start.index for e in deltas)
    pieces = [e.delta.partial_json for e in deltas]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == uses[0].input
    stop = [e for e in events if e.type == "content_block_stop"]
    assert [e.index for e in stop] == [start.index] and kinds.index("content_block_stop") > kinds.index(
        "content_block_delta")
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "tool_use"


def _cut_inside_the_arguments(server) -> tuple[int, str]:
    """A max_tokens that ends the reply after the call's name and inside its arguments (found by
    cutting the whole reply's tokens one at a time from its end), and the whole arguments."""
    whole = _openai_whole(server, 64)
    full = whole.message.tool_calls[0].function.arguments
    n = server.client().chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                max_tokens=64, temperature=0).usage.completion_tokens
    for m in range(n - 1, 0, -1):
        c = _openai_whole(server, m)
        calls = c.message.tool_calls or []
        if calls and _json_or_none(calls[0].function.arguments) is None and len(calls[0].function.arguments) > 1:
            return m, full
    raise AssertionError("no max_tokens cuts this call inside its arguments")


@needs_llama
def test_a_call_cut_by_max_tokens_ends_as_llama_server_ends_it(server):
    m, full = _cut_inside_the_arguments(server)
    # OpenAI, whole: the call with the arguments written so far, finish_reason length, no content
    c = _openai_whole(server, m)
    assert c.finish_reason == "length" and not c.message.content
    (call,) = c.message.tool_calls
    cut = call.function.arguments
    assert call.function.name == "get_weather" and full.startswith(cut) and len(cut) < len(full)
    # OpenAI, streamed: the same deltas as a whole call up to the cut, then length
    seen, finish = _openai_stream(server, m)
    assert finish == "length" and not [d for k, d in seen if k == "content"]
    deltas = [d for k, d in seen if k == "call"]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == cut
    # Anthropic, whole: max_tokens, the tool_use block with input {} (its JSON is not whole)
    msg = _anthropic(server).messages.create(model="m", max_tokens=m, messages=ASK, tools=A_TOOLS,
                                             tool_choice=A_NAMED, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].name == "get_weather" and msg.content[0].input == {}
    # Anthropic, streamed: the block opened, the input written so far, the block closed, max_tokens
    events = _anthropic_events(server, m)
    kinds = [e.type for e in events]
    assert kinds.count("content_block_start") == 1 and kinds.count("content_block_stop") == 1
    assert "".join(e.delta.partial_json for e in events if e.type == "content_block_delta") == cut
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "max_tokens"


@needs_llama
def test_a_call_cut_before_its_name_is_whole_is_neither_text_nor_a_call(server):
    """`<tool` (this vocabulary spells the tag in pieces) at the limit: llama-server's content ends
    where a partial `<tool_call>` begins (`until` in common/peg-parser.cpp) and it has no call
    without a whole name, so the reply is empty."""
    c = _openai_whole(server, 3)
    assert c.finish_reason == "length" and not c.message.content and not c.message.tool_calls
    seen, finish = _openai_stream(server, 3)
    assert finish == "length" and seen == []
    msg = _anthropic(server).messages.create(model="m", max_tokens=3, messages=ASK, tools=A_TOOLS,
                                             tool_choice=A_NAMED, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.content == []


# ---- the parser alone ----


def _feed(stream, text: str, cut: bool = False) -> list:
    out = []
    for ch in text:  # a character at a time: the smallest pieces a model can write
        out += stream.feed(ch)
    return out + stream.finish(cut=cut)


def test_a_hermes_call_streams_from_its_name_with_the_models_own_argument_text():
    from mbolt.serve.tools import HERMES, ToolStream

    args = '{"city": "Os\\"lo}", "n": [1,{"a":2}]}'  # a quote and brackets inside a string
    out = _feed(ToolStream(HERMES, {"get_weather"}), f'hi <tool_call>\n{{"name": "get_weather", "arguments": {args}}}'
                f'\n</tool_call>\nbye')
    kinds = [k for k, _ in out]
    assert kinds.index("start") < kinds.index("args") < kinds.index("end")
    assert out[kinds.index("start")][1].name == "get_weather"
    assert "".join(d for k, d in out if k == "args") == args and out[kinds.index("end")][1].arguments == args
    assert "".join(d for k, d in out if k == "text") == "hi bye"


def test_cut_calls_in_the_parser():
    from mbolt.serve.tools import HERMES, ToolStream, parse_reply

    names = {"get_weather"}
    out = _feed(ToolStream(HERMES, names), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', cut=True)
    assert [k for k, _ in out if k != "args"] == ["start", "end"] and out[-1][1].arguments == '{"city": "Os'
    assert out[-1][1].input == {}  # what Anthropic's tool_use carries for arguments that are not JSON
    for cut in ('ok <tool_call>\n{"name": "get_wea', "ok <tool_c"):  # no name yet: neither text nor a call
        assert "".join(d for k, d in _feed(ToolStream(HERMES, names), cut, cut=True)) == "ok "
    # ended by the model (not the limit) before the name: the text stays text, as before
    assert parse_reply('<tool_call>\n{"name": "get_wea', HERMES, names) == ('<tool_call>\n{"name": "get_wea', [])
    # a block that does not begin like a call is judged whole at its end, as before
    text, calls = parse_reply('<tool_call>{"arguments": {"city": "Lima"}, "name": "get_weather"}</tool_call>',
                              HERMES, names)
    assert text == "" and calls[0].input == {"city": "Lima"}
