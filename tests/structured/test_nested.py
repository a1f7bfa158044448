"""The pushdown guide (structured/nested.py), for JSON mode and for schemas that refer to
themselves: any depth, brackets matched, each mask the tokens a one-token walk reads,
the regex guide's masks where the depth allows both, the recursions it refuses, and
greedy decoding under it the masked target's with speculation."""

from __future__ import annotations

import json
import random

import pytest

from specserve.errors import ConfigError
from specserve.structured.guide import Guide, GuideCache, GuideVocabulary
from specserve.structured.json_schema import json_object_regex, schema_to_regex
from specserve.structured.nested import MAX_DEPTH, NestedGuide
from specserve.structured.outputs import StructuredOutput, compiled
from specserve.structured.regex import compile_regex
from tests.engine.test_engine import EOS, PROMPTS
from tests.server.test_server_structured import character_tokenizer
from tests.structured.test_guided_engine import (  # noqa: F401 (target: a fixture)
    TEXTS,
    guided_greedy_by_hand,
    guided_through_engine,
    target,
)

# Pieces of JSON, several brackets to a token among them, and text that is no JSON.
PIECES = [
    *'{}[]":, 0123456789-.\\aenx\n',
    *['{"', '"}', "},", "],", "}}", "]]", "]}", "}]}", "[{", "[[", "{}", "[]", '"a"', '"{"', '"}', '\\"'],
    *['{"k": [', '"},{"', "1]", "e5", ".5", "true", "null", "false", '"]}', "[1,", '],"', "é", "\ufdd0"],
]

NONCHARACTER = PIECES.index("\ufdd0")


def guide_of(texts: list[str | None]) -> NestedGuide:
    return NestedGuide(*compiled(StructuredOutput("json_object"), 0), GuideVocabulary.from_texts(texts), "JSON")


def text_of(ids: list[int], texts: list[str | None] = PIECES) -> str:
    return "".join(texts[i] or "" for i in ids)


def random_walks(guide: NestedGuide, count: int, length: int, seed: int = 0):
    """Outputs drawn token by token from each state's mask: (state, output) at each step."""
    rng = random.Random(seed)
    for _ in range(count):
        state, output = guide.start, []
        for _ in range(length):
            yield state, output
            allowed = guide.allowed(state, []).nonzero().flatten().tolist()
            if not allowed:
                break
            output = [*output, rng.choice(allowed)]
            state = guide.step(state, output[-1])


def test_each_mask_is_the_tokens_one_token_walks_read_and_finished_outputs_parse():
    guide = guide_of(PIECES)
    finished = deepest = 0
    for state, output in random_walks(guide, 600, 40):
        mask = guide.allowed(state, [])
        assert mask.tolist() == [guide.step(state, t) != 0 for t in range(len(PIECES))], text_of(output)
        deepest = max(deepest, len(guide._configs[state][1]))
        if guide.accepts(state):
            assert isinstance(json.loads(text_of(output)), dict)
            finished += 1
    assert finished > 100 and deepest >= 6
    assert not guide.allowed(guide.start, [])[NONCHARACTER]  # no nested value
    assert not guide.allowed(guide.state_after([PIECES.index('{"')]), [])[NONCHARACTER]  # nor a string's


def test_where_both_reach_the_regex_guide_allows_the_same_tokens():
    """Up to the regex's depth bound (4 levels), the two guides agree token by token (but
    for a noncharacter in a string, which the regex allows)."""
    nested = guide_of(PIECES)
    regex = Guide(compile_regex(json_object_regex()), GuideVocabulary.from_texts(PIECES), "JSON")
    for state, output in random_walks(nested, 300, 30, seed=1):
        if max((len(nested._configs[nested.state_after(output[:i])][1]) for i in range(len(output) + 1))) >= 3:
            continue  # a token opening two levels there may pass the regex's bound
        ours, theirs = nested.allowed(state, []), regex.allowed(regex.state_after(output), [])
        ours[NONCHARACTER] = theirs[NONCHARACTER] = False  # the regex's strings may hold one
        assert ours.tolist() == theirs.tolist(), text_of(output)


def depth_of(value) -> int:
    """How deep a parsed JSON value's objects and arrays nest."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(depth_of, children), default=0)


def test_objects_nest_past_any_fixed_depth_and_close_in_order():
    guide = guide_of(PIECES)
    deep = [PIECES.index('{"k": [')] * 30 + [PIECES.index("1")] + [PIECES.index("]}")] * 30
    assert guide.accepts(guide.state_after(deep)) and depth_of(json.loads(text_of(deep))) == 60
    opened = guide.state_after([PIECES.index("{"), PIECES.index('"a"'), PIECES.index(":"), PIECES.index("[")])
    allowed = guide.allowed(opened, [])
    assert allowed[PIECES.index("]")] and not allowed[PIECES.index("}")]  # an array closes with ]
    assert allowed[PIECES.index("]}")] and not allowed[PIECES.index("}]}")]  # pops two, not three
    assert not guide.allowed(guide.state_after(deep), []).any()  # nothing after the object
    in_string = guide.state_after([PIECES.index("{"), PIECES.index('"')])
    assert guide.allowed(in_string, [])[PIECES.index("}}")]  # brackets in a string are text
    braced_key = [PIECES.index('{"k": ['), PIECES.index('"{"'), PIECES.index("]}")]
    assert guide.accepts(guide.state_after(braced_key)) and json.loads(text_of(braced_key)) == {"k": ["{"]}


def test_no_level_opens_past_max_depth():
    guide = guide_of(PIECES)
    opens_two = PIECES.index('{"k": [')
    at_the_bound = guide.state_after([opens_two] * (MAX_DEPTH // 2))  # MAX_DEPTH levels open
    full = guide.allowed(at_the_bound, [])
    assert [guide.step(at_the_bound, PIECES.index(t)) == 0 for t in ("{", "[{", "1")] == [True, True, False]
    assert not full[PIECES.index("{")] and not full[PIECES.index("[{")] and not full[opens_two]
    assert full[PIECES.index("1")] and full[PIECES.index("]")] and full[PIECES.index("]}")]
    room_for_two = guide.allowed(guide.state_after([opens_two] * (MAX_DEPTH // 2 - 1)), [])
    assert room_for_two[PIECES.index("[{")] and room_for_two[PIECES.index("[[")]


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "worker"])
def test_json_mode_compiles_to_the_pushdown_guide(isolated):
    guide = GuideCache(character_tokenizer(), isolated=isolated).guide(StructuredOutput("json_object"))
    assert isinstance(guide, NestedGuide)
    ids = character_tokenizer().encode('{"a":[[[[[{"b":null}]]]]]}')
    assert guide.accepts(guide.state_after(ids))


@pytest.mark.parametrize("proposer_kind", ["none", "draft", "ngram"])
def test_json_mode_greedy_decoding_is_the_masked_targets_with_every_proposer(target, proposer_kind):  # noqa: F811
    guide = guide_of(TEXTS)
    for output_ids, prompt in zip(guided_through_engine(target, guide, proposer_kind), PROMPTS):
        expected = guided_greedy_by_hand(target, prompt, guide, 40, reads=lambda state, t: guide.step(state, t) != 0)
        assert output_ids == expected
        if expected[-1] == EOS:
            assert isinstance(json.loads(text_of(expected[:-1], TEXTS)), dict)


# ----- schemas that refer to themselves

TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name", "children"],
}
LINKED = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
            "required": ["v", "next"],
        }
    },
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/Node"}},
    "required": ["head"],
}
TREE_PIECES = [
    *'{}[]":, ab1\n',
    *['{"name": "', '", "children": [', '"name"', '"children"', ": ", "]}", "}]", "]}]}", "}, ", "[]", "[]}"],
    *['{"v": ', ', "next": ', "null", "null}", "}}", "2", '{"head": '],
]


def schema_guide(schema: dict, texts: list[str]) -> NestedGuide:
    return NestedGuide(
        *compiled(StructuredOutput("json", json.dumps(schema)), 0), GuideVocabulary.from_texts(texts), "schema"
    )


def is_tree(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "children"}
        and isinstance(value["name"], str)
        and isinstance(value["children"], list)
        and all(map(is_tree, value["children"]))
    )


def test_a_tree_schema_nests_to_any_depth_and_each_mask_is_what_one_token_walks_read():
    guide = schema_guide(TREE, TREE_PIECES)
    deepest = finished = 0
    for state, output in random_walks(guide, 400, 60, seed=2):
        assert guide.allowed(state, []).tolist() == [guide.step(state, t) != 0 for t in range(len(TREE_PIECES))]
        deepest = max(deepest, len(guide._configs[state][1]))
        if guide.accepts(state):
            assert is_tree(json.loads(text_of(output, TREE_PIECES))), text_of(output, TREE_PIECES)
            finished += 1
    assert finished > 20 and deepest >= 3
    start, opens = TREE_PIECES.index('{"name": "'), TREE_PIECES.index('", "children": [')
    deep = [start, opens] * 21 + [TREE_PIECES.index("]}")] * 21  # 21 nodes, each the last one's only child
    assert guide.accepts(guide.state_after(deep)) and is_tree(json.loads(text_of(deep, TREE_PIECES)))
    childless = [start, opens, start, TREE_PIECES.index('"'), TREE_PIECES.index("}")]  # a child with no children
    assert guide.state_after(childless) == 0


def test_a_linked_list_through_defs_ends_with_null_at_any_length():
    guide = schema_guide(LINKED, TREE_PIECES)
    node, then = TREE_PIECES.index('{"v": '), TREE_PIECES.index(', "next": ')
    assert guide.state_after([node]) == 0  # the document is {"head": ...}
    links = [node, TREE_PIECES.index("1"), then] * 30 + [TREE_PIECES.index("null}")] + [TREE_PIECES.index("}}")] * 15
    state = guide.state_after([TREE_PIECES.index('{"head": '), *links])
    assert guide.accepts(state)
    value, length = json.loads(text_of([TREE_PIECES.index('{"head": '), *links], TREE_PIECES))["head"], 0
    while value is not None:
        value, length = value["next"], length + 1
    assert length == 30
    assert not guide.accepts(guide.state_after([TREE_PIECES.index('{"head": '), *links[:-1]]))  # one still open


@pytest.mark.parametrize(
    "schema, refusal",
    [
        (
            {
                "$defs": {"N": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/N"}}]}},
                "$ref": "#/$defs/N",
            },
            "must be an object or an array",
        ),
        ({"type": "object", "properties": {"a": {"$ref": "#", "type": "object"}}}, "must stand alone"),
        (
            {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "object"}]}}},
            "may both start with '{'",
        ),
    ],
    ids=["not-an-object", "not-alone", "two-at-one-place"],
)
def test_a_recursion_that_cannot_be_read_as_levels_is_refused_by_name(schema, refusal):
    with pytest.raises(ConfigError, match=refusal):
        GuideCache(character_tokenizer()).guide(StructuredOutput("json", json.dumps(schema)))
    with pytest.raises(ConfigError, match="recursive schemas are not supported"):
        schema_to_regex(TREE)


def test_a_schema_that_is_an_object_or_an_array_of_itself_enters_by_either_bracket():
    either = {
        "$defs": {
            "V": {
                "anyOf": [
                    {"type": "array", "items": {"$ref": "#/$defs/V"}},
                    {"type": "object", "properties": {"v": {"$ref": "#/$defs/V"}}, "required": ["v"]},
                ]
            }
        },
        "$ref": "#/$defs/V",
    }
    guide = schema_guide(either, TREE_PIECES)
    pieces = ["[", "[", '{"v": ', "[", "]", "}", "]", "]"]
    ids = [TREE_PIECES.index(p) for p in pieces]
    assert guide.accepts(guide.state_after(ids)) and json.loads("".join(pieces)) == [[{"v": []}]]
    assert guide.state_after([TREE_PIECES.index('{"v": '), TREE_PIECES.index("1")]) == 0  # only arrays and objects
    for state, output in random_walks(guide, 200, 30, seed=3):
        assert guide.allowed(state, []).tolist() == [guide.step(state, t) != 0 for t in range(len(TREE_PIECES))]


def test_a_schemas_open_values_nest_to_any_depth_as_json_modes_do():
    """`{}` and an object's open values read JSON mode's levels: past the 4 levels the
    one-regex form holds, every mask what one-token walks read, finished outputs parse."""
    schema = {"type": "object", "properties": {"data": {}, "meta": {"type": "object"}}, "required": ["data"]}
    levels, calls = StructuredOutput("json", json.dumps(schema)).levels()
    assert len(levels) == 3 and set(calls.values()) == {"\ufdd0", "\ufdd1"}
    texts = [*PIECES, '{"data": ', ', "meta": ']
    guide = schema_guide(schema, texts)
    pieces = [
        '{"data": ',
        *['{"k": ['] * 12,
        "1",
        *["]}"] * 12,
        ', "meta": ',
        *['{"k": ['] * 6,
        "null",
        *["]}"] * 6,
        "}",
    ]
    deep = "".join(pieces)
    assert guide.accepts(guide.state_after([texts.index(p) for p in pieces])) and depth_of(json.loads(deep)) == 25
    assert not compile_regex(schema_to_regex(schema)).matches(deep)  # the one regex: 4 levels
    finished = 0
    for state, output in random_walks(guide, 300, 40, seed=4):
        assert guide.allowed(state, []).tolist() == [guide.step(state, t) != 0 for t in range(len(texts))]
        if guide.accepts(state):
            value = json.loads(text_of(output, texts))
            assert "data" in value and set(value) <= {"data", "meta"} and isinstance(value.get("meta", {}), dict)
            finished += 1
    assert finished > 10


@pytest.mark.parametrize(
    "schema, num_levels",
    [
        ({"anyOf": [{}, {"type": "object", "properties": {"a": {"type": "integer"}}}]}, 1),
        ({"type": "object", "properties": {"v": {"oneOf": [{"type": "array", "items": {}}, True]}}}, 1),
    ],
    ids=["any-or-object", "array-of-any-or-any"],
)
def test_an_open_value_beside_other_alternatives_keeps_its_bound(schema, num_levels):
    """Inside one of several alternatives, an object or array may be either's, which a
    pushdown guide cannot tell apart: open values there keep their bound, and the guide
    builds."""
    levels, _ = StructuredOutput("json", json.dumps(schema)).levels()
    assert len(levels) == num_levels
    GuideCache(character_tokenizer()).guide(StructuredOutput("json", json.dumps(schema)))
