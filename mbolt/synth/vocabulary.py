"""The vocabulary of a synthetic model: byte-level gpt2 (256 byte tokens, a few merges, two
specials), or borrowed from another GGUF (a real tokenizer, every `tokenizer.*` entry copied)."""

from __future__ import annotations

from pathlib import Path

from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.core.vocab import bytes_to_unicode

BYTE_MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a")]
SPECIALS = ["<|bos|>", "<|eos|>"]


def vocabulary() -> tuple[list[str], list[int], list[str], int, int]:
    """tokens (id = byte value for ids 0..255), token types, merges, bos id, eos id."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1] * 256  # NORMAL
    merges = []
    for a, b in BYTE_MERGES:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    bos = len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)  # CONTROL
    return tokens, types, merges, bos, bos + 1


def borrowed_vocabulary(path: str) -> tuple[list[bytes], int, int, int]:
    """The tokenizer.* entries of another GGUF (e.g. llama.cpp's models/ggml-vocab-*.gguf), copied
    byte for byte, with the vocabulary size and its bos/eos ids: a synthetic model that tokenizes
    exactly as the real one does."""
    from mbolt.core.header import read_header

    h = read_header(path)
    tokens = h.kv.get(Keys.Tokenizer.LIST)
    if tokens is None or not hasattr(tokens.value, "__len__") or not len(tokens.value):
        raise MboltError(f"{path}: no {Keys.Tokenizer.LIST}: not a vocabulary to borrow")
    raw = Path(path).read_bytes()[:h.header_size]
    entries = [raw[kv.span[0]:kv.span[1]] for k, kv in h.kv.items() if k.startswith("tokenizer.")]
    n = len(tokens.value)
    bos, eos = h.get_int(Keys.Tokenizer.BOS_ID, 0), h.get_int(Keys.Tokenizer.EOS_ID, 0)
    return entries, n, bos, eos
