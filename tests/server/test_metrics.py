"""Server metrics: the Prometheus exposition (names, labels, per-token inter-token
latency, own registry per server), the periodic StatLogger lines, and the SpecStats
difference the server feeds them with."""

from __future__ import annotations

import logging
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.server import metrics
from specserve.server.metrics import ServerMetrics, StatLogger
from specserve.spec.stats import SpecStats

P = "specserve:"


def samples(server: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels without model_name): value} of the exposition."""
    text = server.exposition().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "tiny-model"
            found[sample.name, frozenset(labels.items())] = sample.value
    return found


def value(server: ServerMetrics, name: str, **labels: str) -> float:
    return samples(server)[P + name, frozenset(labels.items())]


def stats(*steps: tuple[int, int]) -> SpecStats:
    """SpecStats of (num_drafted, num_accepted) steps."""
    result = SpecStats()
    for drafted, accepted in steps:
        result.record(drafted, accepted)
    return result


@pytest.fixture
def server() -> ServerMetrics:
    return ServerMetrics("tiny-model")


# --- ServerMetrics ----------------------------------------------------------------------


def test_every_sample_carries_the_model_name(server):
    server.speculation(stats((2, 1)))
    server.finished("length", 1.0, 3, 4)
    assert samples(server)  # the model_name check is in samples()


def test_speculation_counters_mirror_vllm(server):
    server.speculation(stats((3, 3), (3, 1)))
    server.speculation(stats((2, 0)))
    assert value(server, "spec_decode_num_drafts_total") == 3
    assert value(server, "spec_decode_num_draft_tokens_total") == 8
    assert value(server, "spec_decode_num_accepted_tokens_total") == 4
    per_position = [value(server, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert per_position == [2, 1, 1]


def test_speculation_without_drafts_adds_no_series(server):
    server.speculation(stats((0, 0)))
    assert value(server, "spec_decode_num_drafts_total") == 0
    assert not any("per_pos" in name for name, _ in samples(server))


def test_inter_token_latency_is_observed_once_per_token(server):
    server.tokens(1, gap_s=None)  # the first token: no gap yet
    assert value(server, "inter_token_latency_seconds_count") == 0
    server.tokens(4, gap_s=0.08)  # a speculative step: 4 tokens, 0.02 s each
    assert value(server, "inter_token_latency_seconds_count") == 4
    assert value(server, "inter_token_latency_seconds_sum") == pytest.approx(0.08)
    assert value(server, "inter_token_latency_seconds_bucket", le="0.01") == 0
    assert value(server, "inter_token_latency_seconds_bucket", le="0.02") == 4
    server.tokens(0, gap_s=0.5)  # nothing emitted: nothing observed
    assert value(server, "inter_token_latency_seconds_count") == 4
    assert value(server, "generation_tokens_total") == 5


def test_first_token_and_finish(server):
    server.first_token(0.25, num_prompt_tokens=12)
    server.finished("stop", e2e_s=1.5, num_prompt_tokens=12, num_output_tokens=30)
    assert value(server, "time_to_first_token_seconds_count") == 1
    assert value(server, "time_to_first_token_seconds_sum") == 0.25
    assert value(server, "prompt_tokens_total") == 12
    assert value(server, "e2e_request_latency_seconds_sum") == 1.5
    assert value(server, "request_generation_tokens_sum") == 30
    assert value(server, "request_success_total", finished_reason="stop") == 1
    assert value(server, "request_success_total", finished_reason="length") == 0  # exported before any


def test_queue_gauges(server):
    server.set_queue(running=3, waiting=7)
    server.set_queue(running=2, waiting=5)
    assert (value(server, "num_requests_running"), value(server, "num_requests_waiting")) == (2, 5)


def test_two_servers_have_their_own_registries():
    first, second = ServerMetrics("tiny-model"), ServerMetrics("tiny-model")  # no "Duplicated timeseries"
    first.set_queue(running=1, waiting=0)
    first.speculation(stats((2, 2)))
    assert value(second, "num_requests_running") == 0
    assert value(second, "spec_decode_num_drafts_total") == 0
    assert value(first, "spec_decode_num_drafts_total") == 1


# --- StatLogger -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(monotonic=clock))
    return clock


@pytest.fixture
def caplog(caplog):
    caplog.set_level(logging.INFO, logger="specserve")
    return caplog


def test_stat_logger_waits_for_its_interval(clock, caplog):
    logger = StatLogger(interval_s=10.0)
    logger.count(prompt_tokens=100, generation_tokens=50, spec=None)
    clock.now += 9.0
    logger.maybe_log(running=1, waiting=0)
    assert caplog.messages == []
    clock.now += 1.0
    logger.maybe_log(running=1, waiting=2)
    assert caplog.messages == [
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 1 reqs, Waiting: 2 reqs"
    ]


def test_stat_logger_logs_acceptance(clock, caplog):
    logger = StatLogger(interval_s=5.0)
    logger.count(0, 10, stats((4, 4), (4, 1)))
    logger.count(0, 2, stats((2, 0)))
    clock.now += 5.0
    logger.maybe_log(running=1, waiting=0)
    assert len(caplog.messages) == 2
    assert caplog.messages[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.67, Accepted: 5 tokens, Drafted: 10 tokens, "
        "Per-position acceptance rate: 0.667, 0.333, 0.333, 0.333, Avg Draft acceptance rate: 50.0%"
    )


def test_stat_logger_counts_per_interval(clock, caplog):
    logger = StatLogger(interval_s=1.0)
    logger.count(0, 10, stats((2, 2)))
    clock.now += 1.0
    logger.maybe_log(running=1, waiting=0)
    logger.count(0, 3, None)
    clock.now += 1.0
    logger.maybe_log(running=1, waiting=0)
    assert caplog.messages[-1] == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 3.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs"
    )  # and no second SpecDecoding line
    assert sum(message.startswith("SpecDecoding") for message in caplog.messages) == 1


def test_stat_logger_is_silent_when_idle(clock, caplog):
    logger = StatLogger(interval_s=1.0)
    for _ in range(3):
        clock.now += 5.0
        logger.maybe_log(running=0, waiting=0)
    assert caplog.messages == []


def test_stat_logger_with_no_interval_never_logs(clock, caplog):
    logger = StatLogger(interval_s=0)
    logger.count(5, 5, stats((1, 1)))
    clock.now += 100.0
    logger.maybe_log(running=1, waiting=1)
    assert caplog.messages == []


# --- SpecStats difference and copy ------------------------------------------------------


def test_difference_is_what_was_counted_since_the_copy():
    total = stats((2, 2), (2, 0))
    earlier = total.copy()
    total.record(5, 4)  # a longer draft: per-position list grows from 2 to 5
    total.record(1, 1)
    delta = total - earlier
    assert delta == SpecStats(
        num_drafts=2, num_draft_tokens=6, num_accepted_tokens=5, accepted_per_position=[2, 1, 1, 1, 0]
    )
    assert earlier + delta == total


def test_difference_from_nothing_is_everything():
    total = stats((3, 2))
    assert total - SpecStats() == total


def test_copy_is_independent():
    original = stats((2, 1))
    copy = original.copy()
    copy.record(2, 2)
    assert original == stats((2, 1))
    assert copy.accepted_per_position is not original.accepted_per_position
