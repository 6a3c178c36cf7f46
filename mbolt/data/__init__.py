"""Files shipped with mbolt (README.md here gives each one's source, commit and licence)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
GRANITE_TRACE = "granite3moe.trace.txt"
PROMPTS = "prompts.jsonl"


def path(name: str) -> Path:
    return HERE / name
