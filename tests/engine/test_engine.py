"""The engine on tiny random-weight models: greedy equivalence with speculation on and
off, ragged batches, stopping rules, seeded reproducibility, and rollback of both caches."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from specserve.config import CPU_PREFILL_CHUNK_SIZE, DEFAULT_PREFILL_CHUNK_SIZE, prefill_chunk_size_for
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder
from specserve.model.prefix_cache import PrefixCache
from specserve.sampling import TOP_K_MAX, InvalidSamplingValue, SamplingParams, logits_to_probs, sample
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from specserve.spec.proposer import Draft
from specserve.spec.suffix import SuffixProposer
from specserve.spec.verify import Verdict
from tests.conftest import DEVICES, tiny_config

EOS = 95


def random_decoder(arch: str, seed: int) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(tiny_config(arch)).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy paths are stable
        model.lm_head.weight.mul_(8)
    return model


def perturbed(model: Decoder, scale: float, seed: int) -> Decoder:
    """A draft that mostly agrees with the target but not always."""
    draft = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn_like(p))
    return draft


@pytest.fixture(scope="module")
def target() -> Decoder:
    return random_decoder("qwen2", seed=1)


def on(model: Decoder, device: str) -> Decoder:
    """The model itself on the CPU, a copy elsewhere (the module's fixture stays put)."""
    return model if device == "cpu" else copy.deepcopy(model).to(device)


PROMPTS = [[5, 9, 13, 5, 9], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [77], list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def plain_tokens(target: Decoder, prompt: list[int], params=GREEDY) -> list[int]:
    return Engine(target, eos_token_ids=[EOS]).generate(prompt, params).output_ids


def log_asked(proposer) -> list[int]:
    """Wraps the proposer's propose: a list that gains every k it is asked for."""
    asked, propose = [], proposer.propose
    proposer.propose = lambda seqs, ks, *rest: (asked.extend(ks), propose(seqs, ks, *rest))[1]
    return asked


def log_lookups(engine: Engine) -> list[tuple[int | None, int]]:
    """Wraps the engine's lookup-first step: a list that gains, for each lookup draft,
    what its sequence's previous lookup had accepted (None: no previous one) and its
    length."""
    log = []
    look_up = engine._look_up

    def logged(decoding):
        found = look_up(decoding)
        log.extend((decoding[i].lookup_accepted, draft.num_tokens) for i, draft in found.items())
        return found

    engine._look_up = logged
    return log


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("proposer_kind", ["draft", "ngram", "suffix", "draft, lookup first", "draft, lookup answers"])
def test_greedy_equivalence(target, k, proposer_kind, device):
    proposer = {"ngram": lambda: NgramProposer(1, 3), "suffix": SuffixProposer}.get(
        proposer_kind, lambda: DraftModelProposer(on(perturbed(target, 0.3, seed=2), device))
    )()
    target = on(target, device)
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=k,
        lookup_first=2 if proposer_kind.startswith("draft, lookup") else None,
        lookup_answers=proposer_kind == "draft, lookup answers",
    )
    lookups = log_lookups(engine)
    for prompt in PROMPTS + PROMPTS[:2]:  # asked again: suffix decoding drafts the earlier answers
        seq = engine.generate(prompt, GREEDY)
        assert seq.output_ids == plain_tokens(target, prompt)
    assert bool(lookups) == proposer_kind.startswith("draft, lookup")
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    # Some drafts must be rejected, or rollback is not being exercised.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert not engine.running and (proposer_kind in ("ngram", "suffix") or not proposer.caches)


def test_ragged_batch_gives_each_sequence_its_solo_output(target):
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2))
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    lengths = [5, 24, 11, 17]
    seqs = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(PROMPTS, lengths)
    ]
    late = None
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:  # a request that joins a running batch
            late = engine.add_request([8, 8, 8], GREEDY)
    for seq, prompt, n in zip(seqs, PROMPTS, lengths):
        assert seq.finish_reason == "length" and seq.num_output_tokens == n
        assert seq.output_ids == plain_tokens(target, prompt)[:n]
    assert late.output_ids == plain_tokens(target, [8, 8, 8])


def test_stop_tokens_end_a_step_early(target):
    reference = plain_tokens(target, PROMPTS[1])
    stop = reference[6]
    first = reference.index(stop)
    engine = Engine(target, eos_token_ids=[EOS], proposer=NgramProposer(1, 3), num_speculative_tokens=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop,))
    seq = engine.generate(PROMPTS[1], params)
    assert seq.finish_reason == "stop"
    assert seq.output_ids == reference[: first + 1]  # the stop token is the last one kept


def test_eos_stops_unless_ignored(target):
    reference = plain_tokens(target, PROMPTS[0])
    engine = Engine(target, eos_token_ids=[reference[3]])
    seq = engine.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0))
    assert seq.finish_reason == "stop" and seq.output_ids == reference[: reference.index(reference[3]) + 1]
    seq = engine.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert seq.finish_reason == "length" and seq.output_ids == reference


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_repeats_with_speculation(target, device):
    draft = on(perturbed(target, 0.3, seed=2), device)
    target = on(target, device)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)

    def run() -> list[int]:
        engine = Engine(target, eos_token_ids=[EOS], proposer=DraftModelProposer(draft), num_speculative_tokens=3)
        return engine.generate(PROMPTS[0], params).output_ids

    first = run()
    assert first == run()
    other = Engine(target, eos_token_ids=[EOS], proposer=DraftModelProposer(draft), num_speculative_tokens=3)
    assert other.generate(PROMPTS[0], SamplingParams(**{**params.__dict__, "seed": 99})).output_ids != first


SEEDED = [
    SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.3, top_k=20, repetition_penalty=1.2, seed=-5, ignore_eos=True),
]


@pytest.mark.parametrize("params", SEEDED, ids=["top-p", "top-k-penalised"])
@pytest.mark.parametrize(
    "proposer_kind, k, adaptive",
    [("draft", 3, False), ("draft", 7, True), ("ngram", 5, False), ("ngram", 5, True), ("suffix", 24, True)],
    ids=["draft-k3", "draft-adaptive", "ngram-k5", "ngram-adaptive", "suffix-adaptive"],
)
def test_a_seeded_request_gets_plain_samplings_tokens_whatever_drafts_it(target, params, proposer_kind, k, adaptive):
    """Keyed draws: a seeded request's tokens are those plain sampling gives it, at any k
    (adaptive's, timed on this machine, too), beside a greedy and an unseeded sampling
    request whose steps change its batches."""
    from specserve.spec.adaptive import AdaptiveSpecLength

    expected = plain_tokens(target, PROMPTS[1], params)
    proposer = {"draft": lambda: DraftModelProposer(perturbed(target, 0.3, seed=2)), "suffix": SuffixProposer}.get(
        proposer_kind, lambda: NgramProposer(1, 3)
    )()
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=k,
        adaptive=AdaptiveSpecLength(15, 0.3) if adaptive else None,
    )
    neighbours = [(PROMPTS[0], GREEDY), (PROMPTS[3], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))]
    seqs = [engine.add_request(prompt, p) for prompt, p in [neighbours[0], (PROMPTS[1], params), neighbours[1]]]
    while engine.has_unfinished():
        engine.step()
    assert seqs[1].output_ids == expected
    assert seqs[1].spec.num_drafts > 0 or adaptive
    assert seqs[0].output_ids == plain_tokens(target, PROMPTS[0])


def test_the_check_rejects_a_keyed_verifier_that_keeps_what_the_target_allows(monkeypatch):
    """The distribution test above fails a keyed verifier with a bug: one that keeps a
    draft wherever the target gives it any probability."""
    import specserve.engine.engine as engine_module
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    def keeps_what_the_target_allows(scores, draft, params, uniforms):
        probs = logits_to_probs(scores, params)  # [k+1, V]
        own = sample(probs, uniforms=uniforms).tolist()
        drafts = draft.tokens.tolist()
        kept = next((i for i, t in enumerate(drafts) if probs[i, t] == 0), len(drafts))
        return Verdict(drafts[:kept] + own[kept : kept + 1], kept)

    monkeypatch.setattr(engine_module, "verify_keyed", keeps_what_the_target_allows)
    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    params = dict(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    engine = Engine(
        target,
        eos_token_ids=[EOS % vocab],
        proposer=DraftModelProposer(perturbed(target, 1.5, seed=4)),
        num_speculative_tokens=3,
    )
    samples = seeded_outputs(engine, prompt, params, batches=4)
    assert chi_square_p_value(samples, target_continuation_probs(target, prompt, SamplingParams(**params))) < 1e-4


def test_request_validation(target):
    engine = Engine(target, eos_token_ids=[EOS], max_model_len=32)
    with pytest.raises(ConfigError, match="maximum model length 32"):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=13))
    with pytest.raises(ConfigError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.add_request([1, 500], SamplingParams())
    assert not engine.has_unfinished()


def test_min_tokens_with_every_id_a_stop_is_refused_and_one_id_left_decodes(target):
    """With every id a stop id (EOS counted unless ignored), no token could come before
    min_tokens: greedy decoding once took id 0 anyway. Refused with the fix; with one id
    left out of the stops, the output is that id until min_tokens."""
    engine = Engine(target, eos_token_ids=[EOS])
    vocab = target.config.vocab_size
    others = tuple(i for i in range(vocab) if i != EOS)
    for params in (
        SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2, stop_token_ids=others),
        SamplingParams(max_tokens=4, temperature=0.8, min_tokens=1, stop_token_ids=(*others, EOS), ignore_eos=True),
    ):
        with pytest.raises(ConfigError, match="cover the whole vocabulary.*drop min_tokens"):
            engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished()
    left = others[7]
    stops = tuple(i for i in others if i != left)
    seq = engine.add_request(
        [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2, stop_token_ids=stops)
    )
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids[:2] == [left, left] and seq.finish_reason in ("stop", "length")


def test_a_top_k_past_what_a_chain_holds_is_refused_and_the_largest_decodes_beside_others(target):
    """A multi-step chain holds each request's top_k in a tensor, where 10**400 (which
    JSON carries) failed the step of every request beside it: it is refused. At the
    bound, a sampled request decodes in the chains and its neighbour gets its tokens."""
    with pytest.raises(InvalidSamplingValue, match="top_k"):
        SamplingParams(temperature=1.0, top_k=10**400)
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=2, capacity=64)  # static steps, eager on a CPU
    engine = Engine(graphed, eos_token_ids=[EOS], num_scheduler_steps=4)
    neighbour = engine.add_request(PROMPTS[1], GREEDY)
    widest = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=24, temperature=1.0, top_k=TOP_K_MAX))
    while engine.has_unfinished():
        engine.step()
    assert graphed.static.chains and widest.finish_reason is not None
    assert neighbour.output_ids == plain_tokens(target, PROMPTS[1])


class UnstorablePrefixCache(PrefixCache):
    def store(self, token_ids, cache):
        raise torch.OutOfMemoryError("CUDA out of memory")  # copying a block may find a full GPU


def test_a_prefix_that_cannot_be_stored_fails_no_request_and_gives_its_slot_back(target):
    """A finished request's prefix is copied into the prefix cache: where that fails, the
    request still ends as it would, its neighbour goes on, and its pool slot comes back
    (a slot left taken would fail every later step that needs it)."""
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=2, capacity=64)
    engine = Engine(graphed, eos_token_ids=[EOS], prefix_cache=UnstorablePrefixCache(1024))
    short = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    neighbour = engine.add_request(PROMPTS[1], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert short.output_ids == plain_tokens(target, PROMPTS[0])[:3]
    assert neighbour.output_ids == plain_tokens(target, PROMPTS[1])
    assert graphed.static.pool.num_free == 2


def test_a_draft_prefix_that_cannot_be_stored_gives_the_drafts_slot_back(target):
    """The draft model's own prefix cache fails as the target's may: its pool slot comes
    back all the same, and later requests draft and decode as before."""
    graphed, draft = copy.deepcopy(target), perturbed(target, 0.3, seed=2)
    draft.use_cuda_graphs(num_slots=1, capacity=64)
    proposer = DraftModelProposer(draft, catch_up_chunk_size=8)
    proposer.prefix_cache = UnstorablePrefixCache(1024)
    engine = Engine(graphed, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    for prompt in PROMPTS[:2]:  # one draft slot: the second request needs the first one's back
        seq = engine.add_request(prompt, GREEDY)
        while engine.has_unfinished():
            engine.step()
        assert seq.output_ids == plain_tokens(target, prompt)
        assert draft.static.pool.num_free == 1


def test_a_request_asking_for_logprobs_drafts_on_static_steps_beside_a_sampled_one(target):
    """A draft's chain on static steps samples and processes logits for the requests that
    do, and computes no logprobs: a request asking for them (greedy here) drafts beside a
    sampled one instead of failing the batch's step."""
    graphed, draft = copy.deepcopy(target), perturbed(target, 0.3, seed=2)
    for model in (graphed, draft):
        model.use_cuda_graphs(num_slots=2, capacity=64)
    proposer = DraftModelProposer(draft, catch_up_chunk_size=8)
    engine = Engine(graphed, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, num_scheduler_steps=1)
    with_logprobs = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0, logprobs=1))
    sampled = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert with_logprobs.output_ids == plain_tokens(target, PROMPTS[1], with_logprobs.params)
    assert len(with_logprobs.logprobs) == with_logprobs.num_output_tokens and sampled.num_output_tokens == 24


def test_caches_hold_one_position_less_than_the_tokens(target):
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2))
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=5)
    seq = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
        assert seq.cache.length == len(seq.token_ids) - 1
        draft_cache = proposer.caches.get(seq.seq_id)  # none before the first draft
        assert draft_cache is None or draft_cache.length <= len(seq.token_ids) - 1
    assert seq.seq_id in proposer.caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "draft_head, lookup_first, cut_short, keyed, answers",
    [
        (4, None, False, True, False),
        (3, None, False, True, False),
        (4, 1, False, True, False),
        (4, 1, True, True, False),
        (4, None, False, False, False),
        (4, 1, False, False, False),
        (4, 1, False, True, True),
        (4, 1, False, False, True),
    ],
    ids=[
        "whole-vocabulary",
        "draft-guesses-3-of-4-ids",
        "lookup-first",
        "lookups-cut-short",
        "whole-vocabulary-unseeded",
        "lookup-first-unseeded",
        "lookup-first-and-answers",
        "lookup-first-and-answers-unseeded",
    ],
)
def test_speculative_engine_samples_the_target_distribution(
    device, draft_head, lookup_first, cut_short, keyed, answers
):
    """End to end at temperature > 0: a batch of requests through the draft proposer
    (early stops included), ragged verification and rollback gives 4-token outputs
    distributed exactly as the target's own sampling would (chi-square over all 4^4),
    also where the draft's common head scores only some token ids (Decoder.add_common_head:
    each sequence's guesses over those or every id, by its text),
    where lookups draft in place of the model (one-hot drafts beside the model's), from
    the sequence's own text or from the answers before it too (`lookup_answers`), and
    where only the first token of each lookup is verified, as adaptive speculation cuts
    them under load (the rest still compared with what follows). Seeded requests are
    verified by their keyed draws, unseeded ones by rejection sampling."""
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    vocab, length, prompt = 4, 4, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    draft = perturbed(target, 1.5, seed=4)
    draft.add_common_head(draft_head)  # 3: while a sequence has no 3, a 3 only comes from the target's residual
    draft = on(draft, device)
    params = dict(max_tokens=length, temperature=0.9, top_p=0.95, ignore_eos=True)
    expected = target_continuation_probs(target, prompt, SamplingParams(**params))

    proposer = DraftModelProposer(draft, confidence_threshold=0.5)
    engine = Engine(
        on(target, device),
        eos_token_ids=[EOS % vocab],
        proposer=proposer,
        num_speculative_tokens=3,
        lookup_first=lookup_first,
        lookup_answers=answers,
    )
    if cut_short:
        look_up = engine._look_up
        engine._look_up = lambda decoding: {i: Draft(d.tokens[:1]) for i, d in look_up(decoding).items()}
    lookups = log_lookups(engine)
    samples = seeded_outputs(engine, prompt, params, keyed=keyed)
    stats = engine.spec_stats
    assert 0.2 < stats.acceptance_rate < 0.95  # a draft that is often wrong, not always
    assert stats.num_draft_tokens < 2 * stats.num_drafts  # early stops happened (k would be 2)
    assert bool(lookups) == bool(lookup_first)
    assert chi_square_p_value(samples, expected) > 1e-4


@pytest.mark.parametrize("keyed", [True, False], ids=["seeded", "unseeded"])
def test_suffix_decoding_from_earlier_answers_samples_the_target_distribution(keyed):
    """Sampling requests drafted by suffix decoding, from their own text and from the
    answers of the requests before them (drafts that change with every answer kept),
    give 4-token outputs distributed as the target's own sampling (chi-square over all
    4^4), seeded ones by their keyed draws, unseeded ones by rejection sampling."""
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    params = dict(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    expected = target_continuation_probs(target, prompt, SamplingParams(**params))
    proposer = SuffixProposer(max_tree_depth=8, max_cached_requests=200, min_token_prob=0.2)
    engine = Engine(target, eos_token_ids=[EOS % vocab], proposer=proposer, num_speculative_tokens=3)
    samples = seeded_outputs(engine, prompt, params, batches=5, keyed=keyed)
    stats = engine.spec_stats
    assert len(proposer.shared.documents) == 200
    assert 0.1 < stats.acceptance_rate < 0.95
    assert chi_square_p_value(samples, expected) > 1e-4


def test_max_num_seqs_bounds_the_batch_and_the_rest_wait(target):
    engine = Engine(target, eos_token_ids=[EOS], proposer=NgramProposer(1, 3), num_speculative_tokens=3, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    assert len(engine.waiting) == 4 and not engine.running
    most_running = 0
    while engine.has_unfinished():
        engine.step()
        most_running = max(most_running, len(engine.running))
        assert len(engine.running) <= 2
    assert most_running == 2
    for seq, prompt in zip(seqs, PROMPTS):
        assert seq.output_ids == plain_tokens(target, prompt)[:6]


def test_chunked_prefill_keeps_running_sequences_decoding(target):
    """A long prompt arriving mid-run is fed in chunks while the running sequence still
    gets tokens every step; both outputs equal their solo runs."""
    engine = Engine(target, eos_token_ids=[EOS], prefill_chunk_size=8, price_chunks=False)
    running = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # PROMPTS[0] (5 tokens) fits one chunk
    long_prompt = list(range(3, 60))  # 57 tokens: 8 chunks
    late = engine.add_request(long_prompt, GREEDY)
    for chunk in range(7):
        advanced = engine.step()
        assert advanced == [running]  # the late prompt's partial chunks sample nothing
        assert late.cache.length == 8 * (chunk + 1) and late.num_output_tokens == 0
    assert late in engine.step() and late.num_output_tokens == 1
    while engine.has_unfinished():
        engine.step()
    assert running.output_ids == plain_tokens(target, PROMPTS[0])
    assert late.output_ids == plain_tokens(target, long_prompt)


def test_a_short_prompt_is_read_before_a_long_one_that_joined_first(target):
    """A prompt joining while a long one is being read takes the chunk budget ahead of
    it, where it would otherwise wait out every chunk of the long one; both outputs
    equal their solo runs."""
    engine = Engine(target, eos_token_ids=[EOS], prefill_chunk_size=8)
    long_prompt = list(range(3, 60))  # 57 tokens: 8 chunks
    long = engine.add_request(long_prompt, GREEDY)
    engine.step()
    short = engine.add_request(PROMPTS[0], GREEDY)  # 5 tokens
    assert engine.step() == [short]  # its whole prompt and 3 of the long one's in one step
    assert long.cache.length == 8 + 3
    while engine.has_unfinished():
        engine.step()
    assert short.output_ids == plain_tokens(target, PROMPTS[0])
    assert long.output_ids == plain_tokens(target, long_prompt)


def test_a_long_prompt_is_not_overtaken_without_end(target):
    """Prompts keep overtaking a long one only while they join before it would have
    been read with the whole budget: a steady stream of short prompts delays it, and it
    still gets its first token."""
    engine = Engine(target, eos_token_ids=[EOS], prefill_chunk_size=8, max_num_seqs=64)
    long = engine.add_request(list(range(3, 60)), GREEDY)  # 8 chunks on its own
    steps = 0
    while long.num_output_tokens == 0:
        engine.add_request(list(range(3, 11)), dataclasses.replace(GREEDY, max_tokens=2))  # a chunk each step
        engine.step()
        steps += 1
        assert steps < 40
    assert steps > 8  # overtaken at first


def test_a_cpu_engine_reads_prompts_in_small_chunks_by_default(target):
    """On a CPU a chunk's step holds the running requests' next token: the default chunk
    is the CPU's, and one named explicitly wins."""
    assert Engine(target, eos_token_ids=[EOS]).prefill_chunk_size == CPU_PREFILL_CHUNK_SIZE
    assert Engine(target, eos_token_ids=[EOS], prefill_chunk_size=300).prefill_chunk_size == 300
    assert prefill_chunk_size_for(torch.device("cuda")) == DEFAULT_PREFILL_CHUNK_SIZE > CPU_PREFILL_CHUNK_SIZE


def test_abort_removes_a_sequence_wherever_it_is(target):
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2))
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, max_num_seqs=1)
    first = engine.add_request(PROMPTS[0], GREEDY)
    second = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    engine.step()
    assert first.seq_id in proposer.caches
    engine.finish(second.seq_id)  # still waiting
    engine.finish(first.seq_id)  # running, with a draft cache
    assert not engine.has_unfinished() and not proposer.caches
    assert first.finish_reason == second.finish_reason == "abort"
    engine.finish(first.seq_id)  # a second abort is harmless


def test_lookup_first_drafts_teach_adaptive_k_nothing(target):
    """Where the last tokens occurred before, a lookup drafts and the draft model does
    not run; those steps are not the model's, so adaptive k records neither their
    acceptance nor a drafting time. The output stays the target's own."""
    from specserve.spec.adaptive import AdaptiveSpecLength

    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2))
    adaptive = AdaptiveSpecLength(7, prior_draft_cost_ratio=0.01)  # drafting looks cheap: it drafts
    recorded, timed = [], []
    record, observe_draft = adaptive.record, adaptive.observe_draft
    adaptive.record = lambda seq_id, drafted, accepted, dropped=0: (
        recorded.append(drafted + dropped),  # the model ran where it drafted or dropped a first guess
        record(seq_id, drafted, accepted, dropped),
    )
    adaptive.observe_draft = lambda positions, seconds: (timed.append(positions), observe_draft(positions, seconds))
    # Verified rows priced by the prior, not by this machine's load: a busy machine's
    # timings can price every lookup's rows above what it earns, and none drafts.
    adaptive.observe_target = lambda rows, seconds: None
    engine = Engine(
        target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, adaptive=adaptive, lookup_first=2
    )
    lookups = log_lookups(engine)
    steps = 0
    for prompt in PROMPTS:
        seq = engine.add_request(prompt, GREEDY)
        while not seq.finished:
            engine.step()
            steps += 1
        assert seq.output_ids == plain_tokens(target, prompt)
    assert lookups and any(recorded)
    assert len(recorded) == steps - len(lookups)  # one sequence a step: all but the lookups' recorded
    assert len(timed) <= sum(1 for n in recorded if n)  # drafting timed only where the model drafted


def test_a_lookup_after_a_rejected_one_drafts_less(target):
    """A lookup's k is up to num_speculative_tokens, and 1 + 2a after a lookup that had a
    tokens accepted: where the text stops repeating, the next match is often wrong."""
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=DraftModelProposer(perturbed(target, 0.3, seed=2)),
        num_speculative_tokens=7,
        lookup_first=1,
    )
    lookups = log_lookups(engine)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GREEDY).output_ids == plain_tokens(target, prompt)
    assert any(last == 0 for last, _ in lookups) and any(n == 7 for _, n in lookups)
    assert all(n <= 1 + 2 * last for last, n in lookups if last is not None)


@pytest.mark.parametrize("max_k, lookup_max_k", [(7, None), (2, 9)])
def test_under_adaptive_k_a_lookup_drafts_up_to_its_own_bound(target, max_k, lookup_max_k):
    """A lookup costs nothing to draft: under adaptive k it drafts up to lookup_max_k
    (max_speculative_tokens, or for Medusa 15), whatever k the proposer drafts."""
    from specserve.spec.adaptive import AdaptiveSpecLength

    adaptive = AdaptiveSpecLength(max_k, prior_draft_cost_ratio=0.5, lookup_max_k=lookup_max_k)
    adaptive.lookup_ks = lambda seq_ids, proposed, batch: list(proposed)
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2))
    drafted = log_asked(proposer)
    engine = Engine(
        target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=2, adaptive=adaptive, lookup_first=1
    )
    lookups = log_lookups(engine)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GREEDY).output_ids == plain_tokens(target, prompt)
    assert max(n for _, n in lookups) == (lookup_max_k or max_k)
    assert max(drafted) <= max_k


@pytest.mark.parametrize("max_k", [1, 2])
def test_adaptive_k_bounded_below_a_probes_length_probes_within_its_bound(target, max_k):
    """max_speculative_tokens below PROBE_TOKENS (or a Medusa checkpoint of one or two
    heads) bounds the probes too, and the output stays the target's."""
    from specserve.spec.adaptive import AdaptiveSpecLength

    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2))
    drafted = log_asked(proposer)
    adaptive = AdaptiveSpecLength(max_k, prior_draft_cost_ratio=0.5)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=1, adaptive=adaptive)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        assert engine.generate(prompt, params).output_ids == plain_tokens(target, prompt, params)
    assert drafted and max(drafted) == max_k


def lookup_engine(target, verified) -> tuple[Engine, list, list]:
    """An adaptive engine whose policy verifies verified(n) tokens of each n-token lookup,
    with the lookups it proposed (their start and tokens) and what it learnt of each
    (its length, how many of its tokens came next)."""
    from specserve.spec.adaptive import AdaptiveSpecLength

    adaptive = AdaptiveSpecLength(7, prior_draft_cost_ratio=0.5)
    adaptive.lookup_ks = lambda seq_ids, proposed, batch: [verified(n) for n in proposed]
    learnt, record_lookup = [], adaptive.record_lookup
    adaptive.record_lookup = lambda seq_id, n, matched: (learnt.append((n, matched)), record_lookup(seq_id, n, matched))
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=DraftModelProposer(perturbed(target, 0.3, seed=2)),
        num_speculative_tokens=7,
        adaptive=adaptive,
        lookup_first=1,
    )
    proposed, look_up = [], engine._look_up

    def logged(decoding):
        pending = [s.lookup_pending for s in decoding]
        found = look_up(decoding)
        proposed.extend(s.lookup_pending for s, before in zip(decoding, pending) if s.lookup_pending is not before)
        return found

    engine._look_up = logged
    return engine, proposed, learnt


@pytest.mark.parametrize("verified", [lambda n: 0, lambda n: 1], ids=["none-verified", "one-verified"])
def test_a_lookup_is_learnt_whether_or_not_it_is_verified(target, verified):
    """Adaptive verifies only as much of a lookup as pays (AdaptiveSpecLength.lookup_ks);
    what the lookup would have earned is still learnt, from the tokens that came after
    it, so a lookup cut short is not priced by its prior for good. The output stays the
    target's own."""
    engine, proposed, learnt = lookup_engine(target, verified)
    prompt = PROMPTS[1]
    seq = engine.generate(prompt, GREEDY)
    assert seq.output_ids == plain_tokens(target, prompt)
    truth = []
    for start, tokens in proposed:
        came = seq.token_ids[start : start + len(tokens)]
        matched = next((n for n, (a, b) in enumerate(zip(tokens, came)) if a != b), len(came))
        if matched < len(tokens) and start + matched == len(seq.token_ids):
            break  # the output ended while this one was still matching: never settled
        truth.append((len(tokens), matched))
    assert learnt == truth and any(n > 1 for n, _ in learnt)
    assert any(matched > verified(n) for n, matched in learnt)  # learnt past what was verified


def test_draft_catches_up_on_a_long_prompt_in_chunks(target):
    """A new sequence feeds the draft one chunk per step and is not drafted for until
    the draft has seen everything; the output is still the target's own."""
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2), catch_up_chunk_size=8)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    prompt = list(range(3, 40))  # 37 tokens
    seq = engine.add_request(prompt, GREEDY)
    engine.step()  # the target's prefill: first token
    draft_lengths = []
    while seq.spec.num_drafts == 0:
        engine.step()
        draft_lengths.append(proposer.caches[seq.seq_id].length)
    assert draft_lengths[:4] == [8, 16, 24, 32]  # a chunk per step, no drafts meanwhile
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == plain_tokens(target, prompt)


@pytest.mark.parametrize("proposer_kind", ["none", "draft"])
def test_a_request_whose_verification_fails_ends_alone(target, monkeypatch, proposer_kind):
    """A request whose own arithmetic fails (here: a verifier that raises at top-k 13)
    finishes with "error" and its `failure`; the sequence beside it in the batch gets
    its solo tokens."""
    import specserve.engine.engine as engine_module

    real_verify = engine_module.verify

    def failing_at_top_k_13(scores, draft, params, generator):
        if params.top_k == 13:
            raise RuntimeError("probabilities are not finite")
        return real_verify(scores, draft, params, generator)

    monkeypatch.setattr(engine_module, "verify", failing_at_top_k_13)
    proposer = None if proposer_kind == "none" else DraftModelProposer(perturbed(target, 0.3, seed=2))
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3 if proposer else 0)
    neighbour = engine.add_request(PROMPTS[1], GREEDY)
    failing = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=24, temperature=1.0, top_k=13))
    returned = []
    while engine.has_unfinished():
        returned += engine.step()
    assert failing.finish_reason == "error" and "not finite" in str(failing.failure)
    assert failing in returned and failing.num_output_tokens == 0
    assert neighbour.finish_reason == "length" and neighbour.output_ids == plain_tokens(target, PROMPTS[1])
    assert not engine.running and (proposer is None or not proposer.caches)


def test_steps_that_read_a_prompt_decode_the_others_plainly(target):
    """While a new prompt is read in chunks, the proposer is not called (no drafting, no
    draft reading the prompt) and each decoding sequence, a seeded sampling one too,
    gets one token a step."""
    proposer = DraftModelProposer(copy.deepcopy(target))  # always right: 4 tokens a drafting step
    calls = []
    propose = proposer.propose
    proposer.propose = lambda seqs, ks, least=None: calls.append([s.seq_id for s in seqs]) or propose(seqs, ks, least)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, prefill_chunk_size=8)
    greedy = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    seeded = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=60, temperature=0.8, seed=3, ignore_eos=True))
    engine.step()
    engine.step()
    assert greedy.prefilled and seeded.prefilled
    late = engine.add_request(list(range(10, 40)), GREEDY)  # 30 tokens: 4 steps of 8
    calls.clear()
    while not late.prefilled:
        before = greedy.num_output_tokens, seeded.num_output_tokens
        engine.step()
        assert (greedy.num_output_tokens, seeded.num_output_tokens) == (before[0] + 1, before[1] + 1)
    assert not calls
    calls.clear()
    engine.step()
    assert calls and greedy.seq_id in calls[0]
