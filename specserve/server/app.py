"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics.

Every error leaves as {"error": {"message", "type", "param", "code"}} with a 4xx status
(5xx only for our own bugs). When an API key is set, every /v1 route needs
`Authorization: Bearer <key>`; /health and /metrics stay open for probes and scrapers.
A streaming response sends one SSE `data:` line per engine step (which may carry
several tokens under speculation, and their logprobs when asked) and `data: [DONE]`
last; an error after the stream started is sent as a `data: {"error": ...}` line
before [DONE].
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.errors import SpecserveError
from specserve.logprobs import TokenLogprob
from specserve.server.async_engine import (
    AsyncEngine,
    EngineStepError,
    QueueFullError,
    RequestOutput,
    ShuttingDownError,
)
from specserve.server.fanout import ChoiceResult, Fanout, sample_params
from specserve.server.logprob_fields import (
    chat_logprobs,
    completion_logprobs,
    echoed_entries,
    prompt_logprobs_field,
)
from specserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from specserve.server.reasoning import ReasoningParser, ReasoningTokens, prompt_opens_thinking, reasoning_fields
from specserve.server.recording import PromptRecorder
from specserve.server.responses import (
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    output_text_logprobs,
)
from specserve.server.tool_calls import ForcedToolCalls, ToolCall, ToolCallParser
from specserve.server.transport import BODY_TIMEOUT_S, WholeBody
from specserve.spec.prediction import PredictedText
from specserve.spec.stats import SpecStats
from specserve.structured.guide import Guide, GuideCache
from specserve.structured.thinking import BlockMasks, ThinkingFirst
from specserve.tokenizer import Tokenizer
from specserve.train.instructions import Instruction, from_messages

# A request body's limit: room for a batch of prompts of the whole context as text or
# ids, and no more, since parsing and validating a body holds the interpreter (a 33 MB
# body of nested lists took 25 s).
BODY_BYTES_PER_CONTEXT_TOKEN = 128
MIN_BODY_BYTES = 1024 * 1024


def max_body_bytes(max_model_len: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * max_model_len)


log = logging.getLogger("specserve")
BodyModel = TypeVar("BodyModel", bound=BaseModel)


@dataclass(frozen=True)
class ApiSettings:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    # A stream's events: one per engine step ("step"), or one per token ("token"), for
    # clients that count events as tokens (LLMPerf): see docs/serving.md, "Streaming".
    stream_mode: str = "step"
    # How chat answers' tool calls are read (server/tool_calls.py); None: tool_choice
    # "auto" is refused (vLLM's --enable-auto-tool-choice with --tool-call-parser).
    tool_call_parser: str | None = None
    # How chat answers' reasoning is read apart from their content (server/reasoning.py;
    # vLLM's --reasoning-parser); None: an answer is all content.
    reasoning_parser: str | None = None
    # Chat template variables every conversation gets unless its request sets them
    # (vLLM's --default-chat-template-kwargs; Qwen3's {"enable_thinking": false}, say).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # GET /tokenizer_info, which shows the chat template and special tokens (vLLM's
    # --enable-tokenizer-info-endpoint): off unless asked for.
    tokenizer_info: bool = False
    # Which web pages' scripts may call the API (CORS: vLLM's --allowed-origins,
    # --allowed-methods, --allowed-headers, --allow-credentials, and their defaults).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


# Routes outside /v1 that the API key guards too: they do the model's tokenizer's work.
KEYED_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")
# A prompt's last ids, read for whether its template opened a think block (reasoning.py).
PROMPT_TAIL_IDS = 8
# A stream that has sent nothing for this long (queued, reading a long prompt, or its
# text held back: what may begin a tool call) sends an SSE comment, which clients skip,
# so that a proxy's read timeout (nginx's: 60 s) does not cut it.
KEEP_ALIVE_S = 15.0
KEEP_ALIVE = b": keep-alive\n\n"


def _usage(
    outs: list[RequestOutput], n: int, completed: bool = True, reasoning: Sequence[int] | None = None
) -> dict[str, Any]:
    """Usage of a response's choices (n per prompt): each prompt counted once, every
    choice's tokens (none where the answer leaves them out: `completed` False). Where a
    reasoning parser reads the answers, `reasoning` holds each choice's reasoning tokens."""
    firsts = outs[::n]  # one choice of each prompt
    prompt_tokens = sum(out.num_prompt_tokens for out in firsts)
    completion_tokens = sum(out.num_output_tokens for out in outs) if completed else 0
    cached = [out.num_cached_tokens for out in firsts]
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # OpenAI's field: prompt tokens served from the prefix cache (--enable-prefix-caching).
        # Without a prefix cache it is null, as vLLM leaves it: a benchmark then reports no
        # hit rate rather than a rate of 0 for a cache that is not there.
        "prompt_tokens_details": None if None in cached else {"cached_tokens": sum(cached)},
    }
    details = {}
    if reasoning is not None:  # OpenAI's field, as vLLM fills it: only under a reasoning parser
        details["reasoning_tokens"] = sum(reasoning)
    predictions = [out.prediction for out in outs if out.prediction is not None]
    if predictions:  # OpenAI's fields, where the request sent a prediction: its drafted tokens' fate
        details["accepted_prediction_tokens"] = sum(accepted for accepted, _ in predictions)
        details["rejected_prediction_tokens"] = sum(rejected for _, rejected in predictions)
    if details:
        usage["completion_tokens_details"] = details
    return usage


def _spec_decode(outs: list[RequestOutput]) -> dict[str, Any] | None:
    """Speculation figures of these choices together, under a field of their own."""
    if outs[0].spec is None:
        return None
    total = sum((out.spec for out in outs), SpecStats()).to_dict()
    return {
        k: total[k]
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length")
    }


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _sse_or_none(payload: dict[str, Any] | None) -> bytes | None:
    return None if payload is None else _sse(payload)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _as_api_error(error: Exception) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFullError):
        return APIError(
            str(error),
            status=429,
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(error.retry_after_s)},
        )
    if isinstance(error, ShuttingDownError):  # closing the connection sends the client's retry elsewhere
        return APIError(
            str(error), status=503, type="service_unavailable", code="shutting_down", headers={"Connection": "close"}
        )
    if isinstance(error, SpecserveError):
        return APIError(str(error))
    if isinstance(error, EngineStepError):  # logged where it happened
        return APIError(str(error), status=500, type="internal_error")
    # A bug: its text may hold internals (paths, shapes), so it goes to the log only.
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s", error_id, exc_info=error)
    return APIError(
        f"internal server error (id {error_id}); the server log has the details", status=500, type="internal_error"
    )


def bad_words_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad words as the id sequences the answer must not end with: each word as
    the text's first word, and after a space where that spells it with other ids of
    the same count (vLLM's rule)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def _route_path(scope: dict[str, Any]) -> str:
    """The path the routes see: behind a proxy that strips a prefix (`--root-path`),
    uvicorn puts the prefix back in front of the request's path."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return path


async def _off_the_loop(function: Callable, *args: Any) -> Any:
    """Run tokenization on a worker thread: a long prompt takes seconds, and the Rust
    tokenizer lets the event loop (every other request, /health) run meanwhile."""
    return await asyncio.to_thread(function, *args)


async def _parsed(request: Request, model: type[BodyModel]) -> BodyModel:
    """The request's body as `model`, parsed and validated on a worker thread: a large
    body takes a while, and the event loop (every other request, /health) runs on."""
    return await asyncio.to_thread(_validated, model, await request.body())


def _validated(model: type[BodyModel], raw: bytes) -> BodyModel:
    """pydantic's reader first (the fastest); a body it cannot read goes through
    Python's, which reads lone surrogates (refused with their field named) and says
    where the JSON breaks. Raises APIError, made here too, off the event loop."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        if not any(e["type"] == "json_invalid" for e in errors):
            raise validation_error(errors) from None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError included; nesting past Python's
        raise APIError(f"the request body is not valid JSON: {error}") from None
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise validation_error(error.errors(include_url=False)) from None


async def _first_unless_disconnected(work: asyncio.Future, request: Request, timeout_s: float | None = None) -> bool:
    """Wait for `work` (at most `timeout_s`) unless the client disconnects first; then
    cancel it (its `finally` aborts what runs in the engine) and return False."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        left = watch.done() and not work.done()
    finally:
        watch.cancel()
    if not left:
        return True
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return False


async def _sse_stream(
    choices: Fanout,
    starting: asyncio.Future,
    events_of: Callable[[int, RequestOutput], Awaitable[list[bytes]]],
    error_event: Callable[[dict[str, Any]], bytes],
    prelude: Sequence[bytes] = (),
    ending: Callable[[], list[bytes]] = list,
) -> AsyncIterator[bytes]:
    """A stream's bytes once it has answered: `prelude`; an SSE comment every
    KEEP_ALIVE_S until the choices have started, and whenever their outputs make no
    event for that long; each output's events (`events_of`), then `ending`'s; an error
    after the start in-band (`error_event` of its body). However it ends, the client
    gone included, the choices still running are aborted."""
    quiet_since = time.monotonic()
    try:
        for event in prelude:
            yield event
        while not starting.done():
            await asyncio.wait({starting}, timeout=KEEP_ALIVE_S)
            if not starting.done():
                yield KEEP_ALIVE
        starting.result()  # a refusal after the answer: in-band
        async for choice, out in choices:
            events = await events_of(choice, out)
            for event in events:
                yield event
            now = time.monotonic()
            if events:
                quiet_since = now
            elif now - quiet_since >= KEEP_ALIVE_S:
                quiet_since = now
                yield KEEP_ALIVE
        for event in ending():
            yield event
    except Exception as e:  # the stream has started: report in-band
        yield error_event(_as_api_error(e).body())
    finally:
        starting.cancel()  # where the client left before the choices started
        await choices.aclose()  # client gone: abort what still runs


def build_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    settings: ApiSettings,
    lifespan: Callable | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    recorder: PromptRecorder | None = None,
) -> FastAPI:
    """The HTTP API over `engine`. With a `recorder`, each admitted request's prompts are
    recorded (server/recording.py)."""
    app = FastAPI(title="specserve", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(str(error.detail), status=error.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _bug(_: Request, error: Exception) -> JSONResponse:
        return _error_response(_as_api_error(error))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = _route_path(request.scope)
        if settings.api_key is not None and (path.startswith("/v1") or path in KEYED_ROUTES):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            # As bytes: compare_digest refuses str with non-ASCII characters.
            given, key = (
                token.strip().encode("utf-8", "surrogateescape"),
                settings.api_key.encode("utf-8", "surrogateescape"),
            )
            if scheme.lower() != "bearer" or not secrets.compare_digest(given, key):
                return _error_response(
                    APIError(
                        "invalid or missing API key: send 'Authorization: Bearer <key>'",
                        status=401,
                        code="invalid_api_key",
                    )
                )
        return await call_next(request)

    app.add_middleware(
        WholeBody, max_bytes=max_body_bytes(settings.max_model_len), timeout_s=body_timeout_s
    )  # before any handler reads
    app.add_middleware(  # outermost: a browser's preflight carries no API key, and every answer its headers
        CORSMiddleware,
        allow_origins=settings.allowed_origins,
        allow_methods=settings.allowed_methods,
        allow_headers=settings.allowed_headers,
        allow_credentials=settings.allow_credentials,
    )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return _error_response(APIError("the engine is not running", status=503, type="service_unavailable"))
        if not engine.accepting:  # draining: a load balancer should send new work elsewhere
            return _error_response(APIError("the server is shutting down", status=503, type="service_unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "specserve",
                    "root": settings.served_model_name,
                    "max_model_len": settings.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(http_request: Request) -> dict[str, Any]:
        """vLLM's: a text's or a conversation's token ids, as a prompt of it would read."""
        body = await _parsed(http_request, TokenizeRequest)
        body.check()
        check_model(body.model)
        try:
            if body.messages is None:
                encode = functools.partial(tokenizer.encode, add_special_tokens=body.add_special_tokens)
                ids = await _off_the_loop(encode, body.prompt)
            else:
                options = body.template_options(settings.default_chat_template_kwargs)
                encode = functools.partial(tokenizer.encode_chat, **options)
                ids = await _off_the_loop(encode, [m.for_template() for m in body.messages])
        except SpecserveError as e:  # the chat template's refusal
            raise APIError(str(e), param="messages") from None
        strings = tokenizer.token_strings(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids, "token_strs": strings}

    @app.post("/detokenize")
    async def detokenize(http_request: Request) -> dict[str, Any]:
        """vLLM's: token ids' text, special tokens included."""
        body = await _parsed(http_request, DetokenizeRequest)
        check_model(body.model)
        try:
            engine.check_token_ids(body.tokens)
        except SpecserveError as e:
            raise APIError(str(e), param="tokens") from None
        return {
            "prompt": await _off_the_loop(functools.partial(tokenizer.decode, skip_special_tokens=False), body.tokens)
        }

    if settings.tokenizer_info:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            """vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness's
            remote tokenizer reads it)."""
            return {
                "tokenizer_class": "specserve",
                "eos_token": tokenizer.token_text(tokenizer.eos_token_ids[0]),
                "bos_token": tokenizer.token_text(tokenizer.bos_token_id),
                "pad_token": None,
                "add_bos_token": tokenizer.add_bos,
                "chat_template": tokenizer.chat_template,
                "model_max_length": settings.max_model_len,
            }

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {settings.served_model_name!r}",
                status=404,
                param="model",
                type="not_found_error",
                code="model_not_found",
            )

    def without_bos(ids: list[int]) -> list[int]:
        """A prompt's ids less the BOS that encoding its text adds again."""
        return ids[1:] if tokenizer.add_bos and ids[:1] == [tokenizer.bos_token_id] else ids

    def max_tokens_for(requested: int | None, num_prompt_tokens: int) -> int:
        # As vLLM: no max_tokens means the rest of the context.
        return requested if requested is not None else max(1, settings.max_model_len - num_prompt_tokens)

    async def run(
        body,
        http_request: Request,
        prompts: list[list[int]],
        arrival: float,
        head: dict[str, Any],
        make_chunk: Callable[[int, RequestOutput, bool], dict[str, Any] | None],
        make_response: Callable[[list[ChoiceResult]], dict[str, Any]],
        recorded: Callable[[], list[Instruction]],
        events: Callable[[Fanout, asyncio.Future], AsyncIterator[bytes]] | None = None,
        thinking: ReasoningParser | None = None,
        detached: Callable[[Fanout], Response] | None = None,
        reasoning_so_far: Callable[[int], int] | None = None,
    ) -> Response:
        """Generate body.n choices for each prompt: choice i is prompt i // n. Once the
        engine admits them, the prompts `recorded` makes go to the recorder. A stream
        sends make_chunk's chunks, or where given, what `events` makes of the choices
        (which it closes) from the end of their start, the future it is given. Where
        `thinking` reads the answers' reasoning, a structure holds from the reasoning's
        end on, and a stream's usage counts choice i's reasoning tokens as
        `reasoning_so_far(i)` (after make_chunk has read its output). `detached` answers
        at once, the choices once admitted running on without the client (a background
        response)."""
        requests = []
        guide = await structured_guide(body)
        if guide is not None and thinking is not None:
            guide = ThinkingFirst(guide, await _off_the_loop(block_masks), thinking.starts_thinking)
        bad_words = await _off_the_loop(bad_words_ids, tokenizer, body.bad_words) if body.bad_words else ()
        prediction = await predicted(body.prediction_text())
        for prompt_ids in prompts:
            max_tokens = max_tokens_for(body.requested_max_tokens(), len(prompt_ids))
            params = body.sampling_params(max_tokens, guide, bad_words, prediction)
            try:
                requests += [(prompt_ids, sample_params(params, j)) for j in range(body.n)]
            except SpecserveError as e:  # a seed + j past 64 bits
                raise APIError(str(e), param="seed") from None
        try:
            choices = Fanout(engine, requests, body.stop_strings(), arrival, body.stream and per_token, body.priority)
        except Exception as e:  # refused before any choice started
            raise _as_api_error(e) from None
        if recorder is not None:
            recorder.record(recorded)
        if detached is not None:
            return detached(choices)
        if not body.stream:
            collecting = asyncio.ensure_future(choices.collect())
            try:
                if not await _first_unless_disconnected(collecting, http_request):
                    return Response(status_code=499)  # the client left: its choices were aborted
                # Off the loop: a long answer's logprobs take seconds to build and encode.
                results = collecting.result()
                return await asyncio.to_thread(lambda: JSONResponse(make_response(results)))
            except Exception as e:
                raise _as_api_error(e) from None

        # Start the engine before answering, so a refusal (429, 503) is a status, not a
        # stream; a client that leaves meanwhile has its choices aborted. A stream whose
        # choices have not started within KEEP_ALIVE_S (queued, or reading a long prompt)
        # answers then, keeping alive in-band, where any later refusal is reported too.
        starting = asyncio.ensure_future(choices.start())
        try:
            if not await _first_unless_disconnected(starting, http_request, timeout_s=KEEP_ALIVE_S):
                await choices.aclose()
                return Response(status_code=499)
            if starting.done():
                starting.result()
        except Exception as e:
            raise _as_api_error(e) from None
        if events is not None:
            return StreamingResponse(events(choices, starting), media_type="text/event-stream")

        def chunk_of(choice: int, out: RequestOutput, first: bool) -> dict[str, Any] | None:
            """make_chunk's chunk, with its choice's usage so far where the request asks for it."""
            piece = make_chunk(choice, out, first)
            if piece is not None and body.continuous_usage:
                piece["usage"] = _usage([out], 1, completed=not body.echo_only, reasoning=reasoning_of([choice]))
            return piece

        def reasoning_of(choices: list[int]) -> list[int] | None:
            return None if reasoning_so_far is None else [reasoning_so_far(choice) for choice in choices]

        last: dict[int, RequestOutput] = {}  # each choice's latest output

        async def events_of(choice: int, out: RequestOutput) -> list[bytes]:
            first = choice not in last
            last[choice] = out
            if out.prompt_logprobs:  # a whole prompt's logprobs: built and encoded off the loop
                event = await asyncio.to_thread(lambda: _sse_or_none(chunk_of(choice, out, first)))
            else:
                event = _sse_or_none(chunk_of(choice, out, first))
            return [] if event is None else [event]

        def usage_event() -> list[bytes]:
            if not body.include_usage:
                return []
            usage = _usage(
                [last[i] for i in sorted(last)],
                body.n,
                completed=not body.echo_only,
                reasoning=reasoning_of(sorted(last)),
            )
            return [_sse({**head, "choices": [], "usage": usage})]

        async def stream() -> AsyncIterator[bytes]:
            async for event in _sse_stream(choices, starting, events_of, _sse, ending=usage_event):
                yield event
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    def finish(out: RequestOutput) -> dict[str, Any]:
        return {"finish_reason": out.finish_reason if out.finished else None, "stop_reason": out.stop_reason}

    per_token = settings.stream_mode == "token"
    guides = GuideCache(tokenizer, isolated=True)  # schemas compile away from the engine's thread

    @functools.cache
    def block_masks() -> BlockMasks:
        """What a think block allows (structured/thinking.py), for this vocabulary."""
        return BlockMasks(guides.vocabulary())

    # The vocabulary as guides read it, made now (0.7 s of Python for 151,936 ids), not
    # while the first structured request's neighbours decode.
    threading.Thread(target=guides.vocabulary, name="guide-vocabulary", daemon=True).start()

    async def structured_guide(body: CompletionRequest | ChatCompletionRequest) -> Guide | None:
        """The compiled guide of the body's structured output (None: free text), made on a
        worker thread: a new schema takes a while to compile, and the event loop runs on."""
        wanted = body.structured_output()
        if wanted is None:
            return None
        try:
            return await _off_the_loop(guides.guide, wanted)
        except SpecserveError as error:
            raise APIError(str(error), param=body.structured_param()) from None

    def check_request(body: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        """What can be refused before any prompt is read: the model's name, the count,
        the logit bias's and the allowed ids."""
        check_model(body.model)
        if body.priority and engine.engine.scheduling_policy != "priority":
            raise APIError(
                f"priority {body.priority} needs the server started with --scheduling-policy priority",
                param="priority",
            )
        if num_prompts * body.n > engine.max_unfinished:
            raise APIError(
                f"{num_prompts} prompts x n={body.n} is {num_prompts * body.n} completions, more than "
                f"this server holds at once ({engine.max_unfinished}); split the request",
                param="n",
            )
        for param, ids in (
            ("logit_bias", [i for i, _ in body.logit_bias_pairs()]),
            ("allowed_token_ids", body.allowed_token_ids or []),
        ):
            try:
                engine.check_token_ids(ids)
            except SpecserveError as e:
                raise APIError(str(e), param=param) from None

    async def predicted(text: str | None) -> PredictedText | None:
        """A prediction's tokens (spec/prediction.py), read on a worker thread; refused
        past the model's length."""
        if text is None:
            return None
        limit = settings.max_model_len
        encode = functools.partial(tokenizer.encode, add_special_tokens=False, at_most=limit)
        try:
            ids = await _off_the_loop(encode, text)
        except SpecserveError:  # refused after reading its start: past the limit
            ids = None
        if ids is None or len(ids) > limit:
            raise APIError(
                f"the prediction is more than {limit} tokens, the maximum model length; shorten it", param="prediction"
            )
        return PredictedText(ids)

    async def encoded(encode: Callable, text: Any, param: str, keep: int | None) -> list[int]:
        """A prompt's ids, read on a worker thread: refused past the model's length, or,
        where the request keeps its last `keep` ids (truncate_prompt_tokens), cut to them
        (the body's limit bounds what is read)."""
        at_most = settings.max_model_len if keep is None else None
        try:
            ids = await _off_the_loop(functools.partial(encode, at_most=at_most), text)
        except SpecserveError as e:
            raise APIError(str(e), param=param) from None
        return check_length(kept_ids(ids, keep), param)  # a text's ids are the vocabulary's

    async def infilled(prefix: str | list[int], suffix: str) -> list[int]:
        """A fill-in-the-middle prompt's ids (`Tokenizer.encode_infill`), read on a worker
        thread, refused past the model's length."""
        given = check_ids(list(prefix), "prompt") if isinstance(prefix, list) else prefix
        encode = functools.partial(tokenizer.encode_infill, suffix=suffix, at_most=settings.max_model_len)
        try:
            ids = await _off_the_loop(encode, given)
        except SpecserveError as e:  # no FIM tokens (the suffix's fault), or a text past the model's length
            raise APIError(str(e), param="prompt" if tokenizer.fim_ids else "suffix") from None
        return check_length(ids, "prompt")

    def kept(body: CompletionRequest | ChatCompletionRequest) -> int | None:
        """How many of a prompt's last ids the request keeps; None: all."""
        return settings.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens

    def kept_ids(ids: list[int], keep: int | None) -> list[int]:
        return ids if keep is None else ids[-keep:]

    def check_length(ids: list[int], param: str) -> list[int]:
        if len(ids) > settings.max_model_len:
            raise APIError(
                f"the prompt is {len(ids)} tokens, more than the maximum model length "
                f"{settings.max_model_len}; shorten it",
                param=param,
            )
        return ids

    def check_ids(ids: list[int], param: str) -> list[int]:
        check_length(ids, param)  # refused by its length before its ids are read
        try:
            engine.check_token_ids(ids)
        except SpecserveError as e:
            raise APIError(str(e), param=param) from None
        return ids

    @app.post("/v1/completions")
    async def completions(http_request: Request) -> Response:
        arrival = time.perf_counter()
        body = await _parsed(http_request, CompletionRequest)
        body.refuse_unsupported()
        given = body.prompt_list()
        check_request(body, len(given))
        keep = kept(body)
        if body.suffix is not None:  # fill in the middle: each prompt is the text before the gap
            prompts = [await infilled(p, body.suffix) for p in given]
        else:
            prompts = [
                await encoded(tokenizer.encode, p, "prompt", keep)
                if isinstance(p, str)
                else check_ids(kept_ids(list(p), keep), "prompt")
                for p in given
            ]
        prompt_texts = [  # echo: the prompt as read (its ids' text where they were given or cut)
            p if (isinstance(p, str) and keep is None) or not body.echo else await _off_the_loop(tokenizer.decode, ids)
            for p, ids in zip(given, prompts)
        ]
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created, "model": settings.served_model_name}
        text_offsets = [0] * (len(prompts) * body.n)  # of each choice's next listed token (the echo's first)

        def choice(index: int, text: str, out: RequestOutput, logprobs: Sequence[TokenLogprob | int]) -> dict[str, Any]:
            described = None
            if body.logprobs is not None:
                described = completion_logprobs(logprobs, tokenizer, text_offsets[index])
                text_offsets[index] += sum(map(len, described["tokens"]))
            return {"index": index, "text": text, "logprobs": described, **finish(out)}

        def echoed(index: int) -> str:
            return prompt_texts[index // body.n] if body.echo else ""

        def ids_of(index: int, token_ids: Sequence[int], first: bool) -> dict[str, Any]:
            """vLLM's return_token_ids: a choice's new ids, and its prompt's with its first."""
            prompt = {"prompt_token_ids": prompts[index // body.n]} if first else {}
            return {**prompt, "token_ids": list(token_ids)}

        def echoed_logprobs(index: int, prompt_logprobs: Sequence[TokenLogprob] | None) -> list[TokenLogprob | int]:
            """The prompt's tokens leading the choice's logprobs, under echo with logprobs."""
            if body.echoed_logprobs is None:
                return []
            return echoed_entries(prompts[index // body.n], prompt_logprobs or (), body.echoed_logprobs)

        def chunk(index: int, out: RequestOutput, first: bool) -> dict[str, Any] | None:
            generated, generated_logprobs = ("", []) if body.echo_only else (out.text, list(out.logprobs))
            text = (echoed(index) if first else "") + generated
            if (
                not text
                and not out.finished
                and not (body.logprobs is not None and generated_logprobs)
                and not (per_token and out.num_new_tokens and not body.echo_only)
                and not (body.return_token_ids and out.token_ids and not body.echo_only)
            ):
                return None
            logprobs = (echoed_logprobs(index, out.prompt_logprobs) if first else []) + generated_logprobs
            described = choice(index, text, out, logprobs)
            if body.return_token_ids:
                described |= ids_of(index, () if body.echo_only else out.token_ids, first)
            piece = {**head, "choices": [described]}
            if out.finished:
                piece["spec_decode"] = _spec_decode([out])
            return piece

        def whole_choice(index: int, result: ChoiceResult) -> dict[str, Any]:
            generated, generated_logprobs = ("", []) if body.echo_only else ("".join(result.text), result.logprobs)
            logprobs = echoed_logprobs(index, result.prompt_logprobs) + generated_logprobs
            described = choice(index, echoed(index) + generated, result.last, logprobs)
            if body.return_token_ids:
                described |= ids_of(index, () if body.echo_only else result.token_ids, True)
            if body.prompt_logprobs is not None:
                described["prompt_logprobs"] = prompt_logprobs_field(
                    result.prompt_logprobs or (), tokenizer, body.prompt_logprobs
                )
            return described

        def response(results: list[ChoiceResult]) -> dict[str, Any]:
            lasts = [r.last for r in results]
            return {
                **head,
                "choices": [whole_choice(i, r) for i, r in enumerate(results)],
                "usage": _usage(lasts, body.n, completed=not body.echo_only),
                "spec_decode": _spec_decode(lasts),
            }

        def recorded() -> list[Instruction]:
            texts = [
                tokenizer.decode(without_bos(ids), skip_special_tokens=False)  # FIM's tokens kept
                if body.suffix is not None
                else p
                if isinstance(p, str)
                else tokenizer.decode(without_bos(ids))
                for p, ids in zip(given, prompts)
            ]
            return [Instruction("completion", text, templated=False) for text in texts if text.strip()]

        return await run(body, http_request, prompts, arrival, head, chunk, response, recorded)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request) -> Response:
        arrival = time.perf_counter()
        return await chat(await _parsed(http_request, ChatCompletionRequest), http_request, arrival)

    kept_responses = ResponseStore()
    background_runs: dict[str, asyncio.Task] = {}  # background responses still running, by id

    def run_in_background(shape: ResponseObject, make_response: Callable, choices: Fanout) -> Response:
        """Answer with the response in progress (kept, for GET to read) and finish it on
        its own: completed, cancelled (POST .../cancel, or the server's shutdown) or failed."""

        async def finish() -> None:
            try:
                results = await choices.collect()
                await asyncio.to_thread(make_response, results)  # kept as it completes
            except asyncio.CancelledError:
                shape.keep_unfinished("cancelled")
            except Exception as e:
                shape.keep_unfinished("failed", _as_api_error(e).body()["error"])
            finally:
                background_runs.pop(shape.id, None)

        in_progress = shape.keep_unfinished("in_progress")
        background_runs[shape.id] = asyncio.create_task(finish())
        return JSONResponse(in_progress)

    async def cancel_run(response_id: str) -> None:
        """Cancel a background response still running (its choices are aborted) and wait for it to be kept."""
        task = background_runs.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    @app.post("/v1/responses")
    async def responses(http_request: Request) -> Response:
        arrival = time.perf_counter()
        request = await _parsed(http_request, ResponsesRequest)
        previous = request.previous_response_id
        history = [] if previous is None else kept_responses.conversation(previous)
        shape = ResponseObject(request, settings.served_model_name, kept_responses)
        return await chat(request.chat_request(history), http_request, arrival, shape)

    @app.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str) -> dict[str, Any]:
        return kept_responses.get(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def kept_input_items(
        response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        return kept_responses.input_items(response_id, limit, order, after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        """OpenAI's: a background response cancelled (one already ended comes back as it is)."""
        if not kept_responses.get(response_id)["background"]:
            raise APIError(
                f"response {response_id!r} was not made in the background; only background responses can be cancelled",
                param="response_id",
            )
        await cancel_run(response_id)
        return kept_responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def forget_response(response_id: str) -> dict[str, Any]:
        await cancel_run(response_id)
        kept_responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def chat(
        body: ChatCompletionRequest, http_request: Request, arrival: float, shape: ResponseObject | None = None
    ) -> Response:
        """Answer a chat request: as a chat completion, or where `shape` is given, as the
        Responses API's response."""
        body.refuse_unsupported()  # roles first: the template must not see unknown ones
        if body.parses_tool_calls and settings.tool_call_parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
        check_request(body, 1)
        messages = body.template_messages()
        options = body.template_options(settings.default_chat_template_kwargs)
        encode = functools.partial(tokenizer.encode_chat, tools=body.template_tools(), **options)
        prompt_ids = await encoded(encode, messages, "messages", kept(body))
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": settings.served_model_name,
        }

        def described(logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
            return chat_logprobs(logprobs, tokenizer) if body.logprobs else None

        # How the answers' tool calls are read (server/tool_calls.py); None: not read.
        tool_calls: ToolCallParser | ForcedToolCalls | None = None
        if body.parses_tool_calls:
            tool_calls = ToolCallParser(settings.tool_call_parser, frozenset(t.function.name for t in body.tools))
        elif (forced := body.forced_tool()) is not None:
            tool_calls = ForcedToolCalls(forced)
        # Each streamed choice's text, holding back what may be a tool call's.
        calling = None if tool_calls is None else [tool_calls.stream() for _ in range(body.n)]
        # How the answers' reasoning is read apart (server/reasoning.py); None: not read.
        thinking: ReasoningParser | None = None
        if settings.reasoning_parser is not None:
            tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_IDS:], skip_special_tokens=False)
            guided = body.structured_output() is not None
            thinking = ReasoningParser(settings.reasoning_parser, prompt_opens_thinking(tail), guided)
        reading = None if thinking is None else [thinking.stream() for _ in range(body.n)]
        # The answers' text as their reasoning was read: to find where it ended among their ids.
        decode = functools.partial(tokenizer.decode, skip_special_tokens=body.skip_special_tokens)
        # Each streamed choice's reasoning tokens so far.
        counting = None if reading is None else [ReasoningTokens(reader, decode) for reader in reading]

        def reasoning_tokens(results: list[ChoiceResult]) -> list[int] | None:
            """Each whole choice's reasoning tokens, where a parser reads them."""
            if thinking is None:
                return None
            return [thinking.reasoning_tokens("".join(r.text), r.token_ids, decode) for r in results]

        def streamed_reasoning(index: int) -> int:
            return counting[index].count()

        def shown(reasoning: str | None) -> dict[str, Any]:
            """A message's reasoning fields, where a parser reads them and the request wants them."""
            return reasoning_fields(reasoning) if thinking is not None and body.include_reasoning else {}

        def parsed(text: str) -> tuple[str | None, str | None, list[ToolCall]]:
            """A whole answer's reasoning, content and calls."""
            reasoning, rest = (None, text) if thinking is None else thinking.split(text)
            content, calls = (rest, []) if tool_calls is None or rest is None else tool_calls.parse(rest)
            return reasoning, content, calls

        def ended(out: RequestOutput, calls_made: bool) -> dict[str, Any]:
            """The finish_reason: the parser's where the answer made calls, unless it was
            cut short (a call's arguments may be cut too)."""
            reason = tool_calls.finish_reason if calls_made and out.finish_reason != "length" else None
            return finish(out) | ({"finish_reason": reason} if reason else {})

        def pieces(index: int, out: RequestOutput) -> tuple[str, str, list[dict[str, Any]]]:
            """A streamed step's reasoning and content to send, and its delta's tool_calls entries."""
            reasoning, text = ("", out.text) if reading is None else reading[index].step(out.text, out.finished)
            if counting is not None:
                counting[index].add(out.token_ids)
            content, entries = (text, []) if calling is None else calling[index].step(text, out.finished)
            return (reasoning if body.include_reasoning else ""), content, entries

        def chunk(index: int, out: RequestOutput, first: bool) -> dict[str, Any] | None:
            reasoning, content, entries = pieces(index, out)
            with_logprobs = body.logprobs and out.logprobs
            if (
                not content
                and not reasoning
                and not entries
                and not out.finished
                and not first
                and not with_logprobs
                and not (per_token and out.num_new_tokens)
                and not (body.return_token_ids and out.token_ids)
            ):
                return None
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if reasoning:
                delta |= reasoning_fields(reasoning)
            if content or (first and not reasoning) or with_logprobs:
                delta["content"] = None if entries and not content else content
            if entries:
                delta["tool_calls"] = entries
            calls_made = out.finished and calling is not None and calling[index].calls_made
            choice = {"index": index, "delta": delta, "logprobs": described(out.logprobs), **ended(out, calls_made)}
            if body.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            prompt = {"prompt_token_ids": prompt_ids} if body.return_token_ids and first else {}
            piece = {**head, **prompt, "choices": [choice]}
            if out.finished:
                piece["spec_decode"] = _spec_decode([out])
            return piece

        def whole_choice(index: int, result: ChoiceResult) -> dict[str, Any]:
            reasoning, content, calls = parsed("".join(result.text))
            message: dict[str, Any] = {"role": "assistant", "content": content, **shown(reasoning)}
            if calls:
                message["tool_calls"] = [call.described() for call in calls]
            ids = {"token_ids": result.token_ids} if body.return_token_ids else {}
            return {
                "index": index,
                "message": message,
                "logprobs": described(result.logprobs),
                **ended(result.last, bool(calls)),
                **ids,
            }

        def response(results: list[ChoiceResult]) -> dict[str, Any]:
            lasts = [r.last for r in results]
            prompt_logprobs = {}
            if body.prompt_logprobs is not None:  # vLLM's place for them in a chat response
                entries = results[0].prompt_logprobs or ()
                prompt_logprobs["prompt_logprobs"] = prompt_logprobs_field(entries, tokenizer, body.prompt_logprobs)
            prompt_ids_field = {"prompt_token_ids": prompt_ids} if body.return_token_ids else {}
            return {
                **head,
                **prompt_logprobs,
                **prompt_ids_field,
                "object": "chat.completion",
                "choices": [whole_choice(i, r) for i, r in enumerate(results)],
                "usage": _usage(lasts, body.n, reasoning=reasoning_tokens(results)),
                "spec_decode": _spec_decode(lasts),
            }

        def recorded() -> list[Instruction]:
            try:
                return [from_messages(messages, "chat", body.template_tools())]
            except ValueError:  # no user or tool turn last: no instruction train-head answers
                return []

        answer = functools.partial(run, body, http_request, [prompt_ids], arrival, head, chunk, thinking=thinking)
        if shape is None:
            return await answer(response, recorded, reasoning_so_far=None if counting is None else streamed_reasoning)

        def whole_response(results: list[ChoiceResult]) -> dict[str, Any]:
            (result,) = results
            reasoning, content, calls = parsed("".join(result.text))
            logprobs = output_text_logprobs(described(result.logprobs))
            usage = _usage([result.last], 1, reasoning=reasoning_tokens(results))
            text = content if content or not calls else None
            reasoning = reasoning if body.include_reasoning else None
            return shape.whole(reasoning, text, calls, logprobs, usage, result.last.finish_reason)

        def events(choices: Fanout, starting: asyncio.Future) -> AsyncIterator[bytes]:
            stream = ResponseEvents(shape)

            async def events_of(_: int, out: RequestOutput) -> list[bytes]:
                reasoning, content, entries = pieces(0, out)
                logprobs = output_text_logprobs(described(out.logprobs))
                sent = stream.step(content, logprobs, entries, reasoning)
                if out.finished:
                    answered = reading is None or reading[0].answers
                    spent = None if counting is None else [streamed_reasoning(0)]
                    sent += stream.finish(_usage([out], 1, reasoning=spent), out.finish_reason, answered)
                return sent

            return _sse_stream(choices, starting, events_of, stream.error, prelude=stream.start())

        detached = None
        if shape.request.background:
            detached = functools.partial(run_in_background, shape, whole_response)
        return await answer(whole_response, recorded, events=events, detached=detached)

    return app
