"""A JSON Schema as a regular expression: its full matches are JSON texts the schema allows.

`schema_to_regex` turns a schema into a regex over the JSON text a model writes (as
outlines and vLLM's structured outputs do); `json_object_regex` is OpenAI's
`response_format {"type": "json_object"}`. The regex uses only the dialect
specserve/structured/regex.py compiles (which is also Python's `re`): literals and the
usual escapes, `.`, classes, `(?:...)`, `|` and greedy quantifiers; no anchors,
lookarounds or backreferences.

Every full match is valid JSON that the schema accepts; the converse holds up to these
documented narrowings, each of which keeps the answer valid:
- `whitespace` goes between the tokens of objects and arrays, never before or after
  the whole text.
- Objects with `properties` list only those, in their declared order; the ones in
  `required` must appear, the others may be left out. `additionalProperties` is then
  not read (as outlines does). Without `properties`, any keys, with values of
  `additionalProperties`' schema (any value if absent or true; `{}` if false).
- A schema with no constraint (`{}`, `true`, a missing `items`) is any JSON value
  nested at most `max_depth` deep (0: no arrays or objects); each level of a schema's
  own arrays and objects takes one from that depth. In `schema_levels` it nests to any
  depth, unless it is inside one of several alternatives (`anyOf`, `oneOf`).
- Numeric bounds (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`,
  `multipleOf`) are not enforced (vLLM's outlines backend does not enforce them
  either); the type (integer or number) is. Integers are written without a fraction
  or exponent.
- `pattern` is matched against the whole string, as if written `^...$` (as outlines
  does), not searched for; it may use only the dialect above, and is applied to the
  string's value: characters JSON must escape are written the way `json.dumps` escapes
  them. `\\d`, `\\w` and `\\s` are ASCII. A pattern with `minLength`/`maxLength` raises.
- `minLength`/`maxLength` count characters, an escape (`\\n`, `\\u00e9`) as one.
- `format` is an annotation: "date", "time" (RFC 3339, with an offset), "date-time" and
  "uuid" are enforced when they are a string's only constraint; every other format,
  and these beside `pattern` or a length, are ignored.
- `enum` and `const` values are written as `json.dumps` writes them (strings with or
  without `ensure_ascii`), with `whitespace` inside arrays and objects, so the default
  form, the compact one and an indented one all match. Only `type` beside them is read:
  the values of other types are dropped.
- `anyOf` and `oneOf` are alternations (oneOf's exclusivity is not enforced); keywords
  beside them are merged into each alternative, as they are into `$ref`'s target and
  into an `allOf` of exactly one schema (a keyword on both sides raises, but `type`,
  which is intersected).
- `$ref` is a JSON pointer into the root schema (`#/$defs/NAME`, `#/definitions/NAME`,
  `#`). `schema_to_regex` raises for a reference to a schema it is already inside;
  `schema_levels` reads it as a call of that schema's own level (structured/nested.py),
  where the schema is an object or an array and the reference stands alone.
- Annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`,
  `$comment`, `deprecated`, `readOnly`, `writeOnly`, and OpenAPI's `discriminator`,
  which `oneOf`'s branches already pin) are ignored, as is `uniqueItems: false`.

Everything else raises ConfigError naming the keyword and where it is as a JSON pointer:
`minProperties`, `maxProperties`, `patternProperties`, `propertyNames`,
`dependentRequired`, `dependentSchemas`, `unevaluatedProperties`, `uniqueItems: true`,
`contains`, `not`, `if`, an `allOf` of several schemas, an `items` list, external
references, the `false` schema, a count past `MAX_REPEAT` (the regex compiler copies a
bounded repeat out) and a regex past `MAX_REGEX_CHARS`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from specserve.errors import ConfigError
from specserve.structured.regex import MAX_REPEAT, escaped, escaped_char, merged_intervals

WHITESPACE = r"[ \t\n\r]*"  # between JSON tokens, as a generator writes them (pretty-printed or compact)
MAX_REGEX_CHARS = 200_000

# A character of a JSON string: anything but a quote, a backslash or a control, or an escape.
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"
PRIMITIVE = f"(?:{STRING}|{NUMBER}|true|false|null)"

# Days per month, and February 29th in leap years only (every 4th, but every 400th of the 100th).
_MONTH_DAY = r"(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_DATE = f"(?:[0-9]{{4}}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[zZ]|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_HEX = "[0-9a-fA-F]"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[tT]{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
}

TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly"}
    | {"writeOnly", "discriminator"}
)
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
APPLICATORS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"})
KNOWN = ANNOTATIONS | STRING_KEYWORDS | NUMBER_KEYWORDS | OBJECT_KEYWORDS | ARRAY_KEYWORDS | APPLICATORS
IGNORED = ANNOTATIONS | {"$defs", "definitions"}  # read only through a $ref, or not at all


def schema_to_regex(schema: dict | bool, whitespace: str = WHITESPACE, max_depth: int = 4) -> str:
    """The regex whose full matches are the JSON texts `schema` allows (see the module
    docstring for what is enforced); ConfigError for a schema it cannot express."""
    _check_options(whitespace, max_depth)
    compiler = _Compiler(schema, whitespace)
    return _sized(compiler.compile(schema, "#", max_depth, ("#",)))


def json_object_regex(whitespace: str = WHITESPACE, max_depth: int = 4) -> str:
    """Any JSON object, arrays and objects nested at most `max_depth` deep (itself included)."""
    _check_options(whitespace, max_depth)
    compiler = _Compiler({}, whitespace)
    return _sized(compiler.any_object(compiler.generic(max(max_depth - 1, 0))))


# What a nested object or array reads as at its parent's level (Unicode noncharacters,
# which no string may hold): JSON mode's levels (`json_object_levels`, nested.py). A
# recursive schema's levels are called by the noncharacters after these.
CALL_OBJECT, CALL_ARRAY = "\ufdd0", "\ufdd1"
SCHEMA_CALLS = [chr(code) for code in range(0xFDD2, 0xFDF0)]
OPEN_VALUE = f"(?:{PRIMITIVE}|{CALL_OBJECT}|{CALL_ARRAY})"  # any value, in levels: JSON mode's calls


def schema_levels(
    schema: dict | bool, whitespace: str = WHITESPACE, max_depth: int = 4
) -> tuple[list[str], dict[int, str]]:
    """A schema's levels (structured/nested.py): the regex of the schema and of each
    schema a `$ref` inside itself points to, level 0 the whole schema's, each such
    reference read as the call character of its schema's level, and where an open value
    (`{}`, `true`, `additionalProperties` left open) is inside no alternatives, JSON
    mode's object and array levels (`OPEN_VALUE`); and the call character of each level
    called. A schema with neither is one level, its regex `schema_to_regex`'s, with no
    calls."""
    _check_options(whitespace, max_depth)
    compiler = _Compiler(schema, whitespace, calls={})
    regexes = {"#": _sized(compiler.compile(schema, "#", max_depth, ("#",)))}
    while pending := [pointer for pointer in compiler.calls if pointer not in regexes]:
        _, target = compiler._resolve(pending[0], pending[0])  # a level's own references to itself: calls
        regexes[pending[0]] = _sized(compiler.compile(target, pending[0], max_depth, (pending[0],)))
    order = list(regexes)  # "#" first
    levels = [regexes[p] for p in order]
    calls = {order.index(p): char for p, char in compiler.calls.items()}
    if compiler.opens_values:  # JSON mode's object and array levels after the schema's
        _, obj, array = json_object_levels(whitespace)
        calls |= {len(levels): CALL_OBJECT, len(levels) + 1: CALL_ARRAY}
        levels += [obj, array]
    return levels, calls


def json_object_levels(whitespace: str = WHITESPACE) -> tuple[str, str, str]:
    """The regexes of any JSON object's levels, nested to any depth (structured/nested.py):
    the document (one object), an object and an array, each from its opening bracket
    through its closing one, a nested value in them read as CALL_OBJECT or CALL_ARRAY."""
    _check_options(whitespace, 0)
    compiler = _Compiler({}, whitespace)
    return CALL_OBJECT, compiler.any_object(OPEN_VALUE), compiler.any_array(OPEN_VALUE)


def _check_options(whitespace: str, max_depth: int) -> None:
    if not isinstance(whitespace, str):
        raise ConfigError(f"whitespace must be a regex string, not {type(whitespace).__name__}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ConfigError(f"max_depth must be a whole number >= 0, not {max_depth!r}")


def _sized(regex: str, copies: int = 1) -> str:
    """`regex`, unless it, repeated `copies` times, passes MAX_REGEX_CHARS (the regex
    compiler copies a bounded repeat out once per count)."""
    if len(regex) * max(copies, 1) > MAX_REGEX_CHARS:
        raise ConfigError(
            f"the schema is too large for structured outputs: its regex would pass {MAX_REGEX_CHARS} characters "
            "(lower maxItems/minItems, or max_depth for the values it leaves open)"
        )
    return regex


def _unsupported(keyword: str, where: str) -> ConfigError:
    return ConfigError(f"JSON schema keyword '{keyword}' at {where} is not supported by structured outputs")


def _pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _alternation(alternatives: list[str]) -> str:
    unique = list(dict.fromkeys(alternatives))
    return unique[0] if len(unique) == 1 else "(?:" + "|".join(unique) + ")"


def _repeat(atom: str, low: int, high: int | None) -> str:
    """`atom` (one group or class) `low` to `high` times (None: unbounded)."""
    if high is None:
        return atom + ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
    if high == low:
        return "" if low == 0 else atom if low == 1 else f"{atom}{{{low}}}"
    return atom + ("?" if (low, high) == (0, 1) else f"{{{low},{high}}}")


# -- literals


def _string_literal(text: str) -> str:
    """The JSON string `text` as json.dumps writes it, with or without ensure_ascii."""
    return _alternation([escaped(json.dumps(text)), escaped(json.dumps(text, ensure_ascii=False))])


def _is_type(value: Any, kind: str) -> bool:
    """Whether a Python value from json.loads is an instance of a JSON Schema type."""
    if kind in ("integer", "number") and (isinstance(value, bool) or not isinstance(value, int | float)):
        return False
    if kind == "integer":
        return isinstance(value, int) or value.is_integer()
    kinds = {"number": (int, float), "string": str, "boolean": bool, "array": (list, tuple), "object": dict}
    return value is None if kind == "null" else isinstance(value, kinds[kind])


def _types(value: Any, where: str) -> list[str]:
    """`type` as a list of distinct names, "integer" dropped beside "number" (which covers it)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or any(name not in TYPES for name in names):
        raise ConfigError(f"JSON schema keyword 'type' at {where} must be one of {', '.join(TYPES)} or a list of them")
    names = list(dict.fromkeys(names))
    return [name for name in names if not (name == "integer" and "number" in names)]


def _intersect_types(first: Any, second: Any, where: str) -> list[str]:
    def covers(names: list[str], name: str) -> bool:
        return name in names or (name == "integer" and "number" in names)

    a, b = _types(first, where), _types(second, where)
    both = [name for name in dict.fromkeys(a + b) if covers(a, name) and covers(b, name)]
    return [name for name in both if not (name == "integer" and "number" in both)]


def _count(schema: dict, keyword: str, where: str) -> int | None:
    value = schema.get(keyword)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"JSON schema keyword '{keyword}' at {where} must be a whole number >= 0, not {value!r}")
    if value > MAX_REPEAT:
        raise ConfigError(
            f"JSON schema keyword '{keyword}' at {where} is {value}; structured outputs count up to {MAX_REPEAT}"
        )
    return value


def _bounds(schema: dict, low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
    low, high = _count(schema, low_key, where) or 0, _count(schema, high_key, where)
    if high is not None and high < low:
        raise ConfigError(f"JSON schema at {where} has '{low_key}' {low} above '{high_key}' {high}: no value fits")
    return low, high


def _string_list(schema: dict, keyword: str, where: str) -> list[str]:
    value = schema.get(keyword, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"JSON schema keyword '{keyword}' at {where} must be a list of strings")
    return list(dict.fromkeys(value))


# -- schemas


@dataclass
class _Compiler:
    root: Any  # what `$ref`s point into
    ws: str
    # Where recursion is read as calls (`schema_levels`): each pointer called, with its
    # level's call character; None: a recursive reference raises.
    calls: dict[str, str] | None = None
    # Where an open value is read as JSON mode's levels (`schema_levels`): whether one was.
    opens_values: bool = False
    _generic: dict[int, str] = field(default_factory=dict)
    _beside: bool = False  # compiling inside one of several alternatives (see `generic`)

    @property
    def sep(self) -> str:
        return f"{self.ws},{self.ws}"

    def compile(self, schema: Any, where: str, depth: int, refs: tuple[str, ...]) -> str:
        """The regex of `schema` found at `where`; `depth` bounds the nesting it leaves
        open, `refs` are the pointers of the `$ref`s being expanded."""
        if schema is True:
            return self.generic(depth)
        if schema is False:
            raise ConfigError(f"the JSON schema at {where} is false, which no value satisfies")
        if not isinstance(schema, dict):
            raise ConfigError(f"the JSON schema at {where} must be an object or a boolean, not {type(schema).__name__}")
        _check_keywords(schema, where)
        schema = _stripped(schema)
        if "$ref" in schema:
            return self._ref(schema, where, depth, refs)
        if "allOf" in schema:
            return self._all_of(schema, where, depth, refs)
        if "anyOf" in schema or "oneOf" in schema:
            return self._any_of(schema, where, depth, refs)
        if "enum" in schema or "const" in schema:
            return self._enum(schema, where)
        return self._typed(schema, where, depth, refs)

    # combinators

    def _ref(self, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        ref = schema["$ref"]
        pointer, target = self._resolve(ref, where)
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        if pointer in refs:
            return self._call(pointer, ref, where, rest)
        refs = (*refs, pointer)
        if target is True and rest:
            return self.compile(rest, where, depth, refs)
        if not rest or not isinstance(target, dict):
            return self.compile(target, pointer, depth, refs)  # raises for false and for a non-schema
        _check_keywords(target, pointer)
        return self.compile(self._merged(target, rest, where, "$ref"), pointer, depth, refs)

    def _call(self, pointer: str, ref: str, where: str, rest: dict) -> str:
        """The call character of the recursive reference to `pointer` (see `calls`)."""
        if self.calls is None:
            raise ConfigError(
                f"recursive schemas are not supported here: '$ref' {ref!r} at {where} refers to a schema it is inside"
            )
        if rest:
            raise ConfigError(
                f"a recursive '$ref' must stand alone, but {ref!r} at {where} has {sorted(rest)} beside it"
            )
        if pointer not in self.calls:
            if len(self.calls) == len(SCHEMA_CALLS):
                raise ConfigError(f"the schema recurses through more than {len(SCHEMA_CALLS)} schemas")
            self.calls[pointer] = SCHEMA_CALLS[len(self.calls)]
        return self.calls[pointer]

    def _resolve(self, ref: Any, where: str) -> tuple[str, Any]:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ConfigError(
                f"'$ref' {ref!r} at {where} is not supported by structured outputs: only references into the "
                "schema itself ('#/$defs/NAME') are"
            )
        pointer = unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise ConfigError(f"'$ref' {ref!r} at {where} is not a JSON pointer ('#/$defs/NAME')")
        node = self.root
        for token in pointer.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise ConfigError(f"'$ref' {ref!r} at {where} points to nothing in the schema")
        return "#" + pointer, node

    def _merged(self, base: dict, extra: dict, where: str, beside: str) -> dict:
        merged = self._merge(base, extra, where, beside)
        if merged is None:
            raise ConfigError(f"the JSON schema at {where} allows no type beside '{beside}': no value satisfies it")
        return merged

    @staticmethod
    def _merge(base: dict, extra: dict, where: str, beside: str) -> dict | None:
        """Both schemas' keywords (None where their types do not meet)."""
        merged, extra = _stripped(base), _stripped(extra)
        for one, other in ((merged, extra), (extra, merged)):
            # These read their neighbours in their own schema only: merged, they would read the other's.
            for keyword, neighbour in (("additionalProperties", "properties"), ("items", "prefixItems")):
                if one.get(keyword, True) not in (True, {}) and neighbour in other and neighbour not in one:
                    raise ConfigError(
                        f"JSON schema keyword '{keyword}' at {where} is set on one side of '{beside}' and "
                        f"'{neighbour}' on the other, which structured outputs cannot combine"
                    )
        for key, value in extra.items():
            if key == "type" and key in merged:
                merged[key] = _intersect_types(merged[key], value, where)
                if not merged[key]:
                    return None
            elif key in merged and merged[key] != value:
                raise ConfigError(
                    f"JSON schema keyword '{key}' at {where} is set both beside and inside '{beside}', "
                    "which structured outputs cannot combine"
                )
            else:
                merged[key] = value
        return merged

    def _all_of(self, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        subschemas = schema["allOf"]
        if not isinstance(subschemas, list) or len(subschemas) != 1:
            raise ConfigError(
                f"JSON schema keyword 'allOf' at {where} is supported by structured outputs only with one subschema"
            )
        rest = {k: v for k, v in schema.items() if k != "allOf"}
        inner, inner_where = subschemas[0], f"{where}/allOf/0"
        if inner is True:
            return self.compile(rest, where, depth, refs)
        if not isinstance(inner, dict) or not rest:
            return self.compile(inner, inner_where, depth, refs)
        _check_keywords(inner, inner_where)
        return self.compile(self._merged(rest, inner, inner_where, "allOf"), inner_where, depth, refs)

    def _any_of(self, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        if "anyOf" in schema and "oneOf" in schema:
            raise ConfigError(f"JSON schema keywords 'anyOf' and 'oneOf' together at {where} are not supported")
        keyword = "anyOf" if "anyOf" in schema else "oneOf"
        subschemas = schema[keyword]
        if not isinstance(subschemas, list) or not subschemas:
            raise ConfigError(f"JSON schema keyword '{keyword}' at {where} must be a non-empty list of schemas")
        rest = {k: v for k, v in schema.items() if k != keyword}
        alternatives = []
        beside, self._beside = self._beside, self._beside or len(subschemas) > 1
        for i, inner in enumerate(subschemas):
            inner_where = f"{where}/{keyword}/{i}"
            if inner is False:
                continue
            if isinstance(inner, dict) and rest:
                _check_keywords(inner, inner_where)
                inner = self._merge(rest, inner, inner_where, keyword)
                if inner is None:  # an alternative of another type than the siblings allow
                    continue
            alternatives.append(self.compile(rest if inner is True else inner, inner_where, depth, refs))
        self._beside = beside
        if not alternatives:
            raise ConfigError(f"no alternative of '{keyword}' at {where} can be satisfied")
        return _alternation(alternatives)

    # values

    def _enum(self, schema: dict, where: str) -> str:
        if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise ConfigError(f"JSON schema keyword 'enum' at {where} must be a non-empty list")
        values = schema["enum"] if "const" not in schema else [schema["const"]]
        if "const" in schema and "enum" in schema:
            keys = {json.dumps(v, sort_keys=True) for v in schema["enum"]}
            values = [v for v in values if json.dumps(v, sort_keys=True) in keys]
        if "type" in schema:
            types = _types(schema["type"], where)
            values = [v for v in values if any(_is_type(v, t) for t in types)]
        if not values:
            raise ConfigError(f"no value of 'enum'/'const' at {where} has the schema's 'type'")
        return _alternation([self._value(v, where) for v in values])

    def _value(self, value: Any, where: str) -> str:
        """One JSON value, exactly, with whitespace between the tokens of its arrays and objects."""
        if value is None or isinstance(value, bool):
            return json.dumps(value)
        if isinstance(value, int | float):
            if not math.isfinite(value):
                raise ConfigError(f"'enum'/'const' at {where} holds {value}, which JSON cannot write")
            return escaped(json.dumps(value))
        if isinstance(value, str):
            return _string_literal(value)
        if isinstance(value, list | tuple):
            items = self.sep.join(self._value(v, where) for v in value)
            return f"\\[{self.ws}{items}{self.ws if items else ''}\\]"
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            members = self.sep.join(
                f"{_string_literal(k)}{self.ws}:{self.ws}{self._value(v, where)}" for k, v in value.items()
            )
            return f"\\{{{self.ws}{members}{self.ws if members else ''}\\}}"
        raise ConfigError(f"'enum'/'const' at {where} holds {value!r}, which is not a JSON value")

    def _typed(self, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        if "type" in schema:
            types = _types(schema["type"], where)
        else:  # the types the keywords constrain; with none, any value
            implied = [("object", OBJECT_KEYWORDS), ("array", ARRAY_KEYWORDS), ("string", STRING_KEYWORDS)]
            implied.append(("number", NUMBER_KEYWORDS))
            types = [name for name, keywords in implied if keywords & schema.keys()]
            if not types:
                return self.generic(depth)
        return _alternation([self._one_type(name, schema, where, depth, refs) for name in types])

    def _one_type(self, name: str, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        if name == "object":
            return self._object(schema, where, max(depth - 1, 0), refs)
        if name == "array":
            return self._array(schema, where, max(depth - 1, 0), refs)
        if name == "string":
            return self._string(schema, where)
        return {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}[name]

    def _string(self, schema: dict, where: str) -> str:
        low, high = _bounds(schema, "minLength", "maxLength", where)
        pattern, form = schema.get("pattern"), schema.get("format")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise ConfigError(f"JSON schema keyword 'pattern' at {where} must be a string")
            if "minLength" in schema or "maxLength" in schema:
                raise ConfigError(
                    f"JSON schema keywords 'pattern' and 'minLength'/'maxLength' together at {where} are not "
                    "supported by structured outputs; put the length in the pattern"
                )
            return f'"(?:{_PatternTranslator(pattern, where).translate()})"'
        if form is not None and not isinstance(form, str):
            raise ConfigError(f"JSON schema keyword 'format' at {where} must be a string")
        if form in FORMATS and "minLength" not in schema and "maxLength" not in schema:
            return f'"{FORMATS[form]}"'
        return f'"{_repeat(STRING_CHAR, low, high)}"'

    def _object(self, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        """An object; `depth` bounds its values."""
        required = _string_list(schema, "required", where)
        properties = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if not isinstance(extra, bool | dict):
            raise ConfigError(f"JSON schema keyword 'additionalProperties' at {where} must be a schema")
        if properties is None:
            if required:
                raise ConfigError(
                    f"JSON schema keyword 'required' at {where} needs 'properties' naming those keys "
                    "for structured outputs"
                )
            if extra is False:
                return f"\\{{{self.ws}\\}}"
            return self.any_object(self.compile(extra, f"{where}/additionalProperties", depth, refs))
        if not isinstance(properties, dict):
            raise ConfigError(f"JSON schema keyword 'properties' at {where} must be an object")
        missing = [name for name in required if name not in properties]
        if missing:
            raise ConfigError(
                f"JSON schema keyword 'required' at {where} names {missing[0]!r}, not in its 'properties'"
            )
        members = []
        for name, inner in properties.items():
            if inner is False and name not in required:  # a property that may never appear
                continue
            value = self.compile(inner, f"{where}/properties/{_pointer_token(name)}", depth, refs)
            members.append((f"{_string_literal(name)}{self.ws}:{self.ws}{value}", name in required))
        return f"\\{{{self.ws}{self._members(members)}\\}}"

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """The declared members in order, each (regex, required), with the whitespace
        after the last; commas only between the members present."""
        if not members:
            return ""
        required = [i for i, (_, needed) in enumerate(members) if needed]
        if required:  # the first required member anchors the commas: after those before it, before those after
            first = required[0]
            before = "".join(f"(?:{member}{self.sep})?" for member, _ in members[:first])
            after = "".join(
                f"{self.sep}{member}" if needed else f"(?:{self.sep}{member})?"
                for member, needed in members[first + 1 :]
            )
            return f"{before}{members[first][0]}{after}{self.ws}"
        # Some of the first k, none required: (some of the first k-1, then maybe member k) or member k alone.
        some = members[0][0]
        for member, _ in members[1:]:
            some = f"(?:{some}(?:{self.sep}{member})?|{member})"
        return f"(?:{some}{self.ws})?"

    def _array(self, schema: dict, where: str, depth: int, refs: tuple[str, ...]) -> str:
        """An array; `depth` bounds its items."""
        low, high = _bounds(schema, "minItems", "maxItems", where)
        prefix_schemas = schema.get("prefixItems", [])
        if not isinstance(prefix_schemas, list):
            raise ConfigError(f"JSON schema keyword 'prefixItems' at {where} must be a list of schemas")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise ConfigError(
                f"JSON schema keyword 'items' at {where} is a list (the old tuple form); "
                "structured outputs support 'prefixItems' for that"
            )
        prefix = [self.compile(s, f"{where}/prefixItems/{i}", depth, refs) for i, s in enumerate(prefix_schemas)]
        rest = None if items is False else self.compile(items, f"{where}/items", depth, refs)
        if high is not None:
            prefix = prefix[:high]
        if rest is None and low > len(prefix):
            raise ConfigError(f"JSON schema at {where} needs {low} items but allows {len(prefix)}: no array fits")
        if high == 0 or (rest is None and not prefix):
            return f"\\[{self.ws}\\]"
        items_regex = self._items(prefix, rest, low, high)
        if low:
            return f"\\[{self.ws}{items_regex}{self.ws}\\]"
        return f"\\[{self.ws}(?:{items_regex}{self.ws})?\\]"

    def _items(self, prefix: list[str], rest: str | None, low: int, high: int | None) -> str:
        """At least one item: the prefix items in order, then any number of `rest`, the
        count between `low` and `high`; the first item has no comma before it."""
        if not prefix:
            assert rest is not None
            more = _repeat(f"(?:{self.sep}{rest})", max(low - 1, 0), None if high is None else high - 1)
            return _sized(rest + more, max(low, high or 0))
        tail = ""
        if rest is not None and (high is None or high > len(prefix)):
            extra_high = None if high is None else high - len(prefix)
            tail = _repeat(f"(?:{self.sep}{rest})", max(low - len(prefix), 0), extra_high)
        for i in range(len(prefix) - 1, 0, -1):
            body = f"{self.sep}{prefix[i]}{tail}"
            tail = body if i < low else f"(?:{body})?"
        return _sized(prefix[0] + tail, max(low, high or 0) - len(prefix))

    # any value

    def generic(self, depth: int) -> str:
        """Any JSON value, arrays and objects nested at most `depth` deep; in levels
        (`calls` set), nested to any depth as JSON mode's levels are, by their calls,
        unless it is inside one of several alternatives: after a bracket both may have
        written, a pushdown guide could not tell an object of a call's from one of
        another alternative's."""
        if self.calls is not None and not self._beside:
            self.opens_values = True
            return OPEN_VALUE
        if depth not in self._generic:
            if depth == 0:
                self._generic[depth] = PRIMITIVE
            else:
                inner = self.generic(depth - 1)
                containers = f"{self.any_object(inner)}|{self.any_array(inner)}"
                self._generic[depth] = _sized(f"(?:{STRING}|{NUMBER}|true|false|null|{containers})")
        return self._generic[depth]

    def any_object(self, value: str) -> str:
        """An object with any keys, its values matching `value`."""
        member = f"{STRING}{self.ws}:{self.ws}{value}"
        return _sized(f"\\{{{self.ws}(?:{member}(?:{self.sep}{member})*{self.ws})?\\}}")

    def any_array(self, value: str) -> str:
        return _sized(f"\\[{self.ws}(?:{value}(?:{self.sep}{value})*{self.ws})?\\]")


def _check_keywords(schema: dict, where: str) -> None:
    for key, value in schema.items():
        if key not in KNOWN or (key == "uniqueItems" and value is not False):
            raise _unsupported(str(key), where)


def _stripped(schema: dict) -> dict:
    """The keywords that constrain, without annotations and definitions."""
    return {k: v for k, v in schema.items() if k not in IGNORED and not (k == "uniqueItems" and v is False)}


# -- pattern


# The characters a JSON string cannot hold raw: the controls, the quote and the backslash.
SPECIAL = (*range(0x20), 0x22, 0x5C)
SHORT_ESCAPES = {0x22: '"', 0x5C: "\\\\", 0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r"}
RAW_EXCLUDED = r'"\\\x00-\x1f'  # inside a class: what SPECIAL is
ASCII_SPACE = (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20)
# Inside a class, spelled out so that every engine reads them as ASCII; \S's raw complement is a space.
SHORTHAND_BODIES = {"d": "0-9", "w": "0-9A-Z_a-z", "s": " ", "D": "0-9", "W": "0-9A-Z_a-z", "S": " "}
CONTROLS = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}
QUANTIFIER = re.compile(r"\{([0-9]+)(?:(,)([0-9]*))?\}")


@dataclass
class _CharSet:
    """The characters one atom of a pattern matches: code point ranges and shorthand
    letters (d w s D W S), or the complement of those."""

    ranges: list[tuple[int, int]]
    shorthands: list[str]
    negated: bool = False

    def has(self, code: int) -> bool:
        """Whether a SPECIAL code point is in the set (no digit or word character is special)."""
        in_shorthand = {"d": False, "w": False, "s": code in ASCII_SPACE, "D": True, "W": True}
        in_shorthand["S"] = not in_shorthand["s"]
        hit = any(lo <= code <= hi for lo, hi in self.ranges) or any(in_shorthand[s] for s in self.shorthands)
        return hit != self.negated


def _without_special(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in ranges:
        lo = max(lo, 0x20)
        for cut in (0x22, 0x5C):
            if lo <= cut <= hi:
                if lo < cut:
                    out.append((lo, cut - 1))
                lo = cut + 1
        if lo <= hi:
            out.append((lo, hi))
    return out


def _class_body(ranges: list[tuple[int, int]]) -> str:
    parts = []
    for lo, hi in merged_intervals(ranges):
        parts.append(escaped_char(lo, in_class=True))
        if hi > lo:
            parts.append(("-" if hi > lo + 1 else "") + escaped_char(hi, in_class=True))
    return "".join(parts)


def _special_regex(codes: list[int]) -> str:
    """The JSON escapes (as json.dumps writes them) of special characters, one alternative each group."""
    letters = [SHORT_ESCAPES[c] for c in codes if c in SHORT_ESCAPES]
    alternatives = []
    if letters:
        alternatives.append(r"\\" + (letters[0] if len(letters) == 1 else f"[{''.join(letters)}]"))
    for high in (0, 1):
        lows = [f"{c & 0xF:x}" for c in codes if c not in SHORT_ESCAPES and c >> 4 == high]
        if lows:
            alternatives.append(rf"\\u00{high}" + (lows[0] if len(lows) == 1 else f"[{''.join(lows)}]"))
    return "|".join(alternatives)


class _PatternTranslator:
    """A schema's `pattern`, over a string's value, as a regex over its JSON text: the
    same structure, each character atom also matching the escapes of the special
    characters it matches and never them raw."""

    def __init__(self, pattern: str, where: str):
        self.pattern, self.where, self.at = pattern, where, 0

    def fail(self, what: str) -> ConfigError:
        return ConfigError(
            f"JSON schema keyword 'pattern' at {self.where} uses {what}, which structured outputs do not support "
            f"(pattern {self.pattern!r})"
        )

    def peek(self, offset: int = 0) -> str:
        return self.pattern[self.at + offset : self.at + offset + 1]

    def translate(self) -> str:
        out: list[str] = []
        depth, repeatable, branch_start = 0, False, True
        while self.at < len(self.pattern):
            char = self.peek()
            if char == "^" and depth == 0 and branch_start:  # a full match already starts there
                self.at += 1
                continue
            if char == "$" and depth == 0 and self.peek(1) in ("", "|"):
                self.at += 1
                repeatable = False
                continue
            if char in "^$":
                raise self.fail(f"the anchor {char!r} inside the pattern")
            branch_start = False
            if char == "|":
                out.append("|")
                repeatable, branch_start = False, depth == 0
                self.at += 1
            elif char == "(":
                if self.pattern.startswith("(?", self.at) and not self.pattern.startswith("(?:", self.at):
                    raise self.fail("a lookaround, named group or flag '(?'")
                self.at += 3 if self.peek(1) == "?" else 1
                out.append("(?:")
                depth, repeatable = depth + 1, False
            elif char == ")":
                if depth == 0:
                    raise self.fail("an unbalanced ')'")
                out.append(")")
                depth, repeatable = depth - 1, True
                self.at += 1
            elif (quantifier := self._quantifier()) is not None:
                if not repeatable:
                    raise self.fail(f"the quantifier {quantifier!r} with nothing to repeat")
                out.append(quantifier)
                repeatable = False
            else:
                out.append(self._atom())
                repeatable = True
        if depth:
            raise self.fail("an unclosed '('")
        return "".join(out)

    def _quantifier(self) -> str | None:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.at += 1
            quantifier = char
        elif char == "{" and (match := QUANTIFIER.match(self.pattern, self.at)):
            low, comma, high = match.groups()
            if high and int(high) < int(low):
                raise self.fail(f"the quantifier {match.group()!r} with its bounds reversed")
            if max(int(low), int(high or 0)) > MAX_REPEAT:
                raise self.fail(f"the quantifier {match.group()!r} past {MAX_REPEAT}")
            self.at = match.end()
            quantifier = f"{{{int(low)}{comma or ''}{int(high) if high else ''}}}"
        else:
            return None
        if self.peek() == "+":
            raise self.fail(f"the possessive quantifier {quantifier + '+'!r}")
        if self.peek() == "?":  # lazy: the same full matches
            self.at += 1
        return quantifier

    def _atom(self) -> str:
        char = self.peek()
        if char == "[":
            return self._charset(self._class())
        if char == ".":
            self.at += 1
            return self._charset(_CharSet([(0x0A, 0x0A)], [], negated=True))
        if char == "\\":
            item = self._escape(in_class=False)
        else:
            item = ord(char)
            self.at += 1
        if isinstance(item, str):
            return self._charset(_CharSet([], [item])) if item not in "dw" else f"[{SHORTHAND_BODIES[item]}]"
        return self._charset(_CharSet([(item, item)], [])) if item in SPECIAL else escaped_char(item)

    def _escape(self, in_class: bool) -> int | str:
        """The character after a backslash (a code point), or a shorthand letter."""
        self.at += 1
        char = self.peek()
        if not char:
            raise self.fail("a trailing backslash")
        self.at += 1
        if char in "dwsDWS":
            return char
        if char in CONTROLS:
            return CONTROLS[char]
        if char == "b" and in_class:
            return 0x08
        if char in "xu":
            digits = self.pattern[self.at : self.at + (2 if char == "x" else 4)]
            if len(digits) != (2 if char == "x" else 4) or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"the escape '\\{char}' without its hex digits")
            self.at += len(digits)
            if 0xD800 <= int(digits, 16) <= 0xDFFF:
                raise self.fail(f"the surrogate escape '\\{char}{digits}'")
            return int(digits, 16)
        if char.isascii() and char.isalnum():
            raise self.fail(f"the escape '\\{char}'")
        return ord(char)

    def _class(self) -> _CharSet:
        self.at += 1
        negated = self.peek() == "^"
        self.at += negated
        if self.peek() == "]":
            raise self.fail("an empty class '[]' or '[^]'")
        charset = _CharSet([], [], negated)
        while self.peek() != "]":
            if not self.peek():
                raise self.fail("an unclosed '['")
            low = self._class_item()
            if isinstance(low, str):
                charset.shorthands.append(low)
                continue
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.at += 1
                high = self._class_item()
                if isinstance(high, str) or high < low:
                    raise self.fail("a class range that is reversed or ends in a shorthand")
                charset.ranges.append((low, high))
            else:
                charset.ranges.append((low, low))
        self.at += 1
        return charset

    def _class_item(self) -> int | str:
        if self.peek() == "\\":
            return self._escape(in_class=True)
        self.at += 1
        return ord(self.pattern[self.at - 1])

    def _charset(self, charset: _CharSet) -> str:
        """The regex of one character of `charset`: raw where JSON allows, escaped where it must be."""
        alternatives = []
        shorthands = "".join(SHORTHAND_BODIES[s] for s in dict.fromkeys(charset.shorthands) if s in "dws")
        if charset.negated:
            if set(charset.shorthands) & set("DWS"):
                raise self.fail("a negated shorthand (\\D, \\W, \\S) inside a negated class")
            alternatives.append(f"[^{_class_body(charset.ranges)}{shorthands}{RAW_EXCLUDED}]")
        else:
            body = _class_body(_without_special(charset.ranges)) + shorthands
            if body:
                alternatives.append(f"[{body}]")
            for s in dict.fromkeys(charset.shorthands):
                if s in "DWS":
                    alternatives.append(f"[^{SHORTHAND_BODIES[s]}{RAW_EXCLUDED}]")
        special = [code for code in SPECIAL if charset.has(code)]
        if special:
            alternatives.append(_special_regex(special))
        if not alternatives:
            raise self.fail("a class that matches no character")
        if len(alternatives) == 1 and not special:
            return alternatives[0]
        return "(?:" + "|".join(alternatives) + ")"
