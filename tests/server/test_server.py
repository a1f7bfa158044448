"""`specserve serve` as users meet it: a real server process on loopback with the
bundled smollm2-135m, talked to with the official `openai` client and raw HTTP.

Two servers run for the module: `plain` (no speculation, API key on, a tiny batch and
queue so 429 is reachable) and `spec` (smollm2 drafting for itself, k=3, no key,
--max-num-seqs 4, prefix caching on). At temperature 0 both must give the same text as each other and as
`specserve generate`, whatever else is in the batch.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.local_server import ServerProcess
from specserve.train.instructions import Instruction, from_messages, load_instructions, parse_line
from tests.test_tokenizer import SENT_TOOL_CONVERSATION, TOOLS

MODEL = "smollm2-135m"
KEY = "test-key-123"
SPEC = json.dumps({"model": MODEL, "num_speculative_tokens": 3, "adaptive": False})
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Once upon a time, there was a",
    "import numpy as np\n",
    "The quick brown fox",
    "Q: What is 2 + 2?\nA:",
    "My favourite colour is",
]


@pytest.fixture(scope="module")
def plain(prepared_cache, tmp_path_factory):
    recorded = tmp_path_factory.mktemp("recorded") / "prompts.jsonl"
    server = ServerProcess(
        MODEL,
        "--max-num-seqs",
        "2",
        "--max-queue-len",
        "1",
        "--max-model-len",
        "512",
        "--record-prompts",
        str(recorded),
        env={"SPECSERVE_API_KEY": KEY},
    )
    server.recorded = recorded
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spec(prepared_cache):
    server = ServerProcess(
        MODEL,
        "--speculative-config",
        SPEC,
        "--max-num-seqs",
        "4",
        "--max-queue-len",
        "16",
        "--max-model-len",
        "1024",
        "--log-stats-interval",
        "1",
        "--served-model-name",
        "smol",
        "--enable-prefix-caching",
        "--prefix-cache-space",
        "0.5",
        "--enable-tokenizer-info-endpoint",
    )
    yield server
    server.stop()


def client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def complete(server: ServerProcess, prompt: str, model: str, **kwargs) -> openai.types.Completion:
    return client(server).completions.create(model=model, prompt=prompt, temperature=0, **kwargs)


def metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# ----- the happy paths -----


def test_health_and_models(plain, spec):
    assert httpx.get(plain.url + "/health").status_code == 200  # open even with a key
    models = client(spec).models.list().data
    assert [m.id for m in models] == ["smol"]
    assert client(plain).models.list().data[0].id == MODEL


def test_greedy_text_is_the_same_with_and_without_speculation_and_as_generate(plain, spec, prepared_cache):
    from specserve.engine.build import build_engine, run_one
    from specserve.sampling import SamplingParams

    engine, tokenizer = build_engine(MODEL)
    for prompt in PROMPTS[:4]:
        ours = complete(plain, prompt, MODEL, max_tokens=32)
        drafted = complete(spec, prompt, "smol", max_tokens=32)
        assert drafted.choices[0].text == ours.choices[0].text
        expected = run_one(engine, tokenizer, tokenizer.encode(prompt), SamplingParams(max_tokens=32, temperature=0))
        assert ours.choices[0].text == expected["text"]
        assert ours.usage.completion_tokens == expected["num_output_tokens"]
        assert ours.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert ours.usage.total_tokens == ours.usage.prompt_tokens + ours.usage.completion_tokens
        spec_figures = drafted.model_extra["spec_decode"]
        assert spec_figures["num_draft_tokens"] > 0 and 0 <= spec_figures["acceptance_rate"] <= 1
        assert ours.model_extra["spec_decode"] is None


def test_chat_streaming_with_usage_matches_the_whole_response(spec):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three fruits."}]
    whole = client(spec).chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=40)
    chunks = list(
        client(spec).chat.completions.create(
            model="smol",
            messages=messages,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert whole.usage.completion_tokens <= 40


def test_the_responses_api_answers_as_chat_through_the_openai_client(plain, spec):
    """`client.responses.create` and its stream helper, with speculation and without:
    the chat endpoint's greedy answer, as JSON where text.format asks for it."""
    ask = {"input": PROMPTS[6], "instructions": "Answer briefly.", "temperature": 0, "max_output_tokens": 24}
    messages = [{"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}]
    chat = client(plain).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    plainly = client(plain).responses.create(model=MODEL, **ask)
    assert plainly.output_text == chat.choices[0].message.content
    assert plainly.usage.input_tokens == chat.usage.prompt_tokens
    with client(spec).responses.stream(model="smol", **ask) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == plainly.output_text
    follow_up = client(plain).responses.create(
        model=MODEL, input="And 3 + 3?", previous_response_id=plainly.id, temperature=0, max_output_tokens=8
    )
    assert follow_up.usage.input_tokens > plainly.usage.input_tokens + plainly.usage.output_tokens
    assert client(plain).responses.retrieve(follow_up.id).output_text == follow_up.output_text
    (asked,) = client(plain).responses.input_items.list(plainly.id)  # the instructions are no item
    assert asked.type == "message" and asked.role == "user" and asked.content[0].text == PROMPTS[6]
    client(plain).responses.delete(follow_up.id)
    with pytest.raises(openai.NotFoundError):
        client(plain).responses.retrieve(follow_up.id)
    json_mode = client(spec).responses.create(
        model="smol",
        input="A JSON object of two colours:",
        max_output_tokens=48,
        text={"format": {"type": "json_object"}},
    )
    if json_mode.status == "completed":
        assert isinstance(json.loads(json_mode.output_text), dict)
    else:  # cut by max_output_tokens: an object's start
        assert json_mode.incomplete_details.reason == "max_output_tokens" and json_mode.output_text.startswith("{")


def test_a_chats_next_turn_starts_from_the_cache_with_the_same_answer(plain, spec):
    """The spec server keeps the first turn's keys and values; the second turn (the
    conversation so far and a new message) reads them instead of prefilling them, and
    answers as the plain server, which has no prefix cache."""
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    first = client(spec).chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=48)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now make it multiply them."},
    ]
    before = metrics(spec)
    second = client(spec).chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=32)
    after = metrics(spec)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    assert (
        second.choices[0].message.content
        == client(plain)
        .chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
        .choices[0]
        .message.content
    )
    for name, moved in (
        ("prefix_cache_queries_total", second.usage.prompt_tokens),
        ("prefix_cache_hits_total", cached),
    ):
        assert after[("specserve:" + name, ())] - before.get(("specserve:" + name, ()), 0) == moved
    plain_usage = complete(plain, PROMPTS[0], MODEL, max_tokens=4).usage
    assert plain_usage.prompt_tokens_details is None  # no prefix cache: no count of its hits (vLLM's usage)
    assert metrics(plain).get(("specserve:prefix_cache_queries_total", ()), 0) == 0  # no prefix caching there


def test_completion_stream_sends_several_tokens_per_chunk_under_speculation(spec):
    stream = client(spec).completions.create(
        model="smol",
        prompt="1, 2, 3, 4, 5, 6, 7, 8,",
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert chunks[-1].usage.completion_tokens == 48
    assert len(text_chunks) < 48  # drafts accepted: fewer chunks than tokens
    assert text_chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_are_the_targets_with_and_without_speculation(plain, spec):
    """Under speculation a step's tokens come from several verified rows; each token's
    logprob must still be the one plain decoding reports, streamed or not."""
    kwargs = dict(max_tokens=24, logprobs=2, extra_body={"ignore_eos": True})
    ours = complete(plain, PROMPTS[2], MODEL, **kwargs).choices[0]
    drafted = complete(spec, PROMPTS[2], "smol", **kwargs).choices[0]
    for choice in (ours, drafted):
        logprobs = choice.logprobs
        assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == 24
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(24)]
        for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert value <= 0 and top[token] == value and len(top) <= 3
            assert max(top.values()) == value  # greedy: the chosen token is the most likely
    assert drafted.logprobs.tokens == ours.logprobs.tokens
    assert drafted.logprobs.token_logprobs == pytest.approx(ours.logprobs.token_logprobs, abs=1e-4)
    chunks = list(
        client(spec).completions.create(model="smol", prompt=PROMPTS[2], temperature=0, stream=True, **kwargs)
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices]
    assert sum((lp.tokens for lp in streamed), []) == ours.logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == ours.logprobs.text_offset
    assert any(len(lp.tokens) > 1 for lp in streamed)  # several tokens in one chunk: drafts accepted


def test_chat_logprobs_streamed_and_whole(spec):
    messages = [{"role": "user", "content": "Count from one to five."}]
    kwargs = dict(model="smol", messages=messages, temperature=0, max_tokens=20, logprobs=True, top_logprobs=3)
    response = client(spec).chat.completions.create(**kwargs)
    whole, content = response.choices[0], response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    text = bytes(b for entry in content for b in entry.bytes).decode()
    assert text.startswith(whole.message.content)  # a closing end-of-turn token may follow
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token for entry in content)
    chunks = list(client(spec).chat.completions.create(stream=True, **kwargs))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    without = client(spec).chat.completions.create(model="smol", messages=messages, max_tokens=3)
    assert without.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_asks(plain, spec):
    """lm-evaluation-harness scores a loglikelihood task with echo, logprobs 1 and
    max_tokens 1, reading the prompt's tokens' logprobs: each must be the logprob that
    decoding the same text gives it, with speculation on or off, streamed or not."""
    answer = complete(plain, PROMPTS[2], MODEL, max_tokens=8, logprobs=1, extra_body={"ignore_eos": True})
    answer = answer.choices[0]
    asked = dict(max_tokens=1, logprobs=1, echo=True, extra_body={"ignore_eos": True})
    for server, model in ((plain, MODEL), (spec, "smol")):
        scored = complete(server, PROMPTS[2] + answer.text, model, **asked).choices[0]
        logprobs = scored.logprobs
        assert scored.text.startswith(PROMPTS[2] + answer.text)
        assert "".join(logprobs.tokens) == scored.text
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # no row predicts it
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
        # The answer's tokens, read as a prompt, score as they did when generated.
        assert logprobs.tokens[-9:-1] == answer.logprobs.tokens
        assert logprobs.token_logprobs[-9:-1] == pytest.approx(answer.logprobs.token_logprobs, abs=2e-3)
        for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
            assert value <= 0 and top[token] == value and len(top) <= 2
        assert all(
            value == max(top.values()) for value, top in zip(logprobs.token_logprobs[-9:], logprobs.top_logprobs[-9:])
        )
        chunks = list(
            client(server).completions.create(
                model=model, prompt=PROMPTS[2] + answer.text, temperature=0, stream=True, **asked
            )
        )
        streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert sum((lp.tokens for lp in streamed), []) == logprobs.tokens
        assert sum((lp.text_offset for lp in streamed), []) == logprobs.text_offset
        assert sum((lp.token_logprobs for lp in streamed), [])[1:] == pytest.approx(
            logprobs.token_logprobs[1:], abs=1e-5
        )


def test_echo_with_max_tokens_0_answers_the_prompt_alone(plain, spec):
    """Older lm-evaluation-harness versions score a text with echo and max_tokens 0: the
    choice is the prompt and its tokens' logprobs, nothing generated, streamed or not."""
    asked = dict(max_tokens=1, logprobs=2, echo=True)
    for server, model in ((plain, MODEL), (spec, "smol")):
        with_token = complete(server, PROMPTS[1], model, **asked).choices[0]
        alone = client(server).completions.create(
            model=model, prompt=PROMPTS[1], temperature=0, **(asked | {"max_tokens": 0})
        )
        choice = alone.choices[0]
        assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
        assert choice.logprobs.tokens == with_token.logprobs.tokens[:-1]
        assert choice.logprobs.token_logprobs == with_token.logprobs.token_logprobs[:-1]
        assert alone.usage.completion_tokens == 0 and alone.usage.total_tokens == alone.usage.prompt_tokens
        chunks = list(
            client(server).completions.create(
                model=model,
                prompt=PROMPTS[1],
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **(asked | {"max_tokens": 0}),
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[1]
        assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices), []) == choice.logprobs.tokens
        assert chunks[-1].usage.completion_tokens == 0


def test_vllms_prompt_logprobs_rank_each_prompt_token_in_completions_and_chat(spec):
    """vLLM's prompt_logprobs: null for the first prompt token, then the token with its
    rank and its n likeliest alternatives ranked 1..n; the same figures as echo's, and
    again for a prompt the prefix cache holds."""
    body = {"model": "smol", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    responses = [httpx.post(spec.url + "/v1/completions", json=body, timeout=60).json() for _ in range(2)]
    fields = [r["choices"][0]["prompt_logprobs"] for r in responses]
    assert fields[0] == fields[1]  # the second read again, past the prefix cache
    field = fields[0]
    assert len(field) == responses[0]["usage"]["prompt_tokens"] and field[0] is None
    echoed = complete(spec, PROMPTS[0], "smol", max_tokens=2, logprobs=3, echo=True).choices[0].logprobs
    for entry, value, token in zip(field[1:], echoed.token_logprobs[1:], echoed.tokens[1:]):
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert len(entry) in (3, 4) and {1, 2, 3} <= {e["rank"] for e in ranked}  # the token may be among them
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in ranked)
        mine = next(e for e in ranked if e["decoded_token"] == token)
        assert mine["logprob"] == pytest.approx(value, abs=1e-5)
        assert (mine["rank"] == 1) == (mine["logprob"] == max(e["logprob"] for e in ranked))
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    answered = httpx.post(spec.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(answered["prompt_logprobs"]) == answered["usage"]["prompt_tokens"]
    assert answered["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in answered["prompt_logprobs"][1:])


def test_penalties_give_the_same_text_with_and_without_speculation(plain, spec):
    penalties = dict(
        frequency_penalty=0.8, presence_penalty=0.3, extra_body={"repetition_penalty": 1.2, "ignore_eos": True}
    )
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    ours = complete(plain, prompt, MODEL, max_tokens=32, **penalties).choices[0].text
    assert complete(spec, prompt, "smol", max_tokens=32, **penalties).choices[0].text == ours
    assert complete(plain, prompt, MODEL, max_tokens=32, extra_body={"ignore_eos": True}).choices[0].text != ours


def test_a_logit_bias_bans_and_forces_tokens_with_and_without_speculation(plain, spec):
    from specserve import catalogue
    from specserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(catalogue.prepared_dir(MODEL))
    prompt, options = PROMPTS[2], dict(max_tokens=12, extra_body={"ignore_eos": True})
    free = complete(plain, prompt, MODEL, **options).choices[0].text
    first = tokenizer.encode(prompt + free)[len(tokenizer.encode(prompt))]
    banned = complete(plain, prompt, MODEL, logit_bias={str(first): -100}, **options).choices[0].text
    assert banned != free and tokenizer.encode(prompt + banned)[len(tokenizer.encode(prompt))] != first
    assert complete(spec, prompt, "smol", logit_bias={str(first): -100}, **options).choices[0].text == banned
    forced_id = tokenizer.encode(" X")[-1]
    forced = complete(spec, prompt, "smol", logit_bias={str(forced_id): 100}, max_tokens=4).choices[0].text
    assert forced == tokenizer.decode([forced_id] * 4)
    with pytest.raises(openai.BadRequestError) as caught:
        complete(spec, prompt, "smol", logit_bias={"49152": 1})  # smollm2's vocabulary is [0, 49152)
    assert caught.value.body["param"] == "logit_bias" and "outside the vocabulary" in caught.value.body["message"]


def test_allowed_token_ids_keep_the_answer_to_them_with_and_without_speculation(plain, spec):
    """vLLM's allowed_token_ids: a classifier's answer held to " yes" and " no" (and the
    end of text), greedy and sampled, the speculative server's text the plain one's."""
    from specserve import catalogue
    from specserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(catalogue.prepared_dir(MODEL))
    allowed = [tokenizer.encode(" yes")[-1], tokenizer.encode(" no")[-1]]
    prompt = "Q: Is the sky green? Answer yes or no.\nA:"
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        options = dict(max_tokens=6, extra_body={"allowed_token_ids": allowed, "ignore_eos": True, **sampling})
        texts = [
            complete(server, prompt, model, **options).choices[0].text
            for server, model in ((plain, MODEL), (spec, "smol"))
        ]
        assert texts[0] == texts[1]
        assert texts[0] and set(texts[0].split()) <= {"yes", "no"}, texts
    with pytest.raises(openai.BadRequestError) as caught:
        complete(spec, prompt, "smol", extra_body={"allowed_token_ids": [3, 49152]})
    assert caught.value.body["param"] == "allowed_token_ids"


def test_tokenize_and_detokenize_as_vllm_serves_them(plain, spec):
    """vLLM's /tokenize and /detokenize (and, with its flag, /tokenizer_info), which
    lm-evaluation-harness's remote tokenizer reads: a text's ids are those a completion
    of it reads, a conversation's those a chat completion reads, and the ids' text is
    the text again."""
    text = PROMPTS[0] + " <|im_end|>"
    tokenized = httpx.post(spec.url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert (
        tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
        and tokenized["max_model_len"] == 1024
    )
    usage = complete(spec, text, "smol", max_tokens=1).usage
    assert usage.prompt_tokens == tokenized["count"]
    detokenized = httpx.post(spec.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detokenized["prompt"] == text  # special tokens' text included
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = httpx.post(spec.url + "/tokenize", json={"model": "smol", "messages": messages}).json()
    answered = client(spec).chat.completions.create(model="smol", messages=messages, max_tokens=1)
    assert chat["count"] == answered.usage.prompt_tokens
    info = httpx.get(spec.url + "/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == 1024
    eos = httpx.post(spec.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["count"] == 1  # the harness reads the EOS id as its text's one token
    for route, body, param in [
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, "model"),
    ]:
        refused = httpx.post(spec.url + route, json=body)
        assert refused.status_code in (400, 404) and refused.json()["error"]["param"] == param, refused.text
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(plain.url + "/tokenizer_info", headers=auth).status_code == 404  # not without its flag
    assert httpx.post(plain.url + "/tokenize", json={"prompt": "a"}).status_code == 401  # the API key guards it
    keyed = httpx.post(plain.url + "/tokenize", json={"prompt": "a"}, headers=auth).json()
    assert keyed["tokens"] == httpx.post(spec.url + "/tokenize", json={"prompt": "a"}).json()["tokens"]


def test_several_prompts_times_n_choices_streamed_and_whole(spec):
    """Choice i is prompt i // n; at temperature 0 each is that prompt's own answer."""
    prompts = [PROMPTS[2], PROMPTS[0]]
    solo = [complete(spec, p, "smol", max_tokens=16).choices[0].text for p in prompts]
    whole = complete(spec, prompts, "smol", max_tokens=16, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [solo[0], solo[0], solo[1], solo[1]]
    singles = [complete(spec, p, "smol", max_tokens=16).usage for p in prompts]
    assert whole.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)  # each prompt once
    assert whole.usage.completion_tokens == 2 * sum(u.completion_tokens for u in singles)
    assert whole.model_extra["spec_decode"]["num_draft_tokens"] > 0
    chunks = list(
        client(spec).completions.create(
            model="smol",
            prompt=prompts,
            max_tokens=16,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finishes = ["", "", "", ""], [0, 0, 0, 0]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
    assert texts == [c.text for c in whole.choices] and finishes == [1, 1, 1, 1]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_seeded_samples_differ_and_repeat(spec):
    """Sample j of a seeded request draws with seed + j: the n differ, the request repeats."""

    def sample(**kwargs) -> list[str]:
        result = client(spec).chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12,
            temperature=1.0,
            **kwargs,
        )
        return [c.message.content for c in sorted(result.choices, key=lambda c: c.index)]

    three = sample(n=3, seed=11)
    assert len(set(three)) > 1 and sample(n=3, seed=11) == three
    assert sample(seed=12) == three[1:2]


def test_stop_strings_end_the_text_before_them(plain, spec):
    """The text ends before the stop string, and the tokens counted and given logprobs
    end with the one that completed it: a speculative step's tokens past it are none."""
    reference = complete(plain, PROMPTS[0], MODEL, max_tokens=40).choices[0].text
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    expected = reference[: reference.index(stop)]
    counted = []
    for server, name in ((plain, MODEL), (spec, "smol")):
        result = complete(server, PROMPTS[0], name, max_tokens=40, stop=[stop, "never-there"], logprobs=1)
        assert result.choices[0].text == expected
        assert result.choices[0].finish_reason == "stop"
        assert result.choices[0].model_extra["stop_reason"] == stop
        counted.append((result.usage.completion_tokens, len(result.choices[0].logprobs.tokens)))
        chunks = list(
            client(server).completions.create(
                model=name, prompt=PROMPTS[0], temperature=0, max_tokens=40, stop=stop, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == expected
    assert counted[0] == counted[1] and counted[0][0] == counted[0][1]


def test_a_stop_string_that_the_last_allowed_token_completes_finishes_with_stop(plain, spec):
    reference = complete(plain, PROMPTS[0], MODEL, max_tokens=12).choices[0].text
    # the shortest ending found nowhere earlier: only the 12th token's text completes it
    stop = next(
        reference[-n:] for n in range(2, len(reference)) if reference.index(reference[-n:]) == len(reference) - n
    )
    for server, name in ((plain, MODEL), (spec, "smol")):
        before = metrics(server)
        result = complete(server, PROMPTS[0], name, max_tokens=12, stop=[stop])
        assert result.choices[0].text == reference[: -len(stop)]
        assert (result.choices[0].finish_reason, result.choices[0].model_extra["stop_reason"]) == ("stop", stop)
        after = metrics(server)
        finished = [
            key
            for key in after
            if key[0] == "specserve:request_success_total" and ("finished_reason", "stop") in key[1]
        ]
        assert finished and after[finished[0]] - before.get(finished[0], 0) == 1


def test_stop_token_ids_ignore_eos_and_echo(plain):
    from specserve import catalogue
    from specserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(catalogue.prepared_dir(MODEL))
    reference = complete(plain, PROMPTS[2], MODEL, max_tokens=20, extra_body={"ignore_eos": True})
    ids = tokenizer.encode(PROMPTS[2] + reference.choices[0].text)[len(tokenizer.encode(PROMPTS[2])) :]
    stop_id = ids[5]
    stopped = complete(plain, PROMPTS[2], MODEL, max_tokens=20, extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop_id
    assert stopped.usage.completion_tokens == ids.index(stop_id) + 1
    assert reference.usage.completion_tokens == 20 and reference.choices[0].finish_reason == "length"
    # min_tokens (vLLM's): neither the stop id nor a stop string ends the output before it.
    held = complete(plain, PROMPTS[2], MODEL, max_tokens=20, extra_body={"stop_token_ids": [stop_id], "min_tokens": 12})
    assert held.usage.completion_tokens >= 12
    early = held.choices[0].text[:3]  # a stop string the first tokens complete
    also = complete(
        plain,
        PROMPTS[2],
        MODEL,
        max_tokens=20,
        stop=[early],
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 12},
    )
    assert also.usage.completion_tokens >= 12 and held.choices[0].text.startswith(also.choices[0].text)
    # include_stop_str_in_output (vLLM's): the stop string, or the stop token's text, stays.
    text = reference.choices[0].text
    stop = text[4:7]
    include = {"include_stop_str_in_output": True}
    kept = complete(plain, PROMPTS[2], MODEL, max_tokens=20, stop=[stop], extra_body=include)
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    kept_id = complete(plain, PROMPTS[2], MODEL, max_tokens=20, extra_body={"stop_token_ids": [stop_id], **include})
    assert kept_id.choices[0].text == tokenizer.decode(ids[: ids.index(stop_id) + 1])
    echoed = complete(plain, PROMPTS[2], MODEL, max_tokens=5, echo=True)
    assert echoed.choices[0].text.startswith(PROMPTS[2])
    # truncate_prompt_tokens (vLLM's): the prompt's last k ids alone, as text or ids, past the context too.
    prompt_ids = tokenizer.encode(PROMPTS[2])
    last = complete(plain, prompt_ids[-4:], MODEL, max_tokens=8)
    for prompt in (PROMPTS[2], prompt_ids):
        cut = complete(plain, prompt, MODEL, max_tokens=8, echo=True, extra_body={"truncate_prompt_tokens": 4})
        assert cut.usage.prompt_tokens == 4
        assert cut.choices[0].text == tokenizer.decode(prompt_ids[-4:]) + last.choices[0].text
    long = tokenizer.decode(prompt_ids) * (600 // len(prompt_ids) + 1)  # past --max-model-len 512
    assert len(tokenizer.encode(long)) > 512
    fitted = complete(plain, long, MODEL, max_tokens=4, extra_body={"truncate_prompt_tokens": 500})
    assert fitted.usage.prompt_tokens == 500
    token_prompt = complete(plain, tokenizer.encode(PROMPTS[2]), MODEL, max_tokens=20, extra_body={"ignore_eos": True})
    assert token_prompt.choices[0].text == reference.choices[0].text


def test_seeds_repeat_differ_and_give_the_plain_servers_text(plain, spec):
    """A seed gives the same text every time, and the same with or without speculation
    (keyed draws: spec/verify.py)."""

    def sample(seed: int, server: ServerProcess = spec, **cuts) -> str:
        return (
            client(server)
            .completions.create(
                model="smol" if server is spec else MODEL,
                prompt=PROMPTS[3],
                max_tokens=24,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"top_k": 50, **cuts},
            )
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first == sample(7, plain)
    assert len({first, sample(8), sample(9)}) > 1
    cut = sample(7, min_p=0.2)  # vLLM's min-p as well
    assert cut == sample(7, plain, min_p=0.2) and cut != first


def test_metrics_count_requests_tokens_and_speculation(spec):
    before = metrics(spec)
    result = complete(spec, PROMPTS[4], "smol", max_tokens=16, extra_body={"ignore_eos": True})
    after = metrics(spec)

    def moved(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("specserve:generation_tokens_total") == 16 == result.usage.completion_tokens
    assert moved("specserve:prompt_tokens_total") == result.usage.prompt_tokens
    assert moved("specserve:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("specserve:time_to_first_token_seconds_count") == 1
    assert moved("specserve:e2e_request_latency_seconds_count") == 1
    assert moved("specserve:inter_token_latency_seconds_count") == 15
    spec_figures = result.model_extra["spec_decode"]
    assert moved("specserve:spec_decode_num_drafts_total") == spec_figures["num_drafts"] > 0
    assert moved("specserve:spec_decode_num_draft_tokens_total") == spec_figures["num_draft_tokens"]
    accepted = moved("specserve:spec_decode_num_accepted_tokens_total")
    assert accepted == spec_figures["num_accepted_tokens"]
    per_position = sum(
        moved("specserve:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)) for i in range(3)
    )
    assert per_position == accepted
    assert after[("specserve:num_requests_running", ())] == 0
    assert ("specserve:num_requests_waiting", ()) in after


def test_periodic_log_line_reports_acceptance(spec):
    complete(spec, PROMPTS[5], "smol", max_tokens=16)
    deadline = time.monotonic() + 5
    while "SpecDecoding metrics" not in spec.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "SpecDecoding metrics: Mean acceptance length" in spec.log()
    assert "Application startup complete" in spec.log()


# ----- auth, bad input, load -----


def test_api_key_guards_v1_routes(plain):
    assert httpx.get(plain.url + "/v1/models").status_code == 401
    wrong = httpx.get(plain.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(plain, key="nope").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(plain.url + "/metrics").status_code == 200


BAD_REQUESTS = [
    # (route, body, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 600}, 400, None),  # > --max-model-len 512
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": ["hi", "ho"], "n": 2}, 400, "n"),  # 4 > 2 running + 1 waiting
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": 12}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, None),  # token id outside the vocabulary
    ("completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", ["not", "an", "object"], 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 21, "echo": True}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
]


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(plain, route, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{plain.url}/v1/{route}",
        content=content,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert complete(plain, "hi", MODEL, max_tokens=2).choices[0].text is not None


def test_unknown_route_and_oversized_body(plain):
    missing = httpx.get(plain.url + "/v2/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    # Announce a 100 MB body without sending it: refused on the header alone.
    with socket.create_connection(("127.0.0.1", plain.port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000000\r\n\r\n{"
        )
        reply = conn.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413")


def test_full_queue_gets_429_and_everyone_else_is_served(plain):
    """--max-num-seqs 2 and --max-queue-len 1: of 6 simultaneous requests 3 run or wait
    and the rest are refused at once with 429; the accepted ones all finish."""

    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon", "max_tokens": 24, "ignore_eos": True, "temperature": 0},
        )

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=plain.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as http:
            return await asyncio.gather(*(one(http) for _ in range(6)))

    statuses = sorted(r.status_code for r in asyncio.run(burst()))
    assert statuses.count(200) >= 3 and set(statuses) <= {200, 429}, statuses
    refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
    assert all(r.json()["error"]["type"] == "rate_limit_error" for r in refused)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_of_n_choices_goes_in_while_a_place_is_free(plain, stream):
    """2 running + 1 waiting fit: with one request running, n = 3 goes in whole (a
    place is free, as a single request needs), taking the count to 4; while it is in,
    a single request gets 429 before it reaches the engine (none is aborted); the three
    choices and the running request all finish."""
    aborted = ("specserve:request_success_total", (("finished_reason", "abort"),))
    before = metrics(plain).get(aborted, 0)
    headers = {"Authorization": f"Bearer {KEY}"}

    def in_engine() -> float:
        now = metrics(plain)
        return sum(now.get((f"specserve:num_requests_{gauge}", ()), 0) for gauge in ("running", "waiting"))

    async def three_choices_then_one() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=plain.url, timeout=120, headers=headers) as http:
            body = {"model": MODEL, "prompt": "Hello", "n": 3, "max_tokens": 48, "ignore_eos": True, "stream": stream}
            choices = asyncio.ensure_future(http.post("/v1/completions", json=body))
            while (seen := in_engine()) < 4 and not choices.done():
                await asyncio.sleep(0.05)
            assert seen == 4, f"{seen} requests in the engine, {choices.done() and choices.result().text[:300]}"
            single = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
            return await choices, single

    with httpx.stream(
        "POST",
        plain.url + "/v1/completions",
        timeout=120,
        headers=headers,
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True},
    ) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        choices, single = asyncio.run(three_choices_then_one())
        assert single.status_code == 429 and single.json()["error"]["code"] == "queue_full"
        assert choices.status_code == 200, choices.text
        if stream:
            events = [line.removeprefix("data: ") for line in choices.text.splitlines() if line.startswith("data: {")]
            ended = [c for event in events for c in json.loads(event)["choices"] if c["finish_reason"]]
            assert sorted(c["index"] for c in ended) == [0, 1, 2]
        else:
            assert [c["finish_reason"] for c in choices.json()["choices"]] == ["length"] * 3
        assert any('"finish_reason": "length"' in line for line in lines)  # the running one goes on to its end
    assert metrics(plain).get(aborted, 0) == before


def test_disconnect_mid_stream_frees_the_slot(spec):
    before = metrics(spec).get(("specserve:request_success_total", (("finished_reason", "abort"),)), 0)
    with httpx.stream(
        "POST",
        spec.url + "/v1/completions",
        timeout=60,
        json={"model": "smol", "prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True, "stream": True},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # got a chunk; leave
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = metrics(spec)
        if (
            now[("specserve:num_requests_running", ())] == 0
            and now.get(("specserve:request_success_total", (("finished_reason", "abort"),)), 0) == before + 1
        ):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the abandoned request still runs: {now}")
    assert now[("specserve:generation_tokens_total", ())] < 10_000


def test_disconnect_from_n_choices_frees_every_slot(spec):
    with httpx.stream(
        "POST",
        spec.url + "/v1/completions",
        timeout=60,
        json={
            "model": "smol",
            "prompt": ["Once upon a time", "In a galaxy"],
            "n": 2,
            "max_tokens": 800,
            "ignore_eos": True,
            "stream": True,
        },
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # got a chunk; leave
    deadline = time.monotonic() + 10
    while metrics(spec)[("specserve:num_requests_running", ())] > 0:
        if time.monotonic() > deadline:
            pytest.fail("abandoned choices still run")
        time.sleep(0.1)


def test_sixteen_concurrent_requests_each_get_their_solo_answer(spec):
    lengths = [12 + 3 * (i % 5) for i in range(16)]
    requests = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), n) for i, n in enumerate(lengths)]
    solo = [complete(spec, prompt, "smol", max_tokens=n).choices[0].text for prompt, n in requests]

    async def together() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=spec.url + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(prompt: str, n: int, stream: bool) -> str:
            if stream:
                chunks = await async_client.completions.create(
                    model="smol", prompt=prompt, max_tokens=n, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in chunks])
            result = await async_client.completions.create(model="smol", prompt=prompt, max_tokens=n, temperature=0)
            return result.choices[0].text

        return await asyncio.gather(*(one(p, n, i % 2 == 0) for i, (p, n) in enumerate(requests)))

    most_running = 0

    async def watch_and_run() -> list[str]:
        nonlocal most_running
        task = asyncio.ensure_future(together())
        async with httpx.AsyncClient(base_url=spec.url) as http:
            while not task.done():
                text = (await http.get("/metrics")).text
                for family in text_string_to_metric_families(text):
                    if family.name == "specserve:num_requests_running":
                        most_running = max(most_running, family.samples[0].value)
                await asyncio.sleep(0.05)
        return await task

    assert asyncio.run(watch_and_run()) == solo
    assert most_running <= 4


def test_sigterm_finishes_or_fails_requests_in_flight_and_exits(prepared_cache):
    server = ServerProcess(MODEL, "--shutdown-grace", "2")
    try:
        lines: list[str] = []

        async def long_stream() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async with http.stream(
                    "POST",
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True},
                ) as response:
                    async for line in response.aiter_lines():
                        if line:
                            lines.append(line)
                        if len(lines) == 2:
                            server.terminate()

        started = time.monotonic()
        asyncio.run(long_stream())
        # uvicorn re-raises the signal after its graceful shutdown: -SIGTERM is a clean exit.
        assert server.process.wait(30) in (0, -15)
        assert "Finished server process" in server.log()
        assert time.monotonic() - started < 30
        assert lines[-1] == "data: [DONE]"
        assert "shut down" in json.loads(lines[-2][len("data: ") :])["error"]["message"]
    finally:
        server.stop()


def test_admitted_prompts_are_recorded_as_train_head_reads_them(plain):
    """--record-prompts: each admitted request's prompts once (whatever its n), in the
    forms train-head answers them; a refused request, a blank prompt and a conversation
    with no user turn are not recorded."""
    chat = client(plain).chat.completions.create
    brief = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    chat(model=MODEL, messages=brief, max_tokens=2, n=2)
    chat(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], max_tokens=2
    )
    chat(model=MODEL, messages=[{"role": "system", "content": "A system turn alone."}], max_tokens=2)
    calling = SENT_TOOL_CONVERSATION  # an agent's turn after its tool's result
    chat(model=MODEL, messages=calling, tools=TOOLS, tool_choice="none", max_tokens=2)
    complete(plain, ["def add(a, b):", "   "], MODEL, max_tokens=2)
    ids = [504, 1023, 28]
    echoed = complete(plain, ids, MODEL, max_tokens=1, echo=True).choices[0].text  # the ids' text, then a token
    refused = {"model": MODEL, "messages": [{"role": "user", "content": "Refused prompt"}], "temperature": -1}
    answer = httpx.post(f"{plain.url}/v1/chat/completions", json=refused, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 400
    expected = [
        Instruction("chat", "Name a fruit.", (("system", "Be brief."),)),
        Instruction("chat", "Hi"),
        Instruction("completion", "def add(a, b):", templated=False),
        from_messages(calling, "chat", TOOLS),
    ]

    def recorded() -> list[Instruction]:
        lines = plain.recorded.read_text().splitlines() if plain.recorded.exists() else []
        return [parse_line(json.loads(line)) for line in lines]

    def from_ids(lines: list[Instruction]) -> list[Instruction]:
        return [i for i in lines if not i.templated and echoed.startswith(i.prompt)]  # the ids, decoded

    deadline = time.monotonic() + 15  # written on the recorder's thread
    while not (set(expected) <= set(recorded()) and from_ids(recorded())) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = recorded()
    assert [lines.count(i) for i in expected] == [1, 1, 1, 1] and len(from_ids(lines)) == 1
    assert expected[-1].messages()[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert not [
        i for i in lines if "Refused prompt" in i.prompt or "system turn alone" in i.prompt or not i.prompt.strip()
    ]
    assert load_instructions(plain.recorded) == list(dict.fromkeys(lines))  # train-head reads each once
