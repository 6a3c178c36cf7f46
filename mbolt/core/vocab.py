"""Byte-level vocabulary helpers shared by the tokenizer, the synthetic-model writer and parity."""

from __future__ import annotations

from gguf import Keys


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokens(header, text: str) -> list[int]:
    """Token ids of `text` as single bytes of a byte-level (gpt2) vocabulary.

    Parity does not need a real tokenizer, only the same ids on both files; bytes missing from
    the vocabulary fall back to byte value modulo the vocabulary size."""
    tokens = header.get(Keys.Tokenizer.LIST) or []
    index = {t: i for i, t in enumerate(tokens)}
    n_vocab = len(tokens) or 256
    b2u = bytes_to_unicode()
    return [index.get(b2u[b], b % n_vocab) for b in text.encode("utf-8")]
