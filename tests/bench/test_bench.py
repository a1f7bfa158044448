"""`specserve bench` end to end, through the CLI: against a fake OpenAI server that sends
several tokens per SSE chunk on a known schedule (with usage, without it, failing some
requests, stalling), against a real `specserve serve smollm2-135m` with n-gram
speculation, and every bad input's one-line error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from specserve import cli
from specserve.bench import benchmark
from specserve.bench.benchmark import load_tokenizer
from specserve.bench.local_server import ServerProcess, ServerStartError, free_port
from specserve.bench.options import options_from_args
from specserve.bench.workload import Lengths, build_requests, builtin_workload, shared_prefix, sonnet_prompt

MODEL = "smollm2-135m"
SUMMARY_KEYS = {
    "name",
    "model",
    "test_case",
    "variant",
    "url",
    "mean_input_tokens",
    "stddev_input_tokens",
    "mean_output_tokens",
    "stddev_output_tokens",
    "shared_prefix_tokens",
    "num_concurrent_requests",
    "request_rate",
    "additional_sampling_params",
    "metadata",
    "timestamp",
    "version",
    "parts",
    *(
        f"results_{metric}_{figure}"
        for metric in (
            "ttft_s",
            "inter_token_latency_s",
            "end_to_end_latency_s",
            "request_output_throughput_token_per_s",
            "number_input_tokens",
            "number_output_tokens",
            "chunk_gap_s",
        )
        for figure in (
            "quantiles_p25",
            "quantiles_p50",
            "quantiles_p75",
            "quantiles_p90",
            "quantiles_p95",
            "quantiles_p99",
            "mean",
            "min",
            "max",
            "stddev",
        )
    ),
    "results_num_requests_started",
    "results_num_completed_requests",
    "results_number_errors",
    "results_error_rate",
    "results_error_code_frequency",
    "results_mean_output_throughput_token_per_s",
    "results_num_completed_requests_per_min",
    "results_duration_s",
    "results_goodput_requests_per_s",
    "results_goodput_fraction",
    "results_spec_num_drafts",
    "results_spec_num_draft_tokens",
    "results_spec_num_accepted_tokens",
    "results_spec_acceptance_rate",
    "results_spec_mean_acceptance_length",
    "results_spec_accepted_per_position",
    "results_prefix_cache_hit_rate",
}
RECORD_KEYS = {
    "request_index",
    "test_case",
    "prompt_name",
    "start_time_s",
    "ttft_s",
    "inter_token_latency_s",
    "end_to_end_latency_s",
    "request_output_throughput_token_per_s",
    "number_input_tokens",
    "number_output_tokens",
    "number_total_tokens",
    "number_cached_tokens",
    "num_chunks",
    "chunk_gaps_s",
    "error_code",
    "error_msg",
}


# ----- a fake OpenAI server -----

TOKENS_PER_CHUNK = 3
WORD = " lorem"  # one token of the fake server
FAKE_PROMPT_TOKENS = 7
FAKE_CACHED_TOKENS = 4  # of the prompt, as a server with prefix caching reports them
FAKE_MODELS = ("fake-usage", "fake-no-usage", "fake-flaky", "fake-stall")
RECEIVED: list[dict] = []  # every body the fake server was sent, in order


def fake_openai_app() -> FastAPI:
    """Streams max_tokens words, TOKENS_PER_CHUNK per chunk, 20 ms apart after 50 ms.

    fake-no-usage never sends usage; fake-flaky answers its n-th request (n from 0) with
    429 when n % 5 == 1, 500 when n % 5 == 3 and an in-band error when n % 5 == 4;
    fake-stall stops after its first chunk. No /metrics.
    """
    app = FastAPI()
    counts: dict[str, itertools.count] = defaultdict(itertools.count)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model"} for name in FAKE_MODELS]}

    async def respond(request: Request, chat: bool):
        body = await request.json()
        RECEIVED.append(body)
        model, n = body["model"], next(counts[body["model"]])
        if model == "fake-flaky" and n % 5 in (1, 3):
            status = 429 if n % 5 == 1 else 500
            return JSONResponse(
                {"error": {"message": f"fake failure {status}", "type": "x", "param": None, "code": None}},
                status_code=status,
            )

        def event(piece: str | None, **extra) -> str:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece or ""}
            return "data: " + json.dumps({"choices": [] if piece is None else [choice], **extra}) + "\n\n"

        async def stream():
            await asyncio.sleep(0.05)
            if chat:
                yield event("")  # the role chunk: no content, not the first token
            sent = 0
            while sent < body["max_tokens"]:
                size = min(TOKENS_PER_CHUNK, body["max_tokens"] - sent)
                yield event(WORD * size)
                sent += size
                if model == "fake-flaky" and n % 5 == 4:
                    yield 'data: {"error": {"message": "engine died", "code": "internal"}}\n\n'
                    break
                await asyncio.sleep(30 if model == "fake-stall" else 0.02)
            if model != "fake-no-usage" and body.get("stream_options", {}).get("include_usage"):
                yield event(
                    None,
                    usage={
                        "prompt_tokens": FAKE_PROMPT_TOKENS,
                        "completion_tokens": sent,
                        "total_tokens": FAKE_PROMPT_TOKENS + sent,
                        "prompt_tokens_details": {"cached_tokens": FAKE_CACHED_TOKENS},
                    },
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    return app


@pytest.fixture(scope="module")
def fake_url():
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake_openai_app(), host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def results(folder: Path, test_case: str, model: str, mean_input: int = 550, mean_output: int = 150):
    name = f"{test_case}_{model}_{mean_input}_{mean_output}"
    summary = json.loads((folder / f"{name}_summary.json").read_text())
    records = json.loads((folder / f"{name}_individual_responses.json").read_text())
    return summary, records


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_tokens_and_tpot_are_counted_per_token_not_per_chunk(fake_url, tmp_path, api, capsys):
    assert (
        bench(
            "--url",
            fake_url,
            "--api",
            api,
            "--model",
            "fake-usage",
            "--test-case",
            "count",
            "--mean-output-tokens",
            "12",
            "--stddev-output-tokens",
            "0",
            "--max-num-completed-requests",
            "3",
            "--num-concurrent-requests",
            "2",
            "--results-dir",
            str(tmp_path),
            "--metadata",
            "variant=fake",
        )
        == 0
    )
    summary, records = results(tmp_path, "count", "fake-usage", mean_output=12)
    assert set(summary) >= SUMMARY_KEYS and set(records[0]) == RECORD_KEYS
    assert [r["request_index"] for r in records] == [0, 1, 2] and summary["variant"] == "fake"
    for r in records:
        assert r["error_msg"] == "" and r["number_output_tokens"] == 12 and r["num_chunks"] == 4  # tokens != chunks
        assert r["number_input_tokens"] == FAKE_PROMPT_TOKENS and r["number_total_tokens"] == FAKE_PROMPT_TOKENS + 12
        assert r["number_cached_tokens"] == FAKE_CACHED_TOKENS
        assert len(r["chunk_gaps_s"]) == 3
        assert r["inter_token_latency_s"] == pytest.approx((r["end_to_end_latency_s"] - r["ttft_s"]) / 11)
        assert 0.05 <= r["ttft_s"] < r["end_to_end_latency_s"]
    assert summary["results_number_output_tokens_mean"] == 12
    assert summary["results_prefix_cache_hit_rate"] == pytest.approx(FAKE_CACHED_TOKENS / FAKE_PROMPT_TOKENS)
    assert summary["results_num_completed_requests"] == 3 and summary["results_error_rate"] == 0
    assert summary["results_spec_num_drafts"] is None  # no /metrics there
    assert summary["results_chunk_gap_s_mean"] == pytest.approx(
        np.mean([g for r in records for g in r["chunk_gaps_s"]])
    )
    assert "count: 3/3 requests ok" in capsys.readouterr().out


def test_warm_ups_go_first_one_at_a_time_with_prompts_no_test_case_sends(fake_url, tmp_path):
    RECEIVED.clear()
    sampling = '{"temperature": 0, "top_k": 5}'
    args = ["--url", fake_url, "--model", "fake-usage", "--test-case", "count,meaning", "--mean-output-tokens", "40"]
    args += ["--max-num-completed-requests", "2", "--results-dir", str(tmp_path), "--num-warmups", "2"]
    assert bench(*args, "--additional-sampling-params", sampling) == 0
    warmups, measured = RECEIVED[:2], RECEIVED[2:]
    assert len(measured) == 4 and all(
        body["messages"][0]["content"].startswith("Continue this poem") for body in warmups
    )
    assert not any(body["messages"][0]["content"].startswith("Continue this poem") for body in measured)
    assert all(body["max_tokens"] == 32 and body["temperature"] == 0 and body["top_k"] == 5 for body in warmups)
    for test_case in ("count", "meaning"):
        summary, records = results(tmp_path, test_case, "fake-usage", mean_output=40)
        assert summary["num_warmups"] == 2 and len(records) == 2 and summary["results_num_requests_started"] == 2
    RECEIVED.clear()
    assert bench(*args[:-1], "0") == 0 and len(RECEIVED) == 4


def test_without_usage_the_tokenizer_counts(fake_url, tmp_path, prepared_cache):
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-no-usage",
            "--tokenizer",
            MODEL,
            "--test-case",
            "meaning",
            "--mean-output-tokens",
            "10",
            "--stddev-output-tokens",
            "0",
            "--max-num-completed-requests",
            "2",
            "--results-dir",
            str(tmp_path),
        )
        == 0
    )
    summary, records = results(tmp_path, "meaning", "fake-no-usage", mean_output=10)
    tokenizer = load_tokenizer(MODEL)
    expected_output = len(tokenizer.encode(WORD * 10, add_special_tokens=False))
    expected_input = len(tokenizer.encode_chat([{"role": "user", "content": "I believe the meaning of life is"}]))
    for r in records:
        assert r["number_output_tokens"] == expected_output and r["num_chunks"] == 4
        assert r["number_input_tokens"] == expected_input
    assert summary["results_num_token_count_disagreements"] == 0


def test_without_usage_or_tokenizer_the_run_stops_naming_the_fix(fake_url, tmp_path, capsys):
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-no-usage",
            "--test-case",
            "count",
            "--max-num-completed-requests",
            "2",
            "--results-dir",
            str(tmp_path),
        )
        == 2
    )
    assert "pass --tokenizer" in capsys.readouterr().err.splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_sonnet_without_a_tokenizer_is_refused_before_any_request(fake_url, tmp_path, capsys):
    assert (
        bench("--url", fake_url, "--model", "fake-usage", "--test-case", "count,sonnet", "--results-dir", str(tmp_path))
        == 2
    )
    assert "sonnet test case counts prompt tokens with a tokenizer; pass --tokenizer" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_failed_requests_are_counted_and_the_run_completes(fake_url, tmp_path):
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-flaky",
            "--num-warmups",
            "0",  # its failures follow its count of requests
            "--test-case",
            "count",
            "--mean-output-tokens",
            "6",
            "--stddev-output-tokens",
            "0",
            "--max-num-completed-requests",
            "10",
            "--goodput",
            "e2el:60000",
            "--results-dir",
            str(tmp_path),
        )
        == 0
    )
    summary, records = results(tmp_path, "count", "fake-flaky", mean_output=6)
    assert [r["error_code"] for r in records] == [None, 429, None, 500, None] * 2
    assert [bool(r["error_msg"]) for r in records] == [False, True, False, True, True] * 2
    assert records[1]["error_msg"] == "HTTP 429: fake failure 429"
    assert records[4]["error_msg"] == "stream error: engine died" and records[4]["number_output_tokens"] is None
    assert summary["results_error_code_frequency"] == {"429": 2, "500": 2, "stream error": 2}
    assert summary["results_number_errors"] == 6 and summary["results_error_rate"] == pytest.approx(0.6)
    assert summary["results_num_completed_requests"] == 4 and summary["results_num_requests_started"] == 10
    assert summary["results_number_output_tokens_mean"] == 6
    assert summary["results_goodput_fraction"] == pytest.approx(0.4)


def test_requests_still_running_at_the_timeout_are_errors(fake_url, tmp_path):
    started = time.monotonic()
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-stall",
            "--num-warmups",
            "0",
            "--test-case",
            "count",
            "--timeout",
            "1",
            "--num-concurrent-requests",
            "2",
            "--max-num-completed-requests",
            "5",
            "--results-dir",
            str(tmp_path),
        )
        == 0
    )
    assert time.monotonic() - started < 15
    summary, records = results(tmp_path, "count", "fake-stall")
    assert len(records) == 2  # the other three never started
    assert all(r["error_msg"].startswith("timeout") and r["num_chunks"] == 1 for r in records)
    assert summary["results_error_code_frequency"] == {"timeout": 2}
    assert 1.0 <= summary["results_duration_s"] < 10


def parted_options(url: str, folder: Path, model: str, *extra: str):
    flags = ["--url", url, "--model", model, "--test-case", "count", "--results-dir", str(folder), *extra]
    flags += ["--max-num-completed-requests", "4", "--mean-output-tokens", "6", "--stddev-output-tokens", "0"]
    return options_from_args(cli.build_parser().parse_args(["bench", *flags]))


def test_a_test_case_sent_in_parts_is_one_run_along_its_serving_time(fake_url, tmp_path):
    """`specserve ab` sends a test case in parts, another server's between them: the
    result counts the parts' time alone, and the records keep their order along it."""
    options = parted_options(fake_url, tmp_path, "fake-usage")
    model, count_tokens, [(workload, requests)] = benchmark.plan(options)
    case = benchmark.TestCaseRun(options, workload, model, count_tokens)
    case.send(requests[:2])
    first_part_s = case.duration_s
    time.sleep(1.0)  # another server's part
    case.send(requests[2:])
    result = case.finish()
    summary, records = results(tmp_path, "count", "fake-usage", mean_output=6)
    assert summary == result.summary and summary["parts"] == 2
    assert summary["results_num_completed_requests"] == 4 and summary["results_number_errors"] == 0
    assert first_part_s < summary["results_duration_s"] < 1.0  # the pause is not counted
    starts = [r["start_time_s"] for r in records]
    assert starts == sorted(starts) and starts[2] >= first_part_s > starts[1]
    assert all(r["end_to_end_latency_s"] < 1.0 for r in records)


def test_the_parts_of_a_test_case_share_its_timeout(fake_url, tmp_path):
    options = parted_options(fake_url, tmp_path, "fake-stall", "--timeout", "1", "--num-concurrent-requests", "2")
    model, count_tokens, [(workload, requests)] = benchmark.plan(options)
    case = benchmark.TestCaseRun(options, workload, model, count_tokens)
    case.send(requests[:2])  # stalls until the timeout
    case.send(requests[2:])  # no time left: nothing is sent
    summary = case.finish().summary
    assert summary["results_num_requests_started"] == 2 and summary["parts"] == 1
    assert summary["results_error_code_frequency"] == {"timeout": 2}


# ----- a real server -----


def test_a_server_that_cannot_start_says_why_and_leaves_no_log(monkeypatch):
    made = []
    mkstemp = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: made.append(mkstemp(**kw)) or made[-1])
    with pytest.raises(ServerStartError, match="max-num-seqs") as failed:
        ServerProcess(MODEL, "--max-num-seqs", "zero", startup_timeout_s=60)
    assert "'zero'" in failed.value.log
    assert len(made) == 1 and not Path(made[0][1]).exists()


@pytest.fixture(scope="module")
def ngram_server(prepared_cache):
    server = ServerProcess(
        MODEL,
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "max_speculative_tokens": 5}',
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--log-stats-interval",
        "0",
        "--enable-prefix-caching",
    )
    yield server
    server.stop()
    assert not server.log_path.exists() and "Application startup complete" in server.log()


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.endswith("_total") and not s.labels.keys() - {"model_name"}
    }


def test_against_a_real_speculative_server(ngram_server, tmp_path):
    before = counters(ngram_server.url)
    assert (
        bench(
            "--url",
            ngram_server.url,
            "--model",
            MODEL,
            "--test-case",
            "structured",
            "--mean-output-tokens",
            "16",
            "--stddev-output-tokens",
            "4",
            "--max-num-completed-requests",
            "4",
            "--num-concurrent-requests",
            "2",
            "--additional-sampling-params",
            '{"temperature": 0}',
            "--results-dir",
            str(tmp_path),
            "--json",
            "--num-warmups",
            "0",  # the server's counters here span the whole run
        )
        == 0
    )
    after = counters(ngram_server.url)
    summary, records = results(tmp_path, "structured", MODEL, mean_output=16)
    assert set(summary) >= SUMMARY_KEYS and all(set(r) == RECORD_KEYS for r in records)

    # token counts are the server's own
    assert summary["results_number_errors"] == 0 and summary["results_num_completed_requests"] == 4
    assert (
        sum(r["number_output_tokens"] for r in records)
        == after["specserve:generation_tokens_total"] - before["specserve:generation_tokens_total"]
    )
    assert (
        sum(r["number_input_tokens"] for r in records)
        == after["specserve:prompt_tokens_total"] - before["specserve:prompt_tokens_total"]
    )
    expected = build_requests(
        builtin_workload("structured"),
        4,
        Lengths(550, 150, 16, 4),
        api="chat",
        model=MODEL,
        sampling_params={"temperature": 0},
        tokenizer=load_tokenizer(MODEL),
        seed=0,
    )
    assert [r["number_input_tokens"] for r in records] == [e.num_input_tokens for e in expected]
    assert all(r["number_output_tokens"] <= e.body["max_tokens"] for r, e in zip(records, expected))
    assert summary["results_num_token_count_disagreements"] == 0

    # the summary is the records' summary, and plausible
    ttfts = [r["ttft_s"] for r in records]
    assert summary["results_ttft_s_quantiles_p50"] == pytest.approx(float(np.median(ttfts)))
    assert summary["results_number_output_tokens_mean"] == pytest.approx(
        np.mean([r["number_output_tokens"] for r in records])
    )
    assert (
        0
        < summary["results_ttft_s_min"]
        <= summary["results_end_to_end_latency_s_max"]
        <= summary["results_duration_s"]
    )
    assert summary["results_mean_output_throughput_token_per_s"] > 0
    assert sorted(r["start_time_s"] for r in records) == [r["start_time_s"] for r in records]
    assert sorted(r["prompt_name"] for r in records) == ["code", "count", "numeric", "repeat"]

    # speculation figures from /metrics
    drafts = summary["results_spec_num_drafts"]
    assert drafts == after["specserve:spec_decode_num_drafts_total"] - before["specserve:spec_decode_num_drafts_total"]
    assert drafts > 0 and 0 <= summary["results_spec_acceptance_rate"] <= 1
    assert summary["results_spec_mean_acceptance_length"] == pytest.approx(
        1 + summary["results_spec_num_accepted_tokens"] / drafts
    )
    per_position = summary["results_spec_accepted_per_position"]
    # Adaptive k drafts at most max_speculative_tokens = 5.
    assert 1 <= len(per_position) <= 5 and per_position == sorted(per_position, reverse=True)


def test_sonnet_prompts_have_the_sampled_length(ngram_server, tmp_path):
    tokenizer = load_tokenizer(MODEL)
    rng = random.Random(0)
    for length in (40, 97, 300):
        prompt = sonnet_prompt(rng, length, 16, tokenizer)
        assert prompt.startswith("Randomly stream lines from the following text with 16 output tokens.")
        assert abs(len(tokenizer.encode(prompt, add_special_tokens=False)) - length) <= 1
    assert (
        bench(
            "--url",
            ngram_server.url,
            "--api",
            "completions",
            "--test-case",
            "sonnet",
            "--mean-input-tokens",
            "80",
            "--stddev-input-tokens",
            "10",
            "--mean-output-tokens",
            "4",
            "--stddev-output-tokens",
            "0",
            "--max-num-completed-requests",
            "2",
            "--results-dir",
            str(tmp_path),
        )
        == 0
    )
    summary, records = results(tmp_path, "sonnet", MODEL, mean_input=80, mean_output=4)
    expected = build_requests(
        builtin_workload("sonnet"),
        2,
        Lengths(80, 10, 4, 0),
        api="completions",
        model=MODEL,
        sampling_params={},
        tokenizer=tokenizer,
        seed=0,
    )
    assert [r["number_input_tokens"] for r in records] == [e.num_input_tokens for e in expected]  # usage agrees
    assert all(60 <= r["number_input_tokens"] <= 100 for r in records)


def test_a_shared_prefix_starts_every_prompt_and_the_server_finds_it(ngram_server, tmp_path):
    tokenizer = load_tokenizer(MODEL)
    lengths = Lengths(80, 10, 4, 0, shared_prefix_tokens=64)
    chat = build_requests(
        builtin_workload("structured"),
        4,
        lengths,
        api="chat",
        model=MODEL,
        sampling_params={},
        tokenizer=tokenizer,
        seed=0,
    )
    sonnet = build_requests(
        builtin_workload("sonnet"),
        2,
        lengths,
        api="completions",
        model=MODEL,
        sampling_params={},
        tokenizer=tokenizer,
        seed=0,
    )
    prefix = shared_prefix(64, tokenizer, seed=0)
    assert abs(len(tokenizer.encode(prefix, add_special_tokens=False)) - 64) <= 1
    assert all(r.body["messages"][0]["content"].startswith(prefix) for r in chat)
    assert all(r.body["prompt"].startswith(prefix + "Randomly stream lines") for r in sonnet)
    unprefixed = build_requests(
        builtin_workload("structured"),
        4,
        Lengths(80, 10, 4, 0),
        api="chat",
        model=MODEL,
        sampling_params={},
        tokenizer=tokenizer,
        seed=0,
    )
    assert [r.body["messages"][0]["content"] for r in chat] == [
        prefix + r.body["messages"][0]["content"] for r in unprefixed
    ]  # the same requests otherwise

    # One request at a time: each after the first finds the prefix its predecessors stored.
    assert (
        bench(
            "--url",
            ngram_server.url,
            "--model",
            MODEL,
            "--test-case",
            "structured",
            "--shared-prefix-tokens",
            "64",
            "--mean-output-tokens",
            "4",
            "--stddev-output-tokens",
            "0",
            "--max-num-completed-requests",
            "3",
            "--results-dir",
            str(tmp_path),
        )
        == 0
    )
    summary, records = results(tmp_path, "structured", MODEL, mean_output=4)
    assert summary["shared_prefix_tokens"] == 64
    assert all(r["number_cached_tokens"] >= 48 for r in records[1:])  # whole blocks of 16 tokens
    assert summary["results_prefix_cache_hit_rate"] == pytest.approx(
        sum(r["number_cached_tokens"] for r in records) / sum(r["number_input_tokens"] for r in records)
    )


# ----- bad input: one line naming the fix -----


@pytest.mark.parametrize(
    "args, message",
    [
        (["--test-case", "nope"], "unknown test case 'nope'"),
        (["--prompts-file", "/no/such/prompts.jsonl"], "cannot read --prompts-file /no/such/prompts.jsonl"),
        (["--additional-sampling-params", "{temperature: 0}"], "--additional-sampling-params is not JSON"),
        (["--additional-sampling-params", "[1]"], "must be a JSON object"),
        (["--goodput", "ttft:fast"], "--goodput takes KEY:MILLISECONDS"),
        (["--goodput", "latency:100"], "--goodput takes KEY:MILLISECONDS"),
        (["--metadata", "variant"], "--metadata takes KEY=VALUE pairs"),
        (["--num-concurrent-requests", "0"], "--num-concurrent-requests must be >= 1"),
        (["--shared-prefix-tokens", "-1"], "--shared-prefix-tokens must be >= 0"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--url", "localhost:8000"], "--url must start with http://"),
    ],
)
def test_bad_input_gets_one_line(args, message, capsys):
    assert bench(*args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specserve: error: ") and message in err


def test_a_shared_prefix_without_a_tokenizer_names_the_fix(fake_url, capsys):
    assert bench("--url", fake_url, "--model", "fake-usage", "--shared-prefix-tokens", "8") == 2
    assert "--shared-prefix-tokens counts its tokens with a tokenizer; pass --tokenizer" in capsys.readouterr().err


def test_bad_prompts_files_name_the_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    assert bench("--prompts-file", str(prompts)) == 2
    assert f"{prompts}:2: each line must be" in capsys.readouterr().err
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert bench("--prompts-file", str(prompts), "--api", "completions") == 2
    assert "drop --api completions" in capsys.readouterr().err
    prompts.write_text('{"prompt": "def f(", "suffix": "    return y"}\n')
    assert bench("--prompts-file", str(prompts)) == 2
    assert "only the completions API sends; pass --api completions" in capsys.readouterr().err
    prompts.write_text('{"prompt": "def f(", "suffix": 3}\n')
    assert bench("--prompts-file", str(prompts), "--api", "completions") == 2
    assert '"suffix" must be a text beside "prompt"' in capsys.readouterr().err


def test_a_prompts_files_suffix_is_sent_and_counted_as_the_fim_prompt(tmp_path):
    from specserve.bench.workload import load_prompts_file
    from specserve.tokenizer import FIM_TOKENS
    from tests.server.test_server_tools import scripted_tokenizer

    prompts = tmp_path / "infill.jsonl"
    prompts.write_text('{"prompt": "def f ( x ):", "suffix": "return y", "name": "f"}\n')
    workload = load_prompts_file(prompts, "completions")
    tokenizer = scripted_tokenizer([], others=FIM_TOKENS[0])
    (request,) = build_requests(
        workload, 1, Lengths(1, 0, 8, 0), api="completions", model="m", sampling_params={}, tokenizer=tokenizer, seed=0
    )
    assert (request.body["prompt"], request.body["suffix"]) == ("def f ( x ):", "return y")
    assert request.num_input_tokens == 3 + 5 + 2  # the three FIM tokens around the two texts


def test_an_unreachable_server_is_named(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert bench("--url", url) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot reach the server at {url}" in err and "--url" in err


def test_a_model_the_server_does_not_serve_is_named(fake_url, capsys):
    assert bench("--url", fake_url, "--model", "gpt-9") == 2
    assert "not 'gpt-9'; pass one of those as --model" in capsys.readouterr().err
