"""Adaptive k judged on recorded text (benchmarks/adaptive_replay.py): the int4 pair's
draft/target agreement on every suite prompt, replayed through the real policy under
the recorded step costs and under dearer drafts. Deterministic, so these are checks of
the policy's decisions, not timings: it must never run measurably slower than plain
decoding, and where drafting pays it must come close to the best fixed k."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.adaptive_replay import (
    FIXED_KS,
    Costs,
    Trace,
    geomean,
    load_traces,
    machine_costs,
    replay,
    score,
    speedups,
    suite_names,
)
from benchmarks.adaptive_replay import TRACES as ZEN4_FILE

# The pair's costs on two machines' kernels as they stood when each set was recorded
# (benchmarks/README.md, "adaptive_replay.py", lists them): a Zen 4 whose costs are lines
# (a draft position ~0.39 of a plain step, a verified row ~0.22), and Zen 5 sets, the
# later ones with each row count's own forward time (9-16 rows a second pass of
# arithmetic).
TRACE_FILES = {
    "zen4": ZEN4_FILE,
    "zen5": ZEN4_FILE.with_name("adaptive_traces_zen5.json"),
    "zen5-tiles": ZEN4_FILE.with_name("adaptive_traces_zen5_tiles.json"),
    "zen5-huge-pages": ZEN4_FILE.with_name("adaptive_traces_zen5_hp.json"),
    "zen5-chains": ZEN4_FILE.with_name("adaptive_traces_zen5_chains.json"),
}
TRACE_SETS = {name: load_traces(path) for name, path in TRACE_FILES.items()}
COSTS, TRACES = TRACE_SETS["zen4"]
H200_COSTS = ZEN4_FILE.with_name("costs_h200.json")


def suite_speedups(costs: Costs, k: int | None, warm: bool = True, traces: list[Trace] = TRACES) -> dict[str, float]:
    table = speedups(traces, costs, [k], warm=warm)
    return {suite: geomean([table[name][k] for name in names]) for suite, names in suite_names(traces).items()}


@pytest.mark.parametrize("machine", TRACE_SETS)
def test_the_traces_cover_both_suites(machine):
    _, traces = TRACE_SETS[machine]
    assert sorted({t.suite for t in traces}) == ["open-ended", "structured"]
    assert all(len(t.match) == len(t.confidence) > 40 for t in traces)


@pytest.mark.parametrize("machine", TRACE_SETS)
@pytest.mark.parametrize("warm", [True, False], ids=["serving", "new-engine"])
def test_where_drafting_pays_adaptive_comes_close_to_the_best_fixed_k(warm, machine):
    costs, traces = TRACE_SETS[machine]
    adaptive = suite_speedups(costs, None, warm, traces)
    for suite, speed in adaptive.items():
        best_fixed = max(suite_speedups(costs, k, traces=traces)[suite] for k in FIXED_KS)
        assert speed >= 0.98, (suite, adaptive)
        assert speed >= 0.9 * best_fixed, (suite, speed, best_fixed)


# Draft costs times these where drafting starts to lose, and where it loses outright
# (k = 3 loses 10% or more on both suites): on the Zen 4 traces 1.5x loses ~9% on
# open-ended text at any fixed k, 2-3x 11-35%; the Zen 5's draft is cheaper.
DEARER = [
    ("zen4", 1.5),
    ("zen4", 2.0),
    ("zen4", 3.0),
    ("zen5", 1.5),
    ("zen5", 2.5),
    ("zen5", 3.0),
    ("zen5-tiles", 1.5),
    ("zen5-tiles", 2.5),
    ("zen5-tiles", 3.0),
    ("zen5-huge-pages", 1.5),
    ("zen5-huge-pages", 2.5),
    ("zen5-huge-pages", 3.0),
]
# Known gaps, where drafting is near break-even on open-ended text (a 1.5x dearer draft):
# a new sequence's first drafting on the prior, and the few exploring steps after it, cost
# up to 7% there, and a memory of ~20 steps (ACCEPTANCE_DECAY) ends a losing run later;
# these cells give 0.929-0.949x plain (a new engine on the tiles traces at 2x, 0.943x, is
# not in DEARER). benchmarks/EXPERIMENTS.md: "The replay prices as the engine does",
# "PRIOR_RATE and MIN_SPEEDUP near break-even", "Plain decoding measured, not priced from
# the drafting steps".
NEAR_BREAK_EVEN = {
    ("zen5-tiles", 1.5, True): 0.94,
    ("zen5-tiles", 1.5, False): 0.94,
    ("zen4", 1.5, False): 0.92,
    ("zen5", 1.5, False): 0.94,
    ("zen4", 1.5, True): 0.94,
    ("zen5", 1.5, True): 0.93,
    ("zen5-huge-pages", 1.5, True): 0.92,
    ("zen5-huge-pages", 1.5, False): 0.94,
}


@pytest.mark.parametrize(("machine", "scale"), DEARER)
@pytest.mark.parametrize("warm", [True, False], ids=["serving", "new-engine"])
def test_where_drafting_does_not_pay_adaptive_stays_near_plain(scale, warm, machine):
    """A dearer draft: adaptive pays only for what it must learn."""
    costs, traces = TRACE_SETS[machine]
    costs = costs.with_dearer_draft(scale)
    adaptive = suite_speedups(costs, None, warm, traces)
    floor = NEAR_BREAK_EVEN.get((machine, scale, warm), 0.95)
    assert all(speed >= floor for speed in adaptive.values()), adaptive
    if scale >= 2:
        assert all(speed >= 0.98 for speed in adaptive.values()), adaptive
        assert max(suite_speedups(costs, 3, traces=traces).values()) < 0.9  # a scenario where drafting loses


HEAD_TRACES = {
    method: load_traces(ZEN4_FILE.with_name(f"head_traces_{method}.json")) for method in ("eagle3", "medusa")
}


@pytest.mark.parametrize("method", HEAD_TRACES)
@pytest.mark.parametrize("warm", [True, False], ids=["serving", "new-engine"])
def test_with_a_head_adaptive_is_never_slower_than_plain_on_any_prompt(method, warm):
    """The catalogue's heads, chain by chain: a head position costs 0.04 of a plain step,
    so a verified row is what drafting pays; where its guesses are right too seldom
    (`repeat` without lookups, every fixed k 0.85-0.89x), adaptive decodes plainly."""
    costs, traces = HEAD_TRACES[method]
    table = speedups(traces, costs, [None], warm=warm)
    assert min(row[None] for row in table.values()) >= 0.98, table
    assert geomean([table[t.name][None] for t in traces if t.suite == "structured"]) > 1.1


@pytest.mark.parametrize("warm", [True, False], ids=["serving", "new-engine"])
def test_with_a_head_no_better_than_chance_adaptive_stays_near_plain(warm):
    """A random head of `train-head`'s shape (`--head eagle3:random`): its first guesses
    are too unsure to pay for a row, so each drafting step drops them, yet costs a head
    step. Such a run is held to the bar of a new one, so it ends; before, a serving
    engine stayed in it at 0.93-0.94x plain on five of the seven prompts."""
    costs, traces = load_traces(ZEN4_FILE.with_name("head_traces_eagle3_random.json"))
    table = speedups(traces, costs, [None], warm=warm)
    assert min(row[None] for row in table.values()) >= 0.965, table
    assert geomean([row[None] for row in table.values()]) >= 0.98, table


def test_replay_counts_every_token_once():
    trace = TRACES[0]
    for k in (None, 0, 1, 7):
        outcome = replay(trace, COSTS, k)
        assert outcome.tokens == len(trace.match) - 1
        assert outcome.accepted <= outcome.drafted
    plain = replay(trace, COSTS, 0)
    assert plain.seconds == pytest.approx(plain.tokens * COSTS.plain_step())


def test_the_score_judges_every_scale_suite_and_engine_against_hindsight():
    total, cells = score([TRACE_FILES["zen5-huge-pages"]], scales=(1.0, 3.0))
    assert len(cells) == 2 * 2 * 2  # scales x suites x serving or new engine
    assert [cell.ratio for cell in cells] == sorted(cell.ratio for cell in cells)
    assert total == pytest.approx(geomean([cell.ratio for cell in cells]))
    assert {cell.traces for cell in cells} == {"zen5_hp"}
    # At 3x every fixed k loses: plain is the best choice, and adaptive stays at it.
    assert all(cell.ratio == pytest.approx(1.0, abs=0.02) for cell in cells if cell.scale == 3.0)
    assert all(0.85 < cell.ratio <= 1.0 for cell in cells if cell.scale == 1.0)


def test_recording_gives_traces_and_costs_the_replay_reads(prepared_cache, tmp_path):
    """--record on the test model (a few tokens a prompt): every suite prompt's trace,
    each row count's forward measured, and the line through them for counts past those."""
    import json

    from benchmarks.adaptive_replay import record

    path = tmp_path / "traces.json"
    path.write_text(json.dumps(record("smollm2-135m", "smollm2-135m", "none", max_tokens=4)))
    costs, traces = load_traces(path)
    assert sorted(t.name for t in traces) == sorted(name for names in suite_names(traces).values() for name in names)
    assert len(traces) >= 7 and all(0 < len(t.match) == len(t.confidence) <= 4 for t in traces)
    assert sorted(map(int, costs.target_by_rows)) == list(range(1, 17))
    assert costs.target_per_row >= 0 and costs.forward(1) > 0 and costs.forward(64) > 0
    assert costs.draft_per_position >= 0
    replay(traces[0], costs, None)  # the replay runs on what was recorded


def test_a_random_head_is_written_in_train_heads_shape_and_records(prepared_cache, tmp_path):
    import json

    from benchmarks.adaptive_replay import record, write_random_head
    from specserve.train.run import TrainHeadSettings

    folder = write_random_head("eagle3", "smollm2-135m", tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    defaults = TrainHeadSettings("smollm2-135m")
    assert (config["draft_vocab_size"], config["intermediate_size"]) == (
        defaults.draft_vocab_size,
        defaults.head_intermediate_size,
    )
    recorded = record("smollm2-135m", "", "none", max_tokens=4, head="eagle3:random")
    assert len(recorded["traces"]) >= 7 and recorded["pair"]["draft"] == "eagle3:random"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_a_recorded_head_chain_is_the_chain_its_proposer_drafts(method):
    """Every draft the engine's proposer makes, after the target's own tokens, is the
    chain `chain_guesses` recorded at that output position."""
    import torch

    from benchmarks.adaptive_replay import chain_guesses, head_chains
    from specserve.engine.engine import Engine
    from tests.head_models import permutation_target, right_head
    from tests.spec.test_head_proposers import EOS, GREEDY, proposer_of

    target, perm = permutation_target(noise=0.18)
    prompt, depth = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3
    output = Engine(target, eos_token_ids=[EOS]).generate(prompt, GREEDY).output_ids
    proposer = proposer_of(right_head(method, target, perm), target)
    guesses, _ = chain_guesses(proposer, target, prompt, output, depth)
    drafted = []  # (output position, the draft's tokens)
    propose = proposer.propose

    def recording(seqs, num_tokens, least_chances=None):
        drafts = propose(seqs, num_tokens, least_chances)
        drafted.extend((len(s.token_ids) - len(prompt), d.tokens.tolist()) for s, d in zip(seqs, drafts))
        return drafts

    proposer.propose = recording
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=depth)
    assert engine.generate(prompt, GREEDY).output_ids == output
    assert len(drafted) > 3 and all(tokens == guesses[i][: len(tokens)] for i, tokens in drafted if tokens)
    assert any(tokens != output[i : i + len(tokens)] for i, tokens in drafted)  # rejections happened
    fields = head_chains(proposer, target, prompt, output, depth)
    assert fields["chain"][: len(output)] == [
        next((d for d, (g, t) in enumerate(zip(chain, output[i:])) if g != t), min(depth, len(output) - i))
        for i, chain in enumerate(guesses)
    ]
    assert fields["match"] == [chain[0] == token for chain, token in zip(guesses, output)]
    assert torch.tensor(fields["chain_confidence"]).shape == (len(output), depth)


def test_a_head_trace_drafts_its_chain_and_accepts_its_run_of_matches():
    trace = Trace(
        "t", "structured", 5, match=[True] * 4, confidence=[0.9] * 4,
        chain=[0, 3, 1, 0], chain_confidence=[[0.9, 0.9, 0.9], [0.9, 0.2, 0.9], [0.9, 0.9, 0.9], [0.9, 0.9, 0.9]],
    )  # fmt: skip
    assert trace.drafted_and_accepted(0, 3, threshold=0.5) == (3, 0, 0)  # the first guess misses
    assert trace.drafted_and_accepted(1, 3, threshold=0.5) == (2, 2, 0)  # an unsure second guess is the last
    assert trace.drafted_and_accepted(2, 2, threshold=0.5) == (2, 1, 0)
    assert trace.drafted_and_accepted(3, 5, threshold=0.5) == (3, 0, 0)  # at most the recorded depth
    assert trace.drafted_and_accepted(4, 2, threshold=0.5) == (2, 0, 0)  # past the answer's end: guesses on
    # A first guess less sure than the least chance is dropped, and nothing drafted.
    assert trace.drafted_and_accepted(1, 3, threshold=0.5, least_chance=0.95) == (0, 0, 1)
    assert trace.drafted_and_accepted(1, 3, threshold=0.5, least_chance=0.85) == (2, 2, 0)  # later guesses: never


@pytest.mark.parametrize(
    ("traces", "drafting"),
    [
        (ZEN4_FILE.with_name("adaptive_traces_zen5_hp.json"), "draft"),
        *((ZEN4_FILE.with_name(f"head_traces_{m}.json"), m) for m in HEAD_TRACES),
    ],
)
def test_another_machines_costs_price_the_proposer_the_traces_were_recorded_with(traces, drafting):
    """`--costs`: the H200's costs by proposer kind, a draft model's priced as a draft
    model's and each head's as its own; plain decoding there is cheaper than any
    verification (8 tokens a graph), so k = 1 with nothing accepted loses."""
    table = json.loads(H200_COSTS.read_text())
    costs = machine_costs(H200_COSTS, traces)
    assert costs == Costs(**table[drafting])
    assert costs.plain_step() < costs.forward(2)
    trace = dataclasses.replace(
        load_traces(traces)[1][0], match=[False] * 64, confidence=[1.0] * 64, chain=None, chain_confidence=None
    )
    assert replay(trace, costs, 1).seconds > replay(trace, costs, 0).seconds


def test_costs_for_a_proposer_the_file_does_not_price_name_what_it_has(tmp_path):
    only_draft = tmp_path / "costs.json"
    only_draft.write_text(json.dumps({"source": "a test", "draft": json.loads(H200_COSTS.read_text())["draft"]}))
    with pytest.raises(SystemExit, match="prices no 'eagle3' proposer \\(it has draft, source\\)"):
        machine_costs(only_draft, ZEN4_FILE.with_name("head_traces_eagle3.json"))
