"""`specserve bench`'s arithmetic, without a server: per-request figures (tokens never
counted as chunks, TPOT, TTFT, gaps), quantiles and stddev, error frequencies, goodput,
spec-decode figures from two /metrics texts, and the workload's reproducibility."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import numpy as np
import pytest

from specserve.bench.benchmark import result_name
from specserve.bench.client import StreamedResponse
from specserve.bench.runner import arrival_offsets
from specserve.bench.spec_metrics import parse_spec_counters, spec_figures
from specserve.bench.summary import distribution, output_tokens, request_record, summarise, usage_disagrees
from specserve.bench.workload import BenchRequest, Lengths, build_requests, builtin_workload, sample_length
from specserve.errors import ConfigError
from specserve.server.metrics import ServerMetrics
from specserve.spec.stats import SpecStats

REQUEST = BenchRequest(index=3, prompt_name="count", body={}, num_input_tokens=9)


def words(text: str) -> int:
    return len(text.split())


def response(
    chunk_times_s=(0.1, 0.2, 0.3, 0.4),
    end_to_end_s=0.45,
    text="a b c d e f g h i j k l",
    completion_tokens: int | None = 12,
    prompt_tokens: int | None = 7,
    **error,
) -> StreamedResponse:
    return StreamedResponse(
        started_at=100.5,
        chunk_times_s=list(chunk_times_s),
        end_to_end_s=end_to_end_s,
        text=text,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        **error,
    )


def record(r: StreamedResponse, count_tokens=None) -> dict:
    return request_record(REQUEST, r, test_case="structured", run_started_at=100.0, count_tokens=count_tokens)


# ----- one request -----


def test_tokens_come_from_usage_and_tpot_spreads_over_tokens_not_chunks():
    rec = record(response())
    assert rec["number_output_tokens"] == 12 and rec["num_chunks"] == 4
    assert rec["ttft_s"] == pytest.approx(0.1)
    assert rec["inter_token_latency_s"] == pytest.approx((0.45 - 0.1) / 11)
    assert rec["end_to_end_latency_s"] == pytest.approx(0.45)
    assert rec["request_output_throughput_token_per_s"] == pytest.approx(12 / 0.45)
    assert rec["chunk_gaps_s"] == pytest.approx([0.1, 0.1, 0.1])
    assert rec["number_input_tokens"] == 7 and rec["number_total_tokens"] == 19
    assert rec["start_time_s"] == pytest.approx(0.5)
    assert (rec["request_index"], rec["test_case"], rec["prompt_name"]) == (3, "structured", "count")
    assert rec["error_code"] is None and rec["error_msg"] == ""


def test_without_usage_the_tokenizer_counts_the_text_and_the_prompt():
    rec = record(response(completion_tokens=None, prompt_tokens=None, text="one two three four five"), words)
    assert rec["number_output_tokens"] == 5
    assert rec["inter_token_latency_s"] == pytest.approx((0.45 - 0.1) / 4)
    assert rec["number_input_tokens"] == 9  # counted when the request was built


def test_without_usage_or_tokenizer_the_fix_is_named():
    with pytest.raises(ConfigError, match="--tokenizer"):
        record(response(completion_tokens=None))


def test_one_token_has_no_inter_token_latency_and_no_content_means_ttft_is_the_whole_request():
    single = record(response(chunk_times_s=(0.2,), completion_tokens=1))
    assert single["inter_token_latency_s"] == 0.0 and single["chunk_gaps_s"] == []
    empty = record(response(chunk_times_s=(), completion_tokens=1, text=""))
    assert empty["ttft_s"] == pytest.approx(0.45) and empty["num_chunks"] == 0


def test_a_failed_request_keeps_its_error_and_no_figures():
    rec = record(response(chunk_times_s=(0.1,), error_code=429, error_msg="HTTP 429: queue full"))
    assert rec["error_code"] == 429 and rec["error_msg"] == "HTTP 429: queue full"
    for key in (
        "ttft_s",
        "inter_token_latency_s",
        "end_to_end_latency_s",
        "number_output_tokens",
        "number_input_tokens",
        "number_total_tokens",
        "request_output_throughput_token_per_s",
    ):
        assert rec[key] is None
    assert rec["chunk_gaps_s"] == [] and rec["num_chunks"] == 1


def test_usage_and_tokenizer_disagree_beyond_one_token():
    text = "a b c d e f g h i j"  # 10 words
    assert not usage_disagrees(response(text=text, completion_tokens=10), words)
    assert not usage_disagrees(response(text=text, completion_tokens=11), words)  # an end-of-sequence token
    assert usage_disagrees(response(text=text, completion_tokens=13), words)
    assert not usage_disagrees(response(text=text, completion_tokens=13), None)
    assert not usage_disagrees(response(text=text, completion_tokens=None), words)


def test_streaming_events_fold_into_a_response():
    r = StreamedResponse(started_at=0.0)
    assert not r.take_event('{"choices": [{"delta": {"role": "assistant", "content": ""}}]}', 0.05)
    assert not r.take_event('{"choices": [{"delta": {"content": "one two"}}]}', 0.1)
    assert not r.take_event('{"choices": [{"text": " three"}]}', 0.2)  # the completions API's shape
    assert not r.take_event('{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}', 0.2)
    assert r.take_event("[DONE]", 0.3)
    assert (r.text, r.chunk_times_s, r.prompt_tokens, r.completion_tokens, r.ok) == (
        "one two three",
        [0.1, 0.2],
        4,
        3,
        True,
    )
    thinking = StreamedResponse(started_at=0.0)  # a reasoning parser's stream: both names, one text
    assert not thinking.take_event('{"choices": [{"delta": {"reasoning": "hm", "reasoning_content": "hm"}}]}', 0.1)
    assert not thinking.take_event('{"choices": [{"delta": {"content": "yes"}}]}', 0.3)
    assert (thinking.reasoning, thinking.text, thinking.chunk_times_s) == ("hm", "yes", [0.1, 0.3])
    assert output_tokens(thinking, words) == 2
    assert not usage_disagrees(dataclasses.replace(thinking, completion_tokens=6), words)  # the tags are not sent
    bad = StreamedResponse(started_at=0.0)
    assert bad.take_event('{"error": {"message": "engine died", "code": 500}}', 0.1)
    assert (bad.error_code, bad.error_msg) == (500, "stream error: engine died")
    garbled = StreamedResponse(started_at=0.0)
    assert garbled.take_event("{not json", 0.1) and garbled.error_msg.startswith("bad stream:")


# ----- distributions and the summary -----


def test_distribution_quantiles_interpolate_linearly_and_stddev_is_the_sample_one():
    values = [float(v) for v in range(1, 101)]
    d = distribution("ttft_s", values)
    for q in (25, 50, 75, 90, 95, 99):
        assert d[f"results_ttft_s_quantiles_p{q}"] == pytest.approx(np.percentile(values, q))
    assert d["results_ttft_s_quantiles_p50"] == pytest.approx(50.5)
    assert d["results_ttft_s_quantiles_p99"] == pytest.approx(99.01)
    assert (d["results_ttft_s_mean"], d["results_ttft_s_min"], d["results_ttft_s_max"]) == (50.5, 1.0, 100.0)
    assert d["results_ttft_s_stddev"] == pytest.approx(statistics.stdev(values))
    assert distribution("x", [2.0])["results_x_stddev"] == 0.0
    assert set(distribution("x", []).values()) == {None} and len(distribution("x", [])) == 10


def test_summary_counts_errors_throughput_and_goodput():
    ok_fast = record(response())  # ttft 100 ms, tpot ~32 ms, e2e 450 ms, 12 tokens
    ok_slow = record(response(chunk_times_s=(0.5, 1.0), end_to_end_s=1.5, completion_tokens=6))
    failures = [
        record(response(error_code=429, error_msg="HTTP 429: full")),
        record(response(error_code=429, error_msg="HTTP 429: full")),
        record(response(error_code=500, error_msg="HTTP 500: bug")),
        record(response(error_msg="timeout: the run's --timeout ran out")),
    ]
    records = [ok_fast, ok_slow, *failures]
    s = summarise(records, duration_s=2.0, goodput_slos_ms={"ttft": 200, "tpot": 50})
    assert s["results_num_requests_started"] == 6 and s["results_num_completed_requests"] == 2
    assert s["results_number_errors"] == 4 and s["results_error_rate"] == pytest.approx(4 / 6)
    assert s["results_error_code_frequency"] == {"429": 2, "500": 1, "timeout": 1}
    assert s["results_mean_output_throughput_token_per_s"] == pytest.approx(18 / 2.0)
    assert s["results_num_completed_requests_per_min"] == pytest.approx(60.0)
    assert s["results_number_output_tokens_mean"] == 9.0 and s["results_ttft_s_max"] == pytest.approx(0.5)
    assert s["results_chunk_gap_s_max"] == pytest.approx(0.5) and s["results_chunk_gap_s_min"] == pytest.approx(0.1)
    assert s["results_goodput_requests_per_s"] == pytest.approx(0.5)  # only the fast one meets both SLOs
    assert s["results_goodput_fraction"] == pytest.approx(1 / 6)
    e2e_only = summarise(records, 2.0, {"e2el": 2000})
    assert e2e_only["results_goodput_requests_per_s"] == pytest.approx(1.0)
    plain = summarise(records, 2.0, None)
    assert plain["results_goodput_requests_per_s"] is None and plain["results_goodput_fraction"] is None


def test_summary_of_only_failures_has_null_figures():
    s = summarise([record(response(error_msg="connection error: ConnectError"))], 1.0, None)
    assert s["results_ttft_s_quantiles_p50"] is None and s["results_error_code_frequency"] == {"connection error": 1}
    assert s["results_mean_output_throughput_token_per_s"] == 0.0 and s["results_error_rate"] == 1.0


# ----- spec-decode figures from /metrics -----


def exposition(*steps: tuple[int, int], prefix_swap: str | None = None) -> str:
    metrics = ServerMetrics("m")
    stats = SpecStats()
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
    metrics.speculation(stats)
    text = metrics.exposition().decode()
    return text.replace("specserve:", prefix_swap) if prefix_swap else text


def test_spec_figures_are_the_difference_of_two_scrapes():
    before = exposition((3, 3), (3, 0))
    after = exposition((3, 3), (3, 0), (3, 2), (3, 1), (2, 2), (3, 0))
    f = spec_figures(before, after)
    # since `before`: 4 drafts, 11 drafted, 5 accepted; position 0 accepted 3 times, 1: 2, 2: 0
    assert (
        f["results_spec_num_drafts"],
        f["results_spec_num_draft_tokens"],
        f["results_spec_num_accepted_tokens"],
    ) == (4, 11, 5)
    assert f["results_spec_acceptance_rate"] == pytest.approx(5 / 11)
    assert f["results_spec_mean_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert f["results_spec_accepted_per_position"] == pytest.approx([3 / 4, 2 / 4, 0.0])


def test_spec_figures_read_vllm_names_and_a_missing_before():
    f = spec_figures(None, exposition((4, 4), (4, 1), prefix_swap="vllm:"))
    assert f["results_spec_num_drafts"] == 2 and f["results_spec_mean_acceptance_length"] == pytest.approx(3.5)
    assert f["results_spec_accepted_per_position"] == pytest.approx([1.0, 0.5, 0.5, 0.5])


def test_spec_figures_of_a_plain_server_and_of_an_endpoint_without_counters():
    plain = spec_figures(exposition(), exposition())  # the counters exist at zero
    assert plain["results_spec_num_drafts"] == 0 and plain["results_spec_acceptance_rate"] is None
    assert plain["results_spec_accepted_per_position"] == []
    foreign = spec_figures("# HELP x a counter\n# TYPE x counter\nx_total 3\n", "x_total 4\n")
    assert set(foreign.values()) == {None}
    assert spec_figures(None, None)["results_spec_num_drafts"] is None
    assert parse_spec_counters("<html>not metrics</html>") is None


# ----- workload, arrivals, names -----

LENGTHS = Lengths(mean_input_tokens=550, stddev_input_tokens=150, mean_output_tokens=150, stddev_output_tokens=80)


def test_requests_are_reproducible_balanced_and_sized():
    def build(seed):
        return build_requests(
            builtin_workload("structured"),
            10,
            LENGTHS,
            api="chat",
            model="m",
            sampling_params={"temperature": 0},
            tokenizer=None,
            seed=seed,
        )

    first = build(0)
    assert [r.body for r in first] == [r.body for r in build(0)]
    assert [r.body for r in first] != [r.body for r in build(1)]
    names = [r.prompt_name for r in first]
    assert sorted(names[:4]) == ["code", "count", "numeric", "repeat"] and sorted(names[4:8]) == sorted(names[:4])
    assert all(r.body["max_tokens"] >= 1 and r.body["temperature"] == 0 and r.body["model"] == "m" for r in first)
    assert first[0].body["messages"][0]["role"] == "user" and first[0].num_input_tokens is None
    completions = build_requests(
        builtin_workload("meaning"),
        2,
        LENGTHS,
        api="completions",
        model="m",
        sampling_params={},
        tokenizer=None,
        seed=0,
    )
    assert completions[0].body["prompt"] == "I believe the meaning of life is"


def test_sampled_lengths_are_at_least_one():
    rng = random.Random(0)
    lengths = [sample_length(rng, 3, 10) for _ in range(2000)]
    assert min(lengths) == 1 and max(lengths) > 20
    assert sample_length(rng, 7, 0) == 7


def test_arrivals_are_poisson_at_the_rate_or_all_at_once():
    assert arrival_offsets(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4001, 20.0, random.Random(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.1) and gaps.std() == pytest.approx(1 / 20, rel=0.1)
    assert arrival_offsets(5, 2.0, random.Random(1)) == arrival_offsets(5, 2.0, random.Random(1))


def test_result_names_are_safe_file_names():
    assert result_name("open-ended", "Qwen/Qwen3-32B", 550, 150) == "open-ended_Qwen-Qwen3-32B_550_150"
    assert result_name("my prompts", "a:b c", 1, 2) == "my-prompts_a-b-c_1_2"
