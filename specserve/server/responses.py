"""OpenAI's Responses API (`POST /v1/responses`), served by the chat machinery.

A request becomes a `ChatCompletionRequest` (`ResponsesRequest.chat_request`): its
`instructions` a system turn, its `input` (a text, or items: messages, the model's
`function_call`s and their `function_call_output`s) the turns after it, its flat
function tools the chat form, `text.format` a `response_format`, `max_output_tokens`
the completion's limit. So sampling, structured outputs, tool calls and speculation are
the chat endpoint's own. The answer comes back as a `response` object: a `message` item
holding the text (`output_text`) and a `function_call` item per call; a stream sends
OpenAI's typed events (`ResponseEvents`), each with its `sequence_number`, and ends with
`response.completed` (or `response.incomplete` where `max_output_tokens` cut it).

Responses are kept (`store`, true by default as in OpenAI's API) in a `ResponseStore`
in the server's memory, the most recent RESPONSES_KEPT: `GET /v1/responses/{id}` returns
one, `GET /v1/responses/{id}/input_items` lists its input as items (each with an id, in
pages), `DELETE` forgets it, and a request's `previous_response_id` continues its
conversation (the turns of every response up its chain, then the new input; the earlier
responses' instructions are not carried over, as OpenAI's are not). They do not outlive
the server. `background` is refused.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import ValidationError

from specserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    RequestBody,
    StopAtFirst,
    Texts,
    validation_error,
)
from specserve.server.tool_calls import ToolCall

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The sampling fields a response request passes to its chat request as they are (vLLM's
# extensions among them).
PASSED_ON = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "user",
    "parallel_tool_calls",
    "priority",
)
INPUT_ROLES = ("user", "assistant", "system", "developer")
# What the store keeps, the least recently made or read forgotten first: at most this
# many responses, and this many characters of their turns' text. A conversation's turns
# are kept once, each response holding its own (its input and its answer), so a chain
# costs what its text does; a kept response leaves its logprobs out.
RESPONSES_KEPT = 1024
RESPONSES_KEPT_CHARS = 64 * 2**20
TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | Annotated[list[Any], StopAtFirst()]  # items are read by `input_turns`
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: Annotated[list[dict[str, Any]], StopAtFirst()] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # Only LOGPROBS_INCLUDE adds to a response here; the others name items it never
    # holds (reasoning, built-in tools' results), so asking for them changes nothing.
    include: Texts | None = None
    truncation: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's sampling extensions, as the chat endpoint takes them
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Texts | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None  # vLLM's: lower is served first, under --scheduling-policy priority

    def chat_request(self, history: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat request this one asks for, after the turns of `history` (those of
        the previous responses); APIError(400) naming the field it cannot serve."""
        if self.background and self.stream:
            raise APIError(
                "a background response is not streamed here; poll GET /v1/responses/{id} for it, "
                "or stream it in the foreground",
                param="background",
            )
        if self.background and self.store is False:
            raise APIError("a background response is kept to be read later, so it needs store", param="background")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}", param="max_output_tokens")
        if self.truncation not in (None, "disabled", "auto"):
            raise APIError(f'truncation must be "disabled" or "auto", got {self.truncation!r}', param="truncation")
        fields = {name: getattr(self, name) for name in PASSED_ON if getattr(self, name) is not None}
        fields.update(
            messages=self.instruction_turns() + list(history) + self.input_turns,
            stream=self.stream,
            max_completion_tokens=self.max_output_tokens,
            tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(),
            response_format=self.response_format(),
            logprobs=self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ()),
            top_logprobs=self.top_logprobs,
            truncate_prompt_tokens=-1 if self.truncation == "auto" else None,
        )
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:
            raise validation_error(error.errors(include_url=False)) from None

    def instruction_turns(self) -> list[dict[str, Any]]:
        return [] if self.instructions is None else [{"role": "system", "content": self.instructions}]

    @property
    def input_turns(self) -> list[dict[str, Any]]:
        """The chat turns of the input (`read_input`)."""
        return self.read_input[0]

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """The input as OpenAI lists a response's input items (`read_input`)."""
        return self.read_input[1]

    @functools.cached_property
    def read_input(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The input as chat turns (function calls join the assistant turn before them, or
        open one; each output is a tool turn) and as input items, in order, each with an
        id (its own where it came with one), a message's text one part. Read once: the
        chat request takes the turns, the kept response both."""
        if isinstance(self.input, str):
            turn = {"role": "user", "content": self.input}
            return [turn], [_message_item(turn)]
        if not self.input:
            raise APIError("input holds no items; send a text or at least one message", param="input")
        turns: list[dict[str, Any]] = []
        items: list[dict[str, Any]] = []
        reasoning = None  # a reasoning item's text, for the assistant turn it came before
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise APIError(
                    "each input item must be an object: a message, or a function call's", param=f"input[{i}]"
                )
            kind = item.get("type", "message")
            if kind == "reasoning":  # an earlier response's, given back: its assistant turn's reasoning
                reasoning = _reasoning_text(item, f"input[{i}]")
                items.append({**item, "id": item.get("id") or _new_id("rs")})
                continue
            if kind == "message":
                turns.append(_message_turn(item, f"input[{i}]"))
                items.append(_message_item(turns[-1], item.get("id")))
                if turns[-1]["role"] == "assistant" and reasoning is not None:
                    turns[-1]["reasoning_content"] = reasoning
                reasoning = None
                continue
            if kind == "function_call":
                call = {
                    "id": _text_field(item, "call_id", f"input[{i}]"),
                    "type": "function",
                    "function": {
                        "name": _text_field(item, "name", f"input[{i}]"),
                        "arguments": _text_field(item, "arguments", f"input[{i}]"),
                    },
                }
                if not turns or turns[-1]["role"] != "assistant":
                    turns.append({"role": "assistant", "content": None})
                if reasoning is not None:
                    turns[-1]["reasoning_content"] = reasoning
                    reasoning = None
                turns[-1].setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                output = item.get("output")
                content = _parts_text(output, f"input[{i}].output") if isinstance(output, list) else output
                if not isinstance(content, str):
                    raise APIError("a function_call_output needs its output: a text", param=f"input[{i}].output")
                turns.append(
                    {"role": "tool", "tool_call_id": _text_field(item, "call_id", f"input[{i}]"), "content": content}
                )
            else:
                raise APIError(
                    f"input items of type {kind!r} are not supported; send messages, function_call and "
                    "function_call_output items",
                    param=f"input[{i}].type",
                )
            prefix = "fc" if kind == "function_call" else "fco"
            items.append({**item, "id": item.get("id") or _new_id(prefix), "status": item.get("status", "completed")})
        return turns, items

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat form ({"type", "function": {...}})."""
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(
                    f'tools of type {tool.get("type")!r} are not supported; use "function"', param=f"tools[{i}].type"
                )
            function = {"name": _text_field(tool, "name", f"tools[{i}]")}
            function.update({k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None})
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
                f"got {choice!r}",
                param="tool_choice",
            )
        return {"type": "function", "function": {"name": name}}

    def response_format(self) -> dict[str, Any] | None:
        """text.format as the chat request's response_format."""
        wanted = (self.text or {}).get("format")
        if wanted is None:
            return None
        kind = wanted.get("type") if isinstance(wanted, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(
                f'text.format type {kind!r} is not supported; use "text", "json_object" or "json_schema"',
                param="text.format.type",
            )
        if kind != "json_schema":
            return {"type": kind}
        inner = {k: wanted[k] for k in ("name", "schema", "strict") if k in wanted}
        return {"type": "json_schema", "json_schema": inner}

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "background": bool(self.background),
            "reasoning": self.reasoning,
            "store": self.store is not False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
            "tool_choice": self.tool_choice or "auto",
            "tools": self.tools or [],
            "top_logprobs": self.top_logprobs,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": self.truncation or "disabled",
            "user": self.user,
        }


def _text_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{key} must be a string", param=f"{where}.{key}")
    return value


def _parts_text(parts: list[Any], where: str) -> str:
    """The text of a content list's parts; another kind of part (an image, a file) is refused."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(
                f"content parts of type {kind!r} are not supported; send text parts "
                '({"type": "input_text", "text": ...})',
                param=f"{where}[{j}].type",
            )
        texts.append(_text_field(part, "text", f"{where}[{j}]"))
    return "".join(texts)


def _message_item(turn: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    """A message turn as an input item: its text one part (the assistant's output_text)."""
    part = {"type": "input_text", "text": turn["content"]}
    if turn["role"] == "assistant":
        part = {"type": "output_text", "text": turn["content"], "annotations": []}
    return {
        "id": item_id or _new_id("msg"),
        "type": "message",
        "role": turn["role"],
        "content": [part],
        "status": "completed",
    }


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts (its summary's where it has none)."""
    for field in ("content", "summary"):
        parts = item.get(field) or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise APIError(f"a reasoning item's {field} must be a list of parts with text", param=f"{where}.{field}")
    return "".join(part["text"] for part in item.get("content") or item.get("summary") or [])


def _message_turn(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise APIError(f"unknown role {role!r}; use one of {list(INPUT_ROLES)}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = _parts_text(content, f"{where}.content")
    if not isinstance(content, str):
        raise APIError("a message needs its content: a text or a list of text parts", param=f"{where}.content")
    return {"role": role, "content": content}


def output_text_logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """An output_text part's logprobs from the chat form's (`logprob_fields.chat_logprobs`)."""
    return [] if chat_logprobs is None else chat_logprobs["content"]


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A response's usage from the chat form's."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat_usage["total_tokens"],
    }


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A thinking model's reasoning (server/reasoning.py) as OpenAI's reasoning item."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class ResponseObject:
    """One response's fixed fields, and its object at a given state; once finished, kept
    in `store` where the request asks for it."""

    def __init__(self, request: ResponsesRequest, model: str, store: ResponseStore):
        self.id, self.created_at = _new_id("resp"), int(time.time())
        self.model, self.settings = model, request.echoed()
        self.request, self.store = request, store

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        chat_usage: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """The response: `status` "in_progress", or from the finish_reason once done
        ("incomplete" where the length limit cut it, "cancelled" where the server's
        shutdown did)."""
        incomplete = None
        if status != "in_progress" and finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif status != "in_progress" and finish_reason == "abort":
            status = "cancelled"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": None if chat_usage is None else usage(chat_usage),
            **self.settings,
        }

    def whole(
        self,
        reasoning: str | None,
        text: str | None,
        calls: list[ToolCall],
        logprobs: list[dict[str, Any]],
        chat_usage,
        finish_reason,
    ) -> dict[str, Any]:
        """The response of a whole answer: its reasoning (None: none read), its text
        (None: calls alone, or reasoning cut off) and calls."""
        output = [] if reasoning is None else [reasoning_item(_new_id("rs"), reasoning, "completed")]
        output += [] if text is None else [message_item(_new_id("msg"), text, logprobs, "completed")]
        output += [call_item(_new_id("fc"), call) for call in calls]
        return self.finished(output, chat_usage, finish_reason)

    def keep_unfinished(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """A background response's object while it runs ("in_progress") or where it
        ended without an answer ("cancelled", "failed" with the error), kept."""
        unfinished = {**self.object(status, []), "error": error}
        self.store.put(StoredResponse(self.request.previous_response_id, [], unfinished, self.request.input_items))
        return unfinished

    def finished(self, output: list[dict[str, Any]], chat_usage, finish_reason: str | None) -> dict[str, Any]:
        """The finished response, kept where the request asks for it."""
        done = self.object("completed", output, chat_usage, finish_reason)
        if self.request.store is not False:
            turns = self.request.input_turns + [assistant_turn(output)]
            kept = {**done, "output": [_without_logprobs(item) for item in output]}
            self.store.put(StoredResponse(self.request.previous_response_id, turns, kept, self.request.input_items))
        return done


def _without_logprobs(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] != "message":
        return item
    return {**item, "content": [{**part, "logprobs": []} for part in item["content"]]}


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the chat turn that answered."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    thought = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    turn = {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
    return {**turn, "reasoning_content": "".join(thought)} if thought else turn


@dataclass(frozen=True)
class StoredResponse:
    previous_id: str | None  # the response it continued
    turns: list[dict[str, Any]]  # the chat turns it added: its input's, then its answer (none while unanswered)
    body: dict[str, Any]  # the response object, its logprobs left out
    input_items: list[dict[str, Any]]  # its input, as `input_items` lists it

    @functools.cached_property
    def chars(self) -> int:
        """The characters of its turns' text and reasoning, and its input items' (its
        answer's counted twice: the body holds it too)."""
        fields = ("content", "reasoning_content")
        texts = [turn.get(f) or "" for turn in [*self.turns, *self.turns[-1:]] for f in fields]
        calls = [call["function"]["arguments"] for turn in self.turns for call in turn.get("tool_calls", ())]
        return sum(map(len, texts)) + 2 * sum(map(len, calls)) + sum(map(_item_chars, self.input_items))


def _item_chars(item: dict[str, Any]) -> int:
    """The characters of an input item's text: a message's, reasoning's, a call's arguments, an output."""
    if item["type"] == "message":
        return sum(len(part["text"]) for part in item["content"])
    if item["type"] == "reasoning":
        return sum(len(part["text"]) for part in (item.get("content") or []) + (item.get("summary") or []))
    if item["type"] == "function_call":
        return len(item["arguments"])
    output = item["output"]
    return len(output) if isinstance(output, str) else sum(len(part.get("text", "")) for part in output)


class ResponseStore:
    """The responses kept, by id: the most recently made or read, at most `size` of them
    and `chars` characters of their text. Thread-safe: a whole response is built, and
    kept, on a worker thread."""

    def __init__(self, size: int = RESPONSES_KEPT, chars: int = RESPONSES_KEPT_CHARS):
        self.size, self.chars = size, chars
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        """Keep `stored`, forgetting the least recent to make room (one larger than the
        whole store is not kept)."""
        if stored.chars > self.chars:
            return
        with self._lock:
            replaced = self._kept.pop(stored.body["id"], None)  # a background response's earlier state
            self._chars -= 0 if replaced is None else replaced.chars
            self._kept[stored.body["id"]] = stored
            self._chars += stored.chars
            while self._kept and (len(self._kept) > self.size or self._chars > self.chars):
                self._chars -= self._kept.popitem(last=False)[1].chars

    def get(self, response_id: str) -> dict[str, Any]:
        """The response object (APIError(404) where it is not kept)."""
        with self._lock:
            return self._stored(response_id, "response_id", status=404).body

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        """A page of response_id's input items as OpenAI lists them: `limit` (1-100) of
        them in `order` ("asc" or "desc", the newest first), after the item `after`
        where given (APIError(404) where the response is not kept, 400 for the rest)."""
        if not 1 <= limit <= 100:
            raise APIError(f"limit must be between 1 and 100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        with self._lock:
            items = self._stored(response_id, "response_id", status=404).input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(f"response {response_id!r} has no input item {after!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, response_id: str) -> None:
        with self._lock:
            self._chars -= self._stored(response_id, "response_id", status=404).chars
            del self._kept[response_id]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat turns of response_id's conversation, its own last (APIError(400)
        where it, or a response up its chain, is not kept)."""
        chain: list[StoredResponse] = []
        with self._lock:
            while response_id is not None:
                chain.append(self._stored(response_id, "previous_response_id", status=400))
                if not chain[-1].turns:  # a background response running, cancelled or failed
                    raise APIError(
                        f"response {response_id!r} is {chain[-1].body['status']}: it has no answer to go on from",
                        param="previous_response_id",
                    )
                response_id = chain[-1].previous_id
        return [turn for stored in reversed(chain) for turn in stored.turns]

    def _stored(self, response_id: str, param: str, status: int) -> StoredResponse:
        stored = self._kept.get(response_id)
        if stored is None:
            raise APIError(
                f"no response {response_id!r} is kept here: this server keeps the last {self.size} responses made "
                f"with store ({self.chars:,} characters of text at most), in memory; send the conversation in input",
                status=status,
                param=param,
                type="invalid_request_error" if status == 400 else "not_found_error",
            )
        self._kept.move_to_end(response_id)
        return stored


class ResponseEvents:
    """A streamed response's events, from each step's reasoning, content and tool-call
    entries (the chat stream's `delta.reasoning`, `delta.content` and
    `delta.tool_calls`): the reasoning item opens at the first reasoning and closes at
    what follows it, the message item opens at the first text, a call's item at its
    first entry; the message and the calls close at the end."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # the items so far, as sent when done
        self.message: dict[str, Any] | None = None  # the open message item
        self.text, self.logprobs = "", []
        self.calls: dict[int, dict[str, Any]] = {}  # open call items, by the chat entries' index
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item, its text so far

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def start(self) -> list[bytes]:
        state = self.response.object("in_progress", [])
        return [self.event("response.created", response=state), self.event("response.in_progress", response=state)]

    def step(
        self, content: str, logprobs: list[dict[str, Any]], entries: list[dict[str, Any]], reasoning: str = ""
    ) -> list[bytes]:
        events = []
        if reasoning:
            if self.reasoning is None:
                events += self._open_reasoning()
            self.reasoning["text"] += reasoning
            events.append(self.event("response.reasoning_text.delta", **self._at_reasoning(), delta=reasoning))
        if content or entries:
            events += self._close_reasoning()
        if content or logprobs:
            if self.message is None:
                events += self._open_message()
            self.text += content
            self.logprobs += logprobs
            events.append(
                self.event("response.output_text.delta", **self._at_message(), delta=content, logprobs=logprobs)
            )
        for entry in entries:
            if entry["index"] not in self.calls:
                events += self._close_message()
                events += self._open_call(entry)
            arguments = entry.get("function", {}).get("arguments") or ""
            if arguments:
                call = self.calls[entry["index"]]
                call["arguments"] += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=call["output_index"],
                        delta=arguments,
                    )
                )
        return events

    def finish(self, chat_usage: dict[str, Any], finish_reason: str | None, answered: bool = True) -> list[bytes]:
        """The closing events; `answered` False where the answer was cut off while it reasoned."""
        events = self._close_reasoning()
        made = self.message is not None or self.calls or any(i.get("type") != "reasoning" for i in self.output)
        if answered and not made:
            events += self._open_message()  # an empty answer: an empty message, as whole
        events += self._close_message()
        for index in sorted(self.calls):
            call = self.calls.pop(index)
            at = call.pop("output_index")
            call["status"] = "completed"
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=call["id"],
                    output_index=at,
                    arguments=call["arguments"],
                )
            )
            events.append(self.event("response.output_item.done", output_index=at, item=call))
            self.output[at] = call
        done = self.response.finished(self.output, chat_usage, finish_reason)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=done)]

    def _at_reasoning(self) -> dict[str, Any]:
        return {"item_id": self.reasoning["id"], "output_index": self.reasoning["output_index"], "content_index": 0}

    def _open_reasoning(self) -> list[bytes]:
        self.reasoning = {"id": _new_id("rs"), "output_index": len(self.output), "text": ""}
        self.output.append({})
        item = reasoning_item(self.reasoning["id"], "", "in_progress")
        return [self.event("response.output_item.added", output_index=self.reasoning["output_index"], item=item)]

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning is None:
            return []
        at, text = self._at_reasoning(), self.reasoning["text"]
        item = reasoning_item(self.reasoning["id"], text, "completed")
        self.output[at["output_index"]] = item
        self.reasoning = None
        return [
            self.event("response.reasoning_text.done", **at, text=text),
            self.event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def _at_message(self) -> dict[str, Any]:
        return {"item_id": self.message["id"], "output_index": self.message["output_index"], "content_index": 0}

    def _open_message(self) -> list[bytes]:
        self.message = {"id": _new_id("msg"), "output_index": len(self.output)}
        self.output.append({})
        item = message_item(self.message["id"], "", [], "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=self.message["output_index"], item=item),
            self.event("response.content_part.added", **self._at_message(), part=part),
        ]

    def _close_message(self) -> list[bytes]:
        if self.message is None:
            return []
        item = message_item(self.message["id"], self.text, self.logprobs, "completed")
        at = self._at_message()
        events = [
            self.event("response.output_text.done", **at, text=self.text, logprobs=self.logprobs),
            self.event("response.content_part.done", **at, part=item["content"][0]),
            self.event("response.output_item.done", output_index=at["output_index"], item=item),
        ]
        self.output[at["output_index"]] = item
        self.message = None
        return events

    def _open_call(self, entry: dict[str, Any]) -> list[bytes]:
        function = entry.get("function", {})
        call = ToolCall(function.get("name", ""), "", entry.get("id") or _new_id("call"))
        item = call_item(_new_id("fc"), call, "in_progress")
        self.calls[entry["index"]] = {**item, "output_index": len(self.output)}
        self.output.append({})
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def error(self, body: dict[str, Any]) -> bytes:
        """An error once the stream has started (an API error's body)."""
        error = body.get("error", {})
        return self.event("error", code=error.get("code"), message=error.get("message", ""), param=error.get("param"))
