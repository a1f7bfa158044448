"""The engine: continuous batching, and one `step()` that advances every running
sequence by one verified step.

- Requests join in FIFO order between steps while fewer than `max_num_seqs` run, and
  leave at the end of the step that finished them. Under the "priority" scheduling
  policy (vLLM's), they join by priority, lower first, then by arrival.
- A step runs ONE target forward over the batch (each sequence's unseen tokens, then its
  drafts, ragged k), keeps 1..k+1 tokens a sequence and rolls the target cache back past
  rejected drafts; greedy sequences of a verifying `FusedDraftProposer` do so in one C call.
- A step that feeds a prompt chunk (at most `prefill_chunk_size` tokens) drafts nothing,
  so TTFT is what it is without speculation. The chunk budget goes first to the prompt
  that would have been read first had each had the whole budget since it joined
  (`_reading_order`): a short prompt is not held behind every chunk of a long one.
  Beside decoding sequences the budget is priced by where each chunk lies and whether
  its rows' logprobs are owed (`ChunkCosts`): far into a long prompt, or for a prompt
  that computes the LM head at every row, a chunk is shorter, so the step the others
  wait for costs about what a whole chunk at a prompt's start does.
- A seeded sampling request is verified by its keyed draws (spec/verify.py,
  `verify_keyed`): its tokens are plain sampling's whatever k, drafts or neighbours its
  steps had, so adaptive k chooses its k as any other's.
- Lookup first (`lookup_first`) drafts from a sequence's own earlier tokens, and no k is
  chosen from the current step's outputs: the output stays the target's.
- A joining request starts from the longest prefix of its prompt, all but its last token,
  stored in the `prefix_cache` or held by a running sequence.
- With `kv_cache_positions`, the running sequences' target caches hold at most that
  many positions of storage (`KVCache.capacity_for`, each with room for its next step):
  a request joins only where its tokens fit, and where the running ones outgrow the
  budget the latest admitted (under "priority": the lowest priority, then the latest
  arrived) is preempted (vLLM's recompute): its caches are dropped
  (kept in the prefix cache where there is one), it waits at the head of the queue (under
  "priority": ahead of those after it in priority and arrival), and
  it joins again by reading all but its newest token as a prompt, unscored, so that its
  next step is the one it would have taken. Greedy and seeded output is unchanged, up
  to the rounding of a read against a step's (as with prefix caching).
- Multi-step decoding (`num_scheduler_steps`, vLLM's name): where the target runs static
  steps (CUDA graphs) and a step would only decode sequences without drafts or prompts
  (plainly, or where adaptive k drafts nothing), it decodes that many tokens each in
  one static step (TokenChain: greedy or sampled, penalised, with the logprobs a
  request asks for, capturing a head's features), the host reading them back once;
  tokens past a stop token or max_tokens are dropped as rejected drafts are. A request
  that arrives meanwhile joins at the next step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple
from typing import Sequence as Seq

import torch

from specserve.config import DEFAULT_MAX_SPECULATIVE_TOKENS, prefill_chunk_size_for
from specserve.engine.chunk_costs import ChunkCosts, arithmetic_horizon, lm_head_share
from specserve.engine.sequence import Sequence
from specserve.errors import ConfigError
from specserve.logprobs import TokenLogprob, token_logprobs
from specserve.model.decoder import Decoder, Segment
from specserve.model.graphs import ProcessedText
from specserve.model.prefix_cache import ChunkReads, PrefixCache, copy_prefix, release_into
from specserve.penalties import processed_logits
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import MAX_CATCH_UP, AdaptiveSpecLength
from specserve.spec.features import FedRows
from specserve.spec.fused import FusedDraftProposer
from specserve.spec.ngram import NgramProposer
from specserve.spec.prediction import MAX_MATCH
from specserve.spec.proposer import Draft, Proposer
from specserve.spec.stats import SpecStats
from specserve.spec.suffix import SuffixProposer
from specserve.spec.verify import Verdict, common_prefix_length, verdict_from_argmax, verify, verify_keyed

DEFAULT_MAX_NUM_SEQS = 8  # the running batch: small, as a few CPU cores pay for every row
# Tokens a sequence decodes per engine step where multi-step decoding runs: the host's
# ~0.3 ms around each GPU step shared by 8 tokens (see the module's docstring).
DEFAULT_NUM_SCHEDULER_STEPS = 8

log = logging.getLogger("specserve")

# How waiting requests are ordered (vLLM's --scheduling-policy): first come first served,
# or by each request's priority (lower first), then its arrival.
SCHEDULING_POLICIES = ("fcfs", "priority")


def _rank(seq: Sequence) -> tuple[int, float, int]:
    """A sequence's place under the "priority" policy: lower is admitted first, preempted last."""
    return seq.priority, seq.arrival_time, seq.seq_id


@dataclass
class _Work:
    """One sequence's share of a step."""

    seq: Sequence
    tokens: list[int]  # fed to the target: unseen tokens (maybe a prompt chunk), then drafts
    draft: Draft
    scored: bool  # False for a prompt chunk that is not the last: nothing is sampled


class _Outcome(NamedTuple):
    """One sequence's step: what it drafted (and dropped: `Draft.dropped`), the verdict,
    and the emitted tokens' logprobs where the request asked for them."""

    seq: Sequence
    num_drafted: int
    verdict: Verdict
    logprobs: list[TokenLogprob] | None = None
    num_dropped: int = 0
    first_confidence: float | None = None  # Draft.first_confidence


def fusable(seq: Sequence) -> bool:
    """Whether the fused call can run this sequence's step: greedy, drafting from the raw
    logits. Masks (allowed ids, min_tokens, bad words, a guide) and logprobs are applied
    to the rows' logits the call returns (`verified_on_host`); penalties and logit bias
    are not fused, since the raw guesses would miss what they change."""
    params = seq.params
    return params.greedy and not params.penalized and not params.logit_bias


def verified_on_host(seq: Sequence) -> bool:
    """Whether a fused sequence's verdict needs its rows' logits, not the raw argmax."""
    return seq.params.processes_logits or seq.params.logprobs is not None


class Engine:
    def __init__(
        self,
        target: Decoder,
        eos_token_ids: Seq[int],
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        prefill_chunk_size: int | None = None,
        adaptive: AdaptiveSpecLength | None = None,
        lookup_first: int | None = None,
        lookup_answers: bool = False,
        prefix_cache: PrefixCache | None = None,
        num_scheduler_steps: int = DEFAULT_NUM_SCHEDULER_STEPS,
        kv_cache_positions: int | None = None,
        scheduling_policy: str = "fcfs",
        price_chunks: bool = True,
    ):
        """With `adaptive`, each sequence's k is chosen per step (see spec/adaptive.py);
        without, every step drafts num_speculative_tokens. lookup_first
        (see `_look_up`), prefix_cache (the target's), num_scheduler_steps (1: off) and
        kv_cache_positions (None: no bound; it must hold one sequence of max_model_len)
        and scheduling_policy (SCHEDULING_POLICIES): see the module's docstring.
        price_chunks False: a step reads prefill_chunk_size prompt tokens wherever they lie.
        prefill_chunk_size None: the target's device's default (`prefill_chunk_size_for`)."""
        prefill_chunk_size = prefill_chunk_size or prefill_chunk_size_for(target.device)
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("prefill_chunk_size", prefill_chunk_size),
            ("num_scheduler_steps", num_scheduler_steps),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        self.scheduling_policy = scheduling_policy
        self.target = target
        self.eos_token_ids = frozenset(eos_token_ids)
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.adaptive = adaptive if proposer is not None else None
        # The last `lookup_first` tokens are looked up in the sequence's own text (their
        # latest occurrence); with lookup_answers, those tokens or more, in it and in the
        # answers before (the continuation most of those occurrences had: spec/suffix.py).
        self.lookup: NgramProposer | SuffixProposer | None = None
        if lookup_first and proposer is not None:
            self.lookup = (
                SuffixProposer(min_match=lookup_first) if lookup_answers else NgramProposer(lookup_first, lookup_first)
            )
        self.max_model_len = max_model_len or target.config.max_position_embeddings
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.chunk_costs = (
            ChunkCosts(arithmetic_horizon(target.config), lm_head_share(target.config)) if price_chunks else None
        )
        self.prefix_cache = prefix_cache
        self.num_scheduler_steps = num_scheduler_steps
        # The most tokens a step drafts for a sequence: by the proposer, by a lookup first.
        max_k = self.adaptive.max_k if self.adaptive is not None else self.num_speculative_tokens
        self.lookup_max_k = self.adaptive.lookup_max_k if self.adaptive is not None else self.num_speculative_tokens
        # A request's prediction drafts in any engine, as far as a lookup does under adaptive k.
        self.prediction_max_k = (
            self.adaptive.lookup_max_k if self.adaptive is not None else DEFAULT_MAX_SPECULATIVE_TOKENS
        )
        # Positions a step may add past a sequence's tokens: its drafts, or a multi-step
        # chain (never past max_model_len: drafts stop at max_tokens).
        self.step_headroom = max(max_k, self.lookup_max_k, num_scheduler_steps) + 1
        self.kv_cache_positions = None if target.static is not None else kv_cache_positions  # a pool bounds itself
        if self.kv_cache_positions is not None:
            longest = target.new_cache().capacity_for(self.max_model_len)
            if self.kv_cache_positions < longest:
                raise ConfigError(
                    f"the KV cache space holds {self.kv_cache_positions} positions, fewer than the {longest} "
                    f"one sequence of the maximum model length {self.max_model_len} may take; "
                    "raise --kv-cache-space or lower --max-model-len"
                )
        self.num_preemptions = 0
        self.prompt_tokens_read = 0  # prompt chunks fed so far (`Sequence.read_turn`)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # in order of admission
        self.chained: set[int] = set()  # the sequences the last step decoded in a multi-step chain
        self.spec_stats = SpecStats()  # every sequence's drafts, for metrics
        self._next_id = itertools.count()

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ConfigError, naming the fix, for a request the engine cannot run."""
        if not prompt_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ConfigError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total} tokens, more than the maximum model length {self.max_model_len}; "
                "shorten the prompt or lower max_tokens"
            )
        self.check_token_ids(
            itertools.chain(
                prompt_ids, params.stop_token_ids, (i for i, _ in params.logit_bias), params.allowed_token_ids
            )
        )
        stops = self.stop_ids(params)
        if params.min_tokens > 0 and len(stops) >= self.target.config.vocab_size:
            raise ConfigError(
                f"stop_token_ids{'' if params.ignore_eos else ' and EOS'} cover the whole vocabulary, so no token "
                f"can come before min_tokens ({params.min_tokens}); drop min_tokens or some stop ids"
            )
        if params.min_tokens > 0 and params.allowed_token_ids and stops.issuperset(params.allowed_token_ids):
            raise ConfigError(
                f"every allowed token id is a stop id, so no token can come before min_tokens ({params.min_tokens}); "
                "allow a token that does not stop, or drop min_tokens"
            )

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a request's output: its own stop ids, and EOS unless it ignores it."""
        stops = frozenset(params.stop_token_ids)
        return stops if params.ignore_eos else stops | self.eos_token_ids

    def check_token_ids(self, ids: Iterable[int]) -> None:
        """Raise ConfigError naming the first ids outside the target's vocabulary."""
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token ids {bad[:3]} are outside the vocabulary [0, {vocab})")

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, arrival_time: float | None = None, priority: int = 0
    ) -> Sequence:
        """Validate a request and queue it; it joins the batch at a later step. A
        priority other than 0 needs the "priority" scheduling policy."""
        if priority and self.scheduling_policy != "priority":
            raise ConfigError(f'a request priority ({priority}) needs the "priority" scheduling policy')
        self.check_request(prompt_ids, params)
        seq = Sequence(
            seq_id=next(self._next_id),
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            generator=params.make_generator(self.target.device),
            cache=self.target.new_cache(),
            stop_token_ids=self.stop_ids(params),
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            priority=priority,
        )
        self._enqueue(seq)
        return seq

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Queue a sequence: last (a preempted one first), or by `_rank` under "priority"."""
        if self.scheduling_policy == "priority":
            later = next((i for i, s in enumerate(self.waiting) if _rank(s) > _rank(seq)), len(self.waiting))
            self.waiting.insert(later, seq)
        elif preempted:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def finish(self, seq_id: int, reason: str = "abort") -> None:
        """End a sequence wherever it is (done, stopped by a stop string, or aborted by its
        client) and free its caches; it keeps an earlier finish reason if it had one."""
        seq = self.running.pop(seq_id, None)
        if seq is None:
            seq = next((s for s in self.waiting if s.seq_id == seq_id), None)
            if seq is None:
                return
            self.waiting.remove(seq)
        seq.finish(reason)
        for proposer in (self.proposer, self.lookup):
            if proposer is not None:
                proposer.finished(seq)
        self._free_caches(seq)

    def _free_caches(self, seq: Sequence) -> None:
        """Store seq's prefix (with a prefix cache), then free its cache and the
        proposers' state of it, whether or not the prefix could be stored."""
        release_into(self.prefix_cache, seq.token_ids, seq.cache)
        for state in (self.proposer, self.lookup, self.adaptive):
            if state is not None:
                state.free(seq.seq_id)

    def _num_draft_tokens(self, decoding: list[Sequence]) -> list[int]:
        ks = [self.num_speculative_tokens] * len(decoding)
        if self.adaptive is not None and decoding:
            remaining = [self._proposer_horizon(s) for s in decoding]
            # What a chain left to read comes back after the next chain: it pays within one.
            spreads = [self.num_scheduler_steps if s.seq_id in self.chained else n for s, n in zip(decoding, remaining)]
            ks = self.adaptive.choose(
                [s.seq_id for s in decoding],
                [self.proposer.backlog(s) for s in decoding],
                remaining,
                others=len(self.running) - len(decoding),
                spreads=spreads,
            )
        # A step emits at most k + 1 tokens; drafting past max_tokens is wasted work.
        return [max(0, min(k, s.remaining_tokens - 1)) for k, s in zip(ks, decoding)]

    @staticmethod
    def _proposer_horizon(seq: Sequence) -> int:
        """The tokens within which reading seq's backlog into the proposer must pay
        (`AdaptiveSpecLength.choose`'s remaining): those left; where the answer follows
        its prediction, those until it does again. What a prediction drafted comes back
        to be read once it drafts again past the answer's edit to it, an edit taken to go
        on as long again as it has so far: the proposer reads (a probe, the prompt too)
        only on a long edit, and a short one decodes plainly, as without a proposer."""
        followed = None if seq.prediction is None else seq.prediction.followed_at
        if followed is None:
            return seq.remaining_tokens
        return min(seq.remaining_tokens, 1 + seq.num_output_tokens - followed)

    def _propose(self, decoding: list[Sequence], wanted: list[int], batch: int, rows: int) -> list[Draft]:
        """The proposer's drafts for a step of `batch` decoding sequences and `rows` rows
        in all if every draft is as long as wanted: with adaptive k, a sequence whose k it
        chose drops a first guess too unlikely to pay for its row (Proposer.propose)."""
        if self.proposer is None or not any(wanted):
            return [Draft.empty()] * len(decoding)
        least_chances = None
        if self.adaptive is not None:
            least_chances = self.adaptive.least_chances(batch, rows, [s.seq_id for s in decoding])
        started = time.perf_counter()
        drafts = self.proposer.propose(decoding, wanted, least_chances)
        self._observe_draft([d.num_tokens + d.dropped for d in drafts], wanted, time.perf_counter() - started)
        return drafts

    def _observe_draft(self, drafted: list[int], wanted: list[int], seconds: float) -> None:
        """Teach adaptive what the proposer call that drafted `drafted` tokens per
        sequence (of `wanted`) cost."""
        # A draft catching up a long prompt drafts nothing this step: not a drafting cost.
        if self.adaptive is None or not any(wanted) or not all(n for n, k in zip(drafted, wanted) if k):
            return
        # What drafting costs is measured on the steps that only draft. Where a draft
        # first reads a prompt, or the tokens of plain steps, that reading is measured
        # on its own: a probe after many plain steps reads them all, and would price
        # every draft as dear whatever its length.
        if self.proposer.last_catch_up <= MAX_CATCH_UP:
            self.adaptive.observe_draft(max(drafted), seconds)
        else:
            self.adaptive.observe_read(self.proposer.last_tokens_read, max(drafted), seconds)

    def _look_up(self, decoding: list[Sequence]) -> dict[int, Draft]:
        """The lookup-first drafts, by index into decoding: from a request's prediction
        where it has one and it matches (in any engine: spec/prediction.py), else from
        lookup_first's. A lookup's k is up to num_speculative_tokens (under adaptive k,
        lookup_max_k: a lookup costs nothing to draft, and its rows are priced by
        `lookup_ks`; a prediction's, prediction_max_k), and 1 + 2a after a lookup that
        had a tokens accepted: where the text stops repeating, the next match is often
        wrong (benchmarks/EXPERIMENTS.md, "Lookup first"); without adaptive k a
        prediction is wary (`PredictionDrafts.draft`). The proposer does not run
        for a sequence a lookup drafts, and adaptive k learns nothing of the proposer
        from it."""
        found, predicted = {}, set()
        for i, seq in enumerate(decoding):
            if seq.prediction is None and self.lookup is None:
                continue
            k = min(self.lookup_max_k if seq.prediction is None else self.prediction_max_k, seq.remaining_tokens - 1)
            if seq.lookup_accepted is not None:
                k = min(k, 1 + 2 * seq.lookup_accepted)
            draft = Draft.empty()
            if seq.prediction is not None:
                seq.prediction.pending = 0
                answer_tail = seq.token_ids[max(seq.num_prompt_tokens, len(seq.token_ids) - MAX_MATCH) :]
                draft = Draft.of(seq.prediction.draft(answer_tail, k, wary=self.adaptive is None))
                if draft.num_tokens:
                    predicted.add(i)
            if not draft.num_tokens and self.lookup is not None:
                draft = self.lookup.propose_for(seq, k)
            if draft.num_tokens:
                found[i] = draft
                if seq.lookup_pending is None:
                    seq.lookup_pending = (len(seq.token_ids), draft.tokens.tolist())
        # As many of each draft as pay for their rows (see AdaptiveSpecLength.lookup_ks).
        if self.adaptive is not None and found:
            ks = self.adaptive.lookup_ks(
                [decoding[i].seq_id for i in found], [found[i].num_tokens for i in found], len(decoding)
            )
            for i, k in zip(list(found), ks):
                if k:
                    found[i] = Draft(found[i].tokens[:k])
                else:
                    del found[i]
        for i in predicted & found.keys():
            decoding[i].prediction.pending = found[i].num_tokens
        return found

    def _compare_lookups(self, advanced: list[Sequence]) -> None:
        """Settle each pending lookup draft whose fate the tokens emitted since show: how
        many of its tokens came next. A lookup verified in full settles in its own step;
        one cut short, or not verified, settles as the tokens come (a lookup costs
        nothing to draft, so its acceptance is learnt whether or not it was verified)."""
        for seq in advanced:
            if seq.lookup_pending is None:
                continue
            start, tokens = seq.lookup_pending
            emitted = seq.token_ids[start : start + len(tokens)]
            matched = common_prefix_length(tokens, emitted)
            if matched == len(emitted) < len(tokens):
                continue  # every token so far matches; the rest is still to come
            seq.lookup_pending = None
            seq.lookup_accepted = matched
            if self.adaptive is not None:
                self.adaptive.record_lookup(seq.seq_id, len(tokens), matched)

    def _schedule(self) -> tuple[list[_Work], list[Sequence], list[int], set[int]]:
        """Admit waiting requests, then choose what each running sequence feeds this
        step: the work of the target's forward, the sequences (with their k) whose
        whole step runs in one fused call, and the ids of those the proposer chose no
        k for (drafted by lookup, or decoded plainly beside a prompt)."""
        self._preempt_to_fit()
        while self.waiting and len(self.running) < self.max_num_seqs:
            if self._over_budget(joining=self.waiting[0]):
                break  # first in, first admitted: it waits for room
            seq = self.waiting.popleft()
            if self.prefix_cache is not None and not seq.num_preemptions:
                self.prefix_cache.count_query(seq.num_prompt_tokens)
            to_read = len(seq.token_ids)
            if self.prefix_cache is not None:  # a chat's next turn: only its new message
                to_read -= self.prefix_cache.cached_length(seq.token_ids, len(seq.token_ids) - 1)
            seq.read_turn = self.prompt_tokens_read + to_read
            self.running[seq.seq_id] = seq
        decoding = [s for s in self.running.values() if s.prefilled]
        # A step that reads a prompt decodes the others plainly: a prompt's first token
        # waits for its step, so that step costs what it would without speculation.
        speculating = decoding if len(decoding) == len(self.running) else []
        looked_up = self._look_up(speculating)
        drafting = [s for i, s in enumerate(speculating) if i not in looked_up]
        wanted = self._num_draft_tokens(drafting)
        fused = isinstance(self.proposer, FusedDraftProposer) and self.proposer.verifies
        in_one_call = [i for i, s in enumerate(drafting) if fused and fusable(s)]
        if len(in_one_call) < len(decoding) or not any(wanted[i] for i in in_one_call):
            # The fused call runs the target over its own sequences alone: any other row (a
            # sampled request's, a lookup's draft, a plain one) would take a second forward,
            # reading the target's weights again, and with nothing to draft the fused call
            # would only run the target. They all go in the step's one forward instead (8
            # requests, none drafting: the step 0.89x the speed of plain decoding's).
            in_one_call = []
        rest = sorted(set(range(len(drafting))) - set(in_one_call))
        proposed = [drafting[i] for i in rest]
        rows = len(decoding) + sum(wanted) + sum(d.num_tokens for d in looked_up.values())
        drafts = self._propose(proposed, [wanted[i] for i in rest], len(decoding), rows)
        plain = [s for s in decoding if s not in speculating]
        drafted = [
            *zip(proposed, drafts),
            *((speculating[i], d) for i, d in looked_up.items()),
            *((s, Draft.empty()) for s in plain),
        ]
        work = [_Work(s, s.token_ids[-1:] + d.tokens.tolist(), d, True) for s, d in drafted]

        # Beside decoding sequences a chunk is priced by where it lies and the LM-head rows
        # it computes, so that the step they wait for costs about what a whole chunk at a
        # prompt's start does (`ChunkCosts`).
        horizon = self.chunk_costs.horizon if decoding and self.chunk_costs is not None else None
        budget = self.prefill_chunk_size if horizon is None else ChunkCosts.cost(0, self.prefill_chunk_size, horizon)
        reads = ChunkReads()
        for seq in self._reading_order():
            if budget <= 0:
                break
            # A preempted sequence reads all but its newest token, unscored: its next step
            # is then the step it would have taken (see the module's docstring).
            end = len(seq.token_ids) - 1 if seq.output_ids else len(seq.token_ids)
            # Sequences with this very prompt (a request's n choices): it reads once.
            siblings = [s for s in self.running.values() if s is not seq and s.same_prompt_as(seq)]
            for sibling in siblings:
                seq.take_prompt_logprobs(sibling)
            # A sequence owing prompt logprobs reads the rows it has none for itself.
            owed = seq.scored_prompt_end
            copyable = min(end, len(seq.token_ids) - 1)  # not the last token, whose row it must compute
            limit = copyable if owed is None else min(copyable, owed)  # only positions whose rows it has
            if self.prefix_cache is not None:
                live = [(s.token_ids, s.cache) for s in self.running.values() if s is not seq]
                loaded = self.prefix_cache.load(seq.token_ids, seq.cache, limit, live)
                if not seq.num_preemptions:  # counted when it first joined
                    seq.num_cached_tokens += loaded
            elif siblings:  # no reuse across requests, but a sibling's prompt is copied, to the token
                source = max(siblings, key=lambda s: s.cache.length).cache
                copy_prefix(source, seq.cache, min(limit, source.length, seq.num_prompt_tokens))
            start = seq.cache.length
            # Owing prompt logprobs, every row of its chunk computes the LM head.
            row_share = 0.0 if owed is None or horizon is None else self.chunk_costs.row_share
            length = int(budget) if horizon is None else ChunkCosts.chunk_length(start, budget, horizon, row_share)
            chunk = seq.token_ids[start : min(start + length, end)]
            # It waits a step for a chunk another reads where it can copy it then (with
            # the rows' logprobs, where it owes them: a sibling's).
            copies_later = (self.prefix_cache is not None and owed is None) or any(
                owed is None or s.params.prompt_logprobs == seq.params.prompt_logprobs for s in siblings
            )
            shares = copies_later and start < copyable
            if not chunk or not reads.claim(seq.token_ids, start, start + len(chunk), shares):
                continue
            budget -= len(chunk) if horizon is None else ChunkCosts.cost(start, len(chunk), horizon, row_share)
            self.prompt_tokens_read += len(chunk)
            work.append(_Work(seq, chunk, Draft.empty(), scored=start + len(chunk) == len(seq.token_ids)))
        return (
            work,
            [drafting[i] for i in in_one_call],
            [wanted[i] for i in in_one_call],
            {speculating[i].seq_id for i in looked_up} | {s.seq_id for s in plain},
        )

    def _reading_order(self) -> list[Sequence]:
        """The running sequences still reading their prompt, in the order the step's chunk
        budget goes to them: by `read_turn`, when each would have finished reading what
        the prefix cache did not hold had it had the whole budget since it joined (under
        "priority", by priority first). So a short prompt is read before a long one that
        joined a little earlier, instead of waiting out all of its chunks, and a long one
        is overtaken only by prompts that joined before it would have finished: none
        waits without end. A request's n choices share a turn (the first admitted reads,
        the others copy)."""
        reading = [s for s in self.running.values() if not s.prefilled]
        if self.scheduling_policy == "priority":
            return sorted(reading, key=lambda s: (s.priority, s.read_turn))
        return sorted(reading, key=lambda s: s.read_turn)

    def _positions_needed(self, seq: Sequence) -> int:
        """Storage seq's target cache takes with room for its tokens and its next step."""
        headroom = self.step_headroom if seq.prediction is None else max(self.step_headroom, self.prediction_max_k + 1)
        return seq.cache.capacity_for(min(len(seq.token_ids) + headroom, self.max_model_len))

    def kv_positions_needed(self) -> int:
        """Storage the running sequences' target caches take with room for their next step."""
        return sum(self._positions_needed(seq) for seq in self.running.values())

    def kv_cache_usage(self) -> float:
        """The share of kv_cache_positions the running sequences take (0 without a bound)."""
        if self.kv_cache_positions is None:
            return 0.0
        return sum(s.cache.capacity for s in self.running.values()) / self.kv_cache_positions

    def _over_budget(self, joining: Sequence | None = None) -> bool:
        """Whether the running sequences (and `joining`) outgrow kv_cache_positions; never
        without a bound, where the storage they take is not even summed."""
        if self.kv_cache_positions is None:
            return False
        extra = 0 if joining is None else self._positions_needed(joining)
        return self.kv_positions_needed() + extra > self.kv_cache_positions

    def _preempt_to_fit(self) -> None:
        """Preempt the latest admitted sequences (under "priority", the last by `_rank`)
        until the rest fit the KV budget (one sequence alone always fits: see __init__)."""
        while len(self.running) > 1 and self._over_budget():
            if self.scheduling_policy == "priority":
                victim = max(self.running.values(), key=_rank).seq_id
            else:
                victim = next(reversed(self.running))
            seq = self.running.pop(victim)
            self._free_caches(seq)  # its prefix stored: its rejoining may load it instead of recomputing
            seq.cache = self.target.new_cache()  # the old storage goes with its last reference
            seq.num_preemptions += 1
            self._enqueue(seq, preempted=True)
            self.num_preemptions += 1
            log.info("preempted request %d: the KV cache space is full; it rejoins when there is room", seq.seq_id)

    def step(self) -> list[Sequence]:
        """Advance the batch by one step; return the sequences that got new tokens, and
        those whose own verification failed (`failure` set, finished with "error"):
        check `finished` on each, finished ones have left the batch."""
        work, fused, fused_wanted, not_proposed = self._schedule()
        outcomes = None if fused else self._decode_ahead(work)
        self.chained = set() if outcomes is None else {outcome.seq.seq_id for outcome in outcomes}
        if outcomes is None:
            outcomes = self._speculate_fused(fused, fused_wanted) + self._forward_and_verify(work)
        advanced = [outcome.seq for outcome in outcomes]
        failed = [seq for seq in [*(w.seq for w in work), *fused] if seq.failure is not None]
        for seq, num_drafted, verdict, logprobs, num_dropped, first_confidence in outcomes:
            seq.append(verdict.tokens, logprobs)
            seq.cache.truncate(min(seq.cache.length, len(seq.token_ids) - 1))
            if num_drafted:
                seq.spec.record(num_drafted, verdict.num_accepted)
                self.spec_stats.record(num_drafted, verdict.num_accepted)
            if seq.prediction is not None and seq.prediction.pending:
                seq.prediction.settle(verdict.num_accepted, seq.num_output_tokens)
            # A lookup's draft tells nothing about the proposer's (see _compare_lookups),
            # and a step that read a prompt chose no k for the others.
            if seq.seq_id not in not_proposed and self.adaptive is not None:
                self.adaptive.record(seq.seq_id, num_drafted, verdict.num_accepted, num_dropped)
                if not num_drafted:  # a multi-step chain's further tokens: as many plain steps (the probes' clock)
                    self.adaptive.record_plain(seq.seq_id, len(verdict.tokens) - 1)
                if (
                    num_drafted
                    and first_confidence is not None
                    and seq.params.greedy
                    and not seq.params.processes_logits
                ):
                    self.adaptive.observe_first_guess(seq.seq_id, first_confidence, verdict.num_accepted > 0)
        self._compare_lookups(advanced)
        if self.proposer is not None:
            self.proposer.observe(advanced, [outcome.verdict.num_accepted for outcome in outcomes])

        for seq in advanced + failed:
            if seq.finished:
                self.finish(seq.seq_id)
        return advanced + failed

    def _speculate_fused(self, seqs: list[Sequence], wanted: list[int]) -> list[_Outcome]:
        """Draft and verify greedy sequences in one fused call (spec/fused.py)."""
        if not seqs:
            return []
        assert isinstance(self.proposer, FusedDraftProposer)
        on_host = [verified_on_host(s) for s in seqs]
        jobs = self.proposer.speculate(seqs, wanted, [s.cache for s in seqs], on_host)
        drafting, verifying = self.proposer.last_seconds
        self._observe_draft([len(job.drafted) for job in jobs], wanted, drafting)
        if self.adaptive is not None:
            self.adaptive.observe_target(sum(len(job.drafted) + 1 for job in jobs), verifying)
        outcomes = []
        for seq, job in zip(seqs, jobs):
            if job.target_logits is None:
                outcomes.append(_Outcome(seq, len(job.drafted), verdict_from_argmax(job.drafted, job.target_argmax)))
                continue
            work = _Work(seq, [], Draft.of(job.drafted), True)
            try:  # as _forward_and_verify: this request's own arithmetic fails it alone
                outcomes.append(self._verify_one(work, job.target_logits.float(), job.target_argmax))
            except Exception as error:
                log.exception("verifying request %d failed; its batch goes on", seq.seq_id)
                seq.fail(error)
        return outcomes

    def _decode_ahead(self, work: list[_Work]) -> list[_Outcome] | None:
        """Multi-step decoding (see the module's docstring): each sequence's next
        num_scheduler_steps tokens from one static step, or None where this step is not
        plain decoding alone (or a cache lacks the room). With a proposer,
        only where adaptive k chose plain decoding for the step (a draft model catches up
        the chain's tokens when it drafts again, a head reads the features the chain
        captured), and not while adaptive waits for a plain step to be measured."""
        static, steps = self.target.static, self.num_scheduler_steps
        if static is None or steps < 2 or not work:
            return None
        if self.proposer is not None and (self.adaptive is None or self.adaptive.measuring_plain(len(work))):
            return None
        if not all(w.seq.prefilled and len(w.tokens) == 1 and not w.seq.params.masks_on_host for w in work):
            return None  # their masks follow each token on the host
        caches = [w.seq.cache for w in work]
        features = None if self.proposer is None else self.proposer.features
        capture = None if features is None else features.new_capture()
        firsts, params = [w.tokens[0] for w in work], [w.seq.params for w in work]
        texts = [
            ProcessedText(w.seq.prompt_distinct_ids, w.seq.output_ids, w.seq.stop_token_ids)
            if w.seq.params.processes_logits
            else None
            for w in work
        ]
        started = time.perf_counter()
        chains = static.token_chain(
            firsts, None, caches, steps, capture=capture, params=params, confidences=False, texts=texts
        )  # its tokens read back: the chain's work waited for
        if chains is None:
            return None
        if features is not None:  # a head reads every position the chain fed
            features.read(capture, [FedRows(w.seq.seq_id, w.seq.cache.length, steps) for w in work])
        if self.adaptive is not None:  # plain decoding's price where it chains
            self.adaptive.observe_chain(len(work), steps, time.perf_counter() - started)
        for cache in caches:
            cache.length += steps  # the newest token and every token but the last (step() cuts the rest)
        # A first guess dropped before the chain is still the proposer's news to adaptive k.
        return [
            _Outcome(w.seq, 0, Verdict(tokens, 0), logprobs, w.draft.dropped)
            for w, tokens, logprobs in zip(work, chains.tokens, chains.logprobs)
        ]

    def _forward_and_verify(self, work: list[_Work]) -> list[_Outcome]:
        """One target forward over the step's work; verify each scored sequence's drafts."""
        if not work:
            return []
        segments = [Segment(w.seq.cache, len(w.tokens), one_query_at_a_time=w.draft.num_tokens > 0) for w in work]
        # Score the last k+1 positions of each scored sequence: its newest token and its
        # drafts; then, after all of those, the rows of prompt tokens owed logprobs.
        rows, end = [], 0
        owed: list[tuple[Sequence, range]] = []  # (sequence, positions) of the prompt rows, in row order
        prompt_rows: list[int] = []
        for w in work:
            positions = w.seq.prompt_rows_to_score(w.seq.cache.length, len(w.tokens))
            if positions:
                owed.append((w.seq, positions))
                prompt_rows.extend(end + p - w.seq.cache.length for p in positions)  # the stream's row of position p
            end += len(w.tokens)
            if w.scored:
                rows.extend(range(end - w.draft.num_tokens - 1, end))
        num_scored = len(rows)
        rows += prompt_rows
        device = self.target.device
        flat = torch.tensor([t for w in work for t in w.tokens], dtype=torch.int64, device=device)
        features = None if self.proposer is None else self.proposer.features
        capture = None if features is None else features.new_capture()
        fed = [FedRows(w.seq.seq_id, w.seq.cache.length, len(w.tokens)) for w in work]  # before the caches move
        reads_a_prompt = any(not w.seq.prefilled for w in work)
        started = time.perf_counter()
        logits = self.target(
            flat, segments, torch.tensor(rows, dtype=torch.int64, device=device), capture=capture
        )  # [R, V]
        # Every greedy verdict comes from this one argmax; on a GPU, reading it back is
        # also where the step's work is waited for, so the timing below includes it.
        argmax = logits[:num_scored].argmax(dim=-1).tolist()  # [num_scored]
        seconds = time.perf_counter() - started
        if self.adaptive is not None and len(flat) == num_scored:  # a pure decode step
            self.adaptive.observe_target(len(flat), seconds)
        # Timed where a read-back waited for the forward.
        if reads_a_prompt and num_scored and self.chunk_costs is not None:
            positions = sum(f.num_rows * (f.start + (f.num_rows - 1) / 2) for f in fed)
            self.chunk_costs.observe(len(flat), positions, len(rows), seconds)
        if features is not None:  # a head reads every row the target computed (its observe drops the rejected)
            features.read(capture, fed)
        self._read_prompt_logprobs(owed, logits[num_scored:])
        outcomes, row = [], 0
        for w in work:
            if not w.scored:
                continue
            k = w.draft.num_tokens
            if w.seq.failure is not None:  # its prompt logprobs failed above
                row += k + 1
                continue
            try:
                outcomes.append(self._verify_one(w, logits[row : row + k + 1], argmax[row : row + k + 1]))
            except Exception as error:  # this request's own arithmetic: it alone fails
                log.exception("verifying request %d failed; its batch goes on", w.seq.seq_id)
                w.seq.fail(error)
            row += k + 1
        return outcomes

    @staticmethod
    def _read_prompt_logprobs(owed: list[tuple[Sequence, range]], logits: torch.Tensor) -> None:
        """Each sequence's prompt logprobs from its rows of `logits` [P, V] (`owed`'s
        positions, in order); one that fails to read them fails alone."""
        row = 0
        for seq, positions in owed:
            tokens = seq.token_ids[positions.start + 1 : positions.stop + 1]
            try:
                seq.prompt_logprobs += token_logprobs(
                    logits[row : row + len(positions)], tokens, seq.params.prompt_logprobs, ranked=True
                )
            except Exception as error:
                log.exception("reading request %d's prompt logprobs failed; its batch goes on", seq.seq_id)
                seq.fail(error)
            row += len(positions)

    @staticmethod
    def _verify_one(w: _Work, logits: torch.Tensor, argmax: list[int]) -> _Outcome:
        """One scored sequence's verdict from its k+1 rows of logits [k+1, V] (and
        their argmaxes)."""
        seq, params = w.seq, w.seq.params
        scores = logits
        drafts = w.draft.tokens.tolist()
        if params.processes_logits:
            prompt = seq.prompt_distinct_ids
            scores = processed_logits(scores, params, prompt, seq.output_ids, drafts, seq.stop_token_ids)
        if params.greedy:
            verdict = verdict_from_argmax(drafts, scores.argmax(dim=-1).tolist() if params.processes_logits else argmax)
        elif params.seed is not None:
            uniforms = seq.keyed_uniforms(len(seq.token_ids), len(drafts) + 1, scores.device)
            verdict = verify_keyed(scores, w.draft, params, uniforms)
        else:
            verdict = verify(scores, w.draft, params, seq.generator)
        # The i-th emitted token is the one row i predicts (see specserve/logprobs.py);
        # logprobs are the raw logits', before penalties.
        num_top = params.logprobs
        logprobs = None if num_top is None else token_logprobs(logits, verdict.tokens, num_top)
        return _Outcome(seq, w.draft.num_tokens, verdict, logprobs, w.draft.dropped, w.draft.first_confidence)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Run one request to completion (with whatever else is queued)."""
        seq = self.add_request(prompt_ids, params)
        while not seq.finished:
            self.step()
        return seq
