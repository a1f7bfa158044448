"""What a web page or a proxy in front of the server meets, in process: CORS as vLLM
serves it (everything allowed unless narrowed), the API key behind a path prefix
(`--root-path`), and /version."""

from __future__ import annotations

import asyncio

import httpx

from specserve import __version__
from tests.server.test_server_tools import scripted_tokenizer, serving

KEY = "page-key"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def sent(
    requests: list[tuple[str, str, dict, dict | None]], root_path: str = "", **settings
) -> list[httpx.Response]:
    """Each (method, path, headers, json) sent in turn to a fresh app with the API key."""
    async with serving(scripted_tokenizer(["a"]), root_path, api_key=KEY, **settings) as client:
        return [await client.request(m, path, headers=h, json=body) for m, path, h, body in requests]


def test_a_web_page_may_call_the_api_by_default_as_vllm_allows():
    """The preflight needs no key; the answers, refused or not, carry the allowing header."""
    page = {"Origin": "https://chat.example.com"}
    preflight, refused, answered = asyncio.run(
        sent(
            [
                ("OPTIONS", "/v1/chat/completions", page | PREFLIGHT, None),
                ("POST", "/v1/chat/completions", page, CHAT),
                ("POST", "/v1/chat/completions", page | {"Authorization": f"Bearer {KEY}"}, CHAT),
            ]
        )
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"


def test_narrowed_origins_allow_those_pages_alone():
    ours, theirs = {"Origin": "https://chat.example.com"}, {"Origin": "https://elsewhere.example"}
    allowed, refused, answered = asyncio.run(
        sent(
            [
                ("OPTIONS", "/v1/chat/completions", ours | PREFLIGHT, None),
                ("OPTIONS", "/v1/chat/completions", theirs | PREFLIGHT, None),
                ("POST", "/v1/chat/completions", theirs | {"Authorization": f"Bearer {KEY}"}, CHAT),
            ],
            allowed_origins=("https://chat.example.com",),
            allow_credentials=True,
        )
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://chat.example.com"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers  # the browser drops it


def test_behind_a_path_prefix_the_key_still_guards_the_api():
    """uvicorn puts --root-path back in front of the forwarded path; the routes and the
    key guard both read the path without it."""
    key = {"Authorization": f"Bearer {KEY}"}
    refused, answered, health, version = asyncio.run(
        sent(
            [
                ("GET", "/llm/v1/models", {}, None),
                ("GET", "/llm/v1/models", key, None),
                ("GET", "/llm/health", {}, None),
                ("GET", "/llm/version", {}, None),
            ],
            root_path="/llm",
        )
    )
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert answered.status_code == 200 and answered.json()["data"][0]["id"] == "tiny"
    assert health.status_code == 200 and version.json() == {"version": __version__}
