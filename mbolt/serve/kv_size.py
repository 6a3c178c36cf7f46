"""KV bytes per token: what one token of a prefix costs in the prompt cache's files (and in a
context's KV cache), family by family, from a model's hyperparameters.

llama.cpp's per-sequence state (`llama_state_seq_get_data`) writes, for each cell a sequence holds,
its position, its number of sequences and the sequence's id (12 bytes), then each attention layer's
K row and V row. What grows with the prompt, per family:
- GQA families (qwen3moe, olmoe, mixtral, qwen2moe, glm4moe): every layer, K and V of n_kv_heads x
  head_dim each;
- deepseek2 (MLA): every layer, one row of kv_lora_rank + the rotary dims (the compressed latent;
  no V cache);
- gpt-oss: the full-attention half of the layers; the sliding-window half holds at most its window
  (a constant, not per token);
- qwen3next: one layer in `full_attn_every`; the linear-attention layers keep a recurrent state of
  fixed size per sequence.
tests/test_prompt_cache.py checks each against llama.cpp's own state size of a synthetic model.
"""

from __future__ import annotations

import dataclasses

from mbolt.synth.config import PRESETS, SynthConfig

CELL_META = 12  # per cell: llama_pos, n_seq_id, one llama_seq_id

# Each family at the geometry of a public model: the presets' (HF config.json), and for the two
# families without a preset the model's config.json: Qwen1.5-MoE-A2.7B (24 layers, 16 KV heads of
# 128) and Mixtral-8x7B (32 layers, 8 KV heads of 128).
FAMILY_MODELS = {
    "qwen3moe": ("Qwen3-30B-A3B", PRESETS["qwen3-30b-a3b"]),
    "olmoe": ("OLMoE-1B-7B", PRESETS["olmoe-1b-7b"]),
    "mixtral": ("Mixtral-8x7B", dict(arch="mixtral", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128)),
    "qwen2moe": ("Qwen1.5-MoE-A2.7B", dict(arch="qwen2moe", n_layers=24, n_heads=16, n_kv_heads=16, head_dim=128)),
    "glm4moe": ("GLM-4.5-Air", PRESETS["glm-4.5-air"]),
    "deepseek2": ("DeepSeek-V3", PRESETS["deepseek-v3"]),
    "gpt-oss": ("gpt-oss-20b", PRESETS["gpt-oss-20b"]),
    "qwen3next": ("Qwen3-Next-80B-A3B", PRESETS["qwen3-next-80b-a3b"]),
}


def kv_layers(cfg: SynthConfig) -> int:
    """Layers whose cache grows by one row per token."""
    if cfg.arch == "gpt-oss":
        return cfg.n_layers // 2  # llama.cpp: the sliding window on every other layer
    if cfg.arch == "qwen3next":
        return cfg.n_layers // cfg.full_attn_every
    return cfg.n_layers


def kv_bytes_per_token(cfg: SynthConfig, elem_bytes: int = 2) -> int:
    """Bytes of a sequence's state per token of its prefix (F16 K and V: 2 bytes an element)."""
    if cfg.arch == "deepseek2":
        row = (cfg.kv_lora_rank + (cfg.rope_dim or cfg.head_dim // 2)) * elem_bytes
    else:
        row = 2 * cfg.n_kv_heads * cfg.head_dim * elem_bytes
    return kv_layers(cfg) * row + CELL_META


def family_table() -> list[tuple[str, str, int, int]]:
    """(family, model, layers growing per token, bytes per token) of each family's public model."""
    out = []
    for arch, (name, geometry) in FAMILY_MODELS.items():
        fields = {k: v for k, v in geometry.items() if k in {f.name for f in dataclasses.fields(SynthConfig)}}
        cfg = SynthConfig(**fields)
        out.append((arch, name, kv_layers(cfg), kv_bytes_per_token(cfg)))
    return out
