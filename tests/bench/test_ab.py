"""`specserve ab` end to end on smollm2-135m: a plain and a speculative server taking
turns, the same workload against each, then the comparison and its plots; the order of
the turns with stand-in servers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specserve import catalogue, cli
from specserve.bench import ab
from specserve.bench.options import options_from_args
from specserve.cli import build_parser, main
from specserve.errors import ConfigError


def test_ab_benches_both_servers_and_compares(prepared_cache, tmp_path, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    results = tmp_path / "ab"
    stale = results / "baseline" / "old_summary.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # a previous run's file must not mix in
    argv = [
        "ab",
        "smollm2-135m",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--test-case",
        "count,meaning",
        "--max-num-completed-requests",
        "2",
        "--mean-output-tokens",
        "24",
        "--stddev-output-tokens",
        "0",
        "--additional-sampling-params",
        '{"temperature": 0}',
        "--enable-prefix-caching",
        "--shared-prefix-tokens",
        "32",
        "--results-dir",
        str(results),
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert not stale.exists()
    for variant in ("baseline", "speculative"):
        summaries = sorted((results / variant).glob("*_summary.json"))
        assert [json.loads(p.read_text())["test_case"] for p in summaries] == ["count", "meaning"]
        for path in summaries:
            summary = json.loads(path.read_text())
            assert summary["variant"] == variant and summary["results_num_completed_requests"] == 2
            assert summary["results_number_errors"] == 0
            spec_rate = summary["results_spec_acceptance_rate"]
            assert (spec_rate is None) == (variant == "baseline")
            assert summary["results_prefix_cache_hit_rate"] > 0  # both servers were given the flag
    # At temperature 0 both servers generate the same tokens.
    outputs = {
        v: json.loads(next((results / v).glob("count_*_summary.json")).read_text())["results_number_output_tokens_mean"]
        for v in ("baseline", "speculative")
    }
    assert outputs["baseline"] == outputs["speculative"]
    comparison = results / "comparison"
    assert (comparison / "comparison.md").read_text().count("| Output throughput") == 2
    for plot in ("e2e_latency.png", "inter_token_latency.png", "ttft.png"):
        assert (comparison / plot).stat().st_size > 5000
    assert {str(comparison / "comparison.md")} <= set(report["files"])


def test_ab_without_a_model_serves_the_default_target():
    """ab's bench flags once set the model name to None over the positional's default,
    and the first server was started as `specserve serve None`."""
    assert build_parser().parse_args(["ab"]).model == catalogue.DEFAULT_TARGET
    assert build_parser().parse_args(["ab", "smollm2-135m"]).model == "smollm2-135m"


def test_ab_refuses_a_prefix_cache_of_no_space(capsys):
    assert main(["ab", "--enable-prefix-caching", "--prefix-cache-space", "0"]) == 2
    assert "--prefix-cache-space must be > 0 GiB, got 0.0" in capsys.readouterr().err


def test_a_server_that_cannot_start_is_a_one_line_error(tmp_path, capsys):
    assert main(["ab", "no-such-model", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "specserve: error: the server exited during start-up: 'no-such-model' is neither a catalogue model" in err
    assert "Traceback" not in err


class StandIn:
    """A server `ab` starts, and a test case's run against it, recording the order of events."""

    def __init__(self, events: list, variant: str):
        self.events, self.variant, self.url = events, variant, f"http://{variant}"
        events.append(("start", variant))

    def stop(self) -> None:  # as ServerProcess.stop: a second call does nothing
        if ("stop", self.variant) not in self.events:
            self.events.append(("stop", self.variant))


def stand_ins(monkeypatch, events: list, fail_on: tuple | None = None, room: bool = True):
    """ab's servers and benchmark calls replaced by recorders; fail_on: the event that
    raises; room: whether the memory holds both servers."""
    monkeypatch.setattr(ab, "start_server", lambda target, args, variant: StandIn(events, variant))
    monkeypatch.setattr(ab, "report", lambda variant, result: None)
    monkeypatch.setattr(ab, "room_for_another", lambda server: room)
    monkeypatch.setattr(ab.benchmark, "run", lambda options: events.append(("bench", options.url[7:])) or [])
    workloads = [("count", list(range(4))), ("meaning", list(range(4, 8)))]
    monkeypatch.setattr(
        ab.benchmark, "plan", lambda options: ("m", None, [(SimpleNamespace(name=n), r) for n, r in workloads])
    )
    monkeypatch.setattr(ab.benchmark, "check_server", lambda options: "m")
    monkeypatch.setattr(ab.benchmark, "warm_up", lambda options, first, count: events.append(("warm", options.url[7:])))

    class Case:
        def __init__(self, options, workload, model, count_tokens):
            self.variant, self.name = options.url[7:], workload.name

        def send(self, part):
            event = ("send", self.variant, self.name, tuple(part))
            if event == fail_on:
                raise RuntimeError("the bench failed")
            events.append(event)

        def finish(self):
            events.append(("finish", self.variant, self.name))

    monkeypatch.setattr(ab.benchmark, "TestCaseRun", Case)


def options(requests: int = 4, concurrency: int = 1):
    args = build_parser().parse_args(
        ["ab", "--max-num-completed-requests", str(requests), "--num-concurrent-requests", str(concurrency)]
    )
    return options_from_args(args)


def test_both_servers_take_turns_the_first_alternating_by_round(monkeypatch, tmp_path):
    events: list = []
    stand_ins(monkeypatch, events)
    folders = ab.run_ab("t", "{}", [], options(), tmp_path, rounds=2)
    assert folders == [tmp_path / "baseline", tmp_path / "speculative"]
    B, S = "baseline", "speculative"
    assert events == [
        ("start", B),
        ("start", S),
        ("warm", B),
        ("warm", S),
        ("send", B, "count", (0, 1)),
        ("send", S, "count", (0, 1)),
        ("send", S, "count", (2, 3)),
        ("send", B, "count", (2, 3)),
        ("finish", B, "count"),
        ("finish", S, "count"),
        ("send", B, "meaning", (4, 5)),
        ("send", S, "meaning", (4, 5)),
        ("send", S, "meaning", (6, 7)),
        ("send", B, "meaning", (6, 7)),
        ("finish", B, "meaning"),
        ("finish", S, "meaning"),
        ("stop", B),
        ("stop", S),
    ]


def test_a_failed_turn_stops_both_servers(monkeypatch, tmp_path):
    events: list = []
    stand_ins(monkeypatch, events, fail_on=("send", "speculative", "count", (2, 3)))
    with pytest.raises(RuntimeError, match="the bench failed"):
        ab.run_ab("t", "{}", [], options(), tmp_path, rounds=2)
    assert events[-2:] == [("stop", "baseline"), ("stop", "speculative")]


@pytest.mark.parametrize("rounds, room", [(1, True), (2, False)])
def test_one_round_or_too_little_memory_runs_each_server_alone(monkeypatch, tmp_path, rounds, room):
    events: list = []
    stand_ins(monkeypatch, events, room=room)
    ab.run_ab("t", "{}", [], options(), tmp_path, rounds=rounds)
    B, S = "baseline", "speculative"
    assert events == [("start", B), ("bench", B), ("stop", B), ("start", S), ("bench", S), ("stop", S)]


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads Linux's /proc")
def test_a_second_server_needs_room_beside_the_first(monkeypatch):
    """room_for_another reads the first server's resident memory and the free memory."""
    server = SimpleNamespace(process=SimpleNamespace(pid=os.getpid()))
    monkeypatch.setattr(ab, "SECOND_SERVER_SHARE", 0.0)
    assert ab.room_for_another(server)
    monkeypatch.setattr(ab, "SECOND_SERVER_SHARE", 1e9)
    assert not ab.room_for_another(server)


def test_rounds_keep_every_part_at_the_concurrency():
    assert ab.rounds_for(None, 10, 1) == ab.DEFAULT_ROUNDS
    assert ab.rounds_for(None, 10, 4) == 2  # parts of 5: never fewer in flight than asked
    assert ab.rounds_for(None, 3, 4) == 1
    assert ab.rounds_for(3, 12, 4) == 3
    with pytest.raises(ConfigError, match="lower --rounds to 2 or raise --max-num-completed-requests"):
        ab.rounds_for(3, 10, 4)
    with pytest.raises(ConfigError, match="--rounds must be >= 1, got 0"):
        ab.rounds_for(0, 10, 1)


def test_too_many_rounds_are_refused_before_any_server_starts(capsys, tmp_path):
    argv = ["ab", "no-such-model", "--rounds", "5", "--max-num-completed-requests", "4"]
    assert main([*argv, "--results-dir", str(tmp_path)]) == 2
    assert "--rounds 5 splits 4 requests a test case into parts of fewer than" in capsys.readouterr().err
    assert not Path(tmp_path, "baseline").exists()


@pytest.mark.parametrize("device, flags, rounds", [("cpu", [], None), ("cuda", [], 1), ("cuda", ["--rounds", "2"], 2)])
def test_a_gpu_runs_the_servers_one_after_the_other_unless_asked(monkeypatch, tmp_path, device, flags, rounds):
    """Both servers' cache pools would share one GPU's memory, and one that could not fit
    its CUDA graphs would run eagerly unseen."""
    asked = []
    monkeypatch.setattr(cli, "device_of", lambda args: torch.device(device))
    monkeypatch.setattr(ab, "run_ab", lambda *args: asked.append(args[-1]) or [tmp_path, tmp_path])
    monkeypatch.setattr(cli, "print_comparison", lambda *args: 0)
    assert main(["ab", "--results-dir", str(tmp_path), *flags]) == 0
    assert asked == [rounds]
