"""A structure after a think block (structured/thinking.py): each mask is what one-token
walks read, over a regex guide and the pushdown one, opened by the prompt or by the
answer's own `<think>`; the structure starts exactly where `</think>` ends; an answer
without a block is the structure from its first token; and guided greedy decoding
through the engine, with speculation, is the masked target's."""

from __future__ import annotations

import json
import random
import re

import pytest

from specserve.server.reasoning import ReasoningParser
from specserve.structured.guide import Guide, GuideVocabulary
from specserve.structured.nested import NestedGuide
from specserve.structured.outputs import StructuredOutput, compiled
from specserve.structured.regex import compile_regex
from specserve.structured.thinking import BEFORE, INSIDE, BlockMasks, ThinkingFirst
from tests.engine.test_engine import EOS, PROMPTS
from tests.structured.test_guided_engine import (  # noqa: F401 (target: a fixture)
    TEXTS,
    guided_greedy_by_hand,
    guided_through_engine,
    target,
)

PIECES = [
    *["<think>", "</think>", "</", "think", ">", ">\n", "</think>\n", "<", "/", "<th", "ink>", "t", "k"],
    *["a", "b", " ", "\n", "{", "}", '"k"', ":", "1", "2", ",", "hi", '{"k":', "1}", None],
]
REGEX = r'\{"k":[12]\}'


def vocabulary_of(texts) -> GuideVocabulary:
    return GuideVocabulary.from_texts(texts)


def regex_guide(texts) -> Guide:
    return Guide(compile_regex(REGEX), vocabulary_of(texts), "regex")


def json_guide(texts) -> NestedGuide:
    return NestedGuide(*compiled(StructuredOutput("json_object"), 0), vocabulary_of(texts), "JSON")


INNERS = {"regex": (regex_guide, lambda text: re.fullmatch(REGEX, text)), "json": (json_guide, json.loads)}


def thinking_first(inner: str, opened: bool, texts=PIECES) -> ThinkingFirst:
    return ThinkingFirst(INNERS[inner][0](texts), BlockMasks(vocabulary_of(texts)), opened)


def text_of(ids: list[int], texts=PIECES) -> str:
    return "".join(texts[i] or "" for i in ids)


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("inner", list(INNERS))
def test_each_mask_is_what_one_token_walks_read_and_finished_answers_hold_the_structure(inner, opened):
    guide = thinking_first(inner, opened)
    parser = ReasoningParser("qwen3", prompt_opened=opened, guided=True)
    rng = random.Random(0)
    finished = thought = 0
    for _ in range(300):
        state, output = guide.start, []
        for _ in range(30):
            mask = guide.allowed(state, [])
            assert mask.tolist() == [guide.step(state, t) != guide.dead for t in range(len(PIECES))], output
            assert guide.state_after(output) == state
            if guide.accepts(state):
                reasoning, content = parser.split(text_of(output))
                assert INNERS[inner][1](content) is not None, text_of(output)
                finished += 1
                thought += reasoning is not None
            allowed = mask.nonzero().flatten().tolist()
            if not allowed:
                break
            output.append(rng.choice(allowed))
            state = guide.step(state, output[-1])
    assert finished > 20 and thought > 5


def test_the_structure_starts_exactly_where_the_tag_ends():
    guide = thinking_first("regex", opened=True)
    index = PIECES.index
    assert guide.start == INSIDE
    allowed = guide.allowed(guide.start, [])
    assert allowed[index("</think>")] and not allowed[index("</think>\n")]  # no text after the tag in its token
    assert allowed[index("{")] and allowed[index("<think>")]  # inside the block, any text
    written = guide.state_after([index("hi"), index("</"), index("think")])
    assert written == INSIDE - 7
    assert guide.allowed(written, [])[index(">")] and not guide.allowed(written, [])[index(">\n")]
    after = guide.step(written, index(">"))
    assert after == guide.inner.start and guide.allowed(after, []).nonzero().flatten().tolist() == [
        index("{"),
        index('{"k":'),
    ]
    assert guide.accepts(guide.state_after([index("</think>"), index('{"k":'), index("1}")]))


def test_an_answer_without_a_block_is_the_structure_from_its_first_token():
    guide = thinking_first("json", opened=False)
    index = PIECES.index
    assert guide.start == BEFORE
    allowed = guide.allowed(BEFORE, [])
    assert allowed[index("<think>")] and allowed[index("{")]
    assert not allowed[index("<th")] and not allowed[index("hi")]  # neither the tag nor JSON
    assert guide.step(BEFORE, index("<think>")) == INSIDE
    assert guide.accepts(guide.state_after([index('{"k":'), index("1}")]))
    assert not guide.accepts(guide.state_after([index("<think>"), index('{"k":'), index("1}")]))  # still thinking


# The engine's vocabulary (test_guided_engine.py) with the tags among its filler ids, the
# closing one often, so that a random target's greedy answers leave the block.
FILLERS = [i for i, text in enumerate(TEXTS) if text and text.startswith("<") and text.endswith(">")]
THINK_TEXTS = list(TEXTS)
THINK_TEXTS[FILLERS[0]] = "<think>"
for i in FILLERS[1:]:
    THINK_TEXTS[i] = "</think>"


@pytest.mark.parametrize("proposer_kind", ["none", "draft", "ngram"])
def test_guided_greedy_decoding_after_a_block_is_the_masked_targets(target, proposer_kind):  # noqa: F811
    inner = Guide(compile_regex(r'\{"name": "[a-z]{1,8}"\}'), vocabulary_of(THINK_TEXTS), "regex")
    closed = 0
    for opened in (False, True):
        guide = ThinkingFirst(inner, BlockMasks(vocabulary_of(THINK_TEXTS)), opened)
        for output_ids, prompt in zip(guided_through_engine(target, guide, proposer_kind), PROMPTS):
            reads = lambda state, t: guide.step(state, t) != guide.dead  # noqa: E731
            assert output_ids == guided_greedy_by_hand(target, prompt, guide, 40, reads=reads)
            text = text_of(output_ids[:-1], THINK_TEXTS)
            closed += "</think>" in text
            if output_ids[-1] == EOS:
                reasoning, content = ReasoningParser("qwen3", opened, guided=True).split(text)
                assert re.fullmatch(r'\{"name": "[a-z]{1,8}"\}', content)
    assert closed >= 4
