"""A thinking model's reasoning read apart from its content (server/reasoning.py), whole
and streamed in every chunking."""

from __future__ import annotations

import random

import pytest

from specserve.server.reasoning import ReasoningParser, ReasoningTokens, prompt_opens_thinking

QWEN3, OPENED, R1 = (
    ReasoningParser("qwen3"),
    ReasoningParser("qwen3", prompt_opened=True),
    ReasoningParser("deepseek_r1"),
)

CASES = [
    # parser, answer, (reasoning, content)
    (QWEN3, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    (QWEN3, "  <think>a < b </think>yes", ("a < b", "yes")),
    (QWEN3, "It is 4.", (None, "It is 4.")),
    (QWEN3, "  It is </think> 4.", (None, "  It is </think> 4.")),  # no block: the text as it is
    (QWEN3, "<think>\n\n</think>\n\nHi", (None, "Hi")),  # an empty block
    (QWEN3, "<think>cut off while thin", ("cut off while thin", None)),
    (QWEN3, "<think>done</think>", ("done", "")),
    (QWEN3, "<thi", (None, "<thi")),
    (QWEN3, "", (None, "")),
    (OPENED, "\nLet me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    (OPENED, "<think>again</think>x", ("again", "x")),
    (OPENED, "never closed", ("never closed", None)),
    (R1, "Let me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    (R1, "<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    (R1, "all thought </thin", ("all thought </thin", None)),
    (R1, "x </think> y </think> z", ("x", "y </think> z")),  # the first close ends the block
]


@pytest.mark.parametrize("parser, answer, expected", CASES)
def test_an_answer_splits_into_its_reasoning_and_content(parser, answer, expected):
    assert parser.split(answer) == expected


@pytest.mark.parametrize("parser, answer, expected", CASES)
def test_a_stream_sends_the_whole_answers_parts_in_every_chunking(parser, answer, expected):
    chunkings = [[answer], list(answer) or [""]]
    generator = random.Random(len(answer))
    for _ in range(30 if len(answer) > 1 else 0):
        cuts = sorted(generator.sample(range(1, len(answer)), min(len(answer) - 1, generator.randint(1, 5))))
        chunkings.append([answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])])
    reasoning, content = expected
    for chunks in chunkings:
        stream = parser.stream()
        sent = [stream.step(chunk, finished=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
        assert "".join(r for r, _ in sent) == (reasoning or ""), chunks
        assert "".join(c for _, c in sent) == (content or ""), chunks


def test_a_tag_still_coming_is_held_back():
    stream = QWEN3.stream()
    assert stream.step("<thi", finished=False) == ("", "")  # may still become the tag
    assert stream.step("nk>Let </th", finished=False) == ("Let", "")  # the blank and the tag's start wait
    assert stream.step("ink>\n\n", finished=False) == ("", "")
    assert stream.step("Four", finished=False) == ("", "Four")


def test_a_prompt_that_ends_with_the_tag_opens_the_block():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


# Each id's text: the tags split over several tokens, as a tokenizer without them as words writes them.
PIECES = ["<", "think>", "Let", " me", " see.", "</", "think", ">", "It", " is", " 4."]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize(
    "parser, ids, expected",
    [
        (QWEN3, range(11), 8),  # up to the token that completes `</think>`
        (QWEN3, range(6), 6),  # cut off inside the block (its closing tag half written): all reasoning
        (QWEN3, range(8, 11), 0),  # no block
        (R1, range(2, 11), 6),  # the block opened by the template
    ],
)
def test_the_reasoning_tokens_run_to_the_one_that_closes_the_block(parser, ids, expected):
    ids = list(ids)
    assert parser.reasoning_tokens(decode(ids), ids, decode) == expected
    rng = random.Random(0)
    for _ in range(20):  # streamed in random steps, counted after each: the same count at the end
        reader, at = parser.stream(), 0
        counter = ReasoningTokens(reader, decode)
        while at < len(ids):
            step = ids[at : at + rng.randint(1, 3)]
            at += len(step)
            reader.step(decode(step), finished=at == len(ids))
            counter.add(step)
            assert counter.count() <= at
        assert counter.count() == expected
