"""The reference tokenizer's pre-tokenizers (gpt2, llama3, qwen2) against llama.cpp's.

Each test GGUF carries a byte-level vocabulary whose merges were learnt on the raw bytes of the
test texts with NO pre-tokenization, so merges span every kind of boundary a pre-tokenizer
draws (letter|space, digit|digit, space|space, letter|apostrophe, emoji|space...): a piece split
in the wrong place, or not split, changes the token ids. llama.cpp loads the vocabulary alone
(vocab_only) and tokenizes the same texts.
"""

from collections import Counter

import gguf
import pytest
from conftest import needs_llama

from mbolt.core.header import read_header
from mbolt.core.vocab import bytes_to_unicode
from mbolt.reference.tokenizer import Tokenizer

pytestmark = needs_llama

TEXTS = [
    "Hello world, this is a test of letters and words.",
    "digits 1234567 and 12 345 and 0.5 and 9876543210x",
    "contractions: it's, we'll, they'd, I'm, you're, we've, can't; IT'S WE'LL THEY'D I'M",
    "whitespace   runs\t\tand\n\n\nnewlines  \n  indented\r\n\tcode   ",
    "non-ASCII: café naïve Ünïcödé Привет мир 日本語のテキスト Ελληνικά ١٢٣٤",
    "emoji 👍🏽 ok 🎉🎉 flag 🇫🇷 mix👍a1",
    "x=1234;y=56\r\n\tz = foo(bar) + 'q'  !!! ... ?!",
    "   leading spaces and trailing   ",
]
N_MERGES = 400
PRE = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2"}


def learn_merges(texts: list[str], n: int) -> list[tuple[str, str]]:
    """Plain BPE training over each text's whole byte string (no pre-tokenization)."""
    b2u = bytes_to_unicode()
    seqs = [[b2u[b] for b in t.encode("utf-8")] for t in texts]
    merges = []
    for _ in range(n):
        pairs = Counter((s[i], s[i + 1]) for s in seqs for i in range(len(s) - 1))
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i:i + 2] = [s[i] + s[i + 1]]
                i += 1
    return merges


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    b2u = bytes_to_unicode()
    merges = learn_merges(TEXTS, N_MERGES)
    tokens = [b2u[b] for b in range(256)]
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    out = {}
    for name, pre in PRE.items():
        path = tmp_path_factory.mktemp("vocab") / f"{name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_block_count(1)
        w.add_feed_forward_length(8)
        w.add_head_count(1)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out[name] = path
    return out


def _llama_ids(path) -> list[list[int]]:
    from mbolt.runtime.runner import LlamaRunner

    r = LlamaRunner(path, vocab_only=True)
    try:
        return [r.tokenize(t, add_special=False) for t in TEXTS]
    finally:
        r.close()


@pytest.mark.parametrize("name", list(PRE))
def test_pre_tokenizer_matches_llama_cpp(vocab_files, name):
    path = vocab_files[name]
    tok = Tokenizer.from_header(read_header(path))
    assert tok.pattern == name
    for text, want in zip(TEXTS, _llama_ids(path)):
        assert tok.encode(text, add_special=False) == want, text
        assert tok.decode(want) == text


def test_the_vocabulary_exposes_each_pre_tokenizer(vocab_files):
    """The three patterns give llama.cpp different ids on these texts (so the comparison above
    would see a wrong pattern), and the merges join across pieces when nothing splits the text."""
    ids = {name: _llama_ids(p) for name, p in vocab_files.items()}
    assert ids["gpt2"] != ids["llama3"] != ids["qwen2"] != ids["gpt2"]
    i = 1  # the digits text
    assert ids["llama3"][i] != ids["qwen2"][i]  # 1-3 digit groups vs single digits
    b2u = bytes_to_unicode()
    merged = [a + b for a, b in learn_merges(TEXTS, N_MERGES)]
    assert any(b2u[ord(" ")] in m[1:] for m in merged)  # a merge that crosses into a following space
