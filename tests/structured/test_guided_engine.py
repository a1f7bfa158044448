"""A guide in the engine: guided greedy decoding is the masked target's, token by token,
with every proposer; sampling through a draft that is often wrong draws the masked
target's distribution (chi-square); an answer that ends on EOS matches the pattern."""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from specserve.engine.engine import Engine
from specserve.model.decoder import Decoder, Segment
from specserve.penalties import processed_logits
from specserve.sampling import SamplingParams, logits_to_probs
from specserve.spec.draft_model import DraftModelProposer
from specserve.structured.guide import Guide, GuideVocabulary
from specserve.structured.regex import compile_regex, mask_classes
from tests.chi_square import chi_square_p_value, seeded_outputs
from tests.conftest import tiny_config
from tests.engine.test_engine import EOS, PROMPTS, perturbed, random_decoder
from tests.head_models import METHODS, permutation_target, right_head
from tests.spec.test_head_proposers import proposer_of, run_batch
from tests.test_penalties import proposer_of_kind

# 96 ids: single characters, a few longer pieces, and EOS (95), which is no text.
PIECES = (
    list("0123456789abcdefghijklmnopqrstuvwxyz")
    + list('{}[]":, -.\n')
    + [
        '{"',
        '":',
        '",',
        '"}',
        "12",
        "ab",
        "true",
        "false",
        "null",
        '": "',
        "name",
        "age",
    ]
)
TEXTS = (PIECES + [f"<{i}>" for i in range(len(PIECES), EOS)] + [None])[: EOS + 1]
VOCABULARY = GuideVocabulary.from_texts(TEXTS)
PATTERNS = {
    "object": r'\{"name": "[a-z ]{1,12}", "age": (0|[1-9][0-9]{0,2})\}',
    "choice": r"(yes|no|maybe)",
    "digits": r"[0-9]+(,[0-9]+)*",
}


def guide_of(pattern: str) -> Guide:
    return Guide(compile_regex(pattern), VOCABULARY, "test pattern")


def text_of(ids: list[int]) -> str:
    return "".join(TEXTS[i] or "" for i in ids)


def guided_greedy_by_hand(
    target: Decoder, prompt: list[int], guide, max_tokens: int, reads: Callable[[int, int], bool] | None = None
) -> list[int]:
    """One full forward a token; the argmax among the ids whose text keeps a match in
    reach (`reads(state, id)`; by default walked through a Guide's DFA), and EOS where
    the text already matches or nothing else can follow, until EOS."""
    if reads is None:
        reads = lambda state, t: bool(TEXTS[t]) and guide.dfa.live()[guide.dfa.walk(state, TEXTS[t])]  # noqa: E731
    output: list[int] = []
    state = guide.start
    while len(output) < max_tokens:
        ids = prompt + output
        logits = target(torch.tensor(ids), [Segment(target.new_cache(), len(ids))])[-1]
        allowed = [t for t in range(EOS) if reads(state, t)]
        if guide.accepts(state) or not allowed:
            allowed.append(EOS)
        token = max(allowed, key=lambda t: float(logits[t]))
        output.append(token)
        if token == EOS:
            break
        state = guide.step(state, token)
    return output


def guided_through_engine(target: Decoder, guide, proposer_kind: str, max_tokens: int = 40) -> list[list[int]]:
    """Each of PROMPTS decoded greedily under `guide` by one engine, with a proposer of
    `proposer_kind` (test_penalties.py) drafting 4 tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guide=guide)
    proposer = proposer_of_kind(proposer_kind, target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    seqs = [engine.add_request(prompt, params) for prompt in PROMPTS]
    while not all(s.finished for s in seqs):
        engine.step()
    return [seq.output_ids for seq in seqs]


def test_masks_are_the_ids_whose_text_keeps_a_match_in_reach():
    """Every state's mask, against walking each id's text through the DFA alone."""
    for pattern in PATTERNS.values():
        guide = guide_of(pattern)
        live = guide.dfa.live()
        for state in range(guide.dfa.dead):
            expected = [bool(t) and bool(live[guide.dfa.walk(state, t)]) for t in TEXTS]
            assert guide.allowed(state, {EOS})[:EOS].tolist() == expected[:EOS], (pattern, state)
            assert bool(guide.allowed(state, {EOS})[EOS]) == (guide.accepts(state) or not any(expected))
        assert guide.allowed(guide.dfa.dead, {EOS}).nonzero().flatten().tolist() == [EOS]


def test_each_row_is_masked_after_the_drafts_before_it():
    guide = guide_of(PATTERNS["choice"])
    params = SamplingParams(guide=guide)
    logits = torch.randn(4, EOS + 1)
    y, e, m = TEXTS.index("y"), TEXTS.index("e"), TEXTS.index("m")
    out = processed_logits(logits, params, [1], [], [y, e, m], stop_ids={EOS})
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == sorted([TEXTS.index(c) for c in "ynm"])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [e]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [TEXTS.index("s")]
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [EOS]  # "yesm" left the pattern


@pytest.fixture(scope="module")
def target() -> Decoder:
    return random_decoder("qwen2", seed=1)


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("proposer_kind", ["none", "draft", "ngram"])
def test_guided_greedy_decoding_is_the_masked_targets_with_every_proposer(target, pattern, proposer_kind):
    guide = guide_of(PATTERNS[pattern])
    params = SamplingParams(max_tokens=40, temperature=0.0, guide=guide)
    proposer = proposer_of_kind(proposer_kind, target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [(prompt, params) for prompt in PROMPTS] + [(PROMPTS[0], free)]  # a free neighbour
    seqs = [engine.add_request(prompt, p) for prompt, p in requests]
    while not all(s.finished for s in seqs):
        engine.step()
    for seq, (prompt, p) in zip(seqs[:-1], requests):
        expected = guided_greedy_by_hand(target, prompt, guide, 40)
        assert seq.output_ids == expected
        if expected[-1] == EOS:
            assert re.fullmatch(PATTERNS[pattern], text_of(expected[:-1]))
    assert seqs[-1].output_ids == Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[0], free).output_ids
    if proposer_kind == "draft":
        assert engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_guided_greedy_decoding_with_heads_is_the_masked_targets(method):
    target, perm = permutation_target(noise=0.18)
    guide = Guide(compile_regex(r"[0-9a-f]{3,30}"), GuideVocabulary.from_texts(TEXTS), "hex")
    head = proposer_of(right_head(method, target, perm), target)
    engine = Engine(target, eos_token_ids=[EOS], proposer=head, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, guide=guide)
    requests = [(PROMPTS[1], params), (PROMPTS[3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]
    seqs = run_batch(engine, requests)
    assert seqs[0].output_ids == guided_greedy_by_hand(target, PROMPTS[1], guide, 24)
    assert all(TEXTS[t] in set("0123456789abcdef") or t == EOS for t in seqs[0].output_ids)
    assert engine.spec_stats.num_draft_tokens > 0


def test_guided_sampling_through_a_draft_samples_the_masked_target():
    """3-token answers at temperature 0.9 through a draft that is often wrong, under a
    pattern that allows some ids at each position and not others: distributed as
    sampling the masked target token by token (chi-square over all outputs)."""
    vocab, length, prompt = 5, 3, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    texts = ["a", "b", "c", "ab", None]  # id 4: the stop id, no text
    guide = Guide(compile_regex("(a|b)(b|c)(a|c)c*"), GuideVocabulary.from_texts(texts), "test")
    fields = dict(max_tokens=length, temperature=0.9, ignore_eos=True, guide=guide)
    params = SamplingParams(**fields)
    expected = torch.zeros([vocab] * length, dtype=torch.float64)
    for cont in itertools.product(range(vocab), repeat=length):
        ids = prompt + list(cont)
        logits = target(torch.tensor(ids), [Segment(target.new_cache(), len(ids))])[len(prompt) - 1 : -1]
        probability = 1.0
        for j, token in enumerate(cont):
            masked = processed_logits(logits[j : j + 1], params, prompt, list(cont[:j]), [], stop_ids=set())
            probability *= float(logits_to_probs(masked, params)[0, token])
        expected[cont] = probability
    assert abs(float(expected.sum()) - 1) < 1e-6
    engine = Engine(
        target, eos_token_ids=[4], proposer=DraftModelProposer(perturbed(target, 1.5, seed=4)), num_speculative_tokens=2
    )
    samples = seeded_outputs(engine, prompt, fields, batches=6)
    for row in samples.tolist()[:200]:
        assert re.fullmatch("(a|b)(b|c)(a|c)c*", "".join(texts[t] for t in row)) or "ab" in [texts[t] for t in row]
    assert 0.1 < engine.spec_stats.acceptance_rate < 0.95
    assert chi_square_p_value(samples, expected) > 1e-4


@pytest.mark.parametrize("proposer_kind", ["none", "draft"])
def test_on_static_steps_a_guided_request_keeps_its_masks(target, proposer_kind):
    """Static steps process logits inside the graph and know no guide or bad words.
    While a request with them runs, the target's multi-step chains wait (the batch steps
    row by row on the host), and a draft's chains of guesses go on unmasked for it (its
    guesses are verified against the masked rows): each request gets the masked
    target's greedy text, the free neighbour plain decoding's."""
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=4, capacity=128)  # static steps, eager on a CPU
    proposer = None
    if proposer_kind == "draft":
        draft = perturbed(target, 0.3, seed=2)
        draft.use_cuda_graphs(num_slots=4, capacity=128)
        proposer = DraftModelProposer(draft, catch_up_chunk_size=8)
    engine = Engine(
        graphed,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=3 if proposer else 0,
        num_scheduler_steps=4 if proposer is None else 1,
    )
    guide = guide_of(PATTERNS["digits"])
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_free = Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[1], free).output_ids
    bad = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, bad_words_ids=(tuple(plain_free[2:4]),))
    guided = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, guide=guide))
    neighbour = engine.add_request(PROMPTS[1], free)
    banned = engine.add_request(PROMPTS[1], bad)
    while engine.has_unfinished():
        engine.step()
    assert guided.output_ids == guided_greedy_by_hand(target, PROMPTS[0], guide, 30)
    assert neighbour.output_ids == plain_free
    assert banned.output_ids[:3] == plain_free[:3] and banned.output_ids[3] != plain_free[3]
    assert proposer is None or draft.static.chains


@pytest.mark.parametrize("pattern", [*PATTERNS.values(), "[a-z]{0,40}x", r'"([^"\\]|\\n){0,30}"', "(ab|a){3,9}b?"])
def test_states_that_share_a_mask_class_allow_the_same_tokens(pattern):
    """Mask classes are exact: every state's own walk over the vocabulary gives the
    mask its class keeps; and a long bounded repeat shares masks."""
    guide = guide_of(pattern)
    for state in range(guide.dfa.dead + 1):
        assert np.array_equal(guide._walk_every_token(state), guide._text_mask(state).numpy()), state
    classes = mask_classes(guide.dfa, len(VOCABULARY.counts))
    if pattern == "[a-z]{0,40}x":
        assert len(np.unique(classes)) < guide.dfa.dead / 2
