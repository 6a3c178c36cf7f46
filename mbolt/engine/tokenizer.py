"""Byte-level BPE from a GGUF vocabulary, as llama.cpp's `gpt2` tokenizer model does it.

Text -> pre-tokens (the pattern named by `tokenizer.ggml.pre`: GPT-2's, or the llama3/qwen2
one) -> bytes mapped to GPT-2's printable characters -> merges applied lowest rank first ->
token ids. Special tokens in the text are not parsed (like llama_tokenize with
parse_special=false); a BOS token is prepended when `tokenizer.ggml.add_bos_token` is true.
The pattern scanners are hand-written (Python's `re` has no \\p{L}); letters and numbers are
Unicode categories L* and N*.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

from mbolt.core.errors import MboltError
from mbolt.core.header import GGUFHeader
from mbolt.core.vocab import bytes_to_unicode

CONTROL = 3
_LLAMA3_PRE = {"llama3", "llama-bpe", "llama-v3", "qwen2", "qwen35", "dbrx", "smaug-bpe", "olmo",
               "deepseek-r1-qwen", "falcon3", "tekken", "gpt-4o", "superbpe", "kimi-k2", "hunyuan"}


@lru_cache(maxsize=4096)
def _cls(c: str) -> str:
    """'L' letter, 'N' number, 'S' whitespace, 'O' other."""
    if c.isspace():
        return "S"
    cat = unicodedata.category(c)[0]
    return cat if cat in ("L", "N") else "O"


def _contraction(text: str, i: int, ignore_case: bool) -> int:
    if text[i] != "'":
        return 0
    rest = text[i + 1: i + 3]
    if ignore_case:
        rest = rest.lower()
    if rest[:2] in ("re", "ve", "ll"):
        return 3
    if rest[:1] in ("s", "t", "m", "d"):
        return 2
    return 0


def split_gpt2(text: str) -> list[str]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    out, i, n = [], 0, len(text)
    while i < n:
        c = _contraction(text, i, False)
        if c:
            out.append(text[i:i + c])
            i += c
            continue
        j = i + 1 if text[i] == " " and i + 1 < n and _cls(text[i + 1]) != "S" else i
        k = _cls(text[j])
        if k != "S":
            e = j + 1
            while e < n and _cls(text[e]) == k:
                e += 1
            out.append(text[i:e])
            i = e
            continue
        e = i
        while e < n and _cls(text[e]) == "S":
            e += 1
        if e - i > 1 and e < n:  # \s+(?!\S) leaves the last space to the next word
            e -= 1
        out.append(text[i:e])
        i = e
    return out


def split_llama3(text: str, max_digits: int = 3) -> list[str]:
    """(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|
    \\s*[\\r\\n]+|\\s+(?!\\S)|\\s+   (qwen2 uses \\p{N} one digit at a time: max_digits=1)"""
    out, i, n = [], 0, len(text)
    while i < n:
        c = _contraction(text, i, True)
        if c:
            out.append(text[i:i + c])
            i += c
            continue
        k = _cls(text[i])
        # [^\r\n\p{L}\p{N}]?\p{L}+
        if k == "L" or (text[i] not in "\r\n" and k != "N" and i + 1 < n and _cls(text[i + 1]) == "L"):
            e = i + 1
            while e < n and _cls(text[e]) == "L":
                e += 1
            out.append(text[i:e])
            i = e
            continue
        if k == "N":
            e = i + 1
            while e < n and e - i < max_digits and _cls(text[e]) == "N":
                e += 1
            out.append(text[i:e])
            i = e
            continue
        # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        j = i + 1 if text[i] == " " and i + 1 < n and _cls(text[i + 1]) == "O" else i
        if _cls(text[j]) == "O":
            e = j + 1
            while e < n and _cls(text[e]) == "O":
                e += 1
            while e < n and text[e] in "\r\n":
                e += 1
            out.append(text[i:e])
            i = e
            continue
        # whitespace run starting at i
        e = i
        while e < n and _cls(text[e]) == "S":
            e += 1
        last_nl = max((p for p in range(i, e) if text[p] in "\r\n"), default=-1)
        if last_nl >= 0:  # \s*[\r\n]+ : up to and including the last newline of the run
            out.append(text[i:last_nl + 1])
            i = last_nl + 1
            continue
        if e - i > 1 and e < n:
            e -= 1
        out.append(text[i:e])
        i = e
    return out


class Tokenizer:
    def __init__(self, tokens: list[str], types: list[int] | None, merges: list[str], pre: str,
                 bos: int | None, eos: int | None, add_bos: bool):
        self.tokens = tokens
        self.types = list(types) if types is not None else [1] * len(tokens)
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {}
        for r, m in enumerate(merges):
            a, _, b = m.partition(" ")
            self.ranks[(a, b)] = r
        self.pre = pre
        self.bos, self.eos, self.add_bos = bos, eos, add_bos
        self.b2u = bytes_to_unicode()
        self.u2b = {v: k for k, v in self.b2u.items()}
        self._cache: dict[str, list[int]] = {}
        if pre in _LLAMA3_PRE:
            self.split = (lambda t: split_llama3(t, 1)) if pre.startswith("qwen") or pre.startswith("deepseek-r1") \
                else split_llama3
        else:
            self.split = split_gpt2

    @classmethod
    def from_header(cls, h: GGUFHeader) -> "Tokenizer":
        model = h.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise MboltError(f"{h.path}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
        tokens = h.get("tokenizer.ggml.tokens")
        if not tokens:
            raise MboltError(f"{h.path}: no tokenizer.ggml.tokens")
        types = h.get("tokenizer.ggml.token_type")
        bos, eos = h.get("tokenizer.ggml.bos_token_id"), h.get("tokenizer.ggml.eos_token_id")
        return cls(list(tokens), None if types is None else [int(t) for t in types],
                   list(h.get("tokenizer.ggml.merges") or []), str(h.get("tokenizer.ggml.pre", "default")),
                   None if bos is None else int(bos), None if eos is None else int(eos),
                   bool(h.get("tokenizer.ggml.add_bos_token", False)))

    def _bpe(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        syms = [self.b2u[b] for b in word.encode("utf-8")]
        while len(syms) > 1:
            best, at = None, -1
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            pair = (syms[at], syms[at + 1])
            merged, i = [], 0
            while i < len(syms):  # merge every occurrence of the pair, left to right
                if i < len(syms) - 1 and (syms[i], syms[i + 1]) == pair:
                    merged.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    merged.append(syms[i])
                    i += 1
            syms = merged
        ids = []
        for s in syms:
            t = self.ids.get(s)
            if t is not None:
                ids.append(t)
            else:
                for ch in s:
                    if ch not in self.ids:
                        raise MboltError(f"tokenizer: byte {self.u2b.get(ch)} has no token in the vocabulary")
                    ids.append(self.ids[ch])
        if len(self._cache) < 100_000:
            self._cache[word] = ids
        return ids

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = [self.bos] if add_special and self.add_bos and self.bos is not None else []
        for w in self.split(text):
            ids.extend(self._bpe(w))
        return ids

    def token_bytes(self, i: int) -> bytes:
        if self.types[i] == CONTROL:
            return b""
        return bytes(self.u2b[c] for c in self.tokens[i] if c in self.u2b) if all(c in self.u2b for c in self.tokens[i]) \
            else self.tokens[i].encode("utf-8")

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")
