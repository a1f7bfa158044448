"""Adaptive speculation: each sequence's k follows its acceptance and the measured costs.

Leviathan et al.: if each drafted token is accepted with probability a (independently),
a step that drafts k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average.
What a step costs is measured on the spot, as two straight lines fitted to the
engine's own timings (recent steps weigh more):

    target forward (seconds) = fixed + per_row * rows       (rows = tokens verified)
    drafting       (seconds) = draft_fixed + per_position * k

For a batch of B decoding sequences a plain step costs T0 = fixed + per_row * B; drafting
k tokens each adds draft_fixed + k * (per_position + per_row * B). So the speed relative
to plain decoding is

    speedup(k) = E(k) * T0 / (T0 + draft_fixed + k * (per_position + per_row * B))

and each sequence drafts the k in [0, max_k] that maximises it with its own a. A
proposer may stop before k (the draft when unsure of a guess, an n-gram lookup that
runs out); with s the measured chance of stopping after a position, E(k) becomes
1 + sum_{i=1..k} a^i (1-s)^(i-1) and the k in the cost becomes the positions expected
to be drafted, sum_{i=1..k} (1-s)^(i-1). Without that, k was chosen as if every
position were drafted and paid for, and on open-ended text adaptive decoded plainly
where drafting paid. When no
k beats plain decoding by a margin the sequence decodes plainly (k = 0) and probes with
a short draft now and then, less often after each probe that fails, so a prompt that
turns predictable is noticed (a fully accepted probe restarts the estimate from that
probe alone) while an open-ended one costs next to nothing. As the
batch grows, per_row * B grows against the draft's fixed costs and k falls: under load
the weights are already shared by many rows and verification is no longer free.

The acceptance estimate is the geometric model's maximum likelihood, accepted /
(accepted + rejections), over exponentially decaying counts. k is chosen from the
target's and the draft's past outputs only, never from the current step's, so
verification stays lossless whatever k is.
"""

from __future__ import annotations

from dataclasses import dataclass

# Speedup a draft must promise over plain decoding; below it, decode plainly.
MIN_SPEEDUP = 1.03
# Weight of older observations after each new one.
ACCEPTANCE_DECAY = 0.85
TIMING_DECAY = 0.97
# A new sequence's acceptance prior: 0.8 with the weight of two steps.
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.6, 0.4
# Plain steps before the first probe; the gap doubles after each failed probe up to the max.
PROBE_INTERVAL, MAX_PROBE_INTERVAL, PROBE_TOKENS = 16, 128, 2
# Rejections a fully accepted probe starts the new estimate with: 2 of 2 accepted -> 0.9.
PROBE_DOUBT = 0.2


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


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    # A proposer may stop before k (a draft unsure of its guess, an n-gram that runs
    # out): continued / stopped count its positions the same way, with no prior.
    continued: float = 0.0
    stopped: float = 0.0
    chosen: int = 0  # this step's k
    plain_steps: int = 0  # since the last draft
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False  # this step's draft is a probe

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def stop_rate(self) -> float:
        """Chance that the proposer stops after a drafted position, before k."""
        total = self.continued + self.stopped
        return self.stopped / total if total > 0 else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.rejected = ACCEPTANCE_DECAY * self.rejected + (num_accepted < num_drafted)
        stopped_early = num_drafted < self.chosen
        self.continued = ACCEPTANCE_DECAY * self.continued + num_drafted - 1
        self.stopped = ACCEPTANCE_DECAY * self.stopped + stopped_early


def expected_tokens(rate: float, k: int, stop_rate: float = 0.0) -> float:
    """Tokens a step emits when it drafts up to k, each accepted with probability
    `rate`, the proposer going on after each drafted position with 1 - stop_rate:
    1 + sum over i = 1..k of rate^i (1 - stop_rate)^(i-1)."""
    go_on = 1.0 - stop_rate
    return 1.0 + sum(rate**i * go_on ** (i - 1) for i in range(1, k + 1))


def expected_drafted(k: int, stop_rate: float = 0.0) -> float:
    """Positions drafted when asked for k: sum over i = 1..k of (1 - stop_rate)^(i-1)."""
    return sum((1.0 - stop_rate) ** (i - 1) for i in range(1, k + 1))


class AdaptiveSpecLength:
    """Chooses each decoding sequence's k before a step; learns from the step after it."""

    def __init__(self, max_k: int, prior_draft_cost_ratio: float):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        # Prior, in units of a one-row target forward: 5% more per verified row, and a
        # draft position costing the draft/target size ratio. Measurements take over
        # within a few dozen steps.
        self.target = LinearFit(((1, 1.0), (9, 1.4)))
        r = prior_draft_cost_ratio
        self.draft = LinearFit(((1, r), (5, 5 * r)))
        self._scale_known = False
        self.sequences: dict[int, _Acceptance] = {}

    def speedup(self, rate: float, k: int, batch: int, stop_rate: float = 0.0) -> float:
        fixed, per_row = self.target.coefficients()
        draft_fixed, per_position = self.draft.coefficients()
        plain = fixed + per_row * batch
        if k == 0 or plain <= 0:
            return 1.0
        drafted = expected_drafted(k, stop_rate)
        return expected_tokens(rate, k, stop_rate) * plain / (
            plain + draft_fixed + drafted * (per_position + per_row * batch))

    def best_k(self, rate: float, batch: int, stop_rate: float = 0.0) -> int:
        speedups = [self.speedup(rate, k, batch, stop_rate) for k in range(self.max_k + 1)]
        k = max(range(len(speedups)), key=speedups.__getitem__)
        return k if speedups[k] >= MIN_SPEEDUP else 0

    def choose(self, seq_ids: list[int]) -> list[int]:
        """k for each decoding sequence of this step (before any cap on remaining tokens)."""
        ks = []
        for seq_id in seq_ids:
            state = self.sequences.setdefault(seq_id, _Acceptance())
            k = self.best_k(state.rate, len(seq_ids), state.stop_rate)
            state.probing = k == 0 and state.plain_steps >= state.probe_interval
            state.chosen = PROBE_TOKENS if state.probing else k
            ks.append(state.chosen)
        return ks

    def record(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """One sequence's step: what it drafted (maybe fewer than chosen) and kept."""
        state = self.sequences.setdefault(seq_id, _Acceptance())
        if num_drafted == 0:
            state.plain_steps += 1
            return
        if state.probing and num_accepted == num_drafted:
            # The text may have turned predictable: forget the streak that stopped drafting
            # and go by this probe, with a little doubt (not the prior: under costs where
            # the prior itself does not pay, the sequence would only ever probe).
            state.accepted, state.rejected = 0.0, PROBE_DOUBT
        state.record(num_drafted, num_accepted)
        state.plain_steps = 0
        if state.probing:  # a probe that still does not pay waits twice as long next time
            paid = self.best_k(state.rate, 1, state.stop_rate) > 0
            state.probe_interval = PROBE_INTERVAL if paid else min(2 * state.probe_interval, MAX_PROBE_INTERVAL)
            state.probing = False

    def observe_target(self, rows: int, seconds: float) -> None:
        """A decode step's target forward: `rows` tokens verified in `seconds`."""
        self._rescale_priors(seconds / rows)
        self.target.add(rows, seconds)

    def observe_draft(self, positions: int, seconds: float) -> None:
        """A proposer call that drafted up to `positions` tokens per sequence."""
        if positions > 0:
            self.draft.add(positions, seconds)

    def _rescale_priors(self, seconds_per_row: float) -> None:
        # The priors are in units of a target forward; the first measurement sets the unit.
        if self._scale_known:
            return
        self._scale_known = True
        for fit in (self.target, self.draft):
            for name in ("sy", "sxy"):
                setattr(fit, name, getattr(fit, name) * seconds_per_row)

    def free(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)
