"""JSON Schema to regex: valid texts match in every layout and invalid ones do not, the
commas of optional properties come out right in every combination, random values and
random strings agree with json.loads, our own regex compiler reads every regex the same
way as Python's `re`, and what is not supported raises ConfigError naming it."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from specserve.errors import ConfigError
from specserve.structured.json_schema import MAX_REGEX_CHARS, json_object_regex, schema_to_regex
from specserve.structured.regex import compile_regex

jsonschema = pytest.importorskip("jsonschema")


def layouts(value: object) -> list[str]:
    """Compact, json.dumps' default and indented."""
    return [json.dumps(value, separators=(",", ":")), json.dumps(value), json.dumps(value, indent=2)]


def matches(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


ADDRESS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["city"],
}

# Schemas with JSON values they allow and texts they do not.
CASES = {
    "string": (
        {"type": "string"},
        ["", "abc", 'say "hi"', "back\\slash", "tab\tnew\nline", "\u0001", "é", "emoji 😀"],
        ['"a\nb"', '"\\x41"', '"\\u12"', '"\\a"', '"a"b"', '"abc', "abc", "1", "null", '"\\"', '"\t"'],
    ),
    "string lengths": (
        {"type": "string", "minLength": 2, "maxLength": 3},
        ["ab", "abc", "a\n", '"\\"'],
        ['""', '"a"', '"abcd"', '"\\n"', '"\\u00e9"'],
    ),
    "pattern": (
        {"type": "string", "pattern": r'^[A-Z]{2}-\d+(\.\d+)?"?$'},
        ["AB-1", "XY-12.5", 'XY-3"'],
        ['"ab-1"', '"AB-"', '"AB-1."', '"AB-1""', '"A-1"', '"AB-1\\"'],
    ),
    "integer": (
        {"type": "integer"},
        [0, -1, 12345, 10**30],
        ["01", "-01", "1.5", "1.0", "-", "+1", "1e3", '"1"', "", "- 1", "true"],
    ),
    "number": (
        {"type": "number"},
        [0, -0.5, 1.25, 1e-7, 1.5e300, 12345678901234567890, 3.0, -0.0],
        ["01", ".5", "1.", "1e", "1e+", "+1", "NaN", "Infinity", "0x1", "1 2", "--1"],
    ),
    "boolean and null": (
        {"type": ["boolean", "null"]},
        [True, False, None],
        ["True", "0", '"true"', "nul", "null null", ""],
    ),
    "type list with string bounds": (
        {"type": ["string", "integer"], "maxLength": 2},
        ["ab", "", 7, -70],
        ['"abc"', "1.5", "null"],
    ),
    "nested objects": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "address": ADDRESS,
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "address"],
        },
        [
            {"name": "Ada", "address": {"city": "London"}},
            {"name": "Ada", "address": {"city": "London", "zip": "12345"}, "tags": []},
            {"name": "", "address": {"city": "x", "zip": "00000"}, "tags": ["a", "b"]},
        ],
        [
            '{"address":{"city":"London"}}',
            '{"name":"Ada","address":{"city":""}}',
            '{"name":"Ada","address":{"city":"L","zip":"1234"}}',
            '{"name":"Ada","address":{"city":"L"},"age":3}',
            '{"name":"Ada","address":{"city":"L"},}',
            '{"name":"Ada","address":{"city":"L"},"tags":[1]}',
            '{"name":"Ada","address":{"city":"L"},"tags":["a",]}',
            ' {"name":"Ada","address":{"city":"L"}}',
        ],
    ),
    "array of objects": (
        {"type": "array", "items": ADDRESS, "minItems": 1, "maxItems": 3},
        [[{"city": "a"}], [{"city": "a"}, {"city": "b", "zip": "11111"}, {"city": "c"}]],
        ["[]", '[{"city":"a"},{"city":"b"},{"city":"c"},{"city":"d"}]', '[{"city":"a"},]', '[,{"city":"a"}]'],
    ),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False, "minItems": 1},
        [[1], [1, "a"]],
        ["[]", '["a"]', '[1,"a",2]', "[1,2]", '[1,"a",]'],
    ),
    "prefixItems then items": (
        {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"}, "maxItems": 3},
        [[], ["a"], ["a", True], ["a", True, False]],
        ["[true]", '["a","b"]', '["a",true,true,true]', "[,]"],
    ),
    "additionalProperties schema": (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1}, {"a": 1, "b": -2, "": 0, 'q"uote': 3}],
        ['{"a":"x"}', '{"a":1,}', "{a:1}", '{"a" 1}', '{"a":1,"b"}'],
    ),
    "enum and const": (
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", 'gre"en', "é", 1, None, [1, {"a": []}]]},
                "kind": {"const": {"x": [1, 2], "y": "z"}},
                "only": {"type": "string", "enum": ["a", 1, True]},
            },
            "required": ["colour", "kind"],
        },
        [
            {"colour": "red", "kind": {"x": [1, 2], "y": "z"}},
            {"colour": 'gre"en', "kind": {"x": [1, 2], "y": "z"}, "only": "a"},
            {"colour": "é", "kind": {"x": [1, 2], "y": "z"}},
            {"colour": None, "kind": {"x": [1, 2], "y": "z"}},
            {"colour": [1, {"a": []}], "kind": {"x": [1, 2], "y": "z"}},
        ],
        [
            '{"colour":"blue","kind":{"x":[1,2],"y":"z"}}',
            '{"colour":"red","kind":{"x":[1,2]}}',
            '{"colour":"red","kind":{"x":[1,2],"y":"z"},"only":1}',
            '{"colour":"red","kind":{"x":[1,2],"y":"z"},"only":true}',
        ],
    ),
    "anyOf with siblings": (
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
            "anyOf": [{"required": ["id"]}, {"required": ["name"]}, {"type": "string"}],
        },
        [{"id": 1}, {"name": "a"}, {"id": 1, "name": "a"}],
        ['"a"', "{}", '{"id":"1"}', '{"id":1,"name":2}'],
    ),
    "oneOf of types": (
        {"oneOf": [{"type": "integer"}, {"type": "string", "format": "date"}, {"type": "array", "maxItems": 1}]},
        [3, "2024-02-29", "2000-02-29", "2023-12-31", [], [[1, {"a": None}]]],
        ['"2024-13-01"', '"2024-1-01"', '"2023-02-29"', '"1900-02-29"', '"2024-04-31"', "[1,2]", "1.5"],
    ),
    "formats": (
        {
            "type": "array",
            "prefixItems": [
                {"type": "string", "format": "date-time"},
                {"type": "string", "format": "time"},
                {"type": "string", "format": "uuid"},
                {"type": "string", "format": "not-a-known-format"},
            ],
            "minItems": 4,
            "items": False,
        },
        [["2024-01-31T23:59:60.5Z", "08:30:00+05:30", "123e4567-e89b-12d3-a456-426614174000", "not checked"]],
        [
            '["2024-01-31 23:59:60Z","08:30:00Z","123e4567-e89b-12d3-a456-426614174000","x"]',
            '["2024-01-31T23:59:60Z","08:30:00","123e4567-e89b-12d3-a456-426614174000","x"]',
            '["2024-01-31T23:59:60Z","08:30:00Z","123e4567e89b12d3a456426614174000","x"]',
        ],
    ),
    "defs and refs": (
        {
            "$defs": {
                "Point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False}
            },
            "definitions": {"Label": {"type": "string", "maxLength": 4}},
            "type": "object",
            "properties": {
                "from": {"$ref": "#/$defs/Point"},
                "to": {"$ref": "#/$defs/Point", "minItems": 2},
                "label": {"allOf": [{"$ref": "#/definitions/Label"}], "description": "shown"},
            },
            "required": ["from", "to"],
        },
        [{"from": [], "to": [1, 2.5]}, {"from": [1], "to": [0, 0], "label": "abcd"}],
        ['{"from":[],"to":[1]}', '{"from":[1,2,3],"to":[1,2]}', '{"from":[],"to":[1,2],"label":"abcde"}'],
    ),
    # A pydantic model's model_json_schema(): an Address model, a str Enum, Optional fields.
    "pydantic": (
        {
            "$defs": {
                "Address": {
                    "properties": {
                        "city": {"title": "City", "type": "string"},
                        "zip_code": {
                            "anyOf": [{"pattern": "^\\d{5}$", "type": "string"}, {"type": "null"}],
                            "default": None,
                            "title": "Zip Code",
                        },
                    },
                    "required": ["city"],
                    "title": "Address",
                    "type": "object",
                },
                "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
            },
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "description": "A person.",
            "properties": {
                "name": {"description": "Full name", "maxLength": 20, "title": "Name", "type": "string"},
                "age": {"maximum": 150, "minimum": 0, "title": "Age", "type": "integer"},
                "born": {"format": "date", "title": "Born", "type": "string", "examples": ["2000-01-01"]},
                "favourite": {"$ref": "#/$defs/Color", "default": "red"},
                "kind": {"const": "person", "default": "person", "title": "Kind", "type": "string"},
                "address": {"$ref": "#/$defs/Address"},
                "previous": {"default": [], "items": {"$ref": "#/$defs/Address"}, "title": "Previous", "type": "array"},
                "score": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None, "title": "Score"},
            },
            "required": ["name", "age", "born", "address"],
            "title": "Person",
            "type": "object",
        },
        [
            {"name": "Ada", "age": 36, "born": "1815-12-10", "address": {"city": "London"}},
            {
                "name": "Ada",
                "age": 36,
                "born": "1815-12-10",
                "favourite": "green",
                "kind": "person",
                "address": {"city": "London", "zip_code": None},
                "previous": [{"city": "Paris", "zip_code": "75001"}],
                "score": 9.5,
            },
        ],
        [
            '{"name":"Ada","age":36,"born":"1815-12-10"}',
            '{"name":"Ada","age":36.5,"born":"1815-12-10","address":{"city":"L"}}',
            '{"name":"Ada","age":36,"born":"1815-12-10","favourite":"blue","address":{"city":"L"}}',
            '{"name":"Ada","age":36,"born":"1815-12-10","address":{"city":"L","zip_code":"123"}}',
            '{"name":"Ada","age":36,"born":"1815-12-10","address":{"city":"L"},"score":null,}',
        ],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_valid_texts_match_and_invalid_ones_do_not(name: str) -> None:
    schema, values, invalid = CASES[name]
    regex = schema_to_regex(schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for value in values:
        validator.validate(value)  # the case itself is right
        for text in layouts(value):
            assert matches(regex, text), text
    for text in invalid:
        assert not matches(regex, text), text


@pytest.mark.parametrize("name", CASES)
def test_our_compiler_reads_the_regex_as_python_does(name: str) -> None:
    schema, values, invalid = CASES[name]
    regex = schema_to_regex(schema)
    dfa = compile_regex(regex)
    for text in [t for v in values for t in layouts(v)] + invalid:
        assert dfa.matches(text) == matches(regex, text), text


@pytest.mark.parametrize("name", CASES)
def test_mutated_texts_that_match_are_valid(name: str) -> None:
    """Soundness: a valid text with a character inserted, deleted or replaced matches
    only where it is still JSON that the schema allows."""
    schema, values, _ = CASES[name]
    regex = schema_to_regex(schema)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    validator = jsonschema.Draft202012Validator(without_numeric_bounds(schema), format_checker=checker)
    rng = random.Random(name)
    for text in (t for v in values for t in layouts(v)):
        for _ in range(40):
            mutated = mutate(rng, text)
            if matches(regex, mutated):
                validator.validate(json.loads(mutated))


def without_numeric_bounds(schema: object) -> object:
    """The schema with the numeric bounds, which are not enforced, left out."""
    if isinstance(schema, list):
        return [without_numeric_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    return {k: without_numeric_bounds(v) for k, v in schema.items() if k not in bounds}


ALPHABET = '{}[]",:0123456789a truefalsn\\'


def mutate(rng: random.Random, text: str) -> str:
    at = rng.randrange(len(text) + 1)
    kind = rng.choice(("insert", "delete", "replace"))
    if kind == "insert" or at == len(text):
        return text[:at] + rng.choice(ALPHABET) + text[at:]
    return text[:at] + ("" if kind == "delete" else rng.choice(ALPHABET)) + text[at + 1 :]


@pytest.mark.parametrize("required", [set(c) for r in range(4) for c in itertools.combinations("abc", r)])
def test_every_combination_of_optional_properties(required: set[str]) -> None:
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}, "required": sorted(required)}
    regex = schema_to_regex(schema)
    for r in range(4):
        for present in itertools.combinations("abc", r):
            value = {k: i for i, k in enumerate(present)}
            for text in layouts(value):
                assert matches(regex, text) == (required <= set(present)), text
    for text in ['{,"b":1}', '{"a":1,"b":2,}', '{"a":1,,"b":2}', '{"a":1 "b":2}', "{,}", '{"b":1,"b":1}']:
        assert not matches(regex, text), text
    assert not matches(regex, '{"b":1,"a":2}')  # the declared order only


def test_numeric_bounds_are_accepted_and_not_enforced() -> None:
    bounds = {"minimum": 5, "maximum": 6, "exclusiveMinimum": 5, "exclusiveMaximum": 6, "multipleOf": 7}
    assert schema_to_regex({"type": "integer", **bounds}) == schema_to_regex({"type": "integer"})
    assert schema_to_regex({"type": "number", **bounds}) == schema_to_regex({"type": "number"})
    assert matches(schema_to_regex(bounds), "-1.5e3")  # no type: the keywords imply a number


def test_no_whitespace_means_compact_only() -> None:
    schema = CASES["nested objects"][0]
    regex = schema_to_regex(schema, whitespace="")
    value = CASES["nested objects"][1][1]
    assert matches(regex, json.dumps(value, separators=(",", ":")))
    assert not matches(regex, json.dumps(value))


def test_empty_and_true_schemas_are_any_value_to_max_depth() -> None:
    for schema in ({}, True, {"title": "anything"}):
        regex = schema_to_regex(schema, max_depth=1)
        for value in (1, "a", None, [], [1, "x"], {"a": False}):
            assert matches(regex, json.dumps(value)), value
        assert not matches(regex, "[[1]]") and not matches(regex, '{"a":{}}')
    assert not matches(schema_to_regex({}, max_depth=0), "[]")


def random_value(rng: random.Random, depth: int) -> object:
    kind = rng.choice(["string", "int", "float", "bool", "null"] + ["array", "object"] * 2 * (depth > 0))
    if kind == "string":
        return "".join(rng.choice('ab "\\/\n\t\x00\x1fé😀') for _ in range(rng.randrange(5)))
    if kind == "int":
        return rng.randrange(-1000, 1000)
    if kind == "float":
        return rng.choice([rng.uniform(-1e3, 1e3), rng.uniform(-1, 1) * 10 ** rng.randrange(-30, 30)])
    if kind in ("bool", "null"):
        return rng.choice([True, False]) if kind == "bool" else None
    children = [random_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    return children if kind == "array" else {str(random_value(rng, 0)): c for c in children}


def depth_of(value: object) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(depth_of, children), default=0)


def test_random_values_of_depth_two_match_the_generic_regex() -> None:
    regex = schema_to_regex({}, max_depth=2)
    rng = random.Random(0)
    for _ in range(200):
        value = random_value(rng, 2)
        for text in layouts(value):
            assert matches(regex, text), text
    assert not matches(regex, "[[[]]]") and not matches(regex, '{"a":[{}]}')


def test_random_strings_match_exactly_when_json_loads_reads_them() -> None:
    """Over a small alphabet: the generic regex at depth 2 accepts a string iff it is a
    JSON text of nesting at most 2 without surrounding whitespace."""
    regex = schema_to_regex({}, max_depth=2)
    tokens = list(ALPHABET) + ["true", "false", "null", '"a"', '"\\n"', "01", "-1", "1.5", "2e3", "{}", "[]"]
    rng = random.Random(1)
    accepted = 0
    for i in range(600):
        if i % 2:
            text = "".join(rng.choice(tokens) for _ in range(rng.randrange(1, 9)))
        else:
            text = mutate(rng, json.dumps(random_value(rng, 2), separators=rng.choice([(",", ":"), (", ", ": ")])))
        try:
            valid = depth_of(json.loads(text)) <= 2 and text == text.strip()
        except ValueError:
            valid = False
        assert matches(regex, text) == valid, text
        accepted += valid
    assert 100 < accepted < 500


def test_json_object_regex() -> None:
    regex = json_object_regex(max_depth=2)
    for value in ({}, {"a": 1}, {"a": [1, "b"], "c": {"d": None}, "": "x"}):
        for text in layouts(value):
            assert matches(regex, text), text
    for text in ("[]", "1", '"a"', '{"a":[[1]]}', '{"a":1,}', "{} "):
        assert not matches(regex, text), text
    assert compile_regex(json_object_regex()).matches('{"a": {"b": [1, 2, {"c": "d"}]}}')


@pytest.mark.parametrize(
    ("schema", "keyword", "where"),
    [
        ({"type": "object", "minProperties": 1}, "minProperties", "#"),
        ({"type": "object", "maxProperties": 1}, "maxProperties", "#"),
        (
            {"type": "object", "properties": {"x": {"type": "object", "patternProperties": {"a": {}}}}},
            "patternProperties",
            "#/properties/x",
        ),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames", "#"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas", "#"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties", "#"),
        (
            {"type": "object", "properties": {"items": {"type": "array", "items": {"uniqueItems": True}}}},
            "uniqueItems",
            "#/properties/items/items",
        ),
        ({"type": "array", "contains": {"type": "integer"}}, "contains", "#"),
        ({"not": {"type": "string"}}, "not", "#"),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if", "#"),
        ({"type": "string", "nullable": True}, "nullable", "#"),
        (
            {"$defs": {"A": {"type": "string", "contentEncoding": "base64"}}, "$ref": "#/$defs/A"},
            "contentEncoding",
            "#/$defs/A",
        ),
        ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf", "#"),
        ({"type": "array", "items": [{"type": "string"}]}, "items", "#"),
        ({"anyOf": [{"type": "string", "foo": 1}]}, "foo", "#/anyOf/0"),
        ({"type": "string", "pattern": "(?=a)a"}, "pattern", "#"),
        ({"type": "string", "pattern": "(a)\\1"}, "pattern", "#"),
        ({"type": "string", "pattern": "\\bword"}, "pattern", "#"),
        ({"type": "string", "pattern": "a^b"}, "pattern", "#"),
        ({"type": "string", "pattern": "a*+"}, "pattern", "#"),
        ({"type": "string", "pattern": "(?i)a"}, "pattern", "#"),
        ({"type": "string", "pattern": "\\p{L}"}, "pattern", "#"),
        ({"type": "string", "pattern": "[a-z]", "maxLength": 3}, "pattern", "#"),
        ({"type": "array", "maxItems": 10_000}, "maxItems", "#"),
        ({"$ref": "other.json#/$defs/A"}, "$ref", "#"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "$ref", "#/properties/a"),
        ({"type": "object", "required": ["a"]}, "required", "#"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required", "#"),
        ({"type": "str"}, "type", "#"),
        (
            {"type": "object", "properties": {"a": {}}, "anyOf": [{"additionalProperties": False}]},
            "additionalProperties",
            "#/anyOf/0",
        ),
        ({"prefixItems": [{"type": "string"}], "allOf": [{"items": {"type": "integer"}}]}, "items", "#/allOf/0"),
        ({"type": "string", "anyOf": [{"type": "string", "pattern": "a"}], "pattern": "b"}, "pattern", "#/anyOf/0"),
    ],
)
def test_unsupported_keywords_raise_naming_them(schema: dict, keyword: str, where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        schema_to_regex(schema)
    assert f"'{keyword}'" in str(caught.value) and f"at {where} " in str(caught.value)


@pytest.mark.parametrize(
    "schema",
    [
        {
            "$defs": {
                "Node": {
                    "type": "object",
                    "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                }
            },
            "$ref": "#/$defs/Node",
        },
        {"type": "object", "properties": {"self": {"$ref": "#"}}},
        {
            "definitions": {"A": {"anyOf": [{"$ref": "#/definitions/B"}]}, "B": {"$ref": "#/definitions/A"}},
            "$ref": "#/definitions/A",
        },
    ],
)
def test_recursive_references_raise(schema: dict) -> None:
    with pytest.raises(ConfigError, match="recursive schemas are not supported"):
        schema_to_regex(schema)


def test_a_definition_used_twice_is_no_recursion() -> None:
    schema = {"$defs": {"N": {"type": "integer"}}, "type": "array", "prefixItems": [{"$ref": "#/$defs/N"}] * 2}
    assert matches(schema_to_regex(schema), "[1, 2]")


@pytest.mark.parametrize(
    "schema",
    [False, {"type": "object", "properties": {"a": False}, "required": ["a"]}, [], "string", {"properties": {"a": 3}}],
)
def test_false_and_non_schemas_raise(schema: object) -> None:
    with pytest.raises(ConfigError):
        schema_to_regex(schema)  # type: ignore[arg-type]


def test_false_properties_and_alternatives_are_left_out() -> None:
    regex = schema_to_regex({"type": "object", "properties": {"a": False, "b": {"anyOf": [False, {"type": "null"}]}}})
    assert matches(regex, '{"b":null}') and not matches(regex, '{"a":1}')


def test_too_large_schemas_raise() -> None:
    for make in (
        lambda: schema_to_regex({}, max_depth=6),
        lambda: json_object_regex(max_depth=6),
        lambda: schema_to_regex({"type": "array", "items": {}, "maxItems": 1000}),
    ):
        with pytest.raises(ConfigError, match="too large for structured outputs"):
            make()
    assert len(json_object_regex()) <= MAX_REGEX_CHARS


def test_patterns_never_let_raw_quotes_backslashes_or_controls_through() -> None:
    for pattern in (".*", "[^a]*", "\\D*", "\\W+", "\\S*", '["\\\\\\n]+', "(a|\\s)*", "[\\x00-\\x7f]*"):
        regex = schema_to_regex({"type": "string", "pattern": pattern})
        for text in ('"a"b"', '"\\"', '"\n"', '"\t"', '"\x00"'):
            assert not matches(regex, text), (pattern, text)
        value = {".*": 'x"\\\ty', "\\D*": '"\t', "\\W+": '"\\', "\\S*": 'a"\\', "(a|\\s)*": "a \t\n"}.get(pattern)
        if value is not None:
            assert matches(regex, json.dumps(value)), (pattern, value)


def test_the_regex_stays_in_the_dialect() -> None:
    regexes = [schema_to_regex(schema) for schema, _, _ in CASES.values()] + [json_object_regex(max_depth=2)]
    regexes.append(schema_to_regex({"type": "string", "pattern": "^a+?b*?(c)??d{1,2}?$"}))
    for regex in regexes:
        plain = re.sub(r"\\.", "", regex)  # escapes out, so an escaped '?' is no quantifier
        plain = re.sub(r"\[\^?\]?[^\]]*\]", "", plain)  # classes out
        for construct in ("(?=", "(?!", "(?<", "(?P", "*?", "+?", "??", "}?", "^", "$"):
            assert construct not in plain, (construct, regex)
        assert not re.search(r"\\[bBAZzgk0-9pP]", regex.replace("\\\\", "")), regex


PATTERN_ATOMS = ["a", "b", '"', "\\\\", "\\n", "\\t", ".", "\\d", "\\w", "\\s", "\\D", "\\W", "\\S", '[ab"]', "[^a]"]
PATTERN_ATOMS += ['[^"\\\\]', "[\\x00-\\x22]", '[\\s"]', "[a-c\\d]", "\\x01", "\\u00e9", "é", "\\.", "{", "[\\b]"]
PATTERN_ATOMS += ["[\\W\\d]", "[^\\s\\d]"]


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    out = []
    for _ in range(rng.randrange(1, 4)):
        if depth < 1 and rng.random() < 0.3:
            atom = f"({random_pattern(rng, depth + 1)}|{random_pattern(rng, depth + 1)})"
        else:
            atom = rng.choice(PATTERN_ATOMS)
        out.append(atom + rng.choice(["", "", "*", "+", "?", "{1,2}", "{2}"]))
    return "".join(out)


def test_random_patterns_match_the_json_text_of_the_strings_they_match() -> None:
    """A pattern (read with ASCII shorthands) fully matches a string iff the regex
    matches the string's JSON text written raw (ensure_ascii=False); the \\u-escaped
    text of a non-ASCII string may be refused, never wrongly accepted; our compiler agrees."""
    rng = random.Random(2)
    chars = ["a", "b", '"', "\\", "\n", "\t", "\x01", " ", "é", "1", "_", "\x0b", "\x1f", ".", "{", "\x08"]
    agreed = 0
    for _ in range(60):
        pattern = random_pattern(rng)
        regex = schema_to_regex({"type": "string", "pattern": pattern})
        dfa = compile_regex(regex)
        for _ in range(30):
            value = "".join(rng.choice(chars) for _ in range(rng.randrange(5)))
            wanted = re.fullmatch(pattern, value, re.ASCII) is not None
            raw = json.dumps(value, ensure_ascii=False)
            assert matches(regex, raw) == wanted == dfa.matches(raw), (pattern, value)
            assert wanted or not matches(regex, json.dumps(value)), (pattern, value)
            agreed += wanted
    assert agreed > 100
