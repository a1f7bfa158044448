"""EAGLE-1, EAGLE-3 and Medusa proposers in the engine, on tiny targets: greedy output equal
to plain decoding (k 1..7, ragged batches, prompts in chunks, adaptive k, lookups first,
penalties, logprobs, prefix caching), heads that guess right making multi-token steps, the
head's state after rejections, the factory's refusals and its quantized heads, and the
target's distribution at temperature > 0 (chi-square); greedy equivalence and the
distribution on float and int4 targets alike (a quantized target's head quantized too)."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from specserve.config import SpecConfig
from specserve.engine.engine import Engine
from specserve.errors import ConfigError, ModelLoadError
from specserve.model.decoder import Capture, Decoder, Segment
from specserve.model.prefix_cache import PrefixCache
from specserve.model.quant import QuantizedLinear
from specserve.sampling import SamplingParams
from specserve.spec import adaptive as adaptive_module
from specserve.spec.adaptive import AdaptiveSpecLength, LinearFit
from specserve.spec.cost import prior_cost_ratio
from specserve.spec.eagle import EagleProposer
from specserve.spec.factory import head_proposer
from specserve.spec.guesses import DraftChains, Guesser
from specserve.spec.heads.checkpoint import save_head
from specserve.spec.heads.eagle import EagleConfig, EagleHead
from specserve.spec.heads.medusa import MedusaHeads
from specserve.spec.medusa import MedusaProposer
from tests.conftest import DEVICES, skip_unless_triton_runs_on
from tests.head_models import (
    METHODS,
    NUM_MEDUSA_HEADS,
    QUANTIZATIONS,
    permutation_target,
    quantized,
    random_head,
    right_head,
    target_config,
)

EOS = 95
PROMPTS = [[5, 9, 13, 5, 9], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [77], list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def proposer_of(
    head: EagleHead | MedusaHeads, target: Decoder, confidence_threshold: float = 0.0, catch_up_chunk_size: int = 512
) -> EagleProposer | MedusaProposer:
    guesser = Guesser(target.config.vocab_size, confidence_threshold)
    if isinstance(head, MedusaHeads):
        return MedusaProposer(head, guesser)
    head.share_target(target.embed_tokens, target.lm_head)
    return EagleProposer(head, guesser, catch_up_chunk_size)


def plain_tokens(target: Decoder, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return Engine(target, eos_token_ids=[EOS]).generate(prompt, params).output_ids


def run_batch(engine: Engine, requests: list[tuple[list[int], SamplingParams]], join_after: int = 3) -> list:
    """Every request at once (a ragged batch), one more joining after `join_after` steps."""
    seqs = [engine.add_request(prompt, params) for prompt, params in requests[:-1]]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == join_after:
            seqs.append(engine.add_request(*requests[-1]))
    return seqs


@pytest.fixture(scope="module")
def noisy() -> tuple[Decoder, torch.Tensor]:
    """A permutation target with noise: right heads are right often, not always."""
    return permutation_target(noise=0.18)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_targets_in_ragged_batches_of_chunked_prompts(noisy, method, k, quantization):
    target, perm = noisy
    head = quantized(right_head(method, target, perm), quantization)
    target = quantized(target, quantization)
    proposer = proposer_of(head, target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=k, prefill_chunk_size=4)
    lengths = [5, 24, 11, 17, 24]
    prompts = PROMPTS + [[8, 8, 8, 8, 8, 8, 8]]
    requests = [(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    for seq, (prompt, params) in zip(run_batch(engine, requests), requests):
        assert seq.output_ids == plain_tokens(target, prompt, params)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # right and wrong guesses: rollback ran
    assert not engine.running and not proposer.features.runs
    if method != "medusa":
        assert not proposer.caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_attention", ["eager", "gathered", "in-place"])
@pytest.mark.parametrize("method", METHODS)
def test_heads_on_a_target_with_cuda_graphs_keep_its_output(noisy, method, head_attention, device):
    """The target's static steps capture the features the head reads (model/graphs.py):
    verifications run as graphs (eagerly on the CPU) and the output stays plain decoding's.
    An EAGLE head's own steps run as static steps too, attending over a gathered copy or
    in place (a catch-up of more than MAX_READ_ROWS pairs: eagerly, on its pool slot)."""
    if head_attention != "eager" and method == "medusa":
        pytest.skip("Medusa heads have no steps of their own")
    if head_attention == "in-place":
        skip_unless_triton_runs_on(device)
    target, perm = noisy
    head = copy.deepcopy(right_head(method, target, perm)).to(device)
    graphed = copy.deepcopy(target).to(device)
    graphed.use_cuda_graphs(num_slots=8, capacity=128)
    proposer = proposer_of(head, graphed)
    if head_attention != "eager":
        head.use_cuda_graphs(num_slots=8, capacity=128)
        head.static.in_place = head_attention == "in-place"  # already so on a GPU with Triton
    engine = Engine(graphed, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, prefill_chunk_size=8)
    penalised = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    requests = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[1], penalised)]  # its chains penalised too
    for seq, (prompt, params) in zip(run_batch(engine, requests), requests):
        assert seq.output_ids == plain_tokens(target, prompt, params)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    captured = [key for key in graphed.static.steps if key.layers or key.final]
    assert max(key.rows for key in captured) > 1  # verifications were static steps that captured
    assert graphed.static.pool.num_free == 8
    if head_attention != "eager":
        assert {key.rows for key in head.static.steps} >= {1, 2}  # catch-ups of one pair and more
        assert head.static.chains  # the greedy chains ran as one static step each (TokenChain)
        assert head.static.pool.num_free == 8 and not proposer.caches


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_heads_chains_guess_for_every_kind_of_request_as_its_steps_do(noisy, method, monkeypatch):
    """A graphed EAGLE head drafts the positions after each first guess in one static
    step (TokenChain) for greedy, penalised and seeded sampling requests alike (EAGLE-3's
    shuffled draft vocabulary widened to the target's for the latter two): every guess
    is the one its static steps position by position give, and each output stays the
    one plain decoding gives it alone."""
    target, perm = noisy
    kinds = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, min_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.1, frequency_penalty=0.6, seed=2**40, ignore_eos=True),
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.9, seed=9, allowed_token_ids=range(0, 64, 2), ignore_eos=True),
    ]
    requests = list(zip(PROMPTS + [[8, 8, 8], [9, 9, 9]], kinds))
    drafts, chains = {}, {}
    for chained in (True, False):
        head = copy.deepcopy(right_head(method, target, perm))
        graphed = copy.deepcopy(target)
        graphed.use_cuda_graphs(num_slots=8, capacity=128)
        proposer = proposer_of(head, graphed)
        head.use_cuda_graphs(num_slots=8, capacity=128)
        if not chained:
            monkeypatch.setattr(DraftChains, "draft_on_the_device", lambda *args, **kwargs: None)
        calls, propose = [], proposer.propose
        proposer.propose = lambda seqs, ks, least=None: calls.append(r := propose(seqs, ks, least)) or r
        engine = Engine(graphed, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
        for seq, (prompt, params) in zip(run_batch(engine, requests), requests):
            assert seq.output_ids == plain_tokens(target, prompt, params)
        assert 0 < engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens
        drafts[chained] = [[d.tokens.tolist() for d in call] for call in calls]
        chains[chained] = {(key.keyed, key.vocab > 0, key.distinct > 0) for key in head.static.chains}
    assert drafts[True] == drafts[False]
    assert (True, True, True) in chains[True] and not chains[False]


@pytest.mark.parametrize("method", METHODS)
def test_where_adaptive_k_drafts_nothing_the_target_decodes_in_chains_that_feed_the_head(noisy, method, monkeypatch):
    """On static steps, a head adaptive k finds not worth drafting (a random one, its
    draft priced dear) leaves the target decoding 4 tokens a step in multi-step chains,
    which capture the features the head reads: its runs stay at the verified positions,
    its probes (every 4 plain steps a sequence here, reading priced free) read them, and
    the output stays plain decoding's."""
    monkeypatch.setattr(adaptive_module, "PROBE_INTERVAL", 2)
    target, perm = noisy
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=4, capacity=128)
    proposer = proposer_of(random_head(method, target.config, seed=7), graphed)
    adaptive = AdaptiveSpecLength(7, prior_cost_ratio(proposer, target))
    observe_draft, observe_target = adaptive.observe_draft, adaptive.observe_target
    adaptive.observe_draft = lambda positions, seconds: observe_draft(positions, 5e-3 * positions)
    adaptive.observe_target = lambda rows, seconds: observe_target(rows, 1e-2 + 1e-3 * rows)
    adaptive.read = LinearFit(((0, 0.0), (64, 0.0)))  # reading free: a probe is never too dear
    engine = Engine(
        graphed, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, adaptive=adaptive,
        num_scheduler_steps=4,
    )  # fmt: skip
    proposed, propose = [], proposer.propose
    proposer.propose = lambda seqs, num_tokens, least=None: (
        proposed.append(bool(graphed.static.chains)) or propose(seqs, num_tokens, least)  # after a chain?
    )
    spreads, choose = [], adaptive.choose
    adaptive.choose = lambda *args, **kwargs: (
        spreads.append((set(engine.chained), kwargs["spreads"])) or choose(*args, **kwargs)
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(prompt, params) for prompt in PROMPTS[:2]]
    while engine.has_unfinished():
        engine.step()
        for seq in seqs:
            run = proposer.features.runs.get(seq.seq_id)
            assert seq.finished or run is None or run.end == len(seq.token_ids) - 1
    for seq, prompt in zip(seqs, PROMPTS):
        assert seq.output_ids == plain_tokens(target, prompt, params)
    assert any(key.positions == 4 and (key.layers or key.final) for key in graphed.static.chains)
    assert any(proposed)  # a probe after chains read the features they captured
    assert adaptive.target_steps > 0  # chains alone priced nothing: a plain step was measured
    # What a chain left is to be read within a chain; a prompt's, within the answer.
    assert any(chained and set(spread) == {4} for chained, spread in spreads)
    assert all(spread[0] > 4 for chained, spread in spreads if not chained)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_graphed_heads_catch_up_of_a_prompt_scores_its_last_row_alone(noisy, method):
    """An EAGLE head on static steps reads a 30-token prompt in one read of 32 rows that
    computes the draft logits of its last row alone (StepKey.scored), as the target's
    read of that prompt does: every draft is the eager head's, and the output plain
    decoding's."""
    target, perm = noisy
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[3], GREEDY)]
    drafted = []
    for graphs in (False, True):
        head, model = copy.deepcopy(right_head(method, target, perm)), copy.deepcopy(target)
        if graphs:
            for graphed in (model, head):
                graphed.use_cuda_graphs(num_slots=4, capacity=128)
        engine = Engine(model, eos_token_ids=[EOS], proposer=proposer_of(head, model), num_speculative_tokens=3)
        for seq, (prompt, params) in zip(run_batch(engine, requests), requests):
            assert seq.output_ids == plain_tokens(target, prompt, params)
        drafted.append((engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens))
    assert drafted[0] == drafted[1] and drafted[0][1] > 0
    for graphed in (model, head):
        assert any(key.rows == 32 and key.scored for key in graphed.static.steps)


@pytest.mark.parametrize("method", METHODS)
def test_random_heads_keep_the_output_the_targets(method):
    torch.manual_seed(5)
    target = Decoder(target_config()).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    proposer = proposer_of(random_head(method, target.config, seed=6, draft_vocab=40), target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4, prefill_chunk_size=7)
    requests = [(p, GREEDY) for p in PROMPTS]
    for seq, (prompt, params) in zip(run_batch(engine, requests), requests):
        assert seq.output_ids == plain_tokens(target, prompt, params)
    assert engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_heads_that_guess_right_make_multi_token_steps(method, device):
    target, perm = permutation_target()
    head = right_head(method, target, perm).to(device)
    target = target.to(device)
    proposer = proposer_of(head, target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=5)
    seq = engine.add_request(PROMPTS[3], GREEDY)
    steps = 0
    while not seq.finished:
        engine.step()
        steps += 1
    assert seq.output_ids == plain_tokens(target, PROMPTS[3])
    assert seq.output_ids[1:] == perm[torch.tensor(seq.output_ids[:-1])].tolist()  # the target as built
    assert seq.spec.acceptance_rate == 1.0 and steps == 1 + 4  # the prompt's step, then 6 tokens a step


def target_features(target: Decoder, tokens: list[int], capture: Capture) -> torch.Tensor:  # [len(tokens), F]
    target(torch.tensor(tokens), [Segment(target.new_cache(), len(tokens))], capture=capture)
    return capture.layer_inputs if capture.layers else capture.final_hidden


@pytest.mark.parametrize("method", METHODS)
def test_after_rejections_the_head_holds_the_verified_positions_alone(noisy, method):
    """After every step: the feature run ends at the last verified position; Medusa keeps
    that row alone, the target's own; an EAGLE head's cache holds every read position,
    each as a fresh head reading the target's features of the whole text computes it."""
    target, perm = noisy
    proposer = proposer_of(right_head(method, target, perm), target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    seq = engine.add_request(PROMPTS[1], GREEDY)
    rejected = 0
    while not seq.finished:
        engine.step()
        rejected += seq.spec.num_draft_tokens - seq.spec.num_accepted_tokens
        if seq.finished:
            break
        run = proposer.features.runs[seq.seq_id]
        verified = len(seq.token_ids) - 1
        assert run.end == verified
        features = target_features(target, seq.token_ids[:verified], proposer.features.new_capture())
        if method == "medusa":
            assert len(run) == 1
            torch.testing.assert_close(run.newest(), features[-1])
            continue
        cache = proposer.caches.get(seq.seq_id)
        if cache is None:
            continue
        assert run.origin == 0 and cache.length == run.start
        fresh = proposer.head.new_cache()
        head = proposer.head
        head(
            torch.tensor(seq.token_ids[1 : run.start + 1]),
            head.project_target_features(features[: run.start]),
            [Segment(fresh, run.start)],
        )
        torch.testing.assert_close(cache.keys[:, :, : cache.length], fresh.keys[:, :, : cache.length])
        torch.testing.assert_close(cache.values[:, :, : cache.length], fresh.values[:, :, : cache.length])
    assert rejected > 0


@pytest.mark.parametrize("method", METHODS)
def test_first_guesses_too_unlikely_for_their_rows_are_dropped_and_the_output_stays_the_targets(noisy, method):
    """Adaptive k asks greedy sequences to drop first guesses less likely than their rows
    are worth (forced here, step by step: none, the less sure ones, every one): some are
    dropped, the output stays the target's, and a seeded sampling request's guesses,
    drawn, are never dropped; its output is plain sampling's. A Medusa head past the
    first scores only the chains still going there: a dropped first guess costs one
    head."""
    target, perm = noisy
    proposer = proposer_of(right_head(method, target, perm), target)
    heads_run = []  # per call: the Medusa heads it ran, with the rows each scored
    if method == "medusa":
        head_scores = proposer.heads.head_scores
        proposer.heads.head_scores = lambda h, i: heads_run[-1].append((i, h.shape[0])) or head_scores(h, i)
    adaptive = AdaptiveSpecLength(7, prior_cost_ratio(proposer, target))
    least = itertools.cycle([0.0, 0.9, 1.1])
    adaptive.least_chances = lambda batch, rows, seq_ids: [next(least)] * len(seq_ids)
    adaptive.choose = lambda seq_ids, *costs, **batch: [3] * len(seq_ids)  # every sequence drafts
    seen, propose = [], proposer.propose

    def spying(seqs, num_tokens, least_chances=None):
        heads_run.append([])
        drafts = propose(seqs, num_tokens, least_chances)
        for i, rows in heads_run[-1][1:]:  # head i: only chains that drafted i tokens may go on
            assert rows <= sum(draft.num_tokens >= i for draft in drafts)
        seen.extend(zip([s.params.greedy for s in seqs], least_chances, drafts))
        return drafts

    proposer.propose = spying
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, adaptive=adaptive)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY), (PROMPTS[3], seeded), (PROMPTS[2], GREEDY)]
    for seq, (prompt, params) in zip(run_batch(engine, requests), requests):
        assert seq.output_ids == plain_tokens(target, prompt, params)
    assert any(draft.dropped for greedy, _, draft in seen if greedy)
    assert any(draft.num_tokens for greedy, _, draft in seen if greedy)
    assert any(draft.num_tokens for greedy, _, draft in seen if not greedy)
    assert not any(draft.dropped for greedy, _, draft in seen if not greedy)
    assert method != "medusa" or max(map(len, heads_run)) > 1  # heads past the first ran where chains went on


@pytest.mark.parametrize("method", METHODS)
def test_allowed_ids_keep_the_targets_output_where_the_heads_guesses_fall_outside_them(noisy, method):
    """A head guesses over every id (EAGLE-3 over its own draft vocabulary): with a third
    of the ids allowed, its guesses are cut to them (or left as they are where its row
    holds none), and the output is plain decoding's, every token an allowed one."""
    target, perm = noisy
    proposer = proposer_of(right_head(method, target, perm), target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    allowed = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=range(1, 64, 3))
    requests = [(PROMPTS[1], allowed), (PROMPTS[3], GREEDY)]
    seqs = run_batch(engine, requests)
    for seq, (prompt, params) in zip(seqs, requests):
        assert seq.output_ids == plain_tokens(target, prompt, params)
    assert set(seqs[0].output_ids) <= set(range(1, 64, 3))
    assert engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_adaptive_k_lookups_penalties_and_logprobs_keep_the_targets_output(noisy, method):
    target, perm = noisy
    proposer = proposer_of(right_head(method, target, perm), target, confidence_threshold=0.3)
    adaptive = AdaptiveSpecLength(7, prior_cost_ratio(proposer, target))
    # Costs as a quiet machine measures them (a draft position a tenth of a target row),
    # so that what adaptive chooses does not depend on how busy this one is.
    timed, observe_draft, observe_target = [], adaptive.observe_draft, adaptive.observe_target
    adaptive.observe_draft = lambda positions, seconds: (
        timed.append(positions),
        observe_draft(positions, 1e-3 * positions),
    )
    adaptive.observe_target = lambda rows, seconds: observe_target(rows, 1e-2 + 1e-3 * rows)
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=3,
        adaptive=adaptive,
        lookup_first=2,
        prefill_chunk_size=6,
    )
    penalised = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        logit_bias={5: 2.0, 11: -100.0},
    )
    with_logprobs = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    requests = [(PROMPTS[0], penalised), (PROMPTS[1], with_logprobs), (PROMPTS[3], GREEDY), (PROMPTS[2], penalised)]
    # The last joins once the others' prompts are read: a fresh sequence with nothing for
    # the head to catch up, which drafts at once (those that decoded beside the prompts
    # being read have a backlog too dear for 24 tokens).
    for seq, (prompt, params) in zip(run_batch(engine, requests, join_after=8), requests):
        plain = Engine(target, eos_token_ids=[EOS]).generate(prompt, params)
        assert seq.output_ids == plain.output_ids
        if params.logprobs is not None:
            for ours, theirs in zip(seq.logprobs, plain.logprobs, strict=True):
                assert ours.token_id == theirs.token_id and ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert engine.spec_stats.num_accepted_tokens > 0
    assert timed  # steps with a catch-up of 1-2 were timed as drafting


@pytest.mark.parametrize("method", METHODS)
def test_a_prefix_from_the_prefix_cache_is_not_read_and_the_output_stays_the_targets(noisy, method):
    """The target computes no features for a prompt prefix it loads: the head's run starts
    after it."""
    target, perm = noisy
    proposer = proposer_of(right_head(method, target, perm), target)
    engine = Engine(
        target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, prefix_cache=PrefixCache(4096)
    )
    shared = list(range(10, 60))  # longer than a prefix-cache block
    first = engine.generate(shared + [3], GREEDY)
    second = engine.add_request(shared + [4, 5], GREEDY)
    engine.step()
    assert second.num_cached_tokens > 0
    assert proposer.features.runs[second.seq_id].origin == second.num_cached_tokens
    while not second.finished:
        engine.step()
    assert first.output_ids == plain_tokens(target, shared + [3])
    assert second.output_ids == plain_tokens(target, shared + [4, 5])
    assert second.spec.num_accepted_tokens > 0


def drafts_by_sequence(proposer: EagleProposer) -> dict[int, dict[int, list[int]]]:
    """Each sequence's drafts by the length of the text they follow, as `proposer` makes
    them from now on."""
    drafts: dict[int, dict[int, list[int]]] = {}
    propose = proposer.propose

    def recording(seqs, num_tokens, least_chances=None):
        made = propose(seqs, num_tokens, least_chances)
        for seq, draft in zip(seqs, made):
            drafts.setdefault(seq.seq_id, {})[len(seq.token_ids)] = draft.tokens.tolist()
        return made

    proposer.propose = recording
    return drafts


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "static-head"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_choice_takes_its_siblings_head_cache_of_their_prompt_and_drafts_as_it(method, graphed):
    """A request's second choice copies its prompt from the first (the target computes
    its last position alone): its head takes the first's cache of the positions before,
    waiting the call in which the first reads them, and then drafts what the first does
    (with static head steps, in a pool slot of its own, every slot back at the end)."""
    torch.manual_seed(5)
    target = Decoder(target_config()).eval()
    head = random_head(method, target.config, seed=6)
    if graphed:
        head.use_cuda_graphs(num_slots=4, capacity=128)
    proposer = proposer_of(head, target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    drafts = drafts_by_sequence(proposer)
    prompt = PROMPTS[3]
    first, second = (engine.add_request(prompt, GREEDY) for _ in range(2))
    while second.seq_id not in proposer.caches:
        engine.step()
    assert second.num_cached_tokens == 0  # no prefix cache: its prompt came from its sibling
    # It waited the call in which the first read the prompt, and drafted in the next.
    (waited, mine), (read, _) = drafts[second.seq_id].items(), drafts[first.seq_id].items()
    assert waited[1] == [] and len(read[1]) == 3 and len(mine[1]) == 3
    context = len(prompt) - 1  # the positions it copied: the target computed its last
    assert proposer.features.runs[second.seq_id].origin == 0
    mine, theirs = proposer.caches[second.seq_id], proposer.caches[first.seq_id]
    assert torch.equal(mine.keys[:, :, :context], theirs.keys[:, :, :context])
    assert torch.equal(mine.values[:, :, :context], theirs.values[:, :, :context])
    while engine.has_unfinished():
        engine.step()
    theirs = drafts[first.seq_id]
    both = [length for length in drafts[second.seq_id] if length in theirs and length != waited[0]]
    assert len(both) > 3 and all(drafts[second.seq_id][n] == theirs[n] for n in both)
    assert not proposer.caches and (head.static is None or head.static.pool.num_free == 4)
    assert first.output_ids == second.output_ids == plain_tokens(target, prompt)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_takes_its_cache_of_a_cached_prefix_from_its_prefix_cache(method):
    """A prompt whose prefix the target loads from its prefix cache: the head loads its
    own cache of the prefix, stored by the sequence that read it (keyed by pairs, so the
    token after the prefix counts), and drafts what a head that read it all drafts."""
    torch.manual_seed(5)
    target = Decoder(target_config()).eval()
    head = random_head(method, target.config, seed=6)
    shared, first_prompt, second_prompt = list(range(10, 60)), list(range(10, 60)) + [3], list(range(10, 60)) + [4, 5]

    def engine_with(prefix_cache: bool) -> tuple[Engine, EagleProposer]:
        proposer = proposer_of(copy.deepcopy(head), target)
        engine = Engine(
            target,
            eos_token_ids=[EOS],
            proposer=proposer,
            num_speculative_tokens=3,
            prefix_cache=PrefixCache(4096) if prefix_cache else None,
        )
        proposer.prefix_cache = PrefixCache(4096) if prefix_cache else None
        return engine, proposer

    cached, proposer = engine_with(prefix_cache=True)
    first = cached.generate(first_prompt, dataclasses.replace(GREEDY, max_tokens=14))
    assert len(first.token_ids) - 1 == 64  # the target stores 4 blocks; its last step's pairs end the 4th
    assert len(proposer.prefix_cache) == len(cached.prefix_cache) == 4  # read as it left
    drafts = drafts_by_sequence(proposer)
    second = cached.generate(second_prompt, GREEDY)
    assert second.num_cached_tokens == len(shared) // 16 * 16
    alone, reference = engine_with(prefix_cache=False)
    reference_drafts = drafts_by_sequence(reference)
    reference_second = alone.generate(second_prompt, GREEDY)
    assert second.output_ids == reference_second.output_ids == plain_tokens(target, second_prompt)
    assert drafts[second.seq_id] == reference_drafts[reference_second.seq_id]  # keyed by the text's length

    # A prefix that differs from the stored one in the token after it: not the same pairs.
    third = cached.add_request(list(range(10, 58)) + [7, 8], GREEDY)
    cached.step()
    assert third.num_cached_tokens == 48
    cached.step()
    assert proposer.features.runs[third.seq_id].origin == 48  # read without the context
    while cached.has_unfinished():
        cached.step()
    assert third.output_ids == plain_tokens(target, list(range(10, 58)) + [7, 8])

    # Two prompts with a new start, arriving together: the target reads it once, and the
    # head of the one that copied it takes the other's cache of it as it runs.
    start = list(range(60, 90)) * 2
    together = [cached.add_request(start + [9, i], GREEDY) for i in (1, 2)]
    while cached.has_unfinished():
        cached.step()
    for seq in together:
        reference_seq = alone.generate(seq.token_ids[: seq.num_prompt_tokens], GREEDY)
        assert seq.output_ids == reference_seq.output_ids
        made = {length: draft for length, draft in drafts[seq.seq_id].items() if draft}  # k = 0 beside the other
        alone_made = reference_drafts[reference_seq.seq_id]
        assert all(alone_made.get(length) == draft for length, draft in made.items())
        assert len(made) >= len(alone_made) - 1  # the one that copied waited a call
    assert together[1].num_cached_tokens == 48


def test_eagle_counts_what_the_chain_guessed_right_as_read_already(noisy):
    """After a drafting step a head catches up 1 token (a rejection) or 2 (all accepted),
    as a draft model does, though it reads again every accepted position."""
    target, perm = noisy
    proposer = proposer_of(right_head("eagle3", target, perm), target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    seq = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    engine.step()
    catch_ups = []  # (backlog before, catch-up, pairs read) of each drafting step
    while not seq.finished:
        backlog, drafts = proposer.backlog(seq), seq.spec.num_drafts
        engine.step()
        if seq.spec.num_drafts > drafts:
            catch_ups.append((backlog, proposer.last_catch_up, proposer.last_tokens_read))
    first, *rest = catch_ups
    assert first[:2] == (len(PROMPTS[3]), len(PROMPTS[3]))  # the prompt's pairs
    assert all(backlog == catch_up in (1, 2) for backlog, catch_up, _ in rest)
    assert any(read > 2 for _, _, read in rest)  # accepted positions were read again


def test_the_factory_loads_heads_and_refuses_what_does_not_fit(tmp_path):
    target = Decoder(target_config()).eval()
    for method in METHODS:
        save_head(random_head(method, target.config, seed=1), tmp_path / method)
    spec = SpecConfig.parse({"method": "medusa", "model": str(tmp_path / "medusa")})
    proposer, settled = head_proposer(spec, target)
    assert isinstance(proposer, MedusaProposer)
    assert settled.num_speculative_tokens == settled.max_speculative_tokens == NUM_MEDUSA_HEADS
    for adaptive in (True, False):  # a k within the heads, adaptive or not, needs no max_speculative_tokens
        raw = {"method": "medusa", "model": str(tmp_path / "medusa"), "num_speculative_tokens": 3, "adaptive": adaptive}
        _, settled = head_proposer(SpecConfig.parse(raw), target)
        most = NUM_MEDUSA_HEADS if adaptive else 3
        assert (settled.num_speculative_tokens, settled.max_speculative_tokens) == (3, most)
    spec = SpecConfig.parse({"method": "medusa", "model": str(tmp_path / "medusa"), "num_speculative_tokens": 8})
    with pytest.raises(ConfigError, match="num_speculative_tokens is 8, but the Medusa checkpoint has 7 heads"):
        head_proposer(spec, target)
    spec = SpecConfig.parse({"method": "medusa", "model": str(tmp_path / "medusa"), "max_speculative_tokens": 9})
    with pytest.raises(ConfigError, match="max_speculative_tokens is 9"):
        head_proposer(spec, target)
    proposer, settled = head_proposer(
        SpecConfig.parse({"method": "eagle3", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 7}), target
    )
    assert isinstance(proposer, EagleProposer) and proposer.head.config.version == 3
    assert settled.num_speculative_tokens == 7 and settled.prompt_lookup_first == 4  # lookups first, as drafts
    assert 0 < prior_cost_ratio(proposer, target) < 1
    with pytest.raises(ConfigError, match='use "method": "eagle3"'):
        head_proposer(
            SpecConfig.parse({"method": "eagle", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 3}),
            target,
        )
    with pytest.raises(ModelLoadError, match="neither a head folder nor a head trained"):
        head_proposer(
            SpecConfig.parse({"method": "eagle", "model": str(tmp_path / "absent"), "num_speculative_tokens": 3}),
            target,
        )
    (tmp_path / "eagle" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot read"):
        head_proposer(
            SpecConfig.parse({"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}), target
        )
    wider = Decoder(target_config(hidden_size=32, intermediate_size=64, head_dim=8)).eval()
    with pytest.raises(ConfigError, match="hidden size 64, the target has 32"):
        head_proposer(
            SpecConfig.parse({"method": "eagle3", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 3}),
            wider,
        )


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_factory_quantizes_a_head_as_its_target_once(tmp_path, monkeypatch, capsys, quantization):
    """A quantized target's head runs on the same kernels: its linear layers quantized as
    the target's (int4 keeps q/k/v and the LM heads in int8), into the cache once."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    float_target = Decoder(target_config()).eval()
    target = quantized(float_target, quantization)
    for method in METHODS:
        head = random_head(method, float_target.config, seed=1)
        save_head(head, tmp_path / method)
        spec = SpecConfig.parse(
            {
                "method": method,
                "model": str(tmp_path / method),
                "num_speculative_tokens": 3,
                "max_speculative_tokens": 3,
            }
        )
        first, again = (head_proposer(spec, target, quantization=quantization)[0] for _ in range(2))
        assert capsys.readouterr().err.count(f"quantizing {method} to {quantization}") == 1
        expected = quantized(head, quantization)
        for loaded in (first, again):
            loaded_head = loaded.heads if method == "medusa" else loaded.head
            assert not any(isinstance(m, torch.nn.Linear) for m in loaded_head.modules())
            state, expected_state = dict(loaded_head.named_buffers()), dict(expected.named_buffers())
            assert state.keys() == expected_state.keys()
            for name, tensor in expected_state.items():
                assert torch.equal(state[name], tensor), name
        bits = {name: layer.bits for name, layer in loaded_head.named_modules() if isinstance(layer, QuantizedLinear)}
        if method == "eagle3":
            low = 4 if quantization == "int4" else 8
            assert bits == {
                "fc": low,
                "layer.self_attn.qkv_proj": 8,
                "layer.self_attn.o_proj": low,
                "layer.mlp.gate_up_proj": low,
                "layer.mlp.down_proj": low,
                "lm_head": 8,
            }
        if method == "medusa":
            assert {bits[f"lm_heads.{i}"] for i in range(NUM_MEDUSA_HEADS)} == {8}
    assert len(list((tmp_path / "cache" / "quantized").glob("*.safetensors"))) == len(METHODS)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("method", METHODS)
def test_speculative_engine_samples_the_target_distribution(method, quantization):
    """At temperature > 0 a batch of seeded requests drafted by random heads (EAGLE-3 over 3
    of the 4 ids; early stops on unsure guesses) gives 4-token outputs distributed as the
    target's own sampling (chi-square over all 4^4)."""
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    config = target_config(vocab_size=vocab, num_layers=4)  # EAGLE-3 reads layers 2, 2 and 1
    target = Decoder(config).eval()
    if method == "eagle3":
        head = EagleHead(EagleConfig.for_target(config, 3, draft_vocab_size=3)).eval()
        head.target_ids = torch.tensor([3, 0, 1])  # id 2 only ever comes from the target's residual
    else:
        head = random_head(method, config, seed=4)
    target, head = quantized(target, quantization), quantized(head, quantization)
    params = dict(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    expected = target_continuation_probs(target, prompt, SamplingParams(**params))
    proposer = proposer_of(head, target, confidence_threshold=0.3)
    engine = Engine(target, eos_token_ids=[EOS % vocab], proposer=proposer, num_speculative_tokens=3)
    samples = seeded_outputs(engine, prompt, params, batches=5)
    stats = engine.spec_stats
    assert 0.1 < stats.acceptance_rate < 0.95
    assert chi_square_p_value(samples, expected) > 1e-4


@pytest.mark.parametrize("keyed", [True, False], ids=["seeded", "unseeded"])
def test_an_eagle_heads_chains_of_sampled_guesses_keep_the_targets_distribution(keyed):
    """Sampling requests drafted by a graphed EAGLE-3 head over 3 of the 4 ids in its
    own order, every position after the first guess drawn in its chain over the widened
    vocabulary (an unseeded one's from the device's generator, its distribution handed
    to rejection sampling): the 4-token outputs are distributed as the target's own
    sampling (chi-square over all 4^4)."""
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    config = target_config(vocab_size=vocab, num_layers=4)
    target = Decoder(config).eval()
    head = EagleHead(EagleConfig.for_target(config, 3, draft_vocab_size=3)).eval()
    head.target_ids = torch.tensor([3, 0, 1])  # id 2 only ever comes from the target's residual
    params = dict(max_tokens=4, temperature=0.6, top_p=0.95, ignore_eos=True)
    expected = target_continuation_probs(target, prompt, SamplingParams(**params))
    proposer = proposer_of(head, target)
    head.use_cuda_graphs(num_slots=8, capacity=16)
    engine = Engine(target, eos_token_ids=[EOS % vocab], proposer=proposer, num_speculative_tokens=3)
    torch.manual_seed(0)  # the chains' draws: the device's generator
    samples = seeded_outputs(engine, prompt, params, batches=5, keyed=keyed)
    assert 0.1 < engine.spec_stats.acceptance_rate < 0.95
    assert {(key.keyed, key.draft_probs, key.vocab) for key in head.static.chains} == {(keyed, not keyed, vocab)}
    assert chi_square_p_value(samples, expected) > 1e-4
