"""Adaptive speculation: each sequence's k follows its acceptance and the measured costs.

Leviathan et al.: if each drafted token is accepted with probability a (independently),
a step that drafts k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average.
Drafts are not independent (the draft goes on exactly when it is confident, and may stop
before k), so E(k) and D(k), the positions a step drafts, come from each sequence's own
history, position by position (`Acceptance`).

Costs are measured from the engine's own timings, recent ones weighing more:
- the target's forward by its row count, each count as measured (`ForwardCosts`): on our
  CPU kernels 9-16 rows take a second pass of arithmetic, a cost no line follows; a
  plain step that no forward measured (every step drafted) is measured once by a plain
  step (`measuring_plain`), as is the forward itself where every step chained;
- plain decoding, where the target decodes it in multi-step chains (engine.py): a
  chain's token as a share of that forward, by batch size (`ChainShares`); one
  drafting sequence turns the whole batch's chain into a single step;
- drafting as a line, draft_fixed + per_position * k, timed only on proposer calls with
  at most MAX_CATCH_UP tokens to catch up;
- reading a backlog into the draft (a new prompt, the tokens of plain steps) as a line
  per token read, charged to a sequence that drafts, spread over the tokens it has left
  (`read_cost`).
The draft's lines are kept in units of a one-row target forward as measured at the time
(`_unit`), not in seconds: the target is timed every step and the draft only while it
drafts, so a slow phase of the machine leaves the draft's price as soon as the target is
fast again.

For a batch of B decoding sequences a plain token costs P(B): T(B), the target's forward
of B rows, or its chain's share of it. Drafting k tokens each makes the forward one of
B * (1 + D(k)) rows:

    speedup(k) = E(k) * P(B) / (T(B * (1 + D(k))) + draft_fixed + D(k) * per_position)

The draft runs for the whole batch at once, so the batch's ks are chosen together
(`batch_ks`). Where no k beats plain decoding by MIN_SPEEDUP (a run of drafting goes on
down to CONTINUE_SPEEDUP while its last step verified a guess) a sequence decodes
plainly (k = 0) and probes with a short draft: at once when new, then after
PROBE_INTERVAL plain steps, the wait doubling after each drafting run shorter than that
(up to MAX_PROBE_INTERVAL) and B times longer in a batch of B, since a probe holds up
the whole batch. A probe is skipped while reading its backlog would cost more than it
can be expected to gain (`_affordable_read`); a fully accepted one restarts the estimate
from that probe. As the batch grows, verified rows cost more against the draft's fixed
costs, and k falls.

Lookup-first drafts (engine.py) cost only their verified rows: each sequence's lookups
have an `Acceptance` of their own, learnt from every lookup compared with the tokens that
followed it (`record_lookup`), and a lookup is verified as far as its expected extra
tokens outweigh its rows' cost at plain decoding's tokens per second (`lookup_ks`).

Invariant: k is chosen from the target's and the draft's past outputs only, never from
the current step's, so verification stays lossless whatever k is.

The measurements behind the constants below: benchmarks/EXPERIMENTS.md, "Adaptive k".
"""

from __future__ import annotations

import bisect
import math

import numpy as np

# Proposer calls that catch up at most this many tokens (the recovered or bonus token, and
# the last accepted draft after a full acceptance) are timed as drafting, longer ones as
# reading ("Drafting timed only on calls that catch up at most 2 tokens").
MAX_CATCH_UP = 2
# Predicted speedup over plain decoding needed to start a run of drafting, and to go on
# with one: the estimate is noisy and plain steps bring no news of it, so a lower bar to
# go on keeps one unlucky streak from ending a run that pays ("A run of drafting goes on
# at 0.97x"). A step that dropped its first guess verified nothing, so a run is held to
# the higher bar after one: the prior alone keeps a useless head's estimate near
# break-even, and each such step costs a head step ("A run of dropped guesses").
MIN_SPEEDUP = 1.03
CONTINUE_SPEEDUP = 0.97
# Target steps measured before CONTINUE_SPEEDUP applies: until then the costs are still
# much the prior's, and a losing run is as likely priced wrong as unlucky (same entry).
COSTS_KNOWN_STEPS = 64
# k goes at most K_GROWTH past the deepest position a sequence has lately asked for (its
# `asked` weight above DEEPEST_ASKED_WEIGHT, ~14 steps at ACCEPTANCE_DECAY): after a
# streak the estimate values untried depths like the deepest tried, and 16 verified rows
# cost twice 8 on our CPU kernels ("k walks up at most K_GROWTH past the depths tried").
K_GROWTH = 4
DEEPEST_ASKED_WEIGHT = 0.5
# Weight of older observations after each new one. Acceptance: a memory of ~20 steps;
# a shorter one follows the text sooner but ends runs of drafting that pay on a few
# unlucky steps, once plain decoding is priced as measured ("Plain decoding measured,
# not priced from the drafting steps"). Timings: a memory of ~30 forwards.
ACCEPTANCE_DECAY = 0.95
TIMING_DECAY = 0.97
# Weight of a row count's past costs at each new forward of that many rows, and of the
# machine's past pace at each forward of a count measured before: the pace follows a
# change in the machine's speed within a few steps, while each count's own cost, noisy
# from one forward to the next, is a mean of many ("ForwardCosts: each row count priced
# as measured").
SHAPE_DECAY = 0.95
PACE_DECAY = 0.5
# The target's prior, in units of a one-row forward: 5% more per verified row. It prices
# the first forwards, and row counts not yet measured where no two measured ones say
# better (`ForwardCosts.shape_at`); cheap on purpose, since a dear prior stops the
# drafting that would measure the real cost ("k for the batch, reading fitted apart,
# probes that cannot pay skipped").
PRIOR_ROW_SHARE = 0.05
# Between two row counts measured, a count not measured is priced on a curve below their
# chord (cost = low + (high - low) * along ** INTERIOR_BEND): our CPU kernels' cost bends
# up past 8 rows, and a count priced dear is never tried ("ForwardCosts: each row count
# priced as measured").
INTERIOR_BEND = 2.0
# A new sequence's prior: each position earned with 0.8 given the one before, with the
# weight of one step; a position never reached leans on the one before it likewise
# ("PRIOR_RATE and MIN_SPEEDUP near break-even").
PRIOR_RATE, PRIOR_WEIGHT = 0.8, 1.0
# Target steps after which a plain step (one row a sequence) never measured is measured
# once: priced from the drafting steps' forwards by the prior's slope, it came out ~15%
# dear on our CPU kernels, and a head guessing right a fifth of the time looked worth
# its row (same entry).
PLAIN_MEASURED_AFTER = 16
# Plain steps before a probe; the gap doubles after each drafting run shorter than
# PROBE_INTERVAL steps, up to the max. A probe drafts 3 tokens: 2 of 2 accepted is
# a coin flip on open-ended text ("Replayed on recorded traces: the prior's unit,
# 3-token probes").
PROBE_INTERVAL, MAX_PROBE_INTERVAL, PROBE_TOKENS = 16, 128, 3
# The prior's weight once a fully accepted probe has restarted the estimate: the probe
# mostly decides (3 of 3 accepted -> about 0.94 a position; same entry).
PROBE_DOUBT = 0.5
# First guesses' acceptance by the proposer's probability of them (`FirstGuesses`): bins
# of a tenth, a memory of some 200 verified guesses, and a bin's own probability as its
# prior. The 0.5B draft's probabilities run below its acceptance (its guesses of 0.2-0.3
# were accepted 0.39-0.41 of the time on open-ended text), a head's near or above it.
CALIBRATION_BINS = 10
CALIBRATION_DECAY = 0.995
CALIBRATION_PRIOR_WEIGHT = 2.0


class LinearFit:
    """Least squares y = intercept + slope * x over decaying weighted samples, started
    from two prior points so it answers before it has seen two different x."""

    def __init__(self, prior: tuple[tuple[float, float], tuple[float, float]], decay: float = TIMING_DECAY):
        self.decay = decay
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        for x, y in prior:
            self.add(x, y)

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both clamped at >= 0: costs never shrink with work."""
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var_x = self.sxx / self.sw - mean_x * mean_x
        slope = (self.sxy / self.sw - mean_x * mean_y) / var_x if var_x > 1e-12 else 0.0
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope


class ForwardCosts:
    """Seconds of a target forward by its row count: pace * shape(rows).

    shape[rows] is what each row count measured costs (decaying, SHAPE_DECAY), in the
    machine's pace when measured; pace is how fast the machine runs now against that,
    moved by every forward of a measured count (PACE_DECAY). A machine's speed moves (a
    busy neighbour, a clock that drops) and moves every count alike, so a count measured
    in a slow phase is not priced slow for good. Not a line through the forwards, nor a
    line times a factor per count: our CPU kernels multiply up to 8 rows by each weight
    row they read, so 9-16 rows take a second pass of arithmetic.

    A count never measured is priced from those that were (`shape_at`), and between
    two of them on the low side: a count priced too dear is never chosen, so never
    measured and never corrected; one priced too cheap is chosen once, and then it is
    measured. Between two counts measured, on a curve below their chord
    (INTERIOR_BEND); past the largest, along the slope of the two largest (a batch's
    rows), at least the prior's; below the smallest, or with one count measured, by
    the prior's shape. (benchmarks/EXPERIMENTS.md, "ForwardCosts: each row count priced
    as measured".)"""

    def __init__(self, prior_row_share: float = PRIOR_ROW_SHARE):
        self.prior_row_share = prior_row_share
        self.shape: dict[int, float] = {}  # rows -> seconds at the pace of 1.0
        self._counts: list[int] = []  # sorted keys of shape
        self._sums: dict[int, tuple[float, float]] = {}  # rows -> decaying (weight, weight * shape)
        self.pace = 1.0
        self.measured = 0  # forwards observed

    def _prior(self, rows: float) -> float:
        return 1.0 + self.prior_row_share * (rows - 1)

    def shape_at(self, rows: int) -> float:
        """A forward of `rows` rows at the pace of 1.0 (before any measurement: in units
        of a one-row forward)."""
        if rows in self.shape:
            return self.shape[rows]
        counts, shape = self._counts, self.shape
        if not counts:
            return self._prior(rows)
        above = bisect.bisect(counts, rows)
        if 0 < above < len(counts):  # between two counts measured: below their chord
            low, high = counts[above - 1], counts[above]
            along = (rows - low) / (high - low)
            return shape[low] + (shape[high] - shape[low]) * along**INTERIOR_BEND
        if above == len(counts) and above >= 2:  # past every count measured: their last slope
            below, high = counts[-2:]
            unit = shape[high] / self._prior(high)  # a one-row forward, by the prior's shape
            slope = max((shape[high] - shape[below]) / (high - below), self.prior_row_share * unit)
            return shape[high] + slope * (rows - high)
        near = counts[min(above, len(counts) - 1)]  # below every count measured, or past the one
        return shape[near] * self._prior(rows) / self._prior(near)

    def measured_only_above(self, rows: int) -> bool:
        """Whether every count measured is larger than `rows` (and some is)."""
        return bool(self._counts) and rows < self._counts[0]

    def seconds(self, rows: float) -> float:
        """Predicted seconds of a forward of `rows` rows; between two counts (an
        expected count), in proportion."""
        low = int(rows)
        share = rows - low
        cost = self.shape_at(low) if share == 0 else (1 - share) * self.shape_at(low) + share * self.shape_at(low + 1)
        return self.pace * cost

    def observe(self, rows: int, seconds: float) -> None:
        if self.measured == 0:  # the first forward sets the unit, by the prior's shape
            self.pace = seconds / self._prior(rows)
        elif rows in self.shape:
            self.pace *= (seconds / (self.pace * self.shape[rows])) ** (1 - PACE_DECAY)
        self.measured += 1
        if rows not in self.shape:
            bisect.insort(self._counts, rows)
        # A mean of the count's measurements, recent ones weighing more.
        weight, total = self._sums.get(rows, (0.0, 0.0))
        weight, total = SHAPE_DECAY * weight + 1, SHAPE_DECAY * total + seconds / self.pace
        self._sums[rows] = weight, total
        self.shape[rows] = total / weight


class ChainShares:
    """What a token of plain decoding costs in a multi-step chain, as a share of the
    target's forward of as many rows (one a sequence) predicted when the chain ran: a
    mean by batch size, recent chains weighing more (SHAPE_DECAY). A batch never chained
    takes the share of the nearest one that was (by their ratio), and 1 where none was:
    where the target runs no chains, plain decoding is that forward.

    A share, not seconds, so that a chain's price follows the machine's pace as the
    forward's does (ForwardCosts)."""

    def __init__(self):
        self.sums: dict[int, tuple[float, float]] = {}  # batch -> decaying (weight, weight * share)

    def share(self, batch: int) -> float:
        if not self.sums:
            return 1.0
        nearest = min(self.sums, key=lambda b: (abs(math.log(b / batch)), b))
        weight, total = self.sums[nearest]
        return total / weight

    def observe(self, batch: int, share: float) -> None:
        weight, total = self.sums.get(batch, (0.0, 0.0))
        self.sums[batch] = SHAPE_DECAY * weight + 1, SHAPE_DECAY * total + share


class Acceptance:
    """What one sequence's drafts have earned, position by position, as decaying counts.

    For drafted position i (1-based) of a step that asked for at least i:
      reached[i]: steps whose first i - 1 drafts were all accepted; gained[i]: of those,
        the steps where position i was drafted and accepted too;
      asked[i]: steps whose proposer drafted i - 1; drafted[i]: of those, the steps
        where it drafted position i as well.
    So rate(i) = gained / reached is the chance to earn position i given i - 1 were
    earned (drafting it and its acceptance together), and go_on(i) = drafted / asked
    the chance that the proposer drafts position i after i - 1: at position 1 the
    chance it keeps its first guess, which a step that drafts nothing drops (guesses.py).
    Each estimate leans on the position before it with `prior_weight` (position 1 on `prior_rate`), so a
    position never asked for is valued like the deepest one measured.
    """

    def __init__(self, max_k: int, prior_rate: float = PRIOR_RATE, prior_weight: float = PRIOR_WEIGHT):
        self.max_k = max_k
        self.prior_rate, self.prior_weight = prior_rate, prior_weight
        self.reached, self.gained = [0.0] * max_k, [0.0] * max_k  # index i - 1 for position i
        self.asked, self.drafted = [0.0] * max_k, [0.0] * max_k
        self.chosen = 0  # this step's k
        self.plain_steps = 0  # since the last draft
        self.drafting_steps = 0  # in the current run of drafting steps
        self.dropped_last = False  # the last drafting step dropped its first guess: it verified nothing
        self.probe_interval = PROBE_INTERVAL
        self.probing = False  # this step's draft is a probe
        self.fresh = True  # no step recorded yet: its first probe need not wait

    def restart(self, prior_weight: float) -> None:
        """Forget every observation, keeping the prior with a new weight."""
        self.prior_weight = prior_weight
        for counts in (self.reached, self.gained, self.asked, self.drafted):
            counts[:] = [0.0] * self.max_k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A drafting step that asked for `chosen` positions (num_drafted 0: it dropped its first guess)."""
        for counts in (self.reached, self.gained, self.asked, self.drafted):
            counts[:] = [ACCEPTANCE_DECAY * c for c in counts]
        for i in range(1, min(max(self.chosen, num_drafted), self.max_k) + 1):
            if num_accepted >= i - 1:
                self.reached[i - 1] += 1
                self.gained[i - 1] += num_accepted >= i
            if num_drafted >= i - 1:
                self.asked[i - 1] += 1
                self.drafted[i - 1] += num_drafted >= i

    def deepest_asked(self) -> int:
        """The deepest position asked for in recent steps (its weight not yet decayed
        below DEEPEST_ASKED_WEIGHT): how far this sequence's estimate has been tried."""
        return max((i + 1 for i, a in enumerate(self.asked) if a > DEEPEST_ASKED_WEIGHT), default=0)

    def curves(self) -> tuple[list[float], list[float]]:
        """(E, D) for k = 0 .. max_k: tokens a step emits, positions it drafts."""
        tokens, drafted = [1.0], [0.0]
        earn_all, reach = 1.0, 1.0  # chance to earn positions 1..i; to draft position i
        rate, go_on = self.prior_rate, 1.0
        w = self.prior_weight
        for i in range(self.max_k):
            rate = (self.gained[i] + w * rate) / (self.reached[i] + w)
            go_on = (self.drafted[i] + w * go_on) / (self.asked[i] + w)  # position 1: 1 unless guesses are dropped
            reach *= go_on
            earn_all *= rate
            tokens.append(tokens[-1] + earn_all)
            drafted.append(drafted[-1] + reach)
        return tokens, drafted


class FirstGuesses:
    """How often a proposer's greedy first guesses are accepted, by its own probability of
    them, in bins of 1 / CALIBRATION_BINS as decaying counts: which probability a wanted
    acceptance rate asks (`least_probability`). Only verified guesses are counted, so a
    bin below the probabilities verified keeps its prior."""

    def __init__(self):
        self.verified = [0.0] * CALIBRATION_BINS
        self.accepted = [0.0] * CALIBRATION_BINS

    def record(self, probability: float, accepted: bool) -> None:
        self.verified = [CALIBRATION_DECAY * v for v in self.verified]
        self.accepted = [CALIBRATION_DECAY * a for a in self.accepted]
        b = min(int(probability * CALIBRATION_BINS), CALIBRATION_BINS - 1)
        self.verified[b] += 1
        self.accepted[b] += accepted

    def rate(self, b: int) -> float:
        """Bin b's acceptance rate, leaning on its middle probability."""
        middle, w = (b + 0.5) / CALIBRATION_BINS, CALIBRATION_PRIOR_WEIGHT
        return (self.accepted[b] + w * middle) / (self.verified[b] + w)

    def least_probability(self, rate: float) -> float:
        """The lowest bin edge from which up every bin is accepted at `rate` or more
        (1.0 where the top bin is not: no first guess is worth its row)."""
        edge = 1.0
        for b in reversed(range(CALIBRATION_BINS)):
            if self.rate(b) < rate:
                break
            edge = b / CALIBRATION_BINS
        return edge


PRIOR_FIRST_GUESSES = FirstGuesses()  # never recorded: each bin at its middle probability


class AdaptiveSpecLength:
    """Chooses each decoding sequence's k before a step; learns from the step after it."""

    def __init__(self, max_k: int, prior_draft_cost_ratio: float, lookup_max_k: int | None = None):
        """max_k bounds the proposer's k, lookup_max_k (max_k where None) a lookup first's."""
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.lookup_max_k = lookup_max_k or max_k
        self.probe_tokens = min(PROBE_TOKENS, max_k)  # a probe's k
        # Prior, in units of a one-row target forward: PRIOR_ROW_SHARE more per verified
        # row (see ForwardCosts), a draft position the draft/target size ratio, and a
        # token read into the draft before drafting half a draft position (a fifth, nearer
        # what reading measures, probes more and loses where drafting does not pay:
        # benchmarks/EXPERIMENTS.md, "Replayed on recorded traces"). Measurements take
        # over within a few dozen steps. The target's costs are in seconds once its first
        # step is measured; the draft's fits stay in units.
        self.target = ForwardCosts()
        self.chains = ChainShares()
        r = prior_draft_cost_ratio
        self.draft = LinearFit(((1, r), (5, 5 * r)))
        self.read = LinearFit(((0, 0.0), (64, 32 * r)))
        self.target_steps = 0  # target forwards measured
        self.unpriced_chains = 0  # multi-step chains before the first (see measuring_plain)
        self.sequences: dict[int, Acceptance] = {}
        self.lookups: dict[int, Acceptance] = {}  # each sequence's lookup-first drafts
        # Each sequence's own: how sure a proposer is of a right guess moves with the text
        # (a head sure and wrong on one answer would drop another's good guesses).
        self.first_guesses: dict[int, FirstGuesses] = {}
        # What `best` weighs changes only with a measurement or a drafting step's record
        # (`_news` counts them); a plain step changes nothing but its clocks. So a batch
        # choosing plain decoding keeps that choice, unpriced, until there is news
        # (`_plain_choice`: the batch, its floor, the news and the read costs it saw).
        self._news = 0
        self._plain_choice: tuple[tuple, list[float]] | None = None

    def plain_step(self, batch: int) -> float:
        """Predicted seconds of plain decoding's token for each of `batch` sequences: the
        target's forward of `batch` rows, or its chain's share of it (`ChainShares`)."""
        return self.target_seconds(batch) * self.chains.share(batch)

    def target_seconds(self, rows: float) -> float:
        """Predicted seconds of a target forward of `rows` rows in all (an expected
        count: between two counts, in proportion; see ForwardCosts)."""
        return self.target.seconds(rows)

    def _unit(self) -> float:
        """Seconds of a one-row target forward now: the unit of the draft's fits."""
        return max(self.target_seconds(1), 1e-12)

    def _in_seconds(self, fit: LinearFit) -> tuple[float, float]:
        """A fit kept in units of a one-row target forward, as (intercept, slope) in seconds."""
        unit = self._unit()
        intercept, slope = fit.coefficients()
        return intercept * unit, slope * unit

    def draft_costs(self) -> tuple[float, float]:
        """Seconds of a drafting call: (fixed, per position drafted)."""
        return self._in_seconds(self.draft)

    def read_costs(self) -> tuple[float, float]:
        """Seconds of reading a backlog into the proposer: (fixed, per token)."""
        return self._in_seconds(self.read)

    def speedup(self, tokens: float, drafted: float, batch: int) -> float:
        """Predicted speed against plain decoding of a step that emits `tokens` on
        average after drafting `drafted` positions for each of `batch` sequences."""
        draft_fixed, per_position = self.draft_costs()
        plain = self.plain_step(batch)
        if drafted == 0 or plain <= 0:
            return 1.0
        return tokens * plain / (self.target_seconds(batch * (1 + drafted)) + draft_fixed + drafted * per_position)

    def best_k(self, acceptance: Acceptance, batch: int) -> int:
        """k for a batch of `batch` sequences that all draft like `acceptance`."""
        return self.batch_ks([acceptance] * batch)[0]

    def read_cost(self, backlog: int, remaining: int) -> float:
        """Seconds per emitted token of reading `backlog` tokens into the proposer
        before a sequence's first draft, spread over the `remaining` tokens it may still
        emit (it pays once, and every drafting step after that gains)."""
        return self._reads_per_token([backlog], [remaining])[0]

    def _reads_per_token(self, backlogs: list[int], spreads: list[int]) -> list[float]:
        """`read_cost` of each backlog spread over as many tokens, the line priced once."""
        intercept, slope = self.read_costs()
        return [0.0 if b <= MAX_CATCH_UP else (intercept + slope * b) / max(n, 1) for b, n in zip(backlogs, spreads)]

    def batch_ks(
        self,
        acceptances: list[Acceptance],
        read_costs: list[float] | None = None,
        others: int = 0,
        floor: float = MIN_SPEEDUP,
    ) -> list[int]:
        """Each sequence's k for the step that maximises the batch's predicted tokens
        per second; all 0 unless that beats plain decoding by `floor` (see `best`)."""
        return self.best(acceptances, read_costs, others, floor)[1]

    def best(
        self,
        acceptances: list[Acceptance],
        read_costs: list[float] | None = None,
        others: int = 0,
        floor: float = MIN_SPEEDUP,
    ) -> tuple[float, list[int]]:
        """(predicted speedup, each sequence's k) of the step that maximises the batch's
        predicted tokens per second; (floor, all 0) unless one beats plain decoding by
        `floor` (MIN_SPEEDUP to start drafting, CONTINUE_SPEEDUP to go on: see `choose`).

        The draft runs for the whole batch at once, so its cost follows the longest
        draft: one sequence drafting alone makes every other one wait through its draft
        steps, which under load costs more than that one sequence gains. For each
        horizon (the most positions drafted) two choices are weighed: every sequence
        drafting up to it, and each drafting the k up to it whose extra tokens best
        outweigh its extra verified rows, valued at the best speed found so far.

        read_costs: per sequence, seconds per emitted token its proposer must first spend
        reading (`read_cost`), charged to a step where it drafts: a prompt not yet read
        into the draft makes a short request's drafting worth less. others: sequences of
        the batch that do not draft (prompts being prefilled join the decoding batch
        within a step or two; a prompt read for a batch that is about to grow is wasted)."""
        count = len(acceptances)
        batch = count + others
        plain = self.plain_step(batch)
        if count == 0 or plain <= 0:
            return floor, [0] * count
        # A verified row's cost, on average over every row a step may add.
        per_row = (self.target_seconds(batch * (1 + self.max_k)) - self.target_seconds(batch)) / (batch * self.max_k)
        curves = np.array([a.curves() for a in acceptances])  # [B, 2, K + 1]: E, D
        tokens, drafted = curves[:, 0], curves[:, 1]  # [B, K + 1]
        limits = np.array([a.deepest_asked() for a in acceptances]) + K_GROWTH  # [B]: see K_GROWTH
        # Per sequence and k, what a candidate step sums (tokens, rows) or takes the
        # largest of (the draft's positions, and a first guess dropped: 1 - D[1] of
        # them), and the reading it is charged where it drafts.
        charged = np.zeros_like(curves)  # [B, 2, K + 1]: positions, reading; 0 at k = 0
        charged[:, 0, 1:] = drafted[:, 1:] + 1 - drafted[:, 1:2]
        if read_costs is not None:
            charged[:, 1, 1:] = np.array(read_costs)[:, None] * tokens[:, 1:]
        table = np.concatenate([curves, charged], axis=1).transpose(1, 0, 2).reshape(4, -1)  # [4, B * (K + 1)]
        offsets = np.arange(count) * (self.max_k + 1)  # [B]: each sequence's k = 0 in a row of `table`
        horizons = np.arange(1, self.max_k + 1)[:, None]  # [K, 1]
        every_one = np.minimum(horizons, limits)  # [K, B]: each drafting up to the horizon
        forwards: dict[float, float] = {}  # seconds of a forward by its rows, as the candidates ask
        best, best_ks = floor, [0] * count
        for _ in range(2):  # the second pass values a verified row at the first pass's best speed
            row_value = per_row * best * batch / plain  # tokens a verified row must earn
            worth = tokens - row_value * drafted  # [B, K + 1]
            # Per sequence, the best k up to each horizon (the first of equals): the last
            # k up to it whose worth beats every smaller k's.
            rises = np.ones_like(worth, dtype=bool)
            rises[:, 1:] = worth[:, 1:] > np.maximum.accumulate(worth, axis=1)[:, :-1]
            best_upto = np.maximum.accumulate(np.where(rises, np.arange(self.max_k + 1), 0), axis=1)[:, 1:].T  # [K, B]
            # Horizon by horizon, both choices: the first of the fastest wins.
            candidates = np.stack([every_one, np.minimum(best_upto, limits)], axis=1).reshape(-1, count)  # [2K, B]
            speeds = self._speedups(table.take(candidates + offsets, axis=1), others, plain, forwards)
            fastest = int(speeds.argmax())
            if speeds[fastest] <= best:
                break  # the second pass would value rows as the first did
            best, best_ks = float(speeds[fastest]), candidates[fastest].tolist()
        return best, best_ks

    def _speedups(self, taken: np.ndarray, others: int, plain: float, forwards: dict[float, float]) -> np.ndarray:
        """Predicted speedup [N] of each candidate step from what each of its sequences
        takes of `best`'s table [4, N, B]: tokens, rows, positions, reading. `forwards`
        keeps the target's seconds by row count across calls."""
        batch = taken.shape[2] + others
        draft_fixed, per_position = self.draft_costs()
        emitted, drafted, _, reading = taken.sum(axis=2)  # [N] each
        longest = taken[2].max(axis=1)  # [N]: 0 where none drafts
        rows = (batch + drafted).tolist()  # the forward's, many alike
        for r in set(rows).difference(forwards):
            forwards[r] = self.target_seconds(r)
        step = np.array([forwards[r] for r in rows]) + draft_fixed + per_position * longest + reading
        return np.where(longest > 0, (others + emitted) * plain / (batch * step), 1.0)

    def choose(
        self,
        seq_ids: list[int],
        backlogs: list[int] | None = None,
        remaining: list[int] | None = None,
        others: int = 0,
        spreads: list[int] | None = None,
    ) -> list[int]:
        """k for each decoding sequence of this step (before any cap on remaining tokens);
        backlogs and remaining (per sequence): see `read_cost`; others: see `batch_ks`.
        spreads (per sequence): the tokens a drafting step's read is spread over where
        fewer than `remaining`: a backlog a multi-step chain left comes back after every
        chain that follows a draft, so it must pay within a chain (the engine's
        num_scheduler_steps). A probe's read is spread over `remaining` either way."""
        states = [self._state(seq_id) for seq_id in seq_ids]
        if self.measuring_plain(len(seq_ids) + others):  # a pause: runs, probes and their clocks go on after
            for state in states:
                state.chosen, state.probing = 0, False
            return [0] * len(states)
        read_costs = drafting_reads = [0.0] * len(states)
        if backlogs is not None and remaining is not None:
            read_costs = drafting_reads = self._reads_per_token(backlogs, remaining)
            if spreads is not None and spreads != remaining:
                drafting_reads = self._reads_per_token(backlogs, [min(r, n) for r, n in zip(remaining, spreads)])
        batch = len(seq_ids) + others
        hopeful = None  # worked out once, if some sequence is due a probe
        # A batch whose every sequence is in a run of drafting goes on at a lower bar
        # than one that would start, once the costs are measured (see CONTINUE_SPEEDUP).
        running = self.target_steps >= COSTS_KNOWN_STEPS and all(
            state.drafting_steps and not state.dropped_last for state in states
        )
        floor = CONTINUE_SPEEDUP if running and states else MIN_SPEEDUP
        ks = []
        for state, k, read in zip(states, self._batch_ks(seq_ids, states, drafting_reads, others, floor), read_costs):
            if k == 0 and state.drafting_steps:  # a run of drafting ends: did it last?
                lasted = state.drafting_steps >= PROBE_INTERVAL
                state.probe_interval = PROBE_INTERVAL if lasted else min(2 * state.probe_interval, MAX_PROBE_INTERVAL)
                state.drafting_steps = 0
            # A probe makes the whole batch wait through a draft: in a batch of B, each
            # sequence probes B times less often, so probes cost the batch alike. A new
            # sequence may probe at once: waiting tells nothing about its text, and its
            # first probe reads the prompt either way.
            state.probing = k == 0 and (state.fresh or state.plain_steps >= state.probe_interval * batch)
            if state.probing:
                hopeful = self._speedup_after_a_full_probe(batch) if hopeful is None else hopeful
                state.probing = read <= self._affordable_read(state, hopeful, batch)
            state.chosen = self.probe_tokens if state.probing else k
            ks.append(state.chosen)
        return ks

    def _batch_ks(
        self, seq_ids: list[int], states: list[Acceptance], read_costs: list[float], others: int, floor: float
    ) -> list[int]:
        """batch_ks, where the last choice for these sequences was plain decoding and
        nothing it weighed has changed since, that choice again without pricing: read
        costs only grow over plain steps (the backlog grows, the tokens left shrink), and
        dearer reading makes no k pay that did not."""
        key = (tuple(seq_ids), others, floor, self._news)
        last = self._plain_choice
        if last is not None and last[0] == key and all(r >= seen for r, seen in zip(read_costs, last[1])):
            return [0] * len(states)
        ks = self.batch_ks(states, read_costs, others, floor)
        self._plain_choice = None if any(ks) else (key, read_costs)
        return ks

    def measuring_plain(self, batch: int) -> bool:
        """Whether this step decodes plainly to measure a plain step of `batch`
        sequences, which every forward so far outgrew (PLAIN_MEASURED_AFTER); or the
        target's forward at all, where every step so far decoded in multi-step chains
        (or drafted only guesses it dropped): without it no cost is known, and the
        draft's and the chains' would be priced by the priors for good."""
        if not self.target.measured:
            return self.unpriced_chains > 0
        return self.target_steps >= PLAIN_MEASURED_AFTER and self.target.measured_only_above(batch)

    def _speedup_after_a_full_probe(self, batch: int) -> float:
        """The predicted speedup of a sequence whose probe was fully accepted: `record`
        restarts its estimate from that probe alone."""
        after = Acceptance(self.max_k)
        after.restart(PROBE_DOUBT)
        after.chosen = self.probe_tokens
        after.record(self.probe_tokens, self.probe_tokens)
        return self.best([after], others=batch - 1)[0]

    def _affordable_read(self, state: Acceptance, hopeful: float, batch: int) -> float:
        """The most a probe may spend per remaining token reading its backlog: what
        drafting saves per token after a fully accepted probe (`hopeful`), times the
        chance of one by the sequence's own estimate. Valued by the least gain worth
        drafting for, or by a new sequence's prior, a sequence near break-even skips
        every probe once its backlog grows, and never drafts again
        (benchmarks/EXPERIMENTS.md, "Probes valued by what follows a fully accepted
        one")."""
        tokens, _ = state.curves()
        chance = tokens[self.probe_tokens] - tokens[self.probe_tokens - 1]  # the whole probe accepted
        return chance * (1 - 1 / hopeful) * self.plain_step(batch) / batch

    def record(self, seq_id: int, num_drafted: int, num_accepted: int, num_dropped: int = 0) -> None:
        """One sequence's step: what it drafted (maybe fewer than chosen), kept, and
        dropped (`Draft.dropped`: a step that dropped its first guess still drafted).
        A step no k was chosen for is not counted: the prefill step that gives a new
        sequence its first token (counted as a plain step, it would clear `fresh`
        before the first choice, and the sequence would not probe at once)."""
        if num_drafted == 0 and not num_dropped:
            self.record_plain(seq_id, 1)
            return
        state = self.sequences.get(seq_id)
        if state is None:
            return
        state.fresh = False
        self._news += 1
        if state.probing and num_accepted == num_drafted and not num_dropped:
            # The text may have turned predictable: forget the streak that stopped drafting
            # and go by this probe, with a little doubt (not the prior's weight: under costs
            # where the prior itself does not pay, the sequence would only ever probe).
            state.restart(PROBE_DOUBT)
        state.record(num_drafted, num_accepted)
        state.plain_steps = 0
        state.drafting_steps += 1
        state.dropped_last = num_drafted == 0
        state.probing = False

    def record_plain(self, seq_id: int, steps: int) -> None:
        """`steps` more plain steps of one sequence, as many `record(seq_id, 0, 0)` (a chain's)."""
        state = self.sequences.get(seq_id)
        if state is not None and steps > 0:
            state.fresh = False
            state.plain_steps += steps

    def lookup_ks(self, seq_ids: list[int], proposed: list[int], batch: int) -> list[int]:
        """How many tokens of each sequence's lookup draft (`proposed` long) to verify
        in a step of `batch` decoding sequences: the k whose expected extra tokens best
        outweigh the seconds its rows add to the forward, each second valued at plain
        decoding's tokens per second (times MIN_SPEEDUP); 0 where none does. The rows of
        the lookups chosen before a sequence's are counted in its forward, and the first
        lookup verified pays for the chain it breaks (`ChainShares`), whether or not
        the proposer drafts in the same step: lookups are chosen first."""
        plain = self.plain_step(batch)
        if plain <= 0:
            return list(proposed)
        if self.measuring_plain(batch):
            return [0] * len(proposed)
        value = MIN_SPEEDUP * batch / plain  # tokens a second of the forward must earn
        rows, ks = batch, []
        for seq_id, most in zip(seq_ids, proposed):
            tokens, _ = self._state(seq_id, self.lookups).curves()
            base = self.target_seconds(rows)
            broken = base - plain if rows == batch else 0.0  # a single step where a chain would run
            gains = [0.0] + [
                tokens[k] - 1 - value * (self.target_seconds(rows + k) - base + broken)
                for k in range(1, min(most, self.lookup_max_k) + 1)
            ]
            k = max(range(len(gains)), key=gains.__getitem__)  # k = 0 unless one gains
            ks.append(k)
            rows += k
        return ks

    def least_chances(self, batch: int, rows: int, seq_ids: list[int]) -> list[float]:
        """The least probability each sequence's greedy first guess needs, by its
        proposer, to be worth its row in a step of `batch` decoding sequences and `rows`
        rows in all: the acceptance rate that pays for the seconds a drafted row adds on
        average, valued as `lookup_ks` values them (about a fifth of a token at batch 1 on
        our CPU kernels, some hundredths on a GPU), through what that sequence's first
        guesses earned by their probability (`FirstGuesses`; the prior's where it has
        none). 0 where no row is drafted."""
        plain = self.plain_step(batch)
        if rows <= batch or plain <= 0:
            return [0.0] * len(seq_ids)
        per_row = (self.target_seconds(rows) - self.target_seconds(batch)) / (rows - batch)
        rate = MIN_SPEEDUP * batch * per_row / plain
        return [self.first_guesses.get(i, PRIOR_FIRST_GUESSES).least_probability(rate) for i in seq_ids]

    def observe_first_guess(self, seq_id: int, probability: float, accepted: bool) -> None:
        """seq_id's verified greedy first guess: its proposer's probability of it, and the verdict."""
        self.first_guesses.setdefault(seq_id, FirstGuesses()).record(probability, accepted)

    def record_lookup(self, seq_id: int, proposed: int, matched: int) -> None:
        """A lookup draft of `proposed` tokens whose first `matched` the target emitted
        after it (verified or not: see `lookup_ks`)."""
        state = self._state(seq_id, self.lookups)
        state.chosen = proposed
        state.record(proposed, matched)

    def _state(self, seq_id: int, states: dict[int, Acceptance] | None = None) -> Acceptance:
        """seq_id's Acceptance in `states` (its proposer's drafts, `self.sequences`, by
        default), a new one if it has none."""
        states = self.sequences if states is None else states
        if seq_id not in states:
            states[seq_id] = Acceptance(self.lookup_max_k if states is self.lookups else self.max_k)
        return states[seq_id]

    def observe_target(self, rows: int, seconds: float) -> None:
        """A decode step's target forward: `rows` tokens verified in `seconds`."""
        self.target.observe(rows, seconds)
        self.target_steps += 1
        self._news += 1

    def observe_chain(self, batch: int, positions: int, seconds: float) -> None:
        """A multi-step chain of `batch` sequences that decoded `positions` tokens each
        in `seconds`. Not news (see `_news`): while a batch decodes plainly, a chain's
        price only confirms that choice. Chains before the first measured target
        forward are not counted: the forward's price is still the prior's."""
        if self.target.measured:
            self.chains.observe(batch, seconds / positions / self.target_seconds(batch))
        else:
            self.unpriced_chains += 1

    def observe_draft(self, positions: int, seconds: float) -> None:
        """A proposer call that drafted up to `positions` tokens per sequence. Calls
        before the first measured target step are not counted: the unit is unknown."""
        if positions > 0 and self.target_steps:
            self.draft.add(positions, seconds / self._unit())
            self._news += 1

    def observe_read(self, tokens: int, positions: int, seconds: float) -> None:
        """A proposer call that read `tokens` before drafting up to `positions`: the
        time beyond what drafting costs is the reading's."""
        if not self.target_steps:
            return
        draft_fixed, per_position = self.draft_costs()
        drafting = draft_fixed + per_position * positions if positions else 0.0
        self.read.add(tokens, max(seconds - drafting, 0.0) / self._unit())
        self._news += 1

    def free(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)
        self.lookups.pop(seq_id, None)
        self.first_guesses.pop(seq_id, None)
