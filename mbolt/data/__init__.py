"""Files shipped with mbolt (README.md here gives each one's source, commit and licence)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
GRANITE_TRACE = "granite3moe.trace.txt"
PROMPTS = "prompts.jsonl"


def path(name: str) -> Path:
    return HERE / name
# the original mbolt's co-activation profiles, reduced to 8 layers (README.md)
QWEN3_30B_PROFILE = "coactivation_qwen3-30b-a3b.8layers.json"
QWEN3_NEXT_80B_PROFILE = "coactivation_qwen3-next-80b-a3b.8layers.json"
# BigMoeOnEdge's Qwen3-30B-A3B trace: its LRU hit rates and consecutive overlap (README.md)
QWEN3_30B_REUSE = "reuse_qwen3-30b-a3b.json"
