"""The OpenAI request bodies we accept, and the turn from a body into engine terms.

Bodies are validated strictly (a string where a number belongs is an error, not a
guess); an invalid one becomes HTTP 400 with an OpenAI-style error naming the
parameter. Unknown fields are ignored, as vLLM does, so clients that send extra
options keep working. Options we do not implement (a forced tool call, best_of above
n, beam search, ...) are refused by name rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Annotated, Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, FailFast, Field, ValidationInfo, field_validator

from specserve.errors import SpecserveError
from specserve.logprobs import MAX_LOGPROBS
from specserve.sampling import LOGIT_BIAS_MAX, InvalidSamplingValue, SamplingParams
from specserve.spec.prediction import PredictedText
from specserve.structured.guide import Guide
from specserve.structured.outputs import KINDS, StructuredOutput
from specserve.tokenizer import CHAT_ROLES, TEMPLATE_VARIABLES, template_arguments, template_role


class APIError(SpecserveError):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code
        self.headers = headers  # of the HTTP response (Retry-After, ...)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


# Bounds on the stop conditions, whose cost every step of the request pays: OpenAI takes
# 4 stop strings; we take more, as vLLM users send them, but not without end.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# And on the logit bias, whose entries every processed row of the request adds, and
# vLLM's bad words, each of which every row looks up.
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 256


# vLLM's sampling extensions we do not implement: (field, whether a value asks for
# nothing, what to use instead).
VLLM_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("use_beam_search", lambda v: not v, ""),
    ("length_penalty", lambda v: v == 1, " (it weighs beams, and there is no beam search)"),
)


def _first_lone_surrogate(value: Any) -> int | None:
    """Where a string (in value, however nested) holds a lone UTF-16 surrogate, which no
    UTF-8 text can: its index in that string; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return e.start
        return None
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):  # token ids: validated lists hold one type
            return None
        return next((i for i in map(_first_lone_surrogate, value) if i is not None), None)
    if isinstance(value, dict):
        return _first_lone_surrogate(list(value.values()))
    return None


class StopAtFirst(FailFast):
    """A list's validation stops at its first bad item: a body of a million bad items
    would otherwise make a million errors (times a union's members), seconds and a
    gigabyte to build. Hashable, as typing's unions need their members to be."""

    def __hash__(self) -> int:
        return hash(StopAtFirst)


Ids = Annotated[list[int], StopAtFirst()]
Texts = Annotated[list[str], StopAtFirst()]


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        index = _first_lone_surrogate(value)
        if index is not None:
            raise ValueError(
                f"the text holds a lone UTF-16 surrogate at character {index}, which is not valid "
                "Unicode; send UTF-8 text (in JSON, escape surrogates only in pairs)"
            )
        return value


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class _Sampling(RequestBody):
    """What completions and chat share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension: 0 or -1 = off
    seed: int | None = None
    stop: str | Texts | None = None
    stop_token_ids: Ids | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension: no stop token or string before this many tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension: 1 = off
    skip_special_tokens: bool = True  # vLLM's extension: False puts special tokens' text in the output
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    min_p: float = 0.0  # vLLM's extension: 0 = off
    include_stop_str_in_output: bool = False  # vLLM's extension: the stop string ending the text stays in it
    allowed_token_ids: Ids | None = None  # vLLM's extension: the only ids the answer may hold
    prompt_logprobs: int | None = None  # vLLM's extension: each prompt token's logprob and n alternatives
    truncate_prompt_tokens: int | None = None  # vLLM's extension: the prompt's last k ids alone; -1: the context's
    priority: int = 0  # vLLM's extension: lower is served first, under --scheduling-policy priority
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the answer's token ids beside the text
    # vLLM's extensions we do not implement, taken only at the values that ask for nothing
    # (`VLLM_UNSUPPORTED`): a vLLM client's request that sets one is refused, not answered
    # as if it had not.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    bad_words: Texts | None = None  # vLLM's: words the answer must not write (penalties.without_bad_words)
    # Structured outputs (specserve/structured/): vLLM's older fields, its newer
    # `structured_outputs` object, and OpenAI's response_format; one of them at most.
    guided_json: Any = None  # a schema: an object, a boolean, or its JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: Any = None  # GBNF text (structured/grammar.py)
    guided_whitespace_pattern: str | None = None  # vLLM's: what JSON may put between its tokens
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI's predicted outputs: {"type": "content", "content": a text or text parts},
    # what the answer is expected to be; drafted from, never changing it (spec/prediction.py).
    prediction: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", param="n")
        stop = self.stop_strings()
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(f"{len(stop)} stop strings, more than the limit of {MAX_STOP_STRINGS}", param="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise APIError(
                f"a stop string is longer than the limit of {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(
                f"{len(self.stop_token_ids)} stop token ids, more than the limit of {MAX_STOP_TOKEN_IDS}",
                param="stop_token_ids",
            )
        if len(self.bad_words or ()) > MAX_BAD_WORDS:
            raise APIError(
                f"{len(self.bad_words)} bad words, more than the limit of {MAX_BAD_WORDS}", param="bad_words"
            )
        if any(not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words or ()):
            raise APIError(
                f"each bad word must hold text, at most {MAX_STOP_STRING_CHARS} characters", param="bad_words"
            )
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise APIError(
                f"{len(self.logit_bias)} logit_bias entries, more than the limit of {MAX_LOGIT_BIAS}",
                param="logit_bias",
            )
        self.logit_bias_pairs()  # keys that are no token ids are refused here
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1
        ):
            raise APIError(
                f"truncate_prompt_tokens must be >= 1, or -1 for the maximum model length, got "
                f"{self.truncate_prompt_tokens}",
                param="truncate_prompt_tokens",
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise APIError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (-1, the whole vocabulary, is not served), "
                f"got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        if self.prompt_logprobs and self.stream:  # 0 is taken, as vLLM takes it, and lists nothing
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        for field, asks_nothing, instead in VLLM_UNSUPPORTED:
            value = getattr(self, field)
            if not asks_nothing(value):
                raise APIError(f"{field} is not supported{instead}, got {value!r}", param=field)
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        self.structured_output()  # a malformed one, or two, refused here; compiled later
        self.prediction_text()

    def structured_output(self) -> StructuredOutput | None:
        """What the answer must follow, from whichever field asks (APIError(400) where two
        do, or one is malformed); None: free text."""
        asked = self._structured_asks()
        if len(asked) > 1:
            names = " and ".join(name for name, _ in asked)
            raise APIError(f"{names} both constrain the answer; send one of them", param=asked[1][0])
        return asked[0][1] if asked else None

    def structured_param(self) -> str | None:
        """The field that asked for the structured output."""
        asked = self._structured_asks()
        return asked[0][0] if asked else None

    def _structured_asks(self) -> list[tuple[str, StructuredOutput]]:
        return [(name, self._with_whitespace(wanted)) for name, wanted in self._structures_asked()]

    def _with_whitespace(self, wanted: StructuredOutput) -> StructuredOutput:
        """`wanted` with the request's whitespace pattern, where its JSON takes one."""
        param, pattern = "guided_whitespace_pattern", self.guided_whitespace_pattern
        if isinstance(self.structured_outputs, dict) and self.structured_outputs.get("whitespace_pattern"):
            param, pattern = "structured_outputs", self.structured_outputs["whitespace_pattern"]
        if pattern is None or wanted.kind not in ("json", "json_object"):
            return wanted
        if not isinstance(pattern, str):
            raise APIError("the whitespace pattern must be a regex string", param=param)
        return dataclasses.replace(wanted, whitespace=pattern)

    def _structures_asked(self) -> list[tuple[str, StructuredOutput]]:
        asked: list[tuple[str, StructuredOutput]] = []
        if self.guided_json is not None:
            asked.append(("guided_json", _json_schema(self.guided_json, "guided_json")))
        if self.guided_regex is not None:
            asked.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", _choices(self.guided_choice, "guided_choice")))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", _grammar(self.guided_grammar, "guided_grammar")))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", _vllm_structured_outputs(self.structured_outputs)))
        if self.response_format is not None:
            wanted = _response_format(self.response_format)
            if wanted is not None:
                asked.append(("response_format", wanted))
        return asked

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stop if s)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """The logit bias as (token id, bias) pairs, ids ascending: keys are token ids in
        decimal (a later key naming the same id wins), biases clamped to OpenAI's range,
        as vLLM clamps them."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key) if key.strip().isdecimal() else -1
            except ValueError:  # more digits than int() reads (4300): no token id either
                token_id = -1
            if token_id < 0:
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            if not math.isfinite(bias):
                raise APIError(f"logit_bias values must be finite numbers, got {bias!r}", param="logit_bias")
            pairs[token_id] = min(LOGIT_BIAS_MAX, max(-LOGIT_BIAS_MAX, bias))
        return tuple(sorted(pairs.items()))

    def prediction_text(self) -> str | None:
        """The text of the body's prediction (None: none, or empty); APIError for a malformed one."""
        if self.prediction is None:
            return None
        content = self.prediction.get("content")
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            content = "".join(part["text"] for part in content)
        if self.prediction.get("type") != "content" or not isinstance(content, str):
            raise APIError(
                'prediction must be {"type": "content", "content": a text or a list of {"type": "text", "text": ...}}',
                param="prediction",
            )
        return content or None

    def sampling_params(
        self,
        max_tokens: int,
        guide: Guide | None = None,
        bad_words_ids: tuple[tuple[int, ...], ...] = (),
        prediction: PredictedText | None = None,
    ) -> SamplingParams:
        """SamplingParams of this body (with the compiled guide of its structured output,
        its bad words' ids and its prediction's); out-of-range values become APIError(400, param)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                min_p=self.min_p,
                top_k=self.top_k,
                seed=self.seed,
                ignore_eos=self.ignore_eos,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                logprobs=self.num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                min_tokens=self.min_tokens,
                logit_bias=self.logit_bias_pairs(),
                allowed_token_ids=tuple(self.allowed_token_ids or ()),
                guide=guide,
                bad_words_ids=bad_words_ids,
                prediction=prediction,
            )
        except InvalidSamplingValue as e:
            param = self.logprobs_param if e.param == "logprobs" else e.param  # the field the body used
            raise APIError(f"{param} {e.rule}, got {e.value!r}", param=param) from None

    logprobs_param: ClassVar[str] = "logprobs"  # the parameter that says how many alternatives

    def num_logprobs(self) -> int | None:
        """How many alternatives to each output token's logprob; None: no logprobs."""
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        """How many alternatives to each prompt token's logprob; None: none asked."""
        return self.listed_prompt_logprobs

    @property
    def listed_prompt_logprobs(self) -> int | None:
        """vLLM's prompt_logprobs where the answer lists them: not in a stream."""
        return None if self.stream else self.prompt_logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def echo_only(self) -> bool:
        """Whether the answer is the prompt alone, its decoded tokens left out."""
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries usage (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def _json_schema(schema: Any, param: str) -> StructuredOutput:
    """A schema given as an object, a boolean, or JSON text, kept as JSON text (its keys
    in the order given: the properties' order is the answer's)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise APIError(f"{param} is not valid JSON: {error}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise APIError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param=param)
    return StructuredOutput("json", json.dumps(schema))


def _choices(choices: Any, param: str) -> StructuredOutput:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise APIError(f"{param} must be a list of one or more non-empty strings", param=param)
    return StructuredOutput("choice", tuple(choices))


def _grammar(grammar: Any, param: str) -> StructuredOutput:
    if not isinstance(grammar, str) or not grammar.strip():
        raise APIError(f"{param} must be a grammar's text (GBNF: `root ::= ...`)", param=param)
    return StructuredOutput("grammar", grammar)


def _vllm_structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    """vLLM's `structured_outputs` object: one of json, regex, choice, grammar, json_object."""
    param = "structured_outputs"
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS) - {"disable_fallback", "whitespace_pattern"})
    if unknown:
        raise APIError(
            f"{param}.{unknown[0]} is not supported; use json, regex, choice, grammar or json_object", param=param
        )
    kinds = [k for k in KINDS if k in given]
    if len(kinds) != 1:
        raise APIError(f"{param} must set exactly one of json, regex, choice, grammar and json_object", param=param)
    kind = kinds[0]
    if kind == "json":
        return _json_schema(given["json"], f"{param}.json")
    if kind == "choice":
        return _choices(given["choice"], f"{param}.choice")
    if kind == "grammar":
        return _grammar(given["grammar"], f"{param}.grammar")
    if kind == "regex":
        if not isinstance(given["regex"], str):
            raise APIError(f"{param}.regex must be a string", param=param)
        return StructuredOutput("regex", given["regex"])
    return StructuredOutput("json_object")


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise APIError(
                'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}',
                param="response_format",
            )
        return _json_schema(inner.get("schema", {}), "response_format.json_schema.schema")
    raise APIError(
        f'response_format type {kind!r} is not supported; use "text", "json_object" or "json_schema"',
        param="response_format",
    )


class CompletionRequest(_Sampling):
    prompt: str | Ids | Texts | Annotated[list[Ids], StopAtFirst()]
    max_tokens: int | None = 16  # the OpenAI default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix is not None and self.echo:
            raise APIError("echo gives the prompt back, which a suffix splits in two; send one of them", param="echo")
        if self.suffix is not None and self.truncate_prompt_tokens is not None:
            raise APIError(
                "truncate_prompt_tokens would cut the start of the text around the gap; shorten the prompt instead",
                param="truncate_prompt_tokens",
            )
        if self.best_of not in (None, self.n):
            raise APIError("best_of is not supported (only best_of = n, which returns every choice)", param="best_of")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone comes back, with its tokens' logprobs
        where asked (vLLM's and the legacy OpenAI completions' way to score a text). The
        engine still decodes one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        """Echo with logprobs lists the prompt's tokens with theirs: the most either asks."""
        asked = [n for n in (self.listed_prompt_logprobs, self.echoed_logprobs) if n is not None]
        return max(asked, default=None)

    @property
    def echoed_logprobs(self) -> int | None:
        """The alternatives listed for each echoed prompt token; None: no prompt in the logprobs."""
        return self.logprobs if self.echo else None

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: a list of texts or of id lists is a batch."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for i, one in enumerate(batch):
            if not one:
                raise APIError("the prompt is empty" if len(batch) == 1 else f"prompt {i} is empty", param="prompt")
        return batch


class ContentPart(RequestBody):
    """One part of a message's content: text is served; another type (an image, audio)
    is refused by name (ChatCompletionRequest.refuse_unsupported)."""

    type: str
    text: str | None = None


class CalledFunction(RequestBody):
    name: str
    arguments: str  # JSON text, as the API gives it


class MessageToolCall(RequestBody):
    """A call an assistant turn made (server/tool_calls.py), given back in a later request."""

    id: str | None = None
    type: str = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """transformers' form (`template_arguments`), as vLLM gives them."""
        arguments = template_arguments(self.function.arguments)
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(RequestBody):
    role: str
    content: str | Annotated[list[ContentPart], StopAtFirst()] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], StopAtFirst()] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    # An assistant turn's reasoning, given back (server/reasoning.py): Qwen3's template
    # keeps it in the turns of the question being answered.
    reasoning: str | None = None
    reasoning_content: str | None = None  # its older name

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The turn as chat templates read it."""
        turn: dict[str, Any] = {"role": template_role(self.role), "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None and self.role == "assistant":
            turn["reasoning_content"] = reasoning
        return turn


class FunctionDefinition(RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestBody):
    type: str
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return {"type": self.type, "function": self.function.model_dump(exclude_none=True)}


SERVED_ROLES = (*CHAT_ROLES, "tool")


def check_messages(messages: list[ChatMessage]) -> None:
    """Refuse, naming the message, a turn a chat template must not see: an unknown role,
    a tool turn without its result, a call made by another than the assistant, a content
    part that is not text."""
    for i, message in enumerate(messages):
        if message.role not in SERVED_ROLES:
            raise APIError(
                f"unknown role {message.role!r}; use one of {list(SERVED_ROLES)}", param=f"messages[{i}].role"
            )
        if message.role == "tool" and message.content is None:
            raise APIError("a tool turn needs its content: the call's result", param=f"messages[{i}].content")
        if message.tool_calls and message.role != "assistant":
            raise APIError("only an assistant turn makes tool calls", param=f"messages[{i}].tool_calls")
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                raise APIError(
                    f"content parts of type {part.type!r} are not supported; send text parts "
                    '({"type": "text", "text": ...})',
                    param=f"messages[{i}].content[{j}].type",
                )
            if part.text is None:
                raise APIError("a text part needs its text", param=f"messages[{i}].content[{j}].text")


class _Templating(RequestBody):
    """vLLM's fields for how a conversation goes through the chat template."""

    add_generation_prompt: bool = True  # the assistant's turn opened after the messages
    continue_final_message: bool = False  # the prompt ends inside the last message: the model goes on with it
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (Qwen3's enable_thinking)

    def check_templating(self) -> None:
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in (self.model_fields_set)
        ):
            raise APIError(
                "continue_final_message goes on with the last message, so it cannot also open a new turn: "
                "set add_generation_prompt to false",
                param="continue_final_message",
            )
        for name in self.chat_template_kwargs or ():
            if name in TEMPLATE_VARIABLES:
                raise APIError(
                    f"{name!r} is the server's to give the chat template; set it through the request's own fields",
                    param=f"chat_template_kwargs.{name}",
                )

    def template_options(self, default_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """`Tokenizer.encode_chat`'s keyword arguments for these fields, the request's
        template variables over the server's `default_kwargs`."""
        return {
            "add_generation_prompt": self.add_generation_prompt and not self.continue_final_message,
            "template_kwargs": {**(default_kwargs or {}), **(self.chat_template_kwargs or {})},
            "continue_final_message": self.continue_final_message,
        }


class ChatCompletionRequest(_Sampling, _Templating):
    messages: Annotated[list[ChatMessage], StopAtFirst()] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], StopAtFirst()] | None = None
    tool_choice: str | dict[str, Any] | None = None  # OpenAI's default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True  # every call the answer makes is returned
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, the message's reasoning is sent

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise APIError(
                    f'tools of type {tool.type!r} are not supported; use "function"', param=f"tools[{i}].type"
                )
        self.forced_tool()  # a malformed or unknown forced choice is refused here
        check_messages(self.messages)
        self.check_templating()

    logprobs_param: ClassVar[str] = "top_logprobs"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates list them; None: no tools."""
        return [tool.for_template() for tool in self.tools] if self.tools else None

    def forced_tool(self) -> str | None:
        """The tool the answer must call: its name for a named choice, "required" for any
        of them (one call or more), None where the answer may be text."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        names = [tool.function.name for tool in self.tools or ()]
        if not names:
            raise APIError(f"tool_choice {choice!r} needs tools to call", param="tool_choice")
        if choice == "required":
            return "required"
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or choice.get("type", "function") != "function":
            raise APIError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
                f"got {choice!r}",
                param="tool_choice",
            )
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools {names}", param="tool_choice")
        return name

    def tool_choice_schema(self) -> dict[str, Any] | None:
        """What a forced choice makes the answer (vLLM's way): a named tool's arguments
        object; for "required", a list of one or more {"name", "arguments"} calls."""
        forced = self.forced_tool()
        if forced is None:
            return None
        parameters = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in self.tools}
        if forced != "required":
            return parameters[forced]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
            }
            for name, schema in parameters.items()
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}

    def _structures_asked(self) -> list[tuple[str, StructuredOutput]]:
        schema = self.tool_choice_schema()
        forced = [] if schema is None else [("tool_choice", _json_schema(schema, "tool_choice"))]
        return super()._structures_asked() + forced

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the answer may call the tools (tool_choice "auto", the default with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")


class TokenizeRequest(_Templating):
    """vLLM's /tokenize: a text (`prompt`), or a conversation (`messages`) through the
    chat template, as a chat request's fields would put it."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], StopAtFirst()] | None = None
    add_special_tokens: bool = True  # a text's: BOS where the model wants one
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give either prompt (a text) or messages (a conversation)", param="prompt")
        if self.messages is not None:
            check_messages(self.messages)
            self.check_templating()


class DetokenizeRequest(RequestBody):
    """vLLM's /detokenize: token ids back to their text."""

    model: str | None = None
    tokens: Ids


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Pydantic's first error as an APIError naming the parameter, e.g. messages[0].role;
    our own checks' errors (value_error) first, since a union's other members report
    only that the value is not of their type."""
    error = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    location = [str(p) for p in error.get("loc", ()) if p != "body"]
    param = ""
    for part in location:
        if part.isdigit():
            param += f"[{part}]"
        elif part.isidentifier():  # union members show up as types like list[int]: skip them
            if part in ("str", "int", "float", "bool"):
                break
            param += ("." if param else "") + part
        else:
            break
    message = error.get("msg", "invalid request").removeprefix("Value error, ")
    if error.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {error.get('ctx', {}).get('error', message)}")
    if error.get("type") in ("missing", "model_type", "model_attributes_type") and not param:
        return APIError("the request needs a JSON object body")
    if error.get("type") == "missing":
        return APIError(f"missing required parameter {param!r}", param=param or None)
    return APIError(f"invalid value for {param!r}: {message}" if param else message, param=param or None)
