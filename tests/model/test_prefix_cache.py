"""Prefix caching (model/prefix_cache.py, `--enable-prefix-caching`): a conversation's
next turn starts from the keys and values its previous turn left, the target's and the
draft's, with the tokens a run without the cache gives and speculation still lossless."""

from __future__ import annotations

import copy

import pytest
import torch

from specserve.cli import main
from specserve.engine.engine import Engine
from specserve.model.decoder import Segment
from specserve.model.kv_cache import bytes_per_position
from specserve.model.prefix_cache import BLOCK, PrefixCache, read_elsewhere, shared_blocks
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import AdaptiveSpecLength
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.fused import FusedDraftProposer
from tests.engine.test_engine import EOS, perturbed, random_decoder
from tests.model.test_native import needs_kernel

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return random_decoder("qwen3", seed=1)


def filled_cache(decoder, token_ids):
    """A cache holding token_ids' keys and values (one prefill)."""
    cache = decoder.new_cache()
    decoder(torch.tensor(token_ids), [Segment(cache, len(token_ids))], torch.empty(0, dtype=torch.int64))
    return cache


# ------------------------------------------------------------------ the store


def test_the_longest_stored_prefix_is_found_in_whole_blocks(target):
    store = PrefixCache(max_tokens=1000)
    tokens = [(7 * i) % 90 for i in range(50)]  # 3 whole blocks and 2 tokens
    store.store(tokens, filled_cache(target, tokens))
    assert store.num_tokens == 3 * BLOCK and len(store) == 3

    prompt = tokens[:40] + [1, 2, 3]  # shares 2 blocks and 8 tokens
    cache = target.new_cache()
    assert store.cached_length(prompt, len(prompt) - 1) == 2 * BLOCK
    assert store.load(prompt, cache, limit=len(prompt) - 1) == 2 * BLOCK == cache.length
    reference = filled_cache(target, prompt)
    assert torch.equal(cache.keys[:, :, : 2 * BLOCK], reference.keys[:, :, : 2 * BLOCK])
    assert torch.equal(cache.values[:, :, : 2 * BLOCK], reference.values[:, :, : 2 * BLOCK])
    assert store.hit_tokens == 2 * BLOCK  # (queries are counted by the engine, once a sequence)

    # The limit holds (a prompt of exactly the stored blocks keeps its last token to feed)...
    assert store.load(tokens[: 3 * BLOCK], target.new_cache(), limit=3 * BLOCK - 1) == 2 * BLOCK
    # ... and a prompt that differs in its first block finds nothing.
    assert store.load([89] + tokens[1:], target.new_cache(), limit=49) == 0


def test_a_cache_that_ends_inside_a_block_is_extended_from_there(target):
    store = PrefixCache(max_tokens=1000)
    tokens = [(7 * i) % 90 for i in range(50)]
    stored = filled_cache(target, tokens)
    store.store(tokens, stored)
    cache = filled_cache(target, tokens[:20])  # read 20 positions itself
    kept = cache.keys[:, :, :20].clone()
    assert store.load(tokens, cache, limit=49) == 3 * BLOCK - 20 and cache.length == 3 * BLOCK
    assert torch.equal(cache.keys[:, :, :20], kept)
    assert torch.equal(cache.keys[:, :, 20 : 3 * BLOCK], stored.keys[:, :, 20 : 3 * BLOCK])
    assert torch.equal(cache.values[:, :, 20 : 3 * BLOCK], stored.values[:, :, 20 : 3 * BLOCK])


def test_turns_and_conversations_share_blocks_and_old_blocks_go_first(target):
    store = PrefixCache(max_tokens=4 * BLOCK)
    turn1 = list(range(2 * BLOCK))
    turn2 = turn1 + list(range(50, 50 + BLOCK))  # the conversation goes on
    store.store(turn1, filled_cache(target, turn1))
    store.store(turn2, filled_cache(target, turn2))
    assert len(store) == 3  # turn 1's blocks are turn 2's first ones
    store.store(turn1, filled_cache(target, turn1))  # held already: nothing new
    assert len(store) == 3

    # 5 blocks > 4: the least recently used goes, which is turn 2's last (turn 1's
    # were used since), never a block that a stored one follows.
    other = [80 - i for i in range(2 * BLOCK)]
    store.store(other, filled_cache(target, other))
    assert len(store) == 4
    assert store.cached_length(turn2 + [1], 3 * BLOCK) == 2 * BLOCK
    assert store.cached_length(other + [1], 2 * BLOCK) == 2 * BLOCK
    # A prefix that is found is used: turn 1's blocks outlast other's now.
    store.load(turn1 + [1], target.new_cache(), 2 * BLOCK)
    store.store(turn2, filled_cache(target, turn2))
    assert store.cached_length(turn2 + [1], 3 * BLOCK) == 3 * BLOCK
    assert store.cached_length(other + [1], 2 * BLOCK) == BLOCK


def test_conversations_with_one_system_prompt_hold_it_once(target):
    store = PrefixCache(max_tokens=1000)
    system = list(range(2 * BLOCK))
    first, second = system + [1] * BLOCK, system + [2] * BLOCK
    store.store(first, filled_cache(target, first))
    store.store(second, filled_cache(target, second))
    assert len(store) == 4  # the system prompt's 2 blocks, and 1 block of each
    assert store.cached_length(first + [0], 3 * BLOCK) == 3 * BLOCK
    assert store.cached_length(second + [0], 3 * BLOCK) == 3 * BLOCK


def test_a_store_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache(max_tokens=BLOCK - 1)


# ------------------------------------------------------------------ the engine


def conversation(engine: Engine, turns: int, params=GREEDY) -> list:
    """Each turn's prompt is the last turn's prompt and answer and a new message; the
    finished sequences."""
    prompt, seqs = [5, 9, 13, 5, 9, 2, 7, 40, 41], []
    for turn in range(turns):
        seq = engine.generate(prompt, params)
        seqs.append(seq)
        prompt = seq.token_ids + [60 + turn, 61, 62 + turn]
    return seqs


def test_a_conversations_turns_start_from_the_last_turns_cache(target):
    expected = [s.output_ids for s in conversation(Engine(target, eos_token_ids=[EOS]), turns=3)]
    store = PrefixCache(max_tokens=10_000)
    seqs = conversation(Engine(target, eos_token_ids=[EOS], prefix_cache=store), turns=3)
    assert [s.output_ids for s in seqs] == expected
    assert seqs[0].num_cached_tokens == 0
    for seq, before in zip(seqs[1:], seqs):  # the last turn's tokens, in whole blocks
        assert seq.num_cached_tokens == (len(before.token_ids) - 1) // BLOCK * BLOCK > 0
    assert store.num_tokens == (len(seqs[-1].token_ids) - 1) // BLOCK * BLOCK  # each turn's blocks begin the next's


@pytest.mark.parametrize("adaptive", [False, True])
def test_speculation_with_prefix_caching_gives_the_plain_tokens(target, adaptive):
    """Plain and speculative engines, each with its stores, on the same conversation:
    the same tokens every turn, and the draft's own store spares it the prompt."""
    plain = conversation(Engine(target, eos_token_ids=[EOS], prefix_cache=PrefixCache(10_000)), turns=3)
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2), catch_up_chunk_size=8)
    proposer.prefix_cache = PrefixCache(10_000)
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=3,
        prefix_cache=PrefixCache(10_000),
        prefill_chunk_size=8,
        adaptive=AdaptiveSpecLength(5, prior_draft_cost_ratio=0.1) if adaptive else None,
    )
    speculative = conversation(engine, turns=3)
    assert [s.output_ids for s in speculative] == [s.output_ids for s in plain]
    assert [s.num_cached_tokens for s in speculative] == [s.num_cached_tokens for s in plain]
    assert sum(s.spec.num_draft_tokens for s in speculative) > 0 and not proposer.caches  # every draft cache freed
    if not adaptive:  # (adaptive k stops drafting on these random models early in turn 1)
        assert proposer.prefix_cache.hit_tokens > 0


def test_sampled_requests_keep_their_seeded_outputs(target):
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    expected = [s.output_ids for s in conversation(Engine(target, eos_token_ids=[EOS]), 2, params)]
    cached = conversation(Engine(target, eos_token_ids=[EOS], prefix_cache=PrefixCache(10_000)), 2, params)
    assert [s.output_ids for s in cached] == expected and cached[1].num_cached_tokens > 0


def test_slots_of_a_pool_are_stored_and_handed_back(target):
    """With a CachePool (the static step of --cuda-graphs), a stored prefix is a copy:
    the slot goes back to the pool, and the next turn's slot is filled from the copy."""
    model = copy.deepcopy(target)
    model.use_cuda_graphs(num_slots=2, capacity=256)
    expected = [s.output_ids for s in conversation(Engine(target, eos_token_ids=[EOS]), turns=2)]
    store = PrefixCache(10_000)
    seqs = conversation(Engine(model, eos_token_ids=[EOS], prefix_cache=store, max_num_seqs=2), turns=2)
    assert [s.output_ids for s in seqs] == expected
    assert seqs[1].num_cached_tokens > 0 and model.static.pool.num_free == 2


def test_a_shared_prompt_is_read_once_by_requests_that_run_together(target):
    """Requests that share a system prompt, added together: the first reads it (prompt
    chunks share one budget per step, so the second waits), the second copies it from
    the first's cache as far as it was read, and nothing is stored until one finishes.
    The tokens are those of runs without the cache."""
    system = [(11 * i) % 89 for i in range(4 * BLOCK)]
    first, second = system + [1, 2], system + [4, 5, 6]  # the shorter prompt's turn comes first
    store = PrefixCache(10_000)
    engine = Engine(target, eos_token_ids=[EOS], prefix_cache=store, prefill_chunk_size=2 * BLOCK)
    a, b = engine.add_request(first, GREEDY), engine.add_request(second, GREEDY)
    engine.step()
    engine.step()  # a has read the system prompt, b nothing yet
    assert (a.cache.length, b.cache.length, store.num_tokens) == (4 * BLOCK, 0, 0)
    engine.step()  # a reads its last 2 tokens; b copies 4 blocks and reads 3 tokens
    assert a.prefilled and b.prefilled and b.num_cached_tokens == 4 * BLOCK
    while engine.has_unfinished():
        engine.step()
    plain = Engine(target, eos_token_ids=[EOS])
    assert [a.output_ids, b.output_ids] == [plain.generate(p, GREEDY).output_ids for p in (first, second)]
    assert a.num_cached_tokens == 0 and store.num_tokens == 4 * BLOCK + 2 * BLOCK  # the system prompt's once
    assert (store.queried_tokens, store.hit_tokens) == (len(first) + len(second), 4 * BLOCK)


def test_a_prompt_mostly_in_the_store_takes_its_turn_by_what_it_reads(target):
    """A chat's next turn, its history in the prefix cache, reads only its new message:
    it goes ahead of a shorter prompt that must be read whole."""
    history = [(7 * i) % 89 for i in range(6 * BLOCK)]
    engine = Engine(target, eos_token_ids=[EOS], prefix_cache=PrefixCache(10_000), prefill_chunk_size=BLOCK)
    engine.generate(history, GREEDY)
    fresh = engine.add_request([(3 * i) % 89 for i in range(2 * BLOCK)], GREEDY)
    next_turn = engine.add_request(history + [5, 6, 7], GREEDY)
    assert engine.step() == [next_turn] and fresh.cache.length == BLOCK - 3  # the rest of the budget
    while engine.has_unfinished():
        engine.step()
    assert next_turn.num_cached_tokens >= 6 * BLOCK - 1


def test_a_prompt_copies_from_a_sequence_still_reading_it_and_then_from_the_store(target):
    """A request arriving while another reads the same long prompt copies what was read
    so far, before each of its chunks, and waits rather than read a block the other reads
    in the same step; a later one finds the finished sequence's entry."""
    prompt = [(5 * i) % 89 for i in range(5 * BLOCK)]
    store = PrefixCache(10_000)
    engine = Engine(target, eos_token_ids=[EOS], prefix_cache=store, prefill_chunk_size=3 * BLOCK)
    a = engine.add_request(prompt, GREEDY)
    engine.step()  # a reads 3 blocks
    b = engine.add_request(prompt + [7], GREEDY)
    # a reads its last 2 blocks; b copies a's 3, and leaves the budget it has for the
    # next block unused, since a reads that block in this step.
    engine.step()
    assert (b.num_cached_tokens, b.cache.length) == (3 * BLOCK, 3 * BLOCK)
    engine.step()  # b copies the 2 blocks a read meanwhile, and reads its last token
    assert b.prefilled and b.num_cached_tokens == 5 * BLOCK
    while engine.has_unfinished():
        engine.step()
    c = engine.generate(prompt + [8], GREEDY)
    assert c.num_cached_tokens == 5 * BLOCK
    plain = Engine(target, eos_token_ids=[EOS])
    assert [s.output_ids for s in (a, b, c)] == [
        plain.generate(s.token_ids[: s.num_prompt_tokens], GREEDY).output_ids for s in (a, b, c)
    ]


def test_the_draft_reads_a_shared_prompt_once(target):
    """Two requests sharing a system prompt through a speculative engine: the draft reads
    it once (the second copies the first's draft cache), for greedy requests and for
    seeded sampling ones, whose outputs stay those they get alone and without speculation."""
    system = [(13 * i) % 89 for i in range(4 * BLOCK)]
    prompts = [system + [1, 2, 3], system + [4, 5]]

    def run(prompts, params):
        proposer = DraftModelProposer(perturbed(target, 0.3, seed=2), catch_up_chunk_size=BLOCK)
        proposer.prefix_cache = PrefixCache(10_000)
        engine = Engine(
            target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, prefix_cache=PrefixCache(10_000)
        )
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs], proposer.prefix_cache.hit_tokens

    greedy, hits = run(prompts, GREEDY)
    assert greedy == [Engine(target, eos_token_ids=[EOS]).generate(p, GREEDY).output_ids for p in prompts]
    assert hits == 4 * BLOCK
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)
    together, hits = run(prompts, seeded)
    assert hits == 4 * BLOCK and together == [run([p], seeded)[0][0] for p in prompts]
    assert together == [Engine(target, eos_token_ids=[EOS]).generate(p, seeded).output_ids for p in prompts]


def tokens_read(engine: Engine) -> list[int]:
    """Wraps the engine's target: a list that gains the tokens each forward reads."""
    read: list[int] = []
    forward = engine.target.forward

    def counted(tokens, *args, **kwargs):
        read.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    engine.target.forward = counted
    return read


@pytest.mark.parametrize("owed", [None, 2], ids=["plain", "prompt-logprobs"])
def test_a_requests_choices_read_their_prompt_once_without_a_prefix_cache(target, owed):
    """n choices of one prompt (no prefix cache): the first reads it, the others wait a
    step and copy its keys and values, and its prompt logprobs where they ask for them,
    reading only their last token; each answers as it would alone. A request with
    another prompt reads its own."""
    prompt = [(7 * i) % 89 for i in range(6 * BLOCK)]
    engine = Engine(copy.deepcopy(target), eos_token_ids=[EOS], prefill_chunk_size=16 * BLOCK)
    read = tokens_read(engine)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, prompt_logprobs=owed) for i in range(4)]
    choices = [engine.add_request(prompt, p) for p in params]
    other = engine.add_request(prompt[:-1] + [3], params[0])
    while engine.has_unfinished():
        engine.step()
    # The first choice's reading and the other's own; then the choices' last tokens
    # beside those two decoding.
    assert read[:2] == [2 * len(prompt), 3 + 2], read
    alone = Engine(target, eos_token_ids=[EOS])
    for seq, p in zip([*choices, other], [*params, params[0]]):
        expected = alone.generate(seq.token_ids[: seq.num_prompt_tokens], p)
        assert seq.output_ids == expected.output_ids and seq.prompt_logprobs == expected.prompt_logprobs
    assert len({tuple(s.output_ids) for s in choices}) > 1  # their own draws
    assert all(s.num_cached_tokens == 0 for s in choices)  # no prefix cache to count


def prompt_positions_read(decoder, prompt_length: int) -> list[int]:
    """Wraps decoder.forward: a list that gains, per call, the positions below
    prompt_length its segments read."""
    read: list[int] = []
    forward = decoder.forward

    def counted(tokens, segments, *args, **kwargs):
        read.append(sum(max(0, min(s.cache.length + s.num_tokens, prompt_length) - s.cache.length) for s in segments))
        return forward(tokens, segments, *args, **kwargs)

    decoder.forward = counted
    return read


@pytest.mark.parametrize("with_prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("chunk_blocks", [16, 2], ids=["read-as-it-drafts", "read-in-chunks"])
def test_a_requests_choices_draft_from_one_reading_of_their_prompt(target, chunk_blocks, with_prefix_cache):
    """n choices of one prompt through a speculative engine: the draft reads the prompt
    once (a short one as it drafts, a long one in catch-up chunks), the other choices
    waiting a call and copying it, to the token; each answers as it would alone."""
    prompt = [(7 * i) % 89 for i in range(6 * BLOCK + 5)]
    draft = perturbed(target, 0.3, seed=2)
    read = prompt_positions_read(draft, len(prompt))
    proposer = DraftModelProposer(draft, catch_up_chunk_size=chunk_blocks * BLOCK)
    proposer.prefix_cache = PrefixCache(10_000) if with_prefix_cache else None
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    params = [GREEDY, *(SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(3))]
    choices = [engine.add_request(prompt, p) for p in params]
    while engine.has_unfinished():
        engine.step()
    assert sum(read) == len(prompt), read
    alone = Engine(target, eos_token_ids=[EOS])
    assert [s.output_ids for s in choices] == [alone.generate(prompt, p).output_ids for p in params]


def test_a_chunk_waits_only_when_most_of_it_is_read_elsewhere():
    first = list(range(4 * BLOCK))
    second = first[: 3 * BLOCK] + [-1] * (7 * BLOCK)  # shares 3 blocks with first
    # first reads its blocks 2 and 3 now: second's next 14 tokens are all in block 2.
    assert read_elsewhere(second, 2 * BLOCK, 2 * BLOCK + 14, [(first, 4 * BLOCK)])
    # second's chunk of 7 blocks would share only its first one: read it twice, not wait.
    assert not read_elsewhere(second, 2 * BLOCK, 9 * BLOCK, [(first, 4 * BLOCK)])
    assert not read_elsewhere(second, 3 * BLOCK, 4 * BLOCK, [(first, 4 * BLOCK)])  # past what they share
    assert not read_elsewhere(second, 0, BLOCK, [(first, 0)]) and not read_elsewhere(second, 0, BLOCK, [])


def test_shared_blocks_counts_whole_blocks_alike():
    a = list(range(3 * BLOCK + 5))
    assert shared_blocks(a, a) == 3 * BLOCK
    assert shared_blocks(a, a[: 2 * BLOCK + 3]) == 2 * BLOCK
    assert shared_blocks(a, a[:BLOCK] + [-1] + a[BLOCK + 1 :]) == BLOCK
    assert shared_blocks(a, [-1] + a[1:]) == 0 and shared_blocks([], a) == 0


def test_running_slots_of_a_pool_are_sources_too(target):
    """On a CachePool, a request copies a shared system prompt from the slot of the one
    that read it, slot to slot."""
    model = copy.deepcopy(target)
    model.use_cuda_graphs(num_slots=2, capacity=256)
    system = [(3 * i) % 89 for i in range(3 * BLOCK)]
    prompts = [system + [1], system + [2, 3]]  # the shorter prompt's turn comes first
    engine = Engine(
        model, eos_token_ids=[EOS], prefix_cache=PrefixCache(10_000), max_num_seqs=2, prefill_chunk_size=2 * BLOCK
    )
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert seqs[1].num_cached_tokens == 3 * BLOCK and model.static.pool.num_free == 2
    assert [s.output_ids for s in seqs] == [
        Engine(target, eos_token_ids=[EOS]).generate(p, GREEDY).output_ids for p in prompts
    ]


def test_an_aborted_request_leaves_what_it_read(target):
    store = PrefixCache(10_000)
    engine = Engine(target, eos_token_ids=[EOS], prefix_cache=store, prefill_chunk_size=BLOCK)
    prompt = list(range(3 * BLOCK))
    seq = engine.add_request(prompt, GREEDY)
    engine.step()  # one chunk of the prompt read
    engine.finish(seq.seq_id)
    assert store.num_tokens == BLOCK
    again = engine.generate(prompt, GREEDY)
    assert again.num_cached_tokens == BLOCK
    assert again.output_ids == Engine(target, eos_token_ids=[EOS]).generate(prompt, GREEDY).output_ids


def test_bytes_per_position_is_what_a_cache_holds_per_position(target):
    cache = target.new_cache()
    held = cache.keys.numel() * cache.keys.element_size() + cache.values.numel() * cache.values.element_size()
    assert bytes_per_position(target.config, target.dtype) == held // cache.capacity


@needs_kernel
def test_fused_speculation_with_prefix_caching_gives_the_plain_tokens(target):
    """The fused path (C kernels, int4 draft and target) loads and stores the same way."""
    from tests.spec.test_fused import quantized

    q_target, q_draft = quantized(target), quantized(perturbed(target, 0.3, seed=2))
    plain = conversation(Engine(q_target, eos_token_ids=[EOS], prefix_cache=PrefixCache(10_000)), turns=3)
    proposer = FusedDraftProposer(q_draft, q_target, catch_up_chunk_size=8)
    proposer.prefix_cache = PrefixCache(10_000)
    engine = Engine(
        q_target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=3,
        prefix_cache=PrefixCache(10_000),
        prefill_chunk_size=8,
    )
    fused = conversation(engine, turns=3)
    assert [s.output_ids for s in fused] == [s.output_ids for s in plain]
    assert fused[2].num_cached_tokens > 0 and proposer.prefix_cache.hit_tokens > 0


# ------------------------------------------------------------------ flags


def test_the_space_is_shared_by_the_target_and_the_draft(prepared_cache, monkeypatch):
    from specserve.config import SpecConfig
    from specserve.engine.build import build_engine
    from specserve.errors import ConfigError

    monkeypatch.setenv("SPECSERVE_CACHE", prepared_cache)
    spec = SpecConfig.parse({"model": "smollm2-135m", "num_speculative_tokens": 3})
    engine, _ = build_engine("smollm2-135m", spec, prefix_cache_space=0.25)
    per_token = sum(bytes_per_position(d.config, d.dtype) for d in (engine.target, engine.proposer.draft))
    assert engine.prefix_cache.max_tokens == engine.proposer.prefix_cache.max_tokens == 2**28 // per_token
    assert build_engine("smollm2-135m")[0].prefix_cache is None  # off unless asked for
    with pytest.raises(ConfigError, match="--prefix-cache-space .* holds 0 tokens"):
        build_engine("smollm2-135m", prefix_cache_space=1e-9)


def test_serve_refuses_a_prefix_cache_of_no_space(capsys):
    assert main(["serve", "--enable-prefix-caching", "--prefix-cache-space", "0"]) == 2
    assert "--prefix-cache-space must be > 0 GiB, got 0.0" in capsys.readouterr().err
