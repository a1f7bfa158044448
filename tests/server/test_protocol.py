"""Request bodies: strict validation, errors naming the parameter, refusals of what we do
not implement, and the turn from a body into engine terms (prompt, stops, sampling)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from specserve.sampling import SamplingParams
from specserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
TOOL_TURN = {"role": "tool", "tool_call_id": "c1", "content": "42"}


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **fields})


def invalid(model: type[pydantic.BaseModel], body: dict[str, Any] | bytes) -> APIError:
    """The APIError the server would answer for this body."""
    with pytest.raises(pydantic.ValidationError) as caught:
        model.model_validate_json(body) if isinstance(body, bytes) else model.model_validate(body)
    return validation_error(caught.value.errors())


# --- strict validation and validation_error --------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "5"),
        ("max_tokens", 5.5),
        ("max_tokens", True),
        ("temperature", True),
        ("temperature", "0.7"),
        ("top_k", 1.0),
        ("stream", "true"),
    ],
)
def test_strict_types_are_not_coerced(field, value):
    error = invalid(CompletionRequest, {"prompt": "Hello", field: value})
    assert (error.status, error.param, error.type) == (400, field, "invalid_request_error")
    assert field in str(error)


def test_a_number_where_a_float_belongs_is_fine_and_unknown_fields_are_ignored():
    body = completion(temperature=1, top_p=1, some_future_option={"x": 1})
    assert body.temperature == 1.0 and not hasattr(body, "some_future_option")


def test_missing_role_names_the_message():
    error = invalid(ChatCompletionRequest, {"messages": [USER, {"content": "no role"}]})
    assert error.param == "messages[1].role"
    assert "missing" in str(error)


@pytest.mark.parametrize("prompt", [5, None, [1, "a"], {"text": "hi"}])
def test_wrong_prompt_type_names_prompt_not_the_union_member(prompt):
    assert invalid(CompletionRequest, {"prompt": prompt}).param == "prompt"


def test_missing_prompt():
    error = invalid(CompletionRequest, {"max_tokens": 5})
    assert error.param == "prompt" and "missing required parameter" in str(error)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"messages": [USER], "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"messages": [USER], "stop": [1]}, "stop"),
    ],
)
def test_nested_errors_name_the_nested_parameter(body, param):
    assert invalid(ChatCompletionRequest, body).param == param


def test_invalid_json_is_reported_as_such():
    error = invalid(CompletionRequest, b'{"prompt": "Hello",')
    assert error.param is None and error.status == 400
    assert str(error).startswith("the request body is not valid JSON")


def test_a_json_body_that_is_not_an_object_has_no_param():
    error = invalid(CompletionRequest, b"[1, 2]")
    assert error.param is None and error.status == 400


def test_fastapi_locations_drop_the_body_prefix():
    # FastAPI reports locations as ("body", ...); a missing body has only ("body",).
    nested = validation_error([{"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required"}])
    assert nested.param == "messages[0].role"
    no_body = validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert no_body.param is None and "JSON object body" in str(no_body)


def test_error_body_is_openai_shaped():
    assert APIError("bad n", param="n").body() == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}
    }


# --- refuse_unsupported -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make, fields, param",
    [
        (completion, {"n": 0}, "n"),
        (chat, {"n": -1}, "n"),
        (completion, {"n": 2, "best_of": 3}, "best_of"),
        (completion, {"suffix": "!", "echo": True}, "echo"),
        (completion, {"best_of": 2}, "best_of"),
        (completion, {"logit_bias": {"fifty": 1.0}}, "logit_bias"),
        (chat, {"logit_bias": {"2.5": 1.0}}, "logit_bias"),
        (chat, {"logit_bias": {"-3": 1.0}}, "logit_bias"),
        (chat, {"logit_bias": {"3": float("nan")}}, "logit_bias"),
        (chat, {"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
        (completion, {"use_beam_search": True}, "use_beam_search"),
        (chat, {"length_penalty": 0.8}, "length_penalty"),
        (chat, {"bad_words": ["no", ""]}, "bad_words"),
        (completion, {"prompt_logprobs": -1}, "prompt_logprobs"),
        (chat, {"prompt_logprobs": 21}, "prompt_logprobs"),
        (completion, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (chat, {"prompt_logprobs": 3, "stream": True}, "prompt_logprobs"),
        (completion, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (chat, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        (chat, {"guided_grammar": 3}, "guided_grammar"),
        (chat, {"guided_grammar": " "}, "guided_grammar"),
        (completion, {"structured_outputs": {"grammar": ["root ::= 'a'"]}}, "structured_outputs.grammar"),
        (chat, {"guided_json": 3}, "guided_json"),
        (chat, {"guided_choice": ["yes", ""]}, "guided_choice"),
        (chat, {"guided_choice": ["yes"], "guided_regex": "a+"}, "guided_choice"),
        (completion, {"structured_outputs": {"regex": "a+", "json": {}}}, "structured_outputs"),
        (completion, {"stream_options": {"include_usage": True}}, "stream_options"),
        (chat, {"top_logprobs": 2}, "top_logprobs"),
        (
            chat,
            {"tools": [{"type": "function", "function": {"name": "f"}}, {**TOOL, "type": "custom"}]},
            "tools[1].type",
        ),
        (chat, {"tool_choice": "required"}, "tool_choice"),
        (chat, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (chat, {"response_format": {"type": "yaml"}}, "response_format"),
        (completion, {"response_format": {"type": "json_schema", "json_schema": "{}"}}, "response_format"),
        (chat, {"messages": [USER, {"role": "function", "content": "42"}]}, "messages[1].role"),
        (chat, {"messages": [USER, {"role": "tool", "tool_call_id": "c1"}]}, "messages[1].content"),
        (chat, {"messages": [{**USER, "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
            "messages[0].content[1].type",
        ),
        (chat, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ],
)
def test_unsupported_options_are_refused_by_name(make, fields, param):
    body = make(**fields)
    with pytest.raises(APIError) as caught:
        body.refuse_unsupported()
    assert (caught.value.param, caught.value.status) == (param, 400)


@pytest.mark.parametrize(
    "body",
    [
        completion(
            n=3,
            best_of=3,
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            logit_bias={},
            use_beam_search=False,
            length_penalty=1.0,
            include_stop_str_in_output=False,
            allowed_token_ids=[],
            bad_words=[],
            prompt_logprobs=None,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=5,
        ),
        chat(
            logprobs=True,
            top_logprobs=0,
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            messages=[{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant")],
        ),
        chat(
            tools=[TOOL],
            tool_choice="auto",
            parallel_tool_calls=False,
            messages=[USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, TOOL_TURN],
        ),
    ],
)
def test_supported_values_of_those_options_pass(body):
    body.refuse_unsupported()


def test_tool_turns_reach_the_template_as_transformers_templates_read_them():
    body = chat(tools=[TOOL], messages=[USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, TOOL_TURN])
    assert body.template_messages() == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert body.template_tools() == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    not_an_object = {**CALL, "function": {"name": "f", "arguments": "[1, 2"}}  # given back as it came
    turn = chat(messages=[{"role": "assistant", "tool_calls": [not_an_object]}]).template_messages()[0]
    assert turn["tool_calls"][0]["function"]["arguments"] == "[1, 2"
    assert chat().template_tools() is None


@pytest.mark.parametrize(
    "fields, parses",
    [({}, False), ({"tools": [TOOL]}, True), ({"tools": [TOOL], "tool_choice": "auto"}, True)]
    + [({"tools": [TOOL], "tool_choice": "none"}, False), ({"tool_choice": "auto"}, False)],
)
def test_tool_calls_are_read_where_the_answer_may_call_a_tool(fields, parses):
    assert chat(**fields).parses_tool_calls is parses


def test_a_logit_bias_becomes_pairs_ids_ascending_biases_clamped_as_vllm_clamps():
    body = chat(logit_bias={"50": 1.5, "7": -250.0, "050": 3.0, "9": 100.0})
    assert body.logit_bias_pairs() == ((7, -100.0), (9, 100.0), (50, 3.0))  # "050" names 50 again, later
    assert body.sampling_params(8).logit_bias == ((7, -100.0), (9, 100.0), (50, 3.0))
    assert chat().sampling_params(8).logit_bias == () and not chat().sampling_params(8).processes_logits


def test_min_p_is_taken_and_checked():
    assert chat(min_p=0.1).sampling_params(8).min_p == 0.1
    with pytest.raises(APIError) as caught:
        chat(min_p=1.5).sampling_params(8)
    assert caught.value.param == "min_p"


def test_include_usage_needs_stream_options():
    assert not completion(stream=True).include_usage
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


# --- sampling_params --------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, max_tokens, param",
    [
        ({}, 0, "max_tokens"),
        ({"temperature": -0.1}, 16, "temperature"),
        ({"temperature": float("nan")}, 16, "temperature"),
        ({"top_p": 0.0}, 16, "top_p"),
        ({"top_p": 1.01}, 16, "top_p"),
        ({"top_k": -2}, 16, "top_k"),
        ({"logprobs": -1}, 16, "logprobs"),
        ({"presence_penalty": 2.5}, 16, "presence_penalty"),
        ({"frequency_penalty": -3.0}, 16, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, 16, "repetition_penalty"),
        ({"logprobs": 21}, 16, "logprobs"),
        ({"min_tokens": 17}, 16, "min_tokens"),
        ({"min_tokens": -1}, 16, "min_tokens"),
    ],
)
def test_out_of_range_sampling_values_name_the_param(fields, max_tokens, param):
    with pytest.raises(APIError) as caught:
        completion(**fields).sampling_params(max_tokens)
    assert (caught.value.param, caught.value.status) == (param, 400)


def test_chat_top_logprobs_out_of_range_names_top_logprobs():
    with pytest.raises(APIError) as caught:
        chat(logprobs=True, top_logprobs=21).sampling_params(16)
    assert caught.value.param == "top_logprobs"


@pytest.mark.parametrize(
    "make, fields, expected",
    [
        (completion, {}, None),
        (completion, {"logprobs": 0}, 0),
        (completion, {"logprobs": 3}, 3),
        (chat, {}, None),
        (chat, {"logprobs": False}, None),
        (chat, {"logprobs": True}, 0),
        (chat, {"logprobs": True, "top_logprobs": 4}, 4),
    ],
)
def test_logprobs_reach_the_sampling_params(make, fields, expected):
    assert make(**fields).sampling_params(8).logprobs == expected


def test_allowed_token_ids_reach_the_sampling_params_distinct_and_ascending():
    assert chat(allowed_token_ids=[9, 2, 9]).sampling_params(8).allowed_token_ids == (2, 9)
    assert chat(allowed_token_ids=[]).sampling_params(8).allowed_token_ids == ()
    assert not chat(allowed_token_ids=[]).sampling_params(8).processes_logits


@pytest.mark.parametrize(
    "make, fields, expected",
    [
        (completion, {"logprobs": 3}, None),
        (completion, {"echo": True}, None),
        (completion, {"echo": True, "logprobs": 3}, 3),  # the echoed prompt lists its tokens' logprobs
        (completion, {"prompt_logprobs": 0}, 0),
        (completion, {"echo": True, "logprobs": 1, "prompt_logprobs": 5}, 5),  # the most either asks
        (completion, {"echo": True, "logprobs": 4, "prompt_logprobs": 0}, 4),
        (chat, {"prompt_logprobs": 2}, 2),
        (chat, {"logprobs": True, "top_logprobs": 4}, None),
        (chat, {"prompt_logprobs": 0, "stream": True}, None),  # taken, as vLLM takes it; a stream lists none
        (completion, {"echo": True, "logprobs": 2, "prompt_logprobs": 0, "stream": True}, 2),
    ],
)
def test_prompt_logprobs_reach_the_sampling_params(make, fields, expected):
    assert make(**fields).sampling_params(8).prompt_logprobs == expected


def test_sampling_params_carry_the_body():
    body = completion(
        temperature=0.0,
        top_p=0.9,
        top_k=-1,
        seed=7,
        ignore_eos=True,
        stop_token_ids=[3, 4],
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        skip_special_tokens=False,
    )
    assert body.sampling_params(5) == SamplingParams(
        max_tokens=5,
        temperature=0.0,
        top_p=0.9,
        top_k=-1,
        seed=7,
        ignore_eos=True,
        stop_token_ids=(3, 4),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        skip_special_tokens=False,
    )


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_outside_64_bits_is_refused(seed):
    """torch's Generator takes 64-bit seeds; a bigger one once killed the engine thread."""
    with pytest.raises(APIError) as caught:
        completion(seed=seed).sampling_params(16)
    assert caught.value.param == "seed"
    completion(seed=2**64 - 1).sampling_params(16)  # the largest one is fine


# --- prompt, stops, max tokens, messages ------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("Hello", ["Hello"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["Hello"], ["Hello"]),
        ([[1, 2]], [[1, 2]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2], [3]], [[1], [2], [3]]),
    ],
)
def test_prompt_list(prompt, expected):
    assert completion(prompt=prompt).prompt_list() == expected


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "the prompt is empty"),
        ([], "the prompt is empty"),
        ([""], "the prompt is empty"),
        ([[]], "the prompt is empty"),
        (["a", ""], "prompt 1 is empty"),
    ],
)
def test_empty_prompts_are_refused(prompt, message):
    with pytest.raises(APIError) as caught:
        completion(prompt=prompt).prompt_list()
    assert caught.value.param == "prompt" and message in str(caught.value)


@pytest.mark.parametrize(
    "stop, expected",
    [
        (None, ()),
        ("\n", ("\n",)),
        (["a", "", "bc"], ("a", "bc")),
        ("", ()),
    ],
)
def test_stop_strings(stop, expected):
    assert completion(stop=stop).stop_strings() == expected


def test_requested_max_tokens():
    assert completion().requested_max_tokens() == 16  # OpenAI's default for completions
    assert completion(max_tokens=None).requested_max_tokens() is None
    assert chat().requested_max_tokens() is None  # the server fills in the rest of the context
    assert chat(max_tokens=5).requested_max_tokens() == 5
    assert chat(max_tokens=5, max_completion_tokens=9).requested_max_tokens() == 9


def test_template_messages():
    body = chat(
        messages=[
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert body.template_messages() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hello, there"},
        {"role": "assistant", "content": ""},
    ]


def test_infinite_temperature_is_refused():
    with pytest.raises(APIError) as caught:
        completion(temperature=float("inf")).sampling_params(16)
    assert caught.value.param == "temperature"
