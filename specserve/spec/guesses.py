"""A proposer's guesses, one draft position at a time: its scores turned into draft tokens
as each request asks. Shared by every proposer that scores (a draft model, EAGLE and
Medusa heads).

A greedy request's guess is the argmax. A sampling request's is drawn from
`logits_to_probs` under its params: an unseeded request's with its own generator, and
those probabilities go to the verifier with the draft (`Draft.probs`), so rejection
sampling stays lossless; a seeded request's with the keyed uniform of the position it
guesses, the one the target's own draw there will take (spec/verify.py, `verify_keyed`),
so that where the two distributions agree the guess is the target's token. A
penalised request's scores are penalised as the target's rows will be
(specserve/penalties.py), this step's earlier guesses counted, so the guesses are what
the penalised target will choose. Scores may cover fewer ids than the vocabulary (a
draft's common head: the first ids) or be -inf at ids a head never guesses: those ids get
no mass. A head's scores may also cover a subset of ids in its own order (`target_ids`
names each column's id): greedy guesses take the argmax there, and only a sampled or
penalised guess widens its row to the whole vocabulary.

A sequence stops drafting after a guess the proposer itself gives less than
`confidence_threshold`: later guesses would build on it and rarely survive. A greedy
sequence also drops its first guess, and drafts nothing, where the proposer gives it less
than `least_chances` asks (adaptive k's price of a verified row, as a probability: on a
CPU a row costs about a fifth of a plain step, and a head's first guess on open-ended
text is often less likely than that). Both choices depend on the proposer's outputs
alone, so verification stays lossless; a sampled guess is never dropped, since dropping
a drawn token for its own probability would bias what the verifier emits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from specserve.model.graphs import ProcessedText
from specserve.penalties import processed_logits
from specserve.sampling import logits_to_probs, sample
from specserve.spec.heads.vocab import widen_to_target_vocab
from specserve.spec.proposer import Draft, SequenceView

if TYPE_CHECKING:
    from specserve.model.graphs import StaticDecode
    from specserve.model.kv_cache import KVCache

log = logging.getLogger("specserve")


@dataclass(frozen=True)
class Guesser:
    vocab_size: int  # the target's: narrower scores are padded to it
    confidence_threshold: float = 0.0

    def greedy_guesses(self, logits: torch.Tensor, needed: bool = False) -> tuple[list[int], list[float]]:
        """Each row's argmax and the proposer's probability of it (logits [R, width]); the
        probabilities are skipped (1.0) unless a confidence threshold or `needed` asks."""
        argmax = logits.argmax(dim=-1).tolist()
        if self.confidence_threshold <= 0 and not needed:
            return argmax, [1.0] * len(argmax)
        return argmax, logits.softmax(dim=-1).amax(dim=-1).tolist()

    def guess(
        self,
        seq: SequenceView,
        row_logits: torch.Tensor,
        drafted: list[int],
        argmax: int,
        confidence: float,
        target_ids: torch.Tensor | None = None,
    ) -> tuple[int, float, torch.Tensor | None]:
        """One draft position of one sequence from its row of scores [1, width] (and its
        argmax as a token id and confidence, computed for the batch): the token, the
        proposer's probability of it, and the distribution [V] it was sampled from, which
        rejection sampling reads (None: greedy, or seeded, whose keyed verification reads
        none). target_ids [width]: the token id of each column; None: ids [0, width)."""
        params = seq.params
        if params.greedy and not params.processes_logits:
            return argmax, confidence, None
        if target_ids is not None:
            row_logits = widen_to_target_vocab(row_logits, target_ids, self.vocab_size)  # [1, V]
        if params.processes_logits:  # guess as the penalised target will choose: more accepted
            row_logits = self.penalised(seq, row_logits, drafted)  # [1, V]
        if params.greedy:
            (token,), (confidence,) = self.greedy_guesses(row_logits)
            return token, confidence, None
        row_probs = logits_to_probs(row_logits, params)  # [1, width]
        row_probs = F.pad(row_probs, (0, self.vocab_size - row_probs.shape[-1]))  # [1, V]
        if params.seed is None:
            token = int(sample(row_probs, seq.generator))
            return token, float(row_probs[0, token]), row_probs[0]
        position = len(seq.token_ids) + len(drafted)  # the index of the token guessed
        token = int(sample(row_probs, uniforms=seq.keyed_uniforms(position, 1, row_probs.device)))
        return token, float(row_probs[0, token]), None

    def penalised(self, seq: SequenceView, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        """A guess's scores [1, width] -> [1, V] with the request's penalties and
        min_tokens, the sequence's output and this step's earlier guesses counted."""
        logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        output = seq.token_ids[seq.num_prompt_tokens :]
        prompt = seq.prompt_distinct_ids
        return processed_logits(logits, seq.params, prompt, [*output, *drafted], [], seq.stop_token_ids)


class DraftChains:
    """Each sequence's guesses in one proposing call, grown a position at a time for the
    sequences that still want one (`active`), then handed out as `Draft`s. Indices are
    into the call's `seqs`."""

    def __init__(
        self,
        seqs: Sequence[SequenceView],
        num_tokens: Sequence[int],
        guesser: Guesser,
        least_chances: Sequence[float] | None = None,  # see Proposer.propose
    ):
        self.seqs, self.num_tokens, self.guesser = seqs, num_tokens, guesser
        self.drafted: dict[int, list[int]] = {i: [] for i, k in enumerate(num_tokens) if k > 0}
        self.probs: dict[int, list[torch.Tensor]] = {i: [] for i in self.drafted}  # each [V]
        self.stopped: set[int] = set()  # unsure of its last guess, or its arithmetic failed
        # A greedy sequence's least probability of its first guess (see the module's docstring).
        self.least = {i: least_chances[i] for i in self.drafted if least_chances is not None and seqs[i].params.greedy}
        self.first_confidence: dict[int, float] = {}
        self.dropped: set[int] = set()  # dropped its first guess

    def active(self) -> list[int]:
        """The sequences that want another guess."""
        return [i for i, d in self.drafted.items() if len(d) < self.num_tokens[i] and i not in self.stopped]

    def newest(self, i: int) -> int:
        return self.drafted[i][-1]

    def add(self, order: list[int], logits: torch.Tensor, target_ids: torch.Tensor | None = None) -> None:
        """Guess the next position of each sequence in `order` from its row of `logits`
        [len(order), width], whose columns are token ids [0, width) or, given, target_ids [width]."""
        needed = any(i in self.least for i in order)
        argmax, confidences = self.guesser.greedy_guesses(logits, needed)  # one read-back for the batch
        if target_ids is not None:
            argmax = target_ids[argmax].tolist()
        for row, i in enumerate(order):
            try:
                token, confidence, row_probs = self.guesser.guess(
                    self.seqs[i], logits[row : row + 1], self.drafted[i], argmax[row], confidences[row], target_ids
                )
            except Exception:  # this request's own arithmetic: it drafts nothing, the rest go on
                log.exception("drafting for request %d failed", self.seqs[i].seq_id)
                self.drafted[i], self.probs[i] = [], []
                self.stopped.add(i)
                continue
            self._take(i, token, confidence, row_probs)

    def _take(self, i: int, token: int, confidence: float, row_probs: torch.Tensor | None = None) -> None:
        """Sequence i's next guess, unless it is a first guess to drop; either may stop its drafting."""
        if not self.drafted[i]:
            self.first_confidence[i] = confidence
            if confidence < self.least.get(i, 0.0):
                self.dropped.add(i)
                self.stopped.add(i)
                return
        self.drafted[i].append(token)
        if row_probs is not None:
            self.probs[i].append(row_probs)
        if confidence < self.guesser.confidence_threshold:
            self.stopped.add(i)

    def draft_on_the_device(
        self,
        static: StaticDecode,
        going_on: list[int],
        caches: list[KVCache],  # each one's proposer cache, its newest guess not yet fed
        features: torch.Tensor | None = None,  # [len(going_on), F]: a head's features that made those guesses
        target_ids: torch.Tensor | None = None,  # [width]: the token id of each logits column (a head's)
    ) -> list[int] | None:
        """Draft the rest of each chain in `going_on` in one static step of `static`
        (TokenChain, model/graphs.py), each guess as `add` would take it: up to its
        count, stopping after an unsure one, a sampled guess with the distribution it was
        drawn from. Returns how many guesses each took (the tokens the chain fed that it
        keeps), or None where it drafted nothing this way."""
        seqs = [self.seqs[i] for i in going_on]
        params = [seq.params for seq in seqs]
        texts = [
            ProcessedText(
                seq.prompt_distinct_ids, [*seq.token_ids[seq.num_prompt_tokens :], *self.drafted[i]], seq.stop_token_ids
            )
            if seq.params.processes_logits
            else None
            for i, seq in zip(going_on, seqs)
        ]
        drafted = static.token_chain(
            [self.newest(i) for i in going_on],
            features,
            caches,
            max(self.num_tokens[i] - len(self.drafted[i]) for i in going_on),
            target_ids,
            params=params,
            texts=texts,
            vocab=self.guesser.vocab_size,
            draw_from=[len(seq.token_ids) + len(self.drafted[i]) for i, seq in zip(going_on, seqs)],
        )
        if drafted is None:
            return None
        taken = []
        for row, (i, tokens, confidences) in enumerate(zip(going_on, drafted.tokens, drafted.confidences)):
            before = len(self.drafted[i])
            keeps_probs = not params[row].greedy and params[row].seed is None  # rejection sampling reads them
            for j, (token, confidence) in enumerate(zip(tokens, confidences)):
                if i in self.stopped or len(self.drafted[i]) >= self.num_tokens[i]:
                    break
                self._take(i, token, confidence, drafted.probs[row][j] if keeps_probs else None)
            taken.append(len(self.drafted[i]) - before)
        return taken

    def drafts(self) -> list[Draft]:
        return [
            Draft.of(
                self.drafted[i],
                torch.stack(self.probs[i]) if self.probs[i] else None,
                int(i in self.dropped),
                self.first_confidence.get(i),
            )
            if i in self.drafted
            else Draft.empty()
            for i in range(len(self.seqs))
        ]
