"""What the HTTP layer does before a request reaches a handler, so that no client can
hold the server's sockets, memory or file descriptors.

Invariants:
- A request's body is read whole, before the app sees it, within `timeout_s`
  (else 408) and up to `max_bytes` (else 413), however it is sent: with a
  Content-Length or chunked. The app then reads it from memory, and a later `receive`
  waits for the client's disconnect as uvicorn's does.
- The bodies held at once, from their first byte until the app takes them, come to at
  most `max_total_bytes`: past it a request gets 503 with Retry-After, so many large
  uploads together cannot take the server's memory. A taken body is the app's (its
  requests are bounded by the queue), so a client that never reads its answers holds
  no room that others' uploads need.
- A connection that sends no complete request head within `head_timeout_s` of
  opening or of its last response is closed (uvicorn's keep-alive timeout closes idle
  ones sooner; neither covers a head sent a byte at a time).
- A connection whose client takes none of its response for `send_timeout_s` while
  the server has more to write (nginx's send_timeout) is dropped, and so is its
  request: a client that stops reading holds no answer in memory for long.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 60.0
# Largest bodies held at once: max_total_bytes' default in units of max_bytes. Many, so
# that a few connections stalling mid-body cannot refuse everyone else's requests.
BODIES_HELD_AT_ONCE = 64
RETRY_AFTER_S = 1

log = logging.getLogger("specserve")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    # The rest of the body is left unread: the connection cannot carry another request.
    return JSONResponse(body, status_code=status, headers={"Connection": "close", **(headers or {})})


class WholeBody:
    """ASGI middleware: reads each HTTP request's body within the limits, then runs
    the app with it."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S, max_total_bytes: int | None = None
    ):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.max_total_bytes = BODIES_HELD_AT_ONCE * max_bytes if max_total_bytes is None else max_total_bytes
        self.held_bytes = 0  # of every body read or being read that the app has not taken

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(int(declared))(scope, receive, send)
            return
        held = [0]  # this request's share of held_bytes

        def release() -> None:
            self.held_bytes -= held[0]
            held[0] = 0

        try:
            body = await self._read(receive, held)
            if isinstance(body, JSONResponse):
                await body(scope, receive, send)
            elif body is not None:
                replayed = _replay(body, receive, release)
                del body  # the replay's alone: the app takes it
                await self.app(scope, replayed, send)
        finally:
            release()

    async def _read(self, receive: Receive, held: list[int]) -> bytes | JSONResponse | None:
        """The whole body, an error response, or None where the client left first;
        `held[0]` counts the bytes it added to `held_bytes`."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        return self._too_large(size)
                    if self.held_bytes + len(chunk) > self.max_total_bytes:
                        return _error(
                            503,
                            f"the server holds {self.max_total_bytes:,} bytes of request bodies "
                            "at once and has no room for this one now; retry shortly",
                            {"Retry-After": str(RETRY_AFTER_S)},
                        )
                    self.held_bytes += len(chunk)
                    held[0] += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            return _error(408, f"the request body did not arrive within {self.timeout_s:.0f} s")

    def _too_large(self, size: int) -> JSONResponse:
        return _error(413, f"the request body is {size:,} bytes or more, more than the limit of {self.max_bytes:,}")


def _replay(body: bytes, receive: Receive, on_taken: Callable[[], None]) -> Receive:
    """A `receive` that gives the whole body once (then calls on_taken, keeping no
    reference to it), then what the client sends next (its disconnect)."""
    kept: list[bytes] = [body]

    async def replayed() -> Message:
        if not kept:
            return await receive()
        message = {"type": "http.request", "body": kept.pop(), "more_body": False}
        on_taken()
        return message

    return replayed


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head, and one for the
    client to take some of a response the server waits to write."""

    head_timeout_s = HEADER_TIMEOUT_S
    send_timeout_s = SEND_TIMEOUT_S
    _head_deadline: asyncio.TimerHandle | None = None
    _send_deadline: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeouts(cls, head_s: float, send_s: float) -> type[TimedH11Protocol]:
        """The protocol class to give uvicorn (it makes one instance per connection)."""
        return type(cls.__name__, (cls,), {"head_timeout_s": head_s, "send_timeout_s": send_s})

    def pause_writing(self) -> None:
        """The transport's buffer is full: the client must take some of it in time."""
        super().pause_writing()
        self._await_progress(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._cancel_send_deadline()
        super().resume_writing()

    def _await_progress(self, buffered: int) -> None:
        self._cancel_send_deadline()
        self._send_deadline = self.loop.call_later(self.send_timeout_s, self._check_progress, buffered)

    def _cancel_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _check_progress(self, buffered_before: int) -> None:
        self._send_deadline = None
        buffered = self.transport.get_write_buffer_size()
        if buffered < buffered_before:  # it took some: slow, not gone
            self._await_progress(buffered)
            return
        log.warning(
            "a client took none of its response for %g s (--send-timeout): its connection and request are ended",
            self.send_timeout_s,
        )
        self.transport.abort()  # connection_lost: the app sees the client gone and aborts its request

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a head arrived
            self._cancel_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        self._cancel_send_deadline()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_too_late)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        between_requests = self.cycle is None or self.cycle.response_complete
        if between_requests and not self.transport.is_closing():
            self.transport.close()


def raise_open_file_limit() -> None:
    """Let this process hold as many sockets as the system allows it (the soft limit up
    to the hard one, as vLLM does): a default of 1024, or 128 in some containers, is a
    few hundred slow clients."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # not allowed here: keep what we have
            pass
