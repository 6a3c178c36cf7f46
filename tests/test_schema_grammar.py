"""JSON-schema grammars (issue 55): what the GBNF built for a schema accepts, judged by llama.cpp's
own grammar engine (the grammar sampler of the release mbolt pins, fed a text's tokens one by
one, the end-of-generation token last), on cases taken from llama.cpp's tests, exhaustively on
integer ranges, and against `jsonschema` on what a schema's grammar can spell.

Cases marked LLAMA come from llama.cpp's tests/test-grammar-integration.cpp (`test_simple_grammar`
and `test_json_schema`, as vendored in llama-cpp-python 0.3.36, MIT licence): the schema and its
passing and failing strings as written there.
"""

from __future__ import annotations

import ctypes
import json
import math
import re

import pytest

from conftest import needs_llama, require_vocab

pytestmark = needs_llama
VOCAB = __import__("pathlib").Path(__file__).parent / ".vocabs" / "ggml-vocab-qwen2.gguf"


class Matcher:
    """Does a GBNF grammar accept a text? llama.cpp's grammar sampler decides: every token of the
    text must keep a finite logit, and the end-of-generation token must be allowed after it."""

    def __init__(self, vocab_path):
        import llama_cpp as L

        from mbolt.runtime.runner import LlamaRunner

        self.L, self.runner = L, LlamaRunner(vocab_path, vocab_only=True)
        self.eos = int(L.llama_vocab_eos(self.runner.vocab))

    def accepts(self, grammar: str, text: str) -> bool:
        L = self.L
        g = L.llama_sampler_init_grammar(self.runner.vocab, grammar.encode(), b"root")
        assert g, f"llama.cpp refused the grammar:\n{grammar}"
        try:
            for t in self.runner.tokenize(text) + [self.eos]:
                cell = (L.llama_token_data * 1)(L.llama_token_data(t, 0.0, 0.0))
                arr = L.llama_token_data_array(cell, 1, -1, False)
                L.llama_sampler_apply(g, ctypes.byref(arr))
                if math.isinf(cell[0].logit):
                    return False
                if t != self.eos:
                    L.llama_sampler_accept(g, t)
            return True
        finally:
            L.llama_sampler_free(g)


@pytest.fixture(scope="module")
def matcher():
    m = Matcher(require_vocab(VOCAB))
    yield m
    m.runner.close()


def grammar(schema: dict) -> str:
    from mbolt.serve.schema_grammar import schema_grammar

    return schema_grammar(schema)


# LLAMA: test_simple_grammar, the integer ranges
INTEGER_CASES = [
    ({"type": "integer", "minimum": 0}, ["0", "10", "12", "10000"],
     ["-1", "-10", "-10000", "-100000000000000000000000000000000", "100000000000000000000000000000000", "00", "01",
      "-0"]),
    ({"type": "integer", "minimum": 2}, ["2", "3", "4", "10", "20", "1234567890000000"],
     ["0", "1", "-1", "-100", "0", "1", "01", "02", "12345678900000000"]),
    ({"type": "integer", "minimum": 456}, ["456", "4560", "457", "460", "500"],
     ["455", "356", "50", "050", "-1", "-456"]),
    ({"type": "integer", "minimum": -123}, ["-123", "-122", "-11", "-1", "0", "1", "123", "1234", "2345"],
     ["-1234", "-124"]),
    ({"type": "integer", "maximum": 9999}, ["-99999", "0", "9999"], ["10000", "99991"]),
    ({"type": "integer", "maximum": -9999}, ["-10000", "-9999"], ["-9998", "0", "9999"]),
    ({"type": "integer", "minimum": 5, "maximum": 30}, ["5", "10", "30"], ["05", "4", "-1", "31", "123", "0123"]),
    ({"type": "integer", "exclusiveMinimum": 0, "maximum": 900719925474091},
     ["1", "2", "10", "900719925474090", "900719925474091"], ["0", "01", "900719925474092", "9007199254740910"]),
    ({"type": "integer", "minimum": -1, "maximum": 1}, ["-1", "0", "1"], ["-11", "-10", "-2", "2", "10", "11"]),
    ({"type": "integer", "minimum": -123, "maximum": 42},
     ["-123", "-122", "-13", "-11", "-2", "-1", "0", "1", "5", "10", "39", "40", "42"],
     ["-0123", "-124", "-1123", "-200", "43", "123", "0123"]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10000}, ["1", "9999"],
     ["0", "01", "10000", "99999"]),
]

# LLAMA: test_json_schema (the cases whose strings keep to one space between tokens, which is all
# llama-cpp-python's space rule allows)
SCHEMA_CASES = [
    ({}, ['{}', '{"foo": "bar"}', "[]", "null", '""', "true"], ["", '{"foo"}', "foo"]),
    ({"items": [{"format": "date"}, {"format": "uuid"}, {"format": "time"}, {"format": "date-time"}]},
     ['["2012-04-23", "12345678-1234-1234-1234-1234567890ab", "18:25:43.511Z", "2012-04-23T18:25:43.511Z"]'],
     ['["foo", "bar"]', '["12345678-1234-1234-1234-1234567890ab"]']),
    ({"type": "string", "minLength": 1}, ['"foo"', '"bar"'], ['""', "{}", '"foo": "bar"']),
    ({"type": "string", "minLength": 3}, ['"foo"', '"bar"', '"foobar"'], ['""', '"f"', '"fo"']),
    ({"type": "string", "maxLength": 3}, ['"foo"', '"bar"', '""', '"f"', '"fo"'], ['"foobar"']),
    ({"type": "string", "minLength": 1, "maxLength": 4}, ['"foo"', '"bar"', '"f"', '"barf"'],
     ['""', '"barfo"', '"foobar"']),
    ({"type": "integer"}, ["0", "12345", "1234567890123456"], ["", "01", "007", "12345678901234567  "]),
    ({"const": "foo"}, ['"foo"'], ["foo", '"bar"']),
    ({"enum": ["red", "amber", "green", None, 42, ["foo"]]}, ['"red"', "null", "42", '["foo"]'],
     ["", "420", "true", "foo"]),
    ({"pattern": "^[a-zA-Z0-9_-]*$"}, ['""', '"He_llo-12"'], ['"!"', '"Hello World"']),
    ({"pattern": "^a\\^\\$\\.\\[\\]\\(\\)\\|\\{\\}\\*\\+\\?b$"}, ['"a^$.[]()|{}*+?b"'], ['"ab"']),
    ({"type": ["array", "null"], "items": {"type": "string"}}, ["null", "[]", '["123"]', '["foo", "bar"]'],
     ["", "[123]", '"foo"', '["foo", 42]']),
    ({"items": {"type": ["number", "integer"]}, "minItems": 3, "maxItems": 5},
     ["[1, 2, 3]", "[1, 2, 3, 4]", "[1, 2, 3, 4, 5]"], ["[1, 2]", "[1, 2, 3, 4, 5, 6]", "1"]),
    ({"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "additionalProperties": True},
     ['{"a": 42}', '{"c": ""}', '{"a": 42, "c": ""}', '{"a_": ""}'], ["", '{"a": ""}', '{"a": "", "b": ""}']),
    ({"properties": {"b": {"type": "string"}, "a": {"type": "string"}, "d": {"type": "string"},
                     "c": {"type": "string"}}, "required": ["a", "b"], "additionalProperties": False},
     ['{"b": "foo", "a": "bar"}', '{"b":"foo","a":"bar","d":"qux"}', '{"b":"foo", "a":"bar", "d":"qux", "c":"baz"}'],
     ['{"a": "foo", "b": "bar"}', '{"b": "bar"}', '{"a": "foo", "c": "baz"}',
      '{"a":"foo", "b":"bar", "c":"baz", "d":"qux"}']),
]


@pytest.mark.parametrize("schema,passing,failing", INTEGER_CASES + SCHEMA_CASES)
def test_llama_cpp_cases(matcher, schema, passing, failing):
    g = grammar(schema)
    for text in passing:
        assert matcher.accepts(g, text), f"{schema}: {text!r} should pass\n{g}"
    for text in failing:
        assert not matcher.accepts(g, text), f"{schema}: {text!r} should fail\n{g}"


# (1000, None), (105, None) and (None, -5) are where llama.cpp's own open-ended branches go wrong
@pytest.mark.parametrize("lo,hi", [(0, 150), (-221, -7), (-15, 1003), (7, None), (-42, None), (None, 19), (None, -3),
                                   (99, 101), (1000, 1000), (1000, None), (105, None), (None, -5), (-1005, None),
                                   (None, -100), (20, None)])
def test_integer_ranges_exhaustively(matcher, lo, hi):
    """Every integer near the bounds and near zero is accepted exactly when it is in range
    (Python decides), and no leading zero is."""
    schema = {"type": "integer"} | ({"minimum": lo} if lo is not None else {}) | (
        {"maximum": hi} if hi is not None else {})
    g = grammar(schema)
    a = (lo if lo is not None else hi) - 60
    b = (hi if hi is not None else lo) + 60
    for n in sorted(set(range(a, b + 1)) | set(range(-130, 131))):
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert matcher.accepts(g, str(n)) == inside, (schema, n)
        assert not matcher.accepts(g, str(n).replace("-", "-0") if n < 0 else "0" + str(n)), (schema, n)


def test_fractional_and_exclusive_bounds_round_inwards(matcher):
    g = grammar({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 3.5, "exclusiveMinimum": -4})
    assert [n for n in range(-10, 10) if matcher.accepts(g, str(n))] == [1, 2, 3]


@pytest.mark.parametrize("pattern,texts", [
    (r"^\d{3}-\d{4}$", ["555-1234", "55-1234", "5555-123", "abc-defg"]),
    (r"^[A-Z][a-z]+(\s[A-Z][a-z]+)*$", ["Ada Lovelace", "ada", "Ada  Lovelace", "Ada"]),
    (r"^\w+@\w+\.(com|org)$", ["a@b.com", "a@b.net", "a_1@x.org", "@b.com"]),
    (r'^[^"\\]*"q"$', ['ab"q"', 'a"q"x', '"q"']),
    (r'^a\\b"c$', ['a\\b"c', "abc"]),
    (r"^x{2,3}y?$", ["xx", "xxx", "xxxx", "xxy", "x"]),
    (r"^(?:ab|cd)+$", ["ab", "abcd", "abc", ""]),
    (r"^[^a-c]$", ["d", "a", "é", "\t"]),
    (r"^.{2}$", ["ab", "a", "\n\n", 'a"']),
    ("abc", ["abc", "xabc"]),
])
def test_patterns_agree_with_python_re(matcher, pattern, texts):
    """A JSON string the grammar accepts decodes to a text `re.search` accepts; a fully matching
    printable ASCII text is accepted (what `.` and negated classes allow beyond it is left out)."""
    g = grammar({"type": "string", "pattern": pattern})
    for text in texts:
        encoded = json.dumps(text, ensure_ascii=False)
        if matcher.accepts(g, encoded):
            assert re.search(pattern, text), (pattern, text)
        elif re.fullmatch(pattern.strip("^$"), text) and all(" " <= c <= "~" for c in text):  # ASCII: spelled raw
            pytest.fail(f"{pattern}: {text!r} matches but the grammar refuses {encoded}")


@pytest.mark.parametrize("fmt,good,bad", [
    ("date", ["2024-02-28", "0001-12-31", "1999-04-30"], ["2024-02-30", "2023-04-31", "0000-01-01", "2024-13-01"]),
    ("time", ["23:59:59Z", "00:00:00.123+05:30"], ["24:00:00Z", "12:00:00"]),
    ("date-time", ["2012-04-23T18:25:43.511Z"], ["2012-04-31T18:25:43Z", "2012-04-23 18:25:43Z"]),
    ("uuid", ["12345678-1234-1234-1234-1234567890ab"], ["12345678-1234-1234-1234-1234567890a"]),
])
def test_formats_spell_only_valid_values(matcher, fmt, good, bad):
    """What the grammar accepts, jsonschema's format checker accepts (a day a month does not
    have is not spelled)."""
    import jsonschema

    schema = {"type": "string", "format": fmt}
    g = grammar(schema)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    assert fmt in checker.checkers, f"jsonschema cannot check {fmt} here (rfc3339-validator missing?)"
    for v in good:
        assert matcher.accepts(g, json.dumps(v)), v
        jsonschema.validate(v, schema, format_checker=checker)
    for v in bad:
        assert not matcher.accepts(g, json.dumps(v)), v


def test_additional_keys_never_repeat_a_declared_property(matcher):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "additionalProperties": {"type": "boolean"}}
    g = grammar(schema)
    assert matcher.accepts(g, '{"name": "x", "nam": true, "names": false}')
    assert not matcher.accepts(g, '{"name": "x", "name": true}')
    assert not matcher.accepts(g, '{"n": 1, "n": true}')
    odd = {"a]b": {"type": "integer"}, "x-y": {"type": "integer"}, 'q"': {"type": "integer"}, "é": {"type": "integer"}}
    g = grammar({"type": "object", "properties": odd, "additionalProperties": {"type": "boolean"}})
    assert matcher.accepts(g, '{"a]b": 1, "q\\"": 2, "a]": true, "é!": false}')
    for key in ("a]b", "x-y", "é"):
        assert not matcher.accepts(g, json.dumps({"z": True}).replace('"z"', json.dumps(key), 1)), key


def test_refs_with_the_same_last_segment_stay_apart(matcher):
    """llama-cpp-python names a $ref's rule by its last segment: #/$defs/a/$defs/item and
    #/$defs/b/$defs/item would share one rule."""
    schema = {"type": "object",
              "properties": {"x": {"$ref": "#/$defs/a/$defs/item"}, "y": {"$ref": "#/$defs/b/$defs/item"}},
              "required": ["x", "y"],
              "$defs": {"a": {"$defs": {"item": {"type": "integer"}}}, "b": {"$defs": {"item": {"type": "string"}}}}}
    g = grammar(schema)
    assert matcher.accepts(g, '{"x": 1, "y": "s"}')
    assert not matcher.accepts(g, '{"x": "s", "y": "s"}')


def test_type_list_keeps_the_other_keywords(matcher):
    g = grammar({"type": ["integer", "null"], "minimum": 1, "maximum": 3})
    assert [t for t in ["0", "1", "3", "4", "null"] if matcher.accepts(g, t)] == ["1", "3", "null"]


def test_strings_have_no_control_characters(matcher):
    g = grammar({"type": "string"})
    assert matcher.accepts(g, '"a\\nb"') and not matcher.accepts(g, '"a\nb"')


# ---- the check, on its own: what is refused names the keyword and the JSON pointer ----


@pytest.mark.parametrize("schema,keyword,path", [
    ({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer", "multipleOf": 2}}]},
     "multipleOf", "#/anyOf/1/items"),
    ({"type": "object", "properties": {"a/b": {"not": {}}}}, "not", "#/properties/a~1b"),
    ({"$defs": {"x": {"type": "number", "maximum": 3}}, "$ref": "#/$defs/x"}, "maximum", "#/$defs/x"),
    ({"allOf": [{"type": "string", "minLength": 1}]}, "allOf", "#/allOf/0"),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"type": "string"}}}]},
     "allOf", "#/allOf/1"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum", "#"),
    ({"type": "integer", "exclusiveMinimum": True}, "exclusiveMinimum", "#"),  # draft 4's boolean form
    ({"type": "array", "prefixItems": [{}, {}], "minItems": 3}, "minItems", "#"),
    ({"type": "string", "enum": [1, 2]}, "enum", "#"),
    ({"$ref": "#/$defs/missing"}, "$ref", "#"),
    ({"minLength": 1, "minimum": 1}, "type", "#"),
])
def test_check_names_keyword_and_pointer(schema, keyword, path):
    from mbolt.serve.schema import Refused, check

    with pytest.raises(Refused) as e:
        check(schema)
    assert (e.value.keyword, e.value.path) == (keyword, path), str(e.value)


def test_check_accepts_a_tagged_union_and_filters_enum_by_type(matcher):
    from mbolt.serve.schema import check

    union = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                       {"type": "object", "properties": {"k": {"enum": ["b", "c"]}, "n": {"type": "integer"}},
                        "required": ["k"]}]}
    check(union)
    g = grammar({"type": "string", "enum": ["a", 1, "b"]})
    assert [t for t in ['"a"', "1", '"b"'] if matcher.accepts(g, t)] == ['"a"', '"b"']
