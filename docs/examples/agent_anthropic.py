"""A small agent against `mbolt serve`: Anthropic's own client, one tool, the loop every agent runs.

    mbolt serve model.gguf --api-key KEY &
    python docs/examples/agent_anthropic.py --base-url http://127.0.0.1:8080 --api-key KEY

The model gets a question and a `get_weather` tool. Each turn: send the conversation; if the reply
stops with `tool_use`, run the tool and send its result back as a `tool_result` block; when it
answers in text, print it and stop. `--tool-choice any` makes the first turn call a tool
(mbolt constrains the reply with a grammar: with a small or random-weight model, the call is
still a well-formed call of the tool's schema); later turns are `auto`.
"""

from __future__ import annotations

import argparse
import json

import anthropic

TOOLS = [{
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]},
}]


def get_weather(city: str, unit: str = "celsius") -> dict:
    """The tool itself (a real agent would call a weather service here)."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "clear"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--question", default="What is the weather in Oslo right now?")
    ap.add_argument("--tool-choice", choices=["auto", "any"], default="auto", help="the first turn's tool_choice")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()

    client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key)
    messages = [{"role": "user", "content": a.question}]
    choice = {"type": a.tool_choice}
    for _ in range(a.max_turns):
        reply = client.messages.create(model="mbolt", max_tokens=a.max_tokens, tools=TOOLS, tool_choice=choice,
                                       messages=messages)
        choice = {"type": "auto"}
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if reply.stop_reason != "tool_use" or not uses:
            print("reply:", "".join(b.text for b in reply.content if b.type == "text"))
            return 0
        results = []
        for use in uses:
            print(f"tool call: {use.name}({json.dumps(use.input)})")
            result = get_weather(**use.input) if use.name == "get_weather" else {"error": f"no tool {use.name}"}
            print("tool result:", json.dumps(result))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(result)})
        messages.append({"role": "user", "content": results})
    print("reply: (no answer within", a.max_turns, "turns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
