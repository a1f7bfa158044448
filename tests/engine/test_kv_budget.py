"""A KV cache budget (`kv_cache_positions`): requests join only where they fit, the latest
admitted is preempted where the running ones outgrow it and rejoins by reading its tokens
again, and no output changes: greedy with every proposer, seeded sampling without one.
The caches never hold more than the budget between steps."""

from __future__ import annotations

import pytest

from specserve.engine import build
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model.kv_cache import KVCache
from specserve.model.prefix_cache import PrefixCache
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from tests.engine.test_engine import EOS, UnstorablePrefixCache, perturbed, random_decoder
from tests.head_models import permutation_target, right_head
from tests.spec.test_head_proposers import proposer_of
from tests.test_logprobs import check_prompt_logprobs

MAX_MODEL_LEN = 200  # a sequence takes at most 256 positions of storage (caches double from 128)
BUDGET = 384  # three short sequences, or one grown past 128 positions and one short
PROMPTS = [list(range(10, 40)), [5, 9, 13, 5, 9] * 4, [1, 2, 3, 4] * 6, [77, 78, 79]]


def requests(params: SamplingParams) -> list[tuple[list[int], SamplingParams]]:
    return [(prompt, params) for prompt in PROMPTS]


def run_all(engine: Engine, batch: list[tuple[list[int], SamplingParams]], budget: int | None) -> list[list[int]]:
    """Every request at once; checks after each step that the running caches hold at
    most `budget` positions."""
    seqs = [engine.add_request(prompt, params) for prompt, params in batch]
    while engine.has_unfinished():
        engine.step()
        held = sum(s.cache.capacity for s in engine.running.values())
        assert budget is None or held <= budget, (held, budget)
    return [seq.output_ids for seq in seqs]


def engine_with(proposer_kind: str, budget: int | None, k: int = 3, prefix_cache: PrefixCache | None = None) -> Engine:
    if proposer_kind in ("eagle3", "medusa"):
        target, perm = HEADS_TARGET
        proposer = proposer_of(right_head(proposer_kind, target, perm), target)
    else:
        target = TARGET
        proposer = {
            "none": None,
            "draft": DraftModelProposer(perturbed(target, 0.3, seed=2)) if proposer_kind == "draft" else None,
            "ngram": NgramProposer(1, 3),
        }[proposer_kind]
    return Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=k if proposer is not None else 0,
        max_model_len=MAX_MODEL_LEN,
        prefill_chunk_size=16,
        kv_cache_positions=budget,
        prefix_cache=prefix_cache,
    )


TARGET = random_decoder("qwen2", seed=1)
HEADS_TARGET = permutation_target(noise=0.18)
LONG_GREEDY = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("proposer_kind", ["none", "draft", "ngram", "eagle3", "medusa"])
def test_preempted_requests_rejoin_with_the_output_they_would_have_had(proposer_kind):
    unbounded = run_all(engine_with(proposer_kind, None), requests(LONG_GREEDY), None)
    engine = engine_with(proposer_kind, BUDGET)
    assert run_all(engine, requests(LONG_GREEDY), BUDGET) == unbounded
    assert engine.num_preemptions > 0
    assert not engine.running and not engine.waiting


@pytest.mark.parametrize("proposer_kind", ["none", "ngram"])
def test_a_seeded_request_samples_the_same_tokens_through_a_preemption(proposer_kind):
    """Its next step after rejoining is the one it would have taken: the same drafts
    (an n-gram's come from its tokens), so the same draws of its generator."""
    sampled = SamplingParams(max_tokens=150, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    unbounded = run_all(engine_with(proposer_kind, None), requests(sampled), None)
    engine = engine_with(proposer_kind, BUDGET)
    assert run_all(engine, requests(sampled), BUDGET) == unbounded
    assert engine.num_preemptions > 0


def test_a_preempted_seeded_request_with_a_draft_model_keeps_its_tokens():
    """Preempted as the latest admitted, its draft reads its tokens again when it rejoins,
    drafting less meanwhile: its tokens are still those it has alone (keyed draws)."""
    seeded = SamplingParams(max_tokens=150, temperature=0.9, seed=7, ignore_eos=True)
    batch = [(PROMPTS[0], LONG_GREEDY), (PROMPTS[1], LONG_GREEDY), (PROMPTS[2], seeded)]
    alone = run_all(engine_with("draft", None), batch[2:], None)
    engine = engine_with("draft", BUDGET)
    seqs = [engine.add_request(prompt, params) for prompt, params in batch]
    while engine.has_unfinished():
        engine.step()
    assert seqs[2].num_preemptions > 0
    assert seqs[2].output_ids == alone[0]


def test_a_preempted_request_reloads_its_prefix_and_counts_its_prompt_once():
    cache = PrefixCache(4096)
    engine = engine_with("none", BUDGET, prefix_cache=cache)
    seqs = [engine.add_request(prompt, LONG_GREEDY) for prompt in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    assert engine.num_preemptions > 0
    unbounded = run_all(engine_with("none", None), requests(LONG_GREEDY), None)
    assert [s.output_ids for s in seqs] == unbounded
    assert all(s.num_cached_tokens < s.num_prompt_tokens for s in seqs)


def test_a_requests_preempted_choice_copies_only_the_prompt_from_a_sibling():
    """Two sampled choices of one prompt; one is preempted after 20 tokens and reads its
    tokens again beside the other, still running: it copies the prompt (not its
    sibling's answer) and reads its own tokens. Each gives what it gives alone."""
    choices = [SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True) for i in range(2)]
    alone = [run_all(engine_with("none", None), [(PROMPTS[0], params)], None)[0] for params in choices]
    engine = engine_with("none", None)
    first, second = (engine.add_request(PROMPTS[0], params) for params in choices)
    while len(second.output_ids) < 20:
        engine.step()
    budget = engine._over_budget
    engine._over_budget = lambda joining=None: len(engine.running) > 1  # room for one, once
    engine.step()
    engine._over_budget = budget
    assert second.num_preemptions == 1 and not first.finished
    while engine.has_unfinished():
        engine.step()
    assert [first.output_ids, second.output_ids] == alone


@pytest.mark.parametrize("with_prefix_cache", [False, True])
def test_prompt_logprobs_survive_a_preemption(with_prefix_cache):
    """Preempted requests read their tokens again when they rejoin, or load them: their
    prompt logprobs stay one per prompt token, each the target's."""
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    engine = engine_with("none", BUDGET, prefix_cache=PrefixCache(4096) if with_prefix_cache else None)
    seqs = [engine.add_request(prompt, params) for prompt in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    assert engine.num_preemptions > 0
    for seq in seqs:
        check_prompt_logprobs(TARGET, seq, 2)


def test_a_preempted_request_whose_prefix_cannot_be_stored_rejoins_all_the_same():
    """Storing a preempted request's prefix may run out of memory: it still waits and
    rejoins, and every request gets the output it has without a budget."""
    engine = engine_with("none", BUDGET, prefix_cache=UnstorablePrefixCache(4096))
    assert run_all(engine, requests(LONG_GREEDY), BUDGET) == run_all(
        engine_with("none", None), requests(LONG_GREEDY), None
    )
    assert engine.num_preemptions > 0


def test_the_first_waiting_request_waits_for_room_and_none_jumps_ahead():
    engine = engine_with("none", 256)  # one sequence of up to 256 positions, or two short ones
    first = engine.add_request([i % 90 for i in range(140)], SamplingParams(max_tokens=10, temperature=0.0))
    engine.step()
    long_one = engine.add_request([i % 80 for i in range(130)], SamplingParams(max_tokens=10, temperature=0.0))
    short_one = engine.add_request([5, 6], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    assert list(engine.running) == [first.seq_id]  # the long one does not fit beside it; the short one waits behind
    while not first.finished:
        engine.step()
    engine.step()
    assert list(engine.running) == [long_one.seq_id]  # it takes the whole budget in turn
    while engine.has_unfinished():
        engine.step()
    assert short_one.finish_reason == "length" and long_one.first_token_time < short_one.first_token_time


def test_a_budget_smaller_than_one_longest_sequence_is_refused():
    with pytest.raises(ConfigError, match="raise --kv-cache-space or lower --max-model-len"):
        engine_with("none", 255)
    engine_with("none", 256)  # exactly one


def test_auto_space_bounds_only_where_the_memory_falls_short(monkeypatch):
    fresh = KVCache(TARGET.config, TARGET.dtype, TARGET.device)
    per_position = 1000
    monkeypatch.setattr(build, "available_memory", lambda: 8 * 256 * per_position * 2)  # 8 sequences, at half
    assert build.kv_positions("auto", per_position, fresh, MAX_MODEL_LEN, 8) is None
    monkeypatch.setattr(build, "available_memory", lambda: 3 * 256 * per_position * 2)
    assert build.kv_positions("auto", per_position, fresh, MAX_MODEL_LEN, 8) == 3 * 256
    monkeypatch.setattr(build, "available_memory", lambda: 100 * per_position)  # below one: one anyway
    assert build.kv_positions("auto", per_position, fresh, MAX_MODEL_LEN, 8) == 256
    monkeypatch.setattr(build, "available_memory", lambda: None)
    assert build.kv_positions("auto", per_position, fresh, MAX_MODEL_LEN, 8) is None
    assert build.kv_positions(0.5, 2**20, fresh, MAX_MODEL_LEN, 8) == 512


def test_available_memory_heeds_a_containers_limit(monkeypatch, tmp_path):
    meminfo, limit, usage = tmp_path / "meminfo", tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(build, "MEMINFO", str(meminfo))
    monkeypatch.setattr(build, "CGROUP_MEMORY_FILES", ((str(limit), str(usage)),))
    assert build.available_memory() is None  # nothing to read
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    assert build.available_memory() == 8_000_000 * 1024
    limit.write_text("3000000000\n")
    usage.write_text("1000000000\n")
    assert build.available_memory() == 2_000_000_000  # the container's room is the closer limit
    limit.write_text("max\n")
    assert build.available_memory() == 8_000_000 * 1024


# ----- the "priority" scheduling policy


def test_under_priority_requests_join_by_priority_then_arrival():
    """One slot: the requests finish in the order they join. FCFS takes them as they
    came; "priority" the lowest priority first, ties by arrival."""
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    priorities = [0, 5, -1, 5, 0]

    def finish_order(policy: str) -> list[int]:
        engine = Engine(TARGET, eos_token_ids=[EOS], max_num_seqs=1, scheduling_policy=policy)
        given = priorities if policy == "priority" else [0] * len(priorities)
        seqs = [engine.add_request(PROMPTS[i % 4], short, priority=p) for i, p in enumerate(given)]
        order = []
        while engine.has_unfinished():
            order += [seqs.index(s) for s in engine.step() if s.finished]
        return order

    assert finish_order("fcfs") == [0, 1, 2, 3, 4]
    assert finish_order("priority") == [2, 0, 4, 1, 3]


def test_under_priority_the_lowest_priority_is_preempted_and_outputs_do_not_change():
    """Three that outgrow the budget: under FCFS the latest admitted gives its room up
    first; under "priority" the lowest priority (the highest number), here the first
    admitted, and never the highest. Every output is still its unbounded one."""
    batch = requests(LONG_GREEDY)[:3]
    unbounded = run_all(engine_with("none", None), batch, None)
    for policy, first_preempted in (("fcfs", 2), ("priority", 0)):
        engine = engine_with("none", BUDGET)
        engine.scheduling_policy = policy
        given = [9, 0, 1] if policy == "priority" else [0, 0, 0]
        seqs = [engine.add_request(prompt, params, priority=p) for (prompt, params), p in zip(batch, given)]
        victims: list[int] = []
        enqueue = engine._enqueue

        def recording(seq, preempted: bool = False, enqueue=enqueue, victims=victims, seqs=seqs) -> None:
            if preempted:
                victims.append(seqs.index(seq))
            enqueue(seq, preempted=preempted)

        engine._enqueue = recording
        while engine.has_unfinished():
            engine.step()
        assert victims[0] == first_preempted
        assert policy == "fcfs" or 1 not in victims
        assert [s.output_ids for s in seqs] == unbounded


def test_a_priority_needs_the_priority_policy():
    with pytest.raises(ConfigError, match='needs the "priority" scheduling policy'):
        engine_with("none", None).add_request(PROMPTS[0], LONG_GREEDY, priority=1)
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        Engine(TARGET, eos_token_ids=[EOS], scheduling_policy="lottery")
