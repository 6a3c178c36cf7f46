"""GBNF pieces that llama-cpp-python's JSON-schema converter (a Python port of llama.cpp's) lacks
or gets wrong, as plain functions of their inputs: integer ranges, JSON string patterns, object
keys that are none of a set of names, and the date/time formats.

Each piece generates only JSON text that a validator accepts (`jsonschema`): where a regular
expression allows characters a JSON string must escape, or llama.cpp's format rules allow a day
that does not exist, the grammar keeps to the part it can spell exactly. A construct with no
such part raises `ValueError` with the reason, and the request is refused with it.
"""

from __future__ import annotations

import json
import re

# ---- integer ranges: llama.cpp's build_min_max_int (common/json-schema-to-grammar.cpp) ----
#
# Its method: a range of equal-length decimal strings is a shared prefix, then per digit a class and
# free digits; a range across lengths is one such range per length. Where one side is open the
# other digits are free, up to 16 digits in all. Its open-ended branches are not ported as they
# are: they lose the digits of a bound whose tail has leading zeros (minimum 1000 lets 115 through,
# minimum 105 lets 15) and allow a leading zero after "-" (maximum -5 lets -05 through).

_MAX_DIGITS = 16


def int_range(lo: int | None, hi: int | None) -> str:
    """GBNF alternatives for the JSON integers in [lo, hi] (None: unbounded on that side; an open
    side stops at 16 digits, as llama.cpp's converter does)."""
    if lo is None and hi is None:
        raise ValueError("an integer range needs a minimum or a maximum")
    if lo is not None and hi is not None:
        if hi < 0:
            return f'"-" ({_between(-hi, -lo)})'
        if lo < 0:
            return f'"-" ({_between(1, -lo)}) | {_between(0, hi)}'
        return _between(lo, hi)
    if lo is not None:
        return _at_least(lo) if lo >= 0 else f'"-" ({_between(1, -lo)}) | {_at_least(0)}'
    if hi < 0:
        return f'"-" ({_at_least(-hi)})'
    return f'"-" [1-9] [0-9]{{0,{_MAX_DIGITS - 1}}} | {_between(0, hi)}'


def _at_least(m: int) -> str:
    """Non-negative integers >= m: as many digits and not below it, or more digits."""
    s = str(m)
    alts = [_uniform(s, "9" * len(s))]
    if len(s) < _MAX_DIGITS:
        alts.append(f"[1-9] [0-9]{{{len(s)},{_MAX_DIGITS - 1}}}")
    return " | ".join(alts)


def _between(lo: int, hi: int) -> str:
    """Integers in [lo, hi], 0 <= lo <= hi: one uniform range per number of digits."""
    alts, lo_s = [], str(lo)
    for digits in range(len(lo_s), len(str(hi))):
        alts.append(_uniform(lo_s, "9" * digits))
        lo_s = "1" + "0" * digits
    alts.append(_uniform(lo_s, str(hi)))
    return " | ".join(alts)


def _digit_range(a: str, b: str) -> str:
    return f"[{a}]" if a == b else f"[{a}-{b}]"


def _free(n: int) -> str:
    return "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _uniform(frm: str, to: str) -> str:
    """Equal-length digit strings from `frm` to `to` (llama.cpp's uniform_range)."""
    i = 0
    while i < len(frm) and frm[i] == to[i]:
        i += 1
    out = [f'"{frm[:i]}"'] if i else []
    if i == len(frm):
        return " ".join(out)
    rest = len(frm) - i - 1
    if rest == 0:
        return " ".join(out + [_digit_range(frm[i], to[i])])
    from_sub, to_sub, nines = frm[i + 1:], to[i + 1:], "9" * rest
    alts, to_reached = [], False
    if from_sub == "0" * rest:
        alts.append(f"{_digit_range(frm[i], chr(ord(to[i]) - 1))} {_free(rest)}")
    else:
        alts.append(f"[{frm[i]}] ({_uniform(from_sub, nines)})")
        if ord(frm[i]) < ord(to[i]) - 1:
            to_reached = to_sub == nines
            top = to[i] if to_reached else chr(ord(to[i]) - 1)
            alts.append(f"{_digit_range(chr(ord(frm[i]) + 1), top)} {_free(rest)}")
    if not to_reached:
        alts.append(f"[{to[i]}] ({_uniform('0' * rest, to_sub)})")
    return " ".join(out + ["(" + " | ".join(alts) + ")"])


# ---- characters ----
#
# llama.cpp's grammar engine matches code points decoded from the model's bytes, and it decodes some
# byte sequences no UTF-8 text has (surrogates, beyond U+10FFFF, 3- and 4-byte overlong forms of a
# non-ASCII character): the reply's text then holds U+FFFD where the grammar saw one character. So
# what a class allows is written as ranges that leave out surrogates and what lies beyond
# U+10FFFF, and where characters are counted or matched (minLength/maxLength, a pattern's `.` and
# negated classes) they are printable ASCII, any other character spelled as its \u escape: no byte
# sequence can then pass for one.

_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF)]
_MAX_CP = 0x10FFFF
_ASCII = [(0x20, 0x7E)]
# '\u' and four hex digits that are not a surrogate (half of a pair would count as one character)
_U_ESCAPE = '"u" ([0-9a-cA-C] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2} | [eEfF] [0-9a-fA-F]{3})'


def literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def json_text(text: str) -> str:
    """The characters a JSON string spells `text` with (its body, between the quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def is_raw(c: str) -> bool:
    return not any(a <= ord(c) <= b for a, b in _UNSAFE)


def _class_char(cp: int) -> str:
    c = chr(cp)
    if 0x20 < cp < 0x7F and c not in "]-^\\\"[":
        return c
    return f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}" if cp < 0x10000 else f"\\U{cp:08X}"


def char_class(ranges: list[tuple[int, int]]) -> str:
    """A GBNF character class of code point ranges."""
    return "[" + "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in ranges) + "]"


def _normalise(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(ranges, cut) -> list[tuple[int, int]]:
    out = []
    for a, b in _normalise(ranges):
        for c, d in _normalise(cut):
            if d < a or c > b:
                continue
            if c > a:
                out.append((a, c - 1))
            a = d + 1
            if a > b:
                break
        if a <= b:
            out.append((a, b))
    return out


# what may stand in a JSON string unescaped (JSON forbids U+0000-U+001F, '"' and '\\' there;
# llama.cpp's char rule leaves out U+007F too)
RAW_CHAR = char_class(_minus([(0, _MAX_CP)], _UNSAFE))
# one JSON string character, raw or escaped: llama.cpp's char rule (llama-cpp-python's lets control
# characters in, which JSON forbids)
JSON_CHAR = RAW_CHAR + r' | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# exactly one character once decoded, in bytes no model can forge: what minLength/maxLength count
ONE_CHAR = char_class(_minus(_ASCII, _UNSAFE)) + r' | [\\] (["\\/bfnrt] | ' + _U_ESCAPE + ")"


# ---- object keys that are none of the declared property names (llama.cpp's _not_strings) ----


def not_strings(names: list[str], key_char: str) -> str:
    """A JSON string (quotes included) of raw characters (`key_char`, a rule name) that is none of
    `names`: the keys additionalProperties may add, which must not repeat a declared property."""
    trie: dict = {}
    for name in (n for n in names if all(is_raw(c) for c in n)):  # others cannot be spelled raw
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}  # a name ends here
    ends = "" in trie

    def visit(node: dict) -> str:
        alts, rejects = [], []
        for ch, child in node.items():
            if ch == "":
                continue
            rejects.append(ord(ch))
            inner = {k: v for k, v in child.items() if k != ""}
            if inner:  # longer names go on: this prefix is not a name unless one ends here
                rest = visit(child)
                alts.append(f"{literal(ch)} ({rest})" if "" in child else f"{literal(ch)} ({rest})?")
            else:
                alts.append(f"{literal(ch)} {key_char}+")
        if rejects:
            others = _minus([(0x20, _MAX_CP)], _UNSAFE + [(r, r) for r in rejects])
            alts.append(f"{char_class(others)} {key_char}*")
        return " | ".join(alts)

    body = visit(trie) if len(trie) > (1 if ends else 0) else ""
    if not body:
        return f'"\\"" {key_char}+ "\\""' if ends else f'"\\"" {key_char}* "\\""'
    return f'"\\"" ({body})' + ("" if ends else "?") + ' "\\""'


# ---- string formats (llama.cpp's rules, with the days each month has) ----

# years 0001-9999 (Python's datetime has no year 0); February to the 28th (a leap day is left out)
DATE = ('([1-9] [0-9]{3} | "0" ([1-9] [0-9]{2} | "0" ([1-9] [0-9] | "0" [1-9]))) "-" ('
        '("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | '
        '("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | '
        '"02" "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]))')
TIME = ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})? '
        '("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])')
UUID = '[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}'


# ---- patterns: a regular expression's strings as a JSON string ----

_MAX_REPEAT = 1000
# \d, \w and \s: Python's match more (any Unicode digit, letter, space); these parts are all ASCII
_CLASS_ESCAPES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
                  "s": [(0x09, 0x0D), (0x20, 0x20)]}
_CONTROL_ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "a": 7}
_HEX = {"x": 2, "u": 4, "U": 8}


def pattern(p: str) -> str:
    """GBNF for JSON strings (quotes included) that `re.search(p, text)` accepts: the texts the
    pattern matches as a whole, with `^`/`$` at its ends or not (unanchored, these are a subset of
    what it accepts). What a JSON string must escape (quote, backslash) is spelled escaped;
    control characters a class or `.` allows are left out. The syntax is llama.cpp's converter's
    (literals, escapes, `.`, classes, groups, `(?:`, `|`, `* + ? {m,n}`) with `\\d \\w \\s`."""
    return f'"\\"" ({_Pattern(p).parse()}) "\\""'


class _Pattern:
    def __init__(self, p: str):
        self.p = p
        s = p[1:] if p.startswith("^") else p
        if s.endswith("$") and (len(s) - len(s[:-1].rstrip("\\")) - 1) % 2 == 0:  # not an escaped $
            s = s[:-1]
        self.s, self.i = s, 0

    def fail(self, why: str):
        raise ValueError(f"pattern {self.p!r}: {why}")

    def peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def parse(self) -> str:
        out = self.alt()
        if self.i < len(self.s):
            self.fail("unbalanced parenthesis")
        return out

    def alt(self) -> str:
        seqs = [self.seq()]
        while self.peek() == "|":
            self.i += 1
            seqs.append(self.seq())
        return " | ".join(s or '""' for s in seqs)

    def seq(self) -> str:
        items = []
        while self.peek() and self.peek() not in "|)":
            items.append(self.quantified(self.atom()))
        return " ".join(items)

    def atom(self) -> str:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.peek() == "?":
                if self.peek(1) != ":":
                    self.fail("groups other than (...) and (?:...) are not supported")
                self.i += 2
            inner = self.alt()
            if self.peek() != ")":
                self.fail("unbalanced parenthesis")
            self.i += 1
            return f"({inner})"
        if c == "[":
            return self.klass()
        if c in "^$":
            self.fail(f"{c} inside the pattern is not supported (only at its ends)")
        if c in "*+?{":
            self.fail(f"{c} with nothing to repeat")
        self.i += 1
        if c == ".":  # Python's dot: anything but a newline (its printable ASCII part)
            return self.chars(_ASCII)
        if c == "\\":
            e = self.escape_letter()
            if e in _CLASS_ESCAPES:
                return self.chars(_CLASS_ESCAPES[e])
            return self.char(self.escaped(e))
        return self.char(ord(c))

    def escape_letter(self) -> str:
        e = self.peek()
        if not e:
            self.fail("trailing backslash")
        self.i += 1
        return e

    def escaped(self, e: str, in_class: bool = False) -> int:
        if e in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[e]
        if e == "b" and in_class:
            return 8
        if e in _HEX:
            digits = self.s[self.i:self.i + _HEX[e]]
            if len(digits) != _HEX[e] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{e} needs {_HEX[e]} hex digits")
            self.i += _HEX[e]
            return int(digits, 16)
        if e.isalnum():
            self.fail(f"\\{e} is not supported")
        return ord(e)  # escaped punctuation stands for itself

    def char(self, cp: int) -> str:
        if 0xD800 <= cp <= 0xDFFF or cp > _MAX_CP:
            self.fail("a surrogate code point cannot be generated")
        return literal(json_text(chr(cp)))

    def chars(self, ranges: list[tuple[int, int]]) -> str:
        safe = _minus(ranges, _UNSAFE)
        alts = [char_class(safe)] if safe else []
        alts += [literal(json_text(chr(cp))) for cp in (0x22, 0x5C) if any(a <= cp <= b for a, b in ranges)]
        if not alts:
            self.fail("a character class of control characters only is not supported")
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def class_member(self, negated: bool) -> list[tuple[int, int]] | int:
        c = self.peek()
        if not c:
            self.fail("unterminated character class")
        self.i += 1
        if c != "\\":
            return ord(c)
        e = self.escape_letter()
        if e in _CLASS_ESCAPES:
            if negated:  # its complement would include the Unicode digits/letters Python's \d/\w match
                self.fail(f"\\{e} in a negated class is not supported")
            return _CLASS_ESCAPES[e]
        return self.escaped(e, in_class=True)

    def klass(self) -> str:
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while first or self.peek() != "]":
            if not self.peek():
                self.fail("unterminated character class")
            first = False
            lo = self.class_member(negated)
            if isinstance(lo, list):
                ranges += lo
                continue
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self.class_member(negated)
                if isinstance(hi, list) or hi < lo:
                    self.fail("bad range in a character class")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        self.i += 1
        if negated:  # the printable ASCII the class leaves
            ranges = _minus(_ASCII, ranges)
        return self.chars(ranges)

    def quantified(self, atom: str) -> str:
        c = self.peek()
        if c in ("*", "+", "?") and c:
            self.i += 1
            q = c
        elif c == "{":
            m = re.match(r"\{(\d*)(,(\d*))?\}", self.s[self.i:])
            if not m or not (m[1] or m[3]):  # Python reads any other { as itself: not supported here
                self.fail("a { that is not a repetition {m}, {m,}, {,n} or {m,n} is not supported")
            self.i += m.end()
            lo = int(m[1] or 0)
            hi = lo if m[2] is None else int(m[3]) if m[3] else None
            parts = [m[1], m[3] or ""] if m[2] else [m[1]]
            if (hi is not None and hi < lo) or max(lo, hi or 0) > _MAX_REPEAT:
                self.fail(f"repetition {{{','.join(parts)}}} is not supported (at most {_MAX_REPEAT})")
            if hi == 0:
                return ""
            q = "{" + str(lo) + ("" if hi == lo else "," + ("" if hi is None else str(hi))) + "}"
        else:
            return atom
        if self.peek() in ("?", "+") and self.peek():  # lazy or possessive: the same strings
            self.i += 1
        if self.peek() and self.peek() in "*+?{":
            self.fail("a repetition of a repetition is not supported")
        return f"({atom}){q}"
