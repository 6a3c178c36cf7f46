"""A small agent against `mbolt serve`: Anthropic's own client, three tools, a long system prompt,
and the loop every agent runs.

    mbolt serve model.gguf --prompt-cache ~/.cache/mbolt/prompts --api-key KEY &
    python docs/examples/agent_anthropic.py --base-url http://127.0.0.1:8080 --api-key KEY

Like a coding agent, it sends the same long prefix with every request: a system prompt of about
`--system-tokens` tokens (house rules, then a knowledge base of notes the `search_notes` tool also
reads) and three tool schemas. Each turn: send the conversation; if the reply stops with
`tool_use`, run the tools and send their results back as `tool_result` blocks; when it answers in
text, print it and stop. `--tool-choice any` makes the first turn call a tool (mbolt constrains the
reply with a grammar: with a small or random-weight model, the call is still a well-formed call of
the tool's schema); later turns are `auto`. `--temperature 0` decodes greedily: the same replies
every run (what the tests run; sampled, a random-weight model may chain calls past `--max-tokens`).

Each turn prints `usage.cache_read_input_tokens`: the prompt tokens the server did not evaluate
again. With `--prompt-cache` the prefix is kept on disk, so a second run of this agent, even after
the server restarts, starts from it. `--json` prints the turns as JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
from pathlib import Path

import anthropic

TOOLS = [
    {"name": "get_weather",
     "description": "The current weather in a city.",
     "input_schema": {"type": "object", "properties": {
         "city": {"type": "string", "description": "The city's name", "maxLength": 24},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "unit"]}},
    {"name": "search_notes",
     "description": "Search the knowledge base of the system prompt; returns the notes that contain every word.",
     "input_schema": {"type": "object", "properties": {
         "query": {"type": "string", "minLength": 1, "maxLength": 40},
         "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
         "required": ["query"]}},
    {"name": "calculate",
     "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
     "input_schema": {"type": "object", "properties": {
         "expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}},
         "required": ["expression"]}},
]

RULES = """You are a careful assistant working for a small team. Answer briefly. Use a tool when the
answer depends on something you cannot know: the weather (get_weather), the team's notes
(search_notes), or arithmetic (calculate). Never guess a number a tool can give you. When a tool
fails, say so and stop. The notes below are the team's knowledge base, one per line."""


def knowledge_base() -> list[str]:
    """Notes for the system prompt and `search_notes`: the prompts mbolt ships (Dolly and CodeAlpaca,
    mbolt/data/prompts.jsonl; MIT, see mbolt/data/README.md)."""
    path = Path(__file__).resolve().parents[2] / "mbolt" / "data" / "prompts.jsonl"
    return [json.loads(line)["prompt"].replace("\n", " ") for line in path.read_text().splitlines() if line.strip()]


def system_prompt(tokens: int) -> str:
    """The rules, then numbered notes up to about `tokens` tokens (4 characters a token)."""
    out, size = [RULES, ""], len(RULES)
    for i, note in enumerate(knowledge_base()):
        line = f"[{i}] {note}"
        if size + len(line) > 4 * tokens:
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def get_weather(city: str, unit: str = "celsius") -> dict:
    """The tool itself (a real agent would call a weather service here)."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "clear"}


def search_notes(query: str, limit: int = 3) -> dict:
    words = query.lower().split()
    hits = [n for n in knowledge_base() if all(w in n.lower() for w in words)]
    return {"query": query, "notes": hits[:limit], "found": len(hits)}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> dict:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        return {"expression": expression, "value": ev(ast.parse(expression, mode="eval").body)}
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return {"expression": expression, "error": str(e) or type(e).__name__}


RUN = {"get_weather": get_weather, "search_notes": search_notes, "calculate": calculate}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--question", default="What is the weather in Oslo right now?")
    ap.add_argument("--system-tokens", type=int, default=8000, help="the system prompt's length, about")
    ap.add_argument("--tool-choice", choices=["auto", "any"], default="auto", help="the first turn's tool_choice")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy); "
                    "default: the server's")
    ap.add_argument("--json", action="store_true", help="print the turns as JSON")
    a = ap.parse_args()

    client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key)
    system = system_prompt(a.system_tokens)
    messages = [{"role": "user", "content": a.question}]
    choice = {"type": a.tool_choice}
    # the Messages API's temperature, which the 2.x client no longer takes as a parameter
    sampling = {} if a.temperature is None else {"extra_body": {"temperature": a.temperature}}
    turns = []
    for _ in range(a.max_turns):
        reply = client.messages.create(model="mbolt", max_tokens=a.max_tokens, system=system, tools=TOOLS,
                                       tool_choice=choice, messages=messages, **sampling)
        choice = {"type": "auto"}
        u = reply.usage
        turns.append({"input_tokens": u.input_tokens, "cache_read_input_tokens": u.cache_read_input_tokens or 0,
                      "output_tokens": u.output_tokens, "stop_reason": reply.stop_reason,
                      "calls": [{"name": b.name, "input": b.input} for b in reply.content if b.type == "tool_use"]})
        if not a.json:
            print(f"turn {len(turns)}: {u.input_tokens} prompt tokens, {u.cache_read_input_tokens or 0} from the "
                  f"cache, {u.output_tokens} generated")
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if reply.stop_reason != "tool_use" or not uses:
            text = "".join(b.text for b in reply.content if b.type == "text")
            if not a.json:
                print("reply:", text)
            break
        results = []
        for use in uses:
            run = RUN.get(use.name)
            try:  # under tool_choice auto the arguments are the model's own: they may not fit the tool
                result = run(**use.input) if run else {"error": f"no tool {use.name}"}
            except TypeError as e:
                result = {"error": str(e)}
            if not a.json:
                print(f"tool call: {use.name}({json.dumps(use.input)})")
                print("tool result:", json.dumps(result))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(result)})
        messages.append({"role": "user", "content": results})
    else:
        if not a.json:
            print("reply: (no answer within", a.max_turns, "turns)")
    if a.json:
        print(json.dumps({"system_chars": len(system), "turns": turns}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
