"""Prompt files: what `trace`, `verify`, `ab --decode` and the demo run.

.jsonl: one JSON object per line with "prompt" (or "text") and an optional "source" (the
domain tag a trace keeps); any other file: one prompt per non-empty line. Errors name the line.
Without a file, commands use BUILTIN_PROMPTS (short, varied, a few dozen tokens each).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mbolt.core.errors import MboltError

BUILTIN_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1905 Einstein published four papers that changed physics.",
    "Mixture-of-experts models route every token to a few experts.",
    "Bonjour, comment allez-vous aujourd'hui ?",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "1 2 3 5 8 13 21 34 55 89",
    "She sells sea shells by the sea shore.",
]


@dataclass
class Prompt:
    text: str
    domain: str
    line: int


def read_prompts(path: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """.jsonl: one JSON object per line with "prompt" (or "text") and optional "source";
    anything else: one prompt per non-empty line. Errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise MboltError(f"{path}: no such prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MboltError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.splitlines()
    out: list[Prompt] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(lines, 1):
            if not line.strip():
                if i == len(lines):
                    continue
                raise MboltError(f"{path}:{i}: empty line (one JSON object per line expected)")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MboltError(f"{path}:{i}: invalid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise MboltError(f"{path}:{i}: invalid JSON (nested too deeply)") from None
            if not isinstance(obj, dict):
                raise MboltError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
            p = obj.get("prompt", obj.get("text"))
            if not isinstance(p, str) or not p:
                raise MboltError(f"{path}:{i}: missing or empty \"prompt\" (or \"text\") field")
            out.append(Prompt(p, str(obj.get("source", "") or ""), i))
            if limit and len(out) >= limit:
                break
    else:
        for i, line in enumerate(lines, 1):
            if line.strip():
                out.append(Prompt(line, "", i))
                if limit and len(out) >= limit:
                    break
    if not out:
        raise MboltError(f"{path}: no prompts in the file")
    return out


def prompt_texts(path: str | os.PathLike | None, n: int | None = None) -> list[str]:
    """The texts of the first `n` prompts of a file, or of BUILTIN_PROMPTS without one."""
    if path is None:
        return BUILTIN_PROMPTS[:n]
    return [p.text for p in read_prompts(path, n)]


def builtin_text() -> str:
    """mbolt/data/kl_text.txt: real text (Dolly and CodeAlpaca passages; see mbolt/data/README.md)."""
    from importlib.resources import files

    return files("mbolt.data").joinpath("kl_text.txt").read_text(encoding="utf-8")


SESSION_FIRST = 100  # sessions read prompts.jsonl from here on: the benchmarks' plans train on its first 24


def session_texts(n: int) -> list[str]:
    """Long texts for teacher-forced sessions (thousands of tokens each): the prompts of
    mbolt/data/prompts.jsonl from SESSION_FIRST on (text no plan was made from), joined with blank
    lines and cut into `n` passages of about equal length at prompt boundaries."""
    from importlib.resources import files

    path = files("mbolt.data").joinpath("prompts.jsonl")
    return _passages([p.text for p in read_prompts(str(path))[SESSION_FIRST:]], n)


def forced_texts(path: str | os.PathLike | None, n: int) -> list[str]:
    """Texts for teacher forcing: the prompts of a file, or the built-in text cut into `n` passages
    of about equal length at paragraph breaks (routing then follows real text)."""
    if path is not None:
        return prompt_texts(path, n)
    return _passages([p for p in builtin_text().split("\n\n") if p.strip()], n)


def _passages(paras: list[str], n: int) -> list[str]:
    """`paras` joined into `n` passages of about equal length (breaks between paragraphs)."""
    size = sum(map(len, paras)) / max(n, 1)
    out, cur = [], ""
    for p in paras:
        cur = f"{cur}\n\n{p}" if cur else p
        if len(cur) >= size and len(out) < n - 1:
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out[:n]
