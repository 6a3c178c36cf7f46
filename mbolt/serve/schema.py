"""JSON schemas in requests: every keyword honoured by the reply's grammar or refused with a 400
naming it and where it is (a JSON pointer), as OpenAI's strict mode refuses what it does not
support.

Honoured, as llama.cpp's converter (common/json-schema-to-grammar.cpp) honours them: `type`
(one or a list), `enum`, `const`, `properties`, `required`, `additionalProperties`, `items`,
`prefixItems`, `minItems`, `maxItems`, `minLength`, `maxLength`, `pattern`, `format` (date, time,
date-time, uuid), `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (integers),
`$ref` into the same document, `$defs`/`definitions`, `anyOf`, `oneOf` (when its alternatives
cannot overlap), `allOf` (of object schemas). Annotations (`title`, `description`, `default`,
`examples`, ...) are accepted. Anything else, and combinations the grammar would not honour
(`pattern` with `minLength`, `required` naming no property, ...), is refused.

`check(schema)` validates a schema and returns the copy the grammar is built from (annotations
dropped, exclusive bounds folded into integer `minimum`/`maximum`, `enum` filtered by `type`, the
type its keywords imply where a schema has none). `Converter` is llama-cpp-python's
`SchemaConverter` with the pieces its port lacks or gets wrong taken from llama.cpp's converter
(integer ranges, additional keys that repeat no declared property, a `type` list that keeps the
other keywords, `$ref` rule names) or made exact (`gbnf.py`: patterns, date formats, lengths).
"""

from __future__ import annotations

import json
import math

from mbolt.serve import gbnf

ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly",
               "discriminator", "$anchor"}
ROOT_ONLY = {"$schema", "$id"}
DEFS = ("$defs", "definitions")
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
FAMILY = {  # the keywords that constrain one type
    "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties"),
}
KEYWORD_TYPE = {k: t for t, ks in FAMILY.items() for k in ks}
GENERAL = {"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf"}
FORMATS = ("date", "time", "date-time", "uuid")
_BOUND = 10 ** 15  # llama.cpp's integer rules spell at most 16 digits


class Refused(ValueError):
    """A schema keyword the grammar cannot honour: `keyword` at JSON pointer `path`, and why."""

    def __init__(self, keyword: str, path: str, why: str):
        super().__init__(f"{keyword!r} at {path}: {why}")
        self.keyword, self.path = keyword, path


def _token(name: str) -> str:
    """A name as a JSON pointer spells it."""
    return name.replace("~", "~0").replace("/", "~1")


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(v)]


def _fits(v, types) -> bool:
    t = _json_type(v)
    return t in types or (t == "integer" and "number" in types)


class _Checker:
    def __init__(self, root: dict):
        self.root = root

    def resolve(self, ref: str, path: str) -> dict:
        node = self.root
        for part in ref[2:].split("/") if ref != "#/" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise Refused("$ref", path, f"{ref} does not resolve in this schema")
        if not isinstance(node, dict):
            raise Refused("$ref", path, f"{ref} is not a schema")
        return node

    def schema(self, s, path: str, at_root: bool = False) -> dict:
        if s is True:
            return {}
        if not isinstance(s, dict):
            raise Refused("schema", path, "must be a JSON object (or true)")
        out: dict = {}
        for d in DEFS:
            if d in s:
                if not isinstance(s[d], dict):
                    raise Refused(d, path, "must be an object of schemas")
                out[d] = {k: self.schema(v, f"{path}/{d}/{_token(k)}") for k, v in s[d].items()}
        keys = {k for k in s if k not in ANNOTATIONS and k not in DEFS and not (at_root and k in ROOT_ONLY)}
        for k in sorted(keys):
            if k not in GENERAL and k not in KEYWORD_TYPE:
                raise Refused(k, path, "is not supported by this server")
        if "$ref" in keys:
            return {**out, **self.ref(s, keys, path)}
        if "anyOf" in keys or "oneOf" in keys:
            return {**out, **self.alternatives(s, keys, path)}
        if "allOf" in keys:
            return {**out, **self.all_of(s, keys, path)}
        types = self.types(s, keys, path)
        if "const" in keys or "enum" in keys:
            return {**out, **self.values(s, keys, types, path)}
        if types is None:
            return out  # any value
        for k in sorted(keys - GENERAL):
            if k in FAMILY["integer"] and "number" in types:  # llama.cpp's converter ranges integers only
                raise Refused(k, path, "is honoured on type integer only, not on type number")
            if KEYWORD_TYPE[k] not in types:
                raise Refused(k, path, f"does not apply to type {' or '.join(types)}")
        out["type"] = types[0] if len(types) == 1 else list(types)
        if "integer" in types:
            out.update(self.integer(s, keys, path))
        if "string" in types:
            out.update(self.string(s, keys, path))
        if "array" in types:
            out.update(self.array(s, keys, path))
        if "object" in types:
            out.update(self.object(s, keys, path))
        return out

    def types(self, s: dict, keys: set, path: str) -> tuple[str, ...] | None:
        t = s.get("type")
        if t is None:  # the type the keywords imply (a subset of what the schema accepts)
            implied = sorted({KEYWORD_TYPE[k] for k in keys - GENERAL})
            if len(implied) > 1:
                raise Refused("type", path, f"keywords of several types ({', '.join(implied)}) without a type "
                                            "are not supported")
            return tuple(implied) or None
        ts = [t] if isinstance(t, str) else t
        if not isinstance(ts, list) or not ts or len(set(map(str, ts))) != len(ts) or any(x not in TYPES for x in ts):
            raise Refused("type", path, f"must be one of {', '.join(TYPES)} or a list of them")
        return tuple(ts)

    def ref(self, s: dict, keys: set, path: str) -> dict:
        ref = s["$ref"]
        if keys - {"$ref"}:
            raise Refused(sorted(keys - {"$ref"})[0], path, "beside $ref is not supported")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise Refused("$ref", path, "only references into the same schema (#/...) are supported")
        self.resolve(ref, path)
        return {"$ref": ref}

    def alternatives(self, s: dict, keys: set, path: str) -> dict:
        kind = "oneOf" if "oneOf" in keys else "anyOf"
        if keys - {kind}:
            raise Refused(sorted(keys - {kind})[0], path, f"beside {kind} is not supported")
        alts = s[kind]
        if not isinstance(alts, list) or not alts:
            raise Refused(kind, path, "must be a non-empty list of schemas")
        out = [self.schema(a, f"{path}/{kind}/{i}") for i, a in enumerate(alts)]
        if kind == "oneOf":  # generated as anyOf: a value must not be able to match two alternatives
            for i in range(len(out)):
                for j in range(i + 1, len(out)):
                    if not self.disjoint(out[i], out[j]):
                        raise Refused("oneOf", path, f"alternatives {i} and {j} may both match one value, which "
                                                     "the grammar cannot rule out (use anyOf)")
        return {kind: out}  # the converter takes oneOf as anyOf; the key stays for $ref paths

    def deref(self, s: dict) -> dict:
        seen = 0
        while "$ref" in s and seen < 64:
            s, seen = self.resolve(s["$ref"], "#"), seen + 1
        return s

    def value_types(self, s: dict) -> set[str] | None:
        s = self.deref(s)
        if "anyOf" in s or "oneOf" in s:
            parts = [self.value_types(a if isinstance(a, dict) else {}) for a in s.get("anyOf") or s.get("oneOf")]
            return None if any(p is None for p in parts) else set().union(*parts)
        if "const" in s or "enum" in s:
            return {_json_type(v) for v in ([s["const"]] if "const" in s else s["enum"])}
        t = s.get("type")
        if t is None:
            return None
        ts = set([t] if isinstance(t, str) else t)
        return ts | {"integer"} if "number" in ts else ts

    def values(self, s: dict, keys: set, types, path: str) -> dict:
        if keys - {"const", "enum", "type"}:
            raise Refused(sorted(keys - {"const", "enum", "type"})[0], path, "beside enum or const is not supported")
        vals = s.get("enum")
        if vals is not None and (not isinstance(vals, list) or not vals):
            raise Refused("enum", path, "must be a non-empty list")
        if "const" in s:
            if vals is not None and s["const"] not in vals:
                raise Refused("const", path, "is not among the enum values: no value matches")
            vals = [s["const"]]
        kept = [v for v in vals if types is None or _fits(v, types)]
        if not kept:
            raise Refused("enum" if "enum" in keys else "const", path, f"no value is of type {' or '.join(types)}")
        return {"const": kept[0]} if len(kept) == 1 else {"enum": kept}

    def disjoint(self, a: dict, b: dict) -> bool:
        ta, tb = self.value_types(a), self.value_types(b)
        if ta is not None and tb is not None and not (ta & tb):
            return True
        va, vb = self.finite(a), self.finite(b)
        if va is not None and vb is not None:
            return not (va & vb)
        a, b = self.deref(a), self.deref(b)
        pa, pb = a.get("properties") or {}, b.get("properties") or {}
        for name in set(a.get("required") or ()) & set(b.get("required") or ()):  # a discriminating property
            fa, fb = self.finite(pa.get(name, {})), self.finite(pb.get(name, {}))
            if fa is not None and fb is not None and not (fa & fb):
                return True
        return False

    def finite(self, s: dict) -> set[str] | None:
        s = self.deref(s)
        if "const" in s or "enum" in s:
            vals = [s["const"]] if "const" in s else s["enum"]
            return {json.dumps(int(v) if isinstance(v, float) and v.is_integer() else v, sort_keys=True)
                    for v in vals}  # 1 and 1.0 are one value to a validator
        return None

    def all_of(self, s: dict, keys: set, path: str) -> dict:
        if keys - {"allOf"} - ({"type"} if s.get("type") == "object" else set()):
            raise Refused(sorted(keys - {"allOf", "type"})[0], path, "beside allOf is not supported")
        parts = s["allOf"]
        if not isinstance(parts, list) or not parts:
            raise Refused("allOf", path, "must be a non-empty list of schemas")
        out, props = [], {}
        for i, p in enumerate(parts):
            where = f"{path}/allOf/{i}"
            c = self.schema(p, where)
            target, hops = c, 0
            while "$ref" in target and hops < 64:  # the referenced schema, checked like any other
                target, hops = self.schema(self.resolve(target["$ref"], where), where), hops + 1
            extra = set(target) - {"type", "properties", "required", *DEFS} - (
                {"additionalProperties"} if target.get("additionalProperties", True) is True else set())
            if target.get("type", "object") != "object" or extra or hops > 1:  # the port follows one $ref
                raise Refused("allOf", where, "only object schemas (properties, required) can be combined")
            for name, sub in (target.get("properties") or {}).items():
                if name in props and props[name] != sub:
                    raise Refused("allOf", where, f"property {name!r} is defined twice, differently")
                props[name] = sub
            out.append(c)
        return {"allOf": out}

    def integer(self, s: dict, keys: set, path: str) -> dict:
        lo = hi = None
        for k in FAMILY["integer"]:
            if k not in keys:
                continue
            v = s[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise Refused(k, path, "must be a number")
            if abs(v) > _BOUND:
                raise Refused(k, path, "bounds beyond ±10^15 are not supported")
            if k == "minimum":
                lo = max(lo, math.ceil(v)) if lo is not None else math.ceil(v)
            elif k == "exclusiveMinimum":
                lo = max(lo, math.floor(v) + 1) if lo is not None else math.floor(v) + 1
            elif k == "maximum":
                hi = min(hi, math.floor(v)) if hi is not None else math.floor(v)
            else:
                hi = min(hi, math.ceil(v) - 1) if hi is not None else math.ceil(v) - 1
        if lo is not None and hi is not None and lo > hi:
            raise Refused("minimum" if "minimum" in keys else "exclusiveMinimum", path, "no integer is in range")
        return {k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None}

    def count(self, s: dict, k: str, path: str) -> int:
        v = s[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise Refused(k, path, "must be a non-negative integer")
        if v > 1000:
            raise Refused(k, path, "counts above 1000 are not supported")
        return v

    def string(self, s: dict, keys: set, path: str) -> dict:
        out = {}
        given = [k for k in ("pattern", "format") if k in keys]
        lengths = [k for k in ("minLength", "maxLength") if k in keys]
        if len(given) > 1 or (given and lengths):
            raise Refused((given + lengths)[1], path, f"together with {given[0]} is not supported")
        if "pattern" in keys:
            if not isinstance(s["pattern"], str):
                raise Refused("pattern", path, "must be a string")
            try:
                gbnf.pattern(s["pattern"])
            except ValueError as e:
                raise Refused("pattern", path, str(e)) from None
            out["pattern"] = s["pattern"]
        if "format" in keys:
            if s["format"] not in FORMATS:
                raise Refused("format", path, f"{s['format']!r} is not supported (honoured: {', '.join(FORMATS)})")
            out["format"] = s["format"]
        for k in lengths:
            out[k] = self.count(s, k, path)
        if out.get("minLength", 0) > out.get("maxLength", math.inf):
            raise Refused("minLength", path, "is above maxLength")
        return out

    def array(self, s: dict, keys: set, path: str) -> dict:
        out = {k: self.count(s, k, path) for k in ("minItems", "maxItems") if k in keys}
        if out.get("minItems", 0) > out.get("maxItems", math.inf):
            raise Refused("minItems", path, "is above maxItems")
        if "items" in keys and "prefixItems" in keys:
            raise Refused("prefixItems", path, "together with items is not supported")
        key = "items" if "items" in keys else "prefixItems" if "prefixItems" in keys else None
        items = s.get(key, {})
        if isinstance(items, list):  # a tuple: exactly these items
            if not (out.get("minItems", 0) <= len(items) <= out.get("maxItems", math.inf)):
                raise Refused("minItems" if out.get("minItems", 0) > len(items) else "maxItems", path,
                              f"disagrees with the {len(items)} items of {key}")
            return {key: [self.schema(x, f"{path}/{key}/{i}") for i, x in enumerate(items)]}
        out["items"] = self.schema(items, f"{path}/{key}") if key else {}
        return out

    def object(self, s: dict, keys: set, path: str) -> dict:
        out: dict = {}
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise Refused("properties", path, "must be an object of schemas")
        if "properties" in keys:
            out["properties"] = {k: self.schema(v, f"{path}/properties/{_token(k)}") for k, v in props.items()}
        req = s.get("required", [])
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req) or len(set(req)) != len(req):
            raise Refused("required", path, "must be a list of distinct property names")
        missing = [r for r in req if r not in props]
        if missing:  # the grammar writes declared properties only
            raise Refused("required", path, f"names {missing[0]!r}, which is not among properties")
        if req:
            out["required"] = req
        if "additionalProperties" in keys:
            ap = s["additionalProperties"]
            if ap is False:
                out["additionalProperties"] = False
            elif ap is True or isinstance(ap, dict):
                out["additionalProperties"] = self.schema(ap, f"{path}/additionalProperties")
            else:
                raise Refused("additionalProperties", path, "must be a boolean or a schema")
        return out


def check(schema) -> dict:
    """The schema the grammar is built from; `Refused` names the first keyword it cannot honour."""
    try:
        return _Checker(schema if isinstance(schema, dict) else {}).schema(schema, "#", at_root=True)
    except RecursionError:
        raise Refused("schema", "#", "is nested too deeply (or its $refs loop)") from None
