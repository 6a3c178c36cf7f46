r"""Byte-level BPE from a GGUF vocabulary, as llama.cpp's `gpt2` tokenizer model does it.

Text -> pre-tokens (the pattern named by `tokenizer.ggml.pre`) -> bytes mapped to GPT-2's
printable characters -> merges applied lowest rank first -> token ids. Special tokens in the
text are not parsed (like llama_tokenize with parse_special=false); a BOS token is prepended
when `tokenizer.ggml.add_bos_token` is true.

The pre-tokenizer patterns are llama.cpp's own (src/llama-vocab.cpp, `regex_exprs`), run with
the `regex` package (Unicode classes \p{L}, \p{N}). As in llama.cpp's unicode_regex_split,
each pattern of a list splits every piece left by the previous one, and text between matches
stays a piece of its own.
"""

from __future__ import annotations

import regex
from gguf import Keys

from mbolt.core.errors import MboltError, warn
from mbolt.core.header import GGUFHeader
from mbolt.core.vocab import bytes_to_unicode

CONTROL = 3

# llama.cpp's regex_exprs, verbatim (LLAMA_VOCAB_PRE_TYPE_*)
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
PATTERNS = {
    "gpt2": ["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"],
    "llama3": [_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "qwen2": [_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
              "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "qwen35": [_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "default": ["[\\p{P}\\$\\+<=>\\^~\\|]+",
                "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                "\\p{N}+", "[0-9][0-9][0-9]"],
}
# tokenizer.ggml.pre -> pattern, as llama_vocab::impl::load maps the names
PRE_NAMES = {
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "olmo",
                     "mpt", "jais"), "gpt2"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open"), "qwen2"),
    "qwen35": "qwen35",
    "default": "default",
}
_COMPILED: dict[str, list] = {}


def pre_tokenizer(pre: str, where: str = "tokenizer") -> str:
    """The pattern name for a `tokenizer.ggml.pre` value; llama.cpp's "default" (with a warning)
    for one this tokenizer does not implement."""
    name = PRE_NAMES.get(pre)
    if name is None:
        warn(f"{where}: pre-tokenizer {pre!r} is not implemented by the reference tokenizer; using llama.cpp's "
             f"default pattern (token ids may differ from llama.cpp's)")
        name = "default"
    return name


def pre_split(text: str, name: str) -> list[str]:
    """Pieces of `text` under pattern `name` (a key of PATTERNS), as llama.cpp splits them."""
    exprs = _COMPILED.get(name)
    if exprs is None:
        exprs = _COMPILED[name] = [regex.compile(p) for p in PATTERNS[name]]
    pieces = [text] if text else []
    for rx in exprs:
        out = []
        for piece in pieces:
            at = 0
            for m in rx.finditer(piece):
                if m.start() > at:
                    out.append(piece[at:m.start()])  # unmatched text stays a piece
                if m.end() > m.start():
                    out.append(m.group())
                at = m.end()
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


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
        self.pattern = pre_tokenizer(pre)

    def split(self, text: str) -> list[str]:
        return pre_split(text, self.pattern)

    @classmethod
    def from_header(cls, h: GGUFHeader) -> "Tokenizer":
        T = Keys.Tokenizer
        model = h.get(T.MODEL)
        if model != "gpt2":
            raise MboltError(f"{h.path}: tokenizer model {model!r} is not supported by the reference engine (only "
                             "byte-level BPE 'gpt2'): use --engine llama.cpp, which tokenizes every vocabulary "
                             "llama.cpp loads")
        tokens = h.get(T.LIST)
        if not tokens:
            raise MboltError(f"{h.path}: no {T.LIST}")
        types = h.get(T.TOKEN_TYPE)
        bos, eos = h.get(T.BOS_ID), h.get(T.EOS_ID)
        return cls(list(tokens), None if types is None else [int(t) for t in types],
                   list(h.get(T.MERGES) or []), str(h.get(T.PRE, "default")),
                   None if bos is None else int(bos), None if eos is None else int(eos),
                   bool(h.get(T.ADD_BOS, False)))

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
