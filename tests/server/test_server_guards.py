"""`specserve serve` against hostile and careless clients: no request, however bad,
harms another, leaks internals, or holds the server's sockets, memory or event loop.

One server runs for the module, as a probe would meet it: smollm2-135m drafting for
itself (k=3), an API key, --max-num-seqs 4, --max-queue-len 8, and short header and
body timeouts so that the timeout tests take seconds.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from uvicorn.config import Config
from uvicorn.server import ServerState

from specserve.bench.local_server import ServerProcess
from specserve.server.app import _as_api_error
from specserve.server.protocol import MAX_STOP_STRINGS
from specserve.server.transport import TimedH11Protocol, WholeBody

MODEL = "smollm2-135m"
KEY = "guard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEC = json.dumps({"model": MODEL, "num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def server(prepared_cache):
    server = ServerProcess(
        MODEL,
        "--speculative-config",
        SPEC,
        "--max-num-seqs",
        "4",
        "--max-queue-len",
        "8",
        "--max-model-len",
        "1024",
        "--header-timeout",
        "1",
        "--body-timeout",
        "2",
        env={"SPECSERVE_API_KEY": KEY},
    )
    yield server
    server.stop()


def post(server: ServerProcess, body: dict | bytes, route: str = "completions", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}/v1/{route}",
        content=content,
        timeout=60,
        headers={**AUTH, "Content-Type": "application/json", **kwargs.pop("headers", {})},
        **kwargs,
    )


def counter(server: ServerProcess, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return 0.0


def wait_until(condition, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s} s")
        time.sleep(0.05)


def greedy(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


# ----- one request never fails its neighbours -----

EXTREME_SAMPLING = [
    {"temperature": 1e-40},
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 0.8, "top_p": 1e-300, "repetition_penalty": 1e-37},
    {"temperature": 1e-20, "repetition_penalty": 3e38, "frequency_penalty": 2},
]


def test_extreme_sampling_values_are_served_and_harm_no_neighbour(server):
    solo = post(server, greedy("Write a long story.", 120)).json()["choices"][0]["text"]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers=AUTH,
        timeout=120,
        json=greedy("Write a long story.", 120, stream=True),
    ) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        for extra in EXTREME_SAMPLING:
            response = post(server, {"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
            assert response.status_code == 200, (extra, response.text)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert all("error" not in event for event in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    again = post(server, greedy("Write a long story.", 120)).json()["choices"][0]["text"]
    assert again == solo


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [2**70]}, "prompt"),
        ({"prompt": [[1, 2], [3, -5]]}, "prompt"),
        ({"prompt": [1, 2], "echo": True, "max_tokens": 600_000}, None),
        ({"prompt": "hi", "stop_token_ids": [2**70]}, None),
        ({"prompt": "hi", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "hi", "stop": ["a" * 2000]}, "stop"),
        ({"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"prompt": "hi", "temperature": 1, "top_k": 10**400}, "top_k"),  # past what a chain's tensor holds
        ({"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # more digits than int() reads
        ({"prompt": "hi", "priority": 1}, "priority"),  # the server schedules first come first served
    ],
)
def test_bad_ids_and_stop_conditions_get_400(server, body, param):
    response = post(server, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "route, raw",
    [
        ("completions", b'{"model": "smollm2-135m", "prompt": "Hi \\ud800", "max_tokens": 2}'),
        ("completions", b'{"model": "smollm2-135m", "prompt": "Hi", "stop": ["\\udc00"], "max_tokens": 2}'),
        ("chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud83d"}]}'),
        (
            "chat/completions",
            b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": '
            b'[{"type": "text", "text": "ok \\udfff"}]}]}',
        ),
    ],
)
def test_lone_surrogates_get_400_naming_the_field(server, route, raw):
    response = post(server, raw, route)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "surrogate" in error["message"] and error["param"] in ("prompt", "stop", "messages[0].content")
    paired = raw.replace(b"\\ud800", b"\\ud83d\\ude00")  # a surrogate pair is a real character
    if paired != raw:
        assert post(server, paired, route).status_code == 200


@pytest.mark.parametrize(
    "header", ["Bearer s\u00e9cret".encode("latin-1"), "Bearer \u00e9".encode("utf-8"), b"Bearer \xff\xfe"]
)
def test_non_ascii_keys_get_401(server, header):
    response = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_an_internal_error_answers_500_without_its_text():
    error = _as_api_error(RuntimeError("shape mismatch in /srv/models/secret.py line 12"))
    assert error.status == 500
    assert "secret" not in str(error) and "shape" not in str(error) and "id " in str(error)


# ----- bodies, sockets, the event loop -----


def test_a_chunked_body_past_the_limit_gets_413_and_the_server_goes_on(server):
    def chunks():
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(40):  # 40 MB, no Content-Length: sent chunked
            yield b"a" * (1 << 20)
        yield b'"}'

    response = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        timeout=60,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert response.status_code == 413, response.text
    assert post(server, greedy("Hi", 2)).status_code == 200


def test_bodies_past_the_shared_budget_get_503_until_room_returns():
    """Many large uploads at once: the one that would pass the bytes held in total is
    refused with 503 and Retry-After, and a later one is served once room returns. A
    body the app has taken holds no room, however long its answer takes."""
    answered = asyncio.Event()
    taken = []

    async def app(scope, receive, send):  # holds each request until `answered` is set
        taken.append(len((await receive())["body"]))
        await answered.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = WholeBody(app, max_bytes=1000, max_total_bytes=1000)

    async def request(body: bytes, rest_sent: asyncio.Event | None = None) -> list[dict]:
        sent, chunks = [], [body[:300], body[300:]]

        async def receive():
            if len(chunks) == 1 and rest_sent is not None:
                await rest_sent.wait()  # a slow upload
            chunk = chunks.pop(0) if chunks else None
            if chunk is None:
                await asyncio.sleep(3600)  # the client waits for its answer
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        await middleware({"type": "http", "headers": []}, receive, send)
        return sent

    async def scenario():
        rest_sent = asyncio.Event()
        first = asyncio.create_task(request(b"a" * 900, rest_sent))
        await asyncio.sleep(0.05)
        assert middleware.held_bytes == 300  # its first part, still uploading
        refused = await request(b"b" * 800)
        rest_sent.set()
        await asyncio.sleep(0.05)
        assert taken == [900] and middleware.held_bytes == 0  # taken, not yet answered
        second = asyncio.create_task(request(b"c" * 900))
        await asyncio.sleep(0.05)
        assert taken == [900, 900]
        answered.set()
        return refused, await first, await second

    refused, first, second = asyncio.run(scenario())
    assert refused[0]["status"] == 503
    headers = dict(refused[0]["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert json.loads(refused[1]["body"])["error"]["type"] == "server_error"
    assert first[0]["status"] == second[0]["status"] == 200 and middleware.held_bytes == 0


def test_a_huge_prompt_is_refused_after_a_bounded_read_and_a_huge_body_before_any(server):
    """--max-model-len 1024: the body limit is 1 MiB; a text near it is refused as too long
    from its first 16k characters, a chat's too, and a body past it gets 413 unread."""
    response = post(server, {"model": MODEL, "prompt": "the quick brown fox " * 50_000})
    assert response.status_code == 400 and "maximum model length" in response.text
    assert response.json()["error"]["param"] == "prompt"
    messages = [{"role": "user", "content": "fox " * 250_000}]
    chat = post(server, {"model": MODEL, "messages": messages}, "chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert post(server, {"model": MODEL, "prompt": "the quick brown fox " * 60_000}).status_code == 413
    ids = post(server, {"model": MODEL, "prompt": [[1] * 1024, [-1] * 2000]})  # the long one's ids never read
    assert ids.status_code == 400 and "the prompt is 2000 tokens, more than the maximum model length" in ids.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [[1]] * 150_000, "max_tokens": 2},  # a batch of prompts, counted before any is read
        {"prompt": "Hi", "max_tokens": 2, "n": 200_000_000},
        {"prompt": "Hi", "max_tokens": 2, "n": 10**20},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 10**20},
    ],
)
def test_more_completions_than_the_server_holds_are_refused_before_reading_prompts(server, body):
    route = "chat/completions" if "messages" in body else "completions"
    response = post(server, {"model": MODEL, **body}, route)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n" and "split the request" in response.text


@pytest.mark.parametrize(
    "raw, param",
    [
        (json.dumps({"model": MODEL, "prompt": [1.5] * 200_000}).encode(), "prompt"),  # stops at the first
        (json.dumps({"model": MODEL, "prompt": "Hi", "stop_token_ids": [0.5] * 200_000}).encode(), "stop_token_ids[0]"),
        (b'{"model": "smollm2-135m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # past Python's depth
    ],
)
def test_bodies_of_many_bad_items_or_deep_nesting_get_400(server, raw, param):
    response = post(server, raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_queued_stream_whose_client_leaves_is_aborted_before_it_runs(server):
    """Four long requests fill --max-num-seqs 4; a streamed one waits behind them, and its
    client leaves: it leaves the queue then, not once the others are done."""
    aborted = {"finished_reason": "abort"}
    before = counter(server, "specserve:request_success_total", aborted)
    fillers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        for conn in fillers:
            send_raw(conn, greedy("Once upon a time", 900))
        wait_until(lambda: counter(server, "specserve:num_requests_running") == 4, "the fillers did not start")
        with socket.create_connection(("127.0.0.1", server.port)) as queued:
            send_raw(queued, greedy("Hello", 20, stream=True))
            wait_until(lambda: counter(server, "specserve:num_requests_waiting") == 1, "the stream did not queue")
        wait_until(
            lambda: (
                counter(server, "specserve:num_requests_waiting") == 0
                and counter(server, "specserve:request_success_total", aborted) == before + 1
            ),
            "the queued stream stayed in the queue",
        )
        assert counter(server, "specserve:num_requests_running") == 4  # the fillers run on
    finally:
        for conn in fillers:
            conn.close()
    wait_until(lambda: counter(server, "specserve:num_requests_running") == 0, "the fillers were not aborted")


def send_raw(conn: socket.socket, body: dict) -> None:
    raw = json.dumps(body).encode()
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Authorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Length: "
        + str(len(raw)).encode()
        + b"\r\n\r\n"
        + raw
    )


def test_a_disconnected_non_streamed_request_is_aborted(server):
    aborted = {"finished_reason": "abort"}
    before = counter(server, "specserve:request_success_total", aborted)
    body = json.dumps(greedy("Once upon a time", 1000)).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        wait_until(lambda: counter(server, "specserve:num_requests_running") == 1, "the request did not start")
    wait_until(
        lambda: counter(server, "specserve:request_success_total", aborted) == before + 1,
        "the abandoned request was not aborted",
    )
    assert counter(server, "specserve:num_requests_running") == 0


def test_silent_and_slow_connections_are_closed(server):
    """--header-timeout 1: a socket that sends nothing, or half a head, is closed; one
    whose body stalls gets 408 after --body-timeout 2."""

    def closed_within(conn: socket.socket, seconds: float) -> bytes:
        conn.settimeout(seconds)
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
        return data  # the server closed it

    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        assert closed_within(idle, 10) == b""
    with socket.create_connection(("127.0.0.1", server.port)) as partial:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert closed_within(partial, 10) == b""
    with socket.create_connection(("127.0.0.1", server.port)) as stalled:
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        reply = closed_within(stalled, 15).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
    assert post(server, greedy("Hi", 2)).status_code == 200


class StandInTransport(asyncio.Transport):
    """A connection's transport whose write buffer the test fills and empties."""

    def __init__(self):
        super().__init__()
        self.buffered, self.aborted = 0, False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def test_a_client_that_takes_none_of_its_response_in_the_send_timeout_is_dropped(caplog):
    """While uvicorn waits to write more (the transport's buffer full), a client that
    takes some of it within --send-timeout gets another; one that takes none has its
    connection aborted, which ends its request as a client gone does. Writing resumed
    (the buffer drained) ends the wait. Timers fire in order, so the sleeps only order."""

    async def run() -> tuple[StandInTransport, StandInTransport]:
        config = Config(app=lambda scope, receive, send: None)
        config.load()
        protocol_class = TimedH11Protocol.with_timeouts(head_s=60, send_s=0.2)
        stalled, drained = StandInTransport(), StandInTransport()
        for transport in (stalled, drained):
            protocol = protocol_class(config, ServerState(), {})
            protocol.connection_made(transport)
            transport.buffered = 100_000
            protocol.pause_writing()
        await asyncio.sleep(0.1)
        stalled.buffered = 90_000  # it took some: a new deadline at 0.4 s
        protocol.resume_writing()  # the other's buffer drained
        await asyncio.sleep(0.2)
        assert not stalled.aborted
        await asyncio.sleep(0.4)
        return stalled, drained

    stalled, drained = asyncio.run(run())
    assert stalled.aborted and not drained.aborted
    assert caplog.text.count("took none of its response for 0.2 s (--send-timeout)") == 1


def test_queue_full_answers_429_with_retry_after(server):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as http:
            return await asyncio.gather(
                *(http.post("/v1/completions", json=greedy("Once upon", 40)) for _ in range(20))
            )

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in responses)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)


# ----- streaming one event per token -----


def test_token_stream_mode_sends_one_event_per_token(prepared_cache):
    server = ServerProcess(MODEL, "--speculative-config", SPEC, "--stream-mode", "token")
    try:
        body = greedy("1, 2, 3, 4, 5, 6,", 40, stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
        tokens = [e for e in events if e["choices"]]
        assert len(tokens) == usage["completion_tokens"] == 40
        assert events[-1 - 1]["choices"][0]["finish_reason"] == "length"
        whole = httpx.post(server.url + "/v1/completions", json=greedy("1, 2, 3, 4, 5, 6,", 40), timeout=120).json()
        assert "".join(e["choices"][0]["text"] for e in tokens) == whole["choices"][0]["text"]
        assert whole["spec_decode"]["num_accepted_tokens"] > 0  # several tokens a step, still one event each
    finally:
        server.stop()


# ----- memory -----


def test_requests_outgrowing_the_kv_cache_space_are_preempted_and_answer_as_alone(prepared_cache):
    """Three long answers at once in room for one: the latest are preempted and recomputed,
    and each answers as it does alone; the server's memory for caches stays bounded."""
    positions = 900  # one answer of up to 512 positions of storage, not three
    per_position = 2 * 30 * 3 * 64 * 4  # smollm2-135m's keys and values, float32
    space = f"{positions * per_position / 2**30:.6f}"
    server = ServerProcess(MODEL, "--max-model-len", "400", "--kv-cache-space", space)
    try:
        prompts = ["Once upon a time", "The history of Rome", "def parse(text):"]

        async def all_at_once() -> list[str]:
            async with httpx.AsyncClient(timeout=300) as client:
                replies = await asyncio.gather(
                    *(client.post(server.url + "/v1/completions", json=greedy(p, 300)) for p in prompts)
                )
            return [r.json()["choices"][0]["text"] for r in replies]

        together = asyncio.run(all_at_once())
        assert counter(server, "specserve:num_preemptions_total") > 0
        held = re.search(r"KV cache (\d+) positions", server.log())
        assert held and abs(int(held.group(1)) - positions) <= 1
        alone = [
            httpx.post(server.url + "/v1/completions", json=greedy(p, 300), timeout=300).json()["choices"][0]["text"]
            for p in prompts
        ]
        assert together == alone
        assert counter(server, "specserve:num_requests_running") == 0
    finally:
        server.stop()


# ----- draining -----


def test_draining_answers_503_while_requests_in_flight_finish(prepared_cache):
    """The answer in flight is long enough (seconds) for the probes to reach the draining
    server before it finishes; the probes wait for the signal to land, not a fixed time."""
    server = ServerProcess(MODEL, "--shutdown-grace", "60")
    try:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=greedy("Once", 600, stream=True), timeout=120
        ) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.terminate()
            deadline = time.monotonic() + 30
            while httpx.get(server.url + "/health", timeout=30).status_code == 200:
                assert time.monotonic() < deadline, "the server never began draining"
                time.sleep(0.05)
            assert httpx.get(server.url + "/health", timeout=30).status_code == 503
            refused = httpx.post(server.url + "/v1/completions", json=greedy("Hi", 2), timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length", rest[-1]  # finished, not cut off
        assert server.process.wait(60) in (0, -15)
    finally:
        server.stop()
