"""One streamed request to an OpenAI-compatible server, timed: what came back and when.

The client keeps raw facts only (when each chunk of text arrived, the text, a thinking
model's reasoning apart from it, the server's `usage`); turning them into tokens and latencies is `summary`'s job, so no
figure depends on how the server cut its stream into chunks. It never raises for the
server's sake: an HTTP error status, an in-band error event, a broken connection or the
run's deadline each end the request with `error_code` (the HTTP status, else None) and
a non-empty `error_msg` whose first word says which.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
STREAM_FIELDS = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class StreamedResponse:
    started_at: float  # time.perf_counter() when the request was sent
    chunk_times_s: list[float] = field(default_factory=list)  # each chunk of content or reasoning, s after start
    end_to_end_s: float = 0.0  # until the stream ended (or failed)
    text: str = ""
    reasoning: str = ""  # a thinking model's, sent apart (`delta.reasoning`, --reasoning-parser)
    prompt_tokens: int | None = None  # the server's usage, when it sent one
    completion_tokens: int | None = None
    cached_prompt_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix caching)
    error_code: int | None = None
    error_msg: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_msg

    def fail(self, code: int | None, message: str) -> None:
        self.error_code, self.error_msg = code, message

    def take_event(self, payload: str, at_s: float) -> bool:
        """Fold in one SSE `data:` payload that arrived `at_s` after the start; True at the end."""
        if payload == "[DONE]":
            return True
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            event = None
        if not isinstance(event, dict):
            self.fail(None, f"bad stream: not a JSON object: {payload[:200]!r}")
            return True
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            code = error.get("code")
            self.fail(code if isinstance(code, int) else None, f"stream error: {error.get('message', error)}")
            return True
        if isinstance(usage := event.get("usage"), dict):
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            self.cached_prompt_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("content") or choice.get("text") or ""
            thought = delta.get("reasoning") or delta.get("reasoning_content") or ""
            if piece or thought:
                self.text += piece if isinstance(piece, str) else ""
                self.reasoning += thought if isinstance(thought, str) else ""
                self.chunk_times_s.append(at_s)
        return False


def open_session(url: str, api_key: str | None, max_connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(None),  # the run's deadline bounds every request
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
    )


async def stream_request(
    http: httpx.AsyncClient, endpoint: str, body: dict[str, Any], deadline: float
) -> StreamedResponse:
    """Send `body` with streaming and usage on; `deadline` is in event-loop time."""
    response = StreamedResponse(started_at=time.perf_counter())
    try:
        async with asyncio.timeout_at(deadline):
            async with http.stream("POST", endpoint, json={**body, **STREAM_FIELDS}) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    response.fail(reply.status_code, f"HTTP {reply.status_code}: {_error_message(reply)}")
                else:
                    async for line in reply.aiter_lines():
                        if line.startswith("data:") and response.take_event(
                            line[len("data:") :].strip(), time.perf_counter() - response.started_at
                        ):
                            break
    except TimeoutError:
        response.fail(None, "timeout: the run's --timeout ran out before the response ended")
    except httpx.HTTPError as e:
        response.fail(None, f"connection error: {type(e).__name__}: {e}")
    response.end_to_end_s = time.perf_counter() - response.started_at
    return response


def _error_message(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:500] or reply.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(body)[:500]
