"""Structured outputs through the whole server, in process: a random target over a
vocabulary of characters (and a few longer pieces) behind the real app, held to a JSON
schema, any JSON object, a regex, a choice list or a grammar, by each field that asks for one,
plain and with a draft model; bad specifications are 400s that name their field, and
a guided request leaves its free neighbour's answer as it was."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import tokenizers

from specserve.engine.engine import Engine
from specserve.server.app import ApiSettings, build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.metrics import ServerMetrics
from specserve.spec.draft_model import DraftModelProposer
from specserve.structured.json_schema import json_object_regex
from specserve.structured.regex import compile_regex
from specserve.tokenizer import Tokenizer
from tests.engine.test_engine import EOS, perturbed, random_decoder

# No whitespace among the pieces: a random target's JSON stays compact and ends.
PIECES = list("0123456789abcdefghijklmnopqrstuvwxyz") + list('{}[]":,-.') + ['{"', '":', '",', '"}', "true", "null"]
TARGET = random_decoder("qwen2", seed=5)
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "string", "maxLength": 3},
    },
    "required": ["ok", "color"],
}

# A grammar (GBNF) and the regex of its language.
GRAMMAR = """
root ::= key ":" value ("," key ":" value){0,2}
key ::= [a-z]{1,3}  # a name
value ::= [0-9]+ | "true" | "null"
"""
GRAMMAR_REGEX = r"[a-z]{1,3}:(?:[0-9]+|true|null)(?:,[a-z]{1,3}:(?:[0-9]+|true|null)){0,2}"


def character_tokenizer() -> Tokenizer:
    """Each piece an id (text split at the longest piece first), placeholders up to EOS;
    decoding joins the pieces as they are."""
    vocab = {piece: i for i, piece in enumerate(PIECES)}
    for i in range(len(PIECES), EOS):
        vocab[f"<{i}>"] = i
    vocab["<eos>"] = EOS
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex("|".join(re.escape(p) for p in sorted(PIECES, key=len, reverse=True))), "isolated"
    )
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens(["<eos>"])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return Tokenizer(backend, bos_token_id=None, declared_eos_ids=[EOS], add_bos=False, chat_template=template)


async def served(bodies: list[tuple[str, dict]], draft: bool = False) -> list[httpx.Response]:
    """Each (route, body) sent at once to one fresh server."""
    tokenizer = character_tokenizer()
    proposer = DraftModelProposer(perturbed(TARGET, 0.3, seed=2)) if draft else None
    engine = Engine(TARGET, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4 if draft else 0)
    engine = AsyncEngine(engine, tokenizer, ServerMetrics("tiny"))
    app = build_app(engine, tokenizer, ApiSettings("tiny", max_model_len=512))
    engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return list(await asyncio.gather(*(client.post(route, json=body) for route, body in bodies)))
    finally:
        engine.stop()


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab12"}], "max_tokens": 80, **fields}


def completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "ab12", "max_tokens": 80, **fields}


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # the pattern ended, so EOS was allowed
    return choice["message"]["content"] if "message" in choice else choice["text"]


def check_schema(value: object) -> None:
    assert isinstance(value, dict) and set(value) <= {"ok", "color", "n"} and {"ok", "color"} <= set(value)
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    assert list(value) == [k for k in ("ok", "color", "n") if k in value]
    assert len(value.get("n", "")) <= 3


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft"])
def test_each_field_holds_the_answer_to_its_structure(draft):
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    responses = asyncio.run(
        served(
            [
                chat(response_format=schema_format, temperature=0),
                chat(response_format=schema_format, temperature=1.0, seed=3),
                completion(guided_json=SCHEMA, temperature=0),
                completion(guided_json=json.dumps(SCHEMA), temperature=0.7, seed=1),
                chat(structured_outputs={"json": SCHEMA}, temperature=0),
                chat(response_format={"type": "json_object"}, temperature=0),
                completion(guided_regex=r"[a-f]{2,5}-[0-9]{3}", temperature=0),
                chat(guided_choice=["yes", "no", "maybe"], temperature=0.8, seed=7),
                completion(structured_outputs={"choice": ["left", "right"]}, temperature=0),
                chat(temperature=0, max_tokens=12, ignore_eos=True),  # a free neighbour
                completion(guided_grammar=GRAMMAR, temperature=0),
                chat(structured_outputs={"grammar": GRAMMAR}, temperature=0.9, seed=4),
            ],
            draft=draft,
        )
    )
    for response in responses[:5]:
        check_schema(json.loads(text_of(response)))
    # A random target's free-form object may run past max_tokens: a prefix of one, then.
    choice = responses[5].json()["choices"][0]
    dfa = compile_regex(json_object_regex())
    assert choice["message"]["content"].startswith("{")
    assert dfa.walk(0, choice["message"]["content"]) != dfa.dead
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", text_of(responses[6]))
    assert text_of(responses[7]) in ("yes", "no", "maybe")
    assert text_of(responses[8]) in ("left", "right")
    free = responses[9].json()["choices"][0]["message"]["content"]
    (alone,) = asyncio.run(served([chat(temperature=0, max_tokens=12, ignore_eos=True)]))
    assert free == alone.json()["choices"][0]["message"]["content"]
    for response in responses[10:]:
        assert re.fullmatch(GRAMMAR_REGEX, text_of(response))


def test_greedy_answers_are_the_same_plain_and_speculative():
    bodies = [
        completion(guided_json=SCHEMA, temperature=0),
        chat(response_format={"type": "json_object"}, temperature=0),
        completion(guided_regex=r"[0-9a-z]{4,20}", temperature=0, stream=False),
        completion(guided_grammar=GRAMMAR, temperature=0),
    ]
    plain = [answer(r) for r in asyncio.run(served(bodies))]
    speculative = [answer(r) for r in asyncio.run(served(bodies, draft=True))]
    assert plain == speculative
    assert plain[0][1] == "stop" and plain[2][1] == "stop"


def answer(response: httpx.Response) -> tuple[str, str]:
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]


def test_a_streamed_guided_answer_is_the_whole_ones():
    stream, whole = asyncio.run(
        served([chat(guided_json=SCHEMA, temperature=0, stream=True), chat(guided_json=SCHEMA, temperature=0)])
    )
    lines = [line.removeprefix("data: ") for line in stream.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == text_of(whole)


@pytest.mark.parametrize(
    "fields, param, says",
    [
        (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
        (dict(guided_json=[1, 2]), "guided_json", "must be a JSON schema"),
        (dict(guided_json={"type": "object", "patternProperties": {}}), "guided_json", "patternProperties"),
        (dict(guided_regex="(a|b"), "guided_regex", "regex"),
        (dict(guided_regex="a(?=b)"), "guided_regex", "lookarounds"),
        (dict(guided_choice=[]), "guided_choice", "non-empty strings"),
        (dict(guided_grammar='root ::= "(" root ")" | "x"'), "guided_grammar", "refers to itself (root -> root)"),
        (dict(guided_grammar="root ::= item"), "guided_grammar", "line 1, column 10: the rule 'item' is not defined"),
        (dict(guided_regex="a", guided_choice=["a"]), "guided_choice", "both constrain"),
        (dict(response_format={"type": "xml"}), "response_format", "not supported"),
        (dict(response_format={"type": "json_schema"}), "response_format", "needs"),
        (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs", "exactly one"),
        (dict(structured_outputs={"grammar": 'start: "a"'}), "structured_outputs", "Lark grammars are not read"),
        (dict(structured_outputs={"lark": "x"}), "structured_outputs", "not supported"),
    ],
)
def test_a_bad_structure_is_a_400_naming_its_field(fields, param, says):
    (response,) = asyncio.run(served([chat(**fields)]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_pattern_no_token_can_start_ends_the_answer_at_once():
    """A regex whose first character no piece spells: EOS is all that is allowed."""
    (response,) = asyncio.run(served([completion(guided_regex="Z+", temperature=0)]))
    assert response.json()["choices"][0]["text"] == "" and response.json()["choices"][0]["finish_reason"] == "stop"


TOOLS = [
    {"type": "function", "function": {"name": "paint", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_choice_answers_with_the_call(stream):
    """A named tool: its arguments, valid for its parameters, as the one call, finishing
    "stop" (OpenAI's); "required": one call or more, each naming a tool, finishing
    "tool_calls". Streamed, arguments come as they are written. Neither needs the auto
    tool-choice flags."""
    named = {"type": "function", "function": {"name": "paint"}}
    responses = asyncio.run(
        served(
            [
                chat(tools=TOOLS, tool_choice=named, temperature=0, stream=stream),
                chat(tools=TOOLS, tool_choice="required", temperature=0, stream=stream, max_tokens=200),
            ]
        )
    )
    for response, finish_reason in zip(responses, ["stop", "tool_calls"]):
        assert response.status_code == 200, response.text
        if stream:
            lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
            deltas = [json.loads(line)["choices"][0] for line in lines if line != "[DONE]"]
            calls = assembled([entry for d in deltas for entry in d["delta"].get("tool_calls") or ()])
            assert not "".join(d["delta"].get("content") or "" for d in deltas)
            reason = deltas[-1]["finish_reason"]
            assert sum(bool(d["delta"].get("tool_calls")) for d in deltas) > 3  # arguments piece by piece
        else:
            choice = response.json()["choices"][0]
            assert choice["message"]["content"] is None
            calls, reason = choice["message"]["tool_calls"], choice["finish_reason"]
        assert reason == finish_reason and calls
        for call in calls:
            assert call["function"]["name"] in ("paint", "ping") and call["id"]
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "paint":
                check_schema(arguments)
            else:
                assert arguments == {}
    assert len(calls) >= 1


def assembled(entries: list[dict]) -> list[dict]:
    """Streamed tool_calls entries put together as the OpenAI SDK does: by index, the
    first giving id, type and name, every one a piece of the arguments."""
    calls: dict[int, dict] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"id": None, "function": {"name": None, "arguments": ""}})
        call["id"] = call["id"] or entry.get("id")
        call["function"]["name"] = call["function"]["name"] or entry["function"].get("name")
        call["function"]["arguments"] += entry["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(tool_choice="required"), "needs tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
        (dict(tools=TOOLS, tool_choice={"function": "paint"}), "tool_choice must be"),
        (dict(tools=TOOLS, tool_choice="required", guided_regex="a"), "both constrain"),
    ],
)
def test_a_bad_forced_tool_choice_is_a_400(fields, says):
    (response,) = asyncio.run(served([chat(**fields)]))
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


def test_bad_words_are_never_written_as_the_tokens_they_read_as():
    """vLLM's bad_words: a word read as two pieces loses its second where the answer ends
    with its first; the answer is the same up to there, plain and speculative."""
    tokenizer = character_tokenizer()
    # Pieces alone, so that a word of two of them reads as those two.
    free = completion(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, allowed_token_ids=list(range(36)))
    (response,) = asyncio.run(served([free]))
    ids = output_ids(tokenizer, response)
    word = tokenizer.decode(ids[3:5])
    assert tokenizer.encode(word, add_special_tokens=False) == ids[3:5], word
    for draft in (False, True):
        (banned,) = asyncio.run(served([completion(**free[1], bad_words=[word])], draft=draft))
        answer = output_ids(tokenizer, banned)
        assert answer[:4] == ids[:4] and answer[4] != ids[4]
        assert tuple(ids[3:5]) not in set(zip(answer, answer[1:]))


def output_ids(tokenizer: Tokenizer, response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [tokenizer.encode(token, add_special_tokens=False)[0] for token in tokens]


def test_too_many_or_blank_bad_words_are_400s():
    responses = asyncio.run(served([chat(bad_words=["x"] * 257), chat(bad_words=["ok", " "])]))
    for response in responses:
        assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words"


def test_a_whitespace_pattern_decides_what_goes_between_jsons_tokens():
    """vLLM's guided_whitespace_pattern (and structured_outputs.whitespace_pattern): with
    a vocabulary holding none of the default whitespace, "-" as JSON's whitespace."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    responses = asyncio.run(
        served(
            [
                chat(guided_json=schema, guided_whitespace_pattern="-{1,2}", temperature=0),
                chat(structured_outputs={"json": schema, "whitespace_pattern": "-{1,2}"}, temperature=0),
                chat(guided_json=schema, guided_whitespace_pattern="(", temperature=0),
            ]
        )
    )
    for response in responses[:2]:
        assert re.fullmatch(r'\{-{1,2}"ok"-{1,2}:-{1,2}(true|false)-{1,2}\}', text_of(response))
    assert responses[2].status_code == 400 and responses[2].json()["error"]["param"] == "guided_json"


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft"])
def test_a_schema_that_refers_to_itself_holds_the_answer_at_every_depth(draft):
    """A tree whose children are trees (`$ref: "#"`), as OpenAI's json_schema and vLLM's
    guided_json: a finished answer is such a tree, one cut by max_tokens a prefix of one."""
    tree = {
        "type": "object",
        "properties": {"n": {"type": "string", "maxLength": 2}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["n", "kids"],
    }

    def is_tree(value) -> bool:
        return set(value) == {"n", "kids"} and isinstance(value["n"], str) and all(map(is_tree, value["kids"]))

    format = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    responses = asyncio.run(
        served([chat(response_format=format, max_tokens=240, seed=seed, temperature=1.0) for seed in range(4)], draft)
    )
    contents = []
    for response in responses:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        contents.append(choice["message"]["content"])
        if choice["finish_reason"] == "stop":
            assert is_tree(json.loads(contents[-1])), contents[-1]
        else:
            assert contents[-1].startswith('{"n":"'), contents[-1]
    assert max(content.count('"kids":[{') for content in contents) >= 5  # deeper than a regex's bound
