"""The GBNF of a checked JSON schema (schema.py): llama-cpp-python's `SchemaConverter`, with the
pieces its Python port lacks or gets wrong replaced in this one place.

From llama.cpp's converter (common/json-schema-to-grammar.cpp): integer `minimum`/`maximum`
(its `build_min_max_int`, in gbnf.py), the keys `additionalProperties` adds are none of the
declared properties (its `_not_strings`), a `type` list keeps the schema's other keywords, `$ref`
rules are named by their whole reference (the port names them by the last segment, so two
`#/.../item` collide), `{}` is any value (the port: any object), arrays without `items` keep
`minItems`/`maxItems`, the string character rule excludes control characters.
Made exact for a validator (gbnf.py): patterns as JSON strings, dates with the days each month
has, `minLength`/`maxLength` counted in code points.
"""

from __future__ import annotations

import json

from llama_cpp.llama_grammar import (INVALID_RULE_CHARS_RE, PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter,
                                     _build_repetition)

from mbolt.serve import gbnf
from mbolt.serve.schema import DEFS, check

_ANY_KEY = None  # the additional-properties entry among an object's keys


class Converter(SchemaConverter):
    def __init__(self):
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._rules["char"] = gbnf.JSON_CHAR  # the port's string rule names "char": this one is used

    def visit(self, schema, name):
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        t = schema.get("type")
        if not set(schema) - set(DEFS):
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if isinstance(t, list):
            alts = [{**schema, "type": x} for x in t]
            return self._add_rule(rule_name, self._generate_union_rule(name, alts))
        if t == "integer" and ("minimum" in schema or "maximum" in schema):
            return self._add_rule(rule_name, f"({gbnf.int_range(schema.get('minimum'), schema.get('maximum'))}) space")
        if t == "string" and {"pattern", "format", "minLength", "maxLength"} & set(schema):
            return self._add_rule(rule_name, self._string(schema))
        if t == "array":
            return self._add_rule(rule_name, self._array(schema, name))
        return super().visit(schema, name)

    def _string(self, s: dict) -> str:
        if "pattern" in s:
            return gbnf.pattern(s["pattern"]) + " space"
        f = s.get("format")
        if f == "uuid":
            return f'"\\"" {gbnf.UUID} "\\"" space'
        if f is not None:
            date, time = self._add_rule("fmt-date", gbnf.DATE), self._add_rule("fmt-time", gbnf.TIME)
            body = {"date": date, "time": time, "date-time": f'{date} "T" {time}'}[f]
            return f'"\\"" {body} "\\"" space'
        one = self._add_rule("char-one", gbnf.ONE_CHAR)
        hi = s.get("maxLength")
        return f'"\\"" {one}{{{s.get("minLength", 0)},{"" if hi is None else hi}}} "\\"" space'

    def _array(self, s: dict, name: str) -> str:
        sub = f"{name}{'-' if name else ''}"
        items = s.get("prefixItems", s.get("items", {}))
        if isinstance(items, list):  # a tuple
            rules = [self.visit(x, f"{sub}tuple-{i}") for i, x in enumerate(items)]
            return '"[" space ' + ' "," space '.join(rules) + ' "]" space'
        item = self.visit(items, f"{sub}item")
        rep = _build_repetition(item, s.get("minItems", 0), s.get("maxItems"), separator_rule='"," space')
        return f'"[" space {rep} "]" space'

    def _resolve_ref(self, ref):
        ref_name = INVALID_RULE_CHARS_RE.sub("-", "ref-" + ref)
        if ref_name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            ref_name = self.visit(self._refs[ref], ref_name)
            self._refs_being_resolved.remove(ref)
        return ref_name

    def _build_object_rule(self, properties, required, name, additional_properties):
        sub = f"{name}{'-' if name else ''}"
        kv, order = {}, []
        for prop_name, prop_schema in properties:
            if prop_name in kv:  # allOf may name a property twice (with the same schema: checked)
                continue
            rule = self.visit(prop_schema, f"{sub}{prop_name}")
            kv[prop_name] = self._add_rule(f"{sub}{prop_name}-kv",
                                           f'{gbnf.literal(json.dumps(prop_name))} space ":" space {rule}')
            order.append(prop_name)
        req = [k for k in order if k in required]
        opt = [k for k in order if k not in required]
        if additional_properties is True or isinstance(additional_properties, dict):
            value = self.visit({} if additional_properties is True else additional_properties,
                               f"{sub}additional-value")
            key_char = self._add_rule("key-char", gbnf.RAW_CHAR)
            key = self._add_rule(f"{sub}additional-k", gbnf.not_strings(order, key_char))
            kv[_ANY_KEY] = self._add_rule(f"{sub}additional-kv", f'{key} space ":" space {value}')
            opt.append(_ANY_KEY)
        rule = '"{" space ' + ' "," space '.join(kv[k] for k in req)
        if opt:
            def rest(ks: list, first_optional: bool) -> str:
                k = ks[0]
                comma = f'( "," space {kv[k]} )'
                if first_optional:
                    out = comma + ("*" if k is _ANY_KEY else "?")
                else:
                    out = kv[k] + (f" {comma}*" if k is _ANY_KEY else "")
                if len(ks) > 1:
                    out += " " + self._add_rule(f"{sub}{k}-rest", rest(ks[1:], True))
                return out

            alts = " | ".join(rest(opt[i:], False) for i in range(len(opt)))
            rule += f' ( "," space ( {alts} ) )?' if req else f" ( {alts} )?"
        return rule + ' "}" space'


def schema_grammar(schema: dict) -> str:
    """GBNF for one JSON value matching `schema` (Refused when a keyword cannot be honoured)."""
    c = Converter()
    c.visit(c.resolve_refs(check(schema), "request"), "")
    return c.format_grammar()


def call_grammar(c: Converter, alternatives: list[tuple[str, dict]], args_key: str, name: str) -> str:
    """The rule (added to `c`) for one call of any of these (tool name, parameters schema): an
    object {"name": <one of them>, args_key: <its arguments>}. Each parameters schema is checked
    and its $refs resolved within itself."""
    alts = []
    for i, (tool, params) in enumerate(alternatives):
        p = check(params or {"type": "object"})
        if not set(p) - set(DEFS):  # arguments are an object even when the schema allows anything
            p = {**p, "type": "object"}
        p = c.resolve_refs(p, f"tool{i}")
        alts.append({"type": "object", "properties": {"name": {"const": tool}, args_key: p},
                     "required": ["name", args_key]})
    return c.visit(alts[0] if len(alts) == 1 else {"anyOf": alts}, name)
