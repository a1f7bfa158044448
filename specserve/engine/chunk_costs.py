"""What a prompt chunk costs by where it lies, so that a step beside decoding sequences
costs about what a whole chunk at a prompt's start does.

A row at position p attends to the p positions before it, so a reading step costs
seconds ~= fixed + per_row * rows + per_position * (the sum of the rows' positions)
+ per_lm_head * (the rows that compute the LM head): n chunk tokens from position p cost
what n * (1 + (p + (n - 1) / 2) / C) tokens cost at position 0, where C = per_row /
per_position (the horizon: the position where a token's attention costs as much as the
rest of its arithmetic), and n * row_share more where each computes the LM head (a prompt
whose logprobs are owed), row_share = per_lm_head / per_row. `ChunkCosts` fits them from
the reading steps the engine times, and gives the longest chunk that a budget in tokens
at position 0 pays for.
"""

from __future__ import annotations

import math

import numpy as np

from specserve.config import ModelConfig

# Positions read in a step's rows, spread this far (the decaying standard deviation of
# their mean positions), and row counts spread this far, before the fitted horizon
# replaces the one from arithmetic: a slope fitted over a few steps of one prompt is
# mostly noise, and with every step of one size the fixed cost and a row's are one. So
# too the LM-head rows apart from the rows, before a fitted row share replaces the prior.
MIN_POSITION_SPREAD = 512.0
MIN_ROW_SPREAD = 2.0
# The fitted horizon is held to at least this share of the arithmetic one, so that a noisy
# fit (a machine shared with other work) cannot cut a long prompt into slivers; on the
# CPU's int4 layers it was 0.26-0.7 by the memory's phase (benchmarks/README.md,
# "long_prompt.py").
MIN_HORIZON_SHARE = 0.25
# The fitted LM-head share is held to at most this many times the arithmetic one: on the
# CPU's int4 target a row's LM head (its int8 weights, then the logprobs of 152k ids)
# cost twice it: 0.36 of a row for 0.18.
MAX_ROW_SHARE_FACTOR = 4.0
# Weight of older reading steps after each new one: a memory of ~200 steps, so that late
# in a long prompt, whose chunks have shortened, the fit still holds its first chunks:
# the horizon is an extrapolation from there, and one over the last ~30 steps alone fell
# to the floor (benchmarks/EXPERIMENTS.md, "The chunk fit's memory and its fixed cost").
CHUNK_TIMING_DECAY = 0.995


def arithmetic_horizon(config: ModelConfig) -> float:
    """The position at which a token's attention (QK and PV over each head) costs as many
    multiply-adds as its layers' projections and MLP: the horizon before any is measured.
    Kernels run attention less efficiently than their matmuls (on the CPU's int4 layers
    the measured horizon is 0.26-0.7 of this), so it prices long contexts cheap until fitted."""
    return _layer_arithmetic(config) / (2 * config.num_heads * config.head_dim)


def lm_head_share(config: ModelConfig) -> float:
    """What a row's LM head (hidden x vocabulary) adds to a token's arithmetic in its
    layers: 0.18 on a Qwen2.5 1.5B, whose 152k ids outweigh a sixth of its 28 layers."""
    return config.hidden_size * config.vocab_size / (config.num_layers * _layer_arithmetic(config))


def _layer_arithmetic(config: ModelConfig) -> float:
    """Multiply-adds of one token's projections and MLP in one layer."""
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return projections + 3 * hidden * config.intermediate_size


class ChunkCosts:
    """A decaying least-squares fit of a reading step's seconds against its rows, the sum
    of their positions and its LM-head rows, and the chunk lengths a budget pays for."""

    def __init__(self, prior_horizon: float, prior_row_share: float = 0.0):
        if prior_horizon <= 0:
            raise ValueError(f"prior_horizon must be > 0, got {prior_horizon}")
        self.prior_horizon = prior_horizon
        self.prior_row_share = prior_row_share
        self._xx = np.zeros((4, 4))  # decaying sums of x x^T, x = (1, rows, position sum, LM-head rows)
        self._xy = np.zeros(4)  # and of x * seconds
        self._positions = np.zeros(2)  # decaying sums of the steps' mean positions and their squares
        self._fitted: tuple[float, float] | None = None  # (horizon, row share) since the last observation

    def observe(self, rows: int, position_sum: float, lm_head_rows: int, seconds: float) -> None:
        """A forward that fed `rows` rows with positions summing to `position_sum`, of
        which `lm_head_rows` computed the LM head, timed at `seconds`; the engine passes
        those that read a prompt chunk."""
        if rows <= 0 or seconds <= 0:
            return
        x = np.array([1.0, rows, position_sum, lm_head_rows])
        mean_position = position_sum / rows
        d = CHUNK_TIMING_DECAY
        self._xx = d * self._xx + np.outer(x, x)
        self._xy = d * self._xy + x * seconds
        self._positions = d * self._positions + np.array([mean_position, mean_position**2])
        self._fitted = None

    @property
    def horizon(self) -> float:
        """C: the fitted per-row / per-position cost where the steps' positions and sizes
        have spread (at least MIN_HORIZON_SHARE of the prior's; infinite where positions
        cost nothing), else the prior's."""
        return self._fit()[0]

    @property
    def row_share(self) -> float:
        """What a row's LM head adds to its cost, in tokens at position 0: fitted where the
        steps' LM-head rows have spread apart from their rows (a prompt owing its logprobs
        was read, and prompts that owed none), at most MAX_ROW_SHARE_FACTOR times the
        prior's; else the prior's."""
        return self._fit()[1]

    def _fit(self) -> tuple[float, float]:
        if self._fitted is None:
            self._fitted = self._solve()
        return self._fitted

    def _solve(self) -> tuple[float, float]:
        weight, prior = self._xx[0, 0], (self.prior_horizon, self.prior_row_share)
        if weight == 0:
            return prior
        xx = self._xx / weight  # weighted means of x x^T
        mean_position, mean_square = self._positions / weight
        if math.sqrt(max(mean_square - mean_position**2, 0.0)) < MIN_POSITION_SPREAD:
            return prior
        rows_variance = xx[1, 1] - xx[0, 1] ** 2
        if rows_variance < MIN_ROW_SPREAD**2:
            return prior
        # LM-head rows that vary apart from the rows (prompts owing logprobs read beside
        # steps that owed none): their own cost is told apart.
        lm_head_variance = xx[3, 3] - xx[0, 3] ** 2
        lm_head_covariance = xx[1, 3] - xx[0, 1] * xx[0, 3]
        separate = lm_head_variance - lm_head_covariance**2 / rows_variance >= MIN_ROW_SPREAD**2
        # Else LM-head rows move only with the rows: each counted at the prior's share of a row.
        fold = np.eye(4) if separate else np.array([[1.0, 0, 0, 0], [0, 1, 0, self.prior_row_share], [0, 0, 1, 0]])
        coefficients = _least_squares(fold @ self._xx @ fold.T, fold @ self._xy)
        if coefficients is None:
            return prior
        per_row, per_position = coefficients[1], coefficients[2]
        per_lm_head = coefficients[3] if separate else per_row * self.prior_row_share
        floor = MIN_HORIZON_SHARE * self.prior_horizon
        if per_row <= 0:  # rows seemingly free, attention all: the floor, and the prior's share
            return (floor if per_position > 0 else math.inf), self.prior_row_share
        row_share = min(max(per_lm_head / per_row, 0.0), MAX_ROW_SHARE_FACTOR * self.prior_row_share)
        if per_position <= 0:  # measured: a position costs nothing
            return math.inf, row_share
        return max(per_row / per_position, floor), row_share

    @staticmethod
    def cost(start: int, tokens: int, horizon: float, row_share: float = 0.0) -> float:
        """What `tokens` chunk tokens from position `start` cost, in tokens at position 0,
        each computing the LM head too at `row_share` a row."""
        return tokens * (1 + row_share + (start + (tokens - 1) / 2) / horizon)

    @staticmethod
    def chunk_length(start: int, budget: float, horizon: float, row_share: float = 0.0) -> int:
        """The most tokens from position `start` that `budget` (tokens at position 0)
        pays for at `horizon`, each at `row_share` more; at least 1, so that a prompt
        always advances."""
        within = budget * (1 + 1e-9)
        if math.isinf(horizon):
            return max(int(within / (1 + row_share)), 1)
        # n * (1 + r + (start + (n - 1) / 2) / C) <= budget, a quadratic in n:
        # n^2 / (2C) + n (1 + r + (start - 1/2) / C) - budget <= 0.
        a = 1 / (2 * horizon)
        b = 1 + row_share + (start - 0.5) / horizon
        n = max(int(2 * budget / (b + math.sqrt(b * b + 4 * a * budget))), 1)  # the root, in a stable form
        # The root in floating point may land a token either side of the boundary.
        while ChunkCosts.cost(start, n + 1, horizon, row_share) <= within:
            n += 1
        while n > 1 and ChunkCosts.cost(start, n, horizon, row_share) > within:
            n -= 1
        return n


def _least_squares(xx: np.ndarray, xy: np.ndarray) -> np.ndarray | None:
    """The coefficients of the normal equations xx @ c = xy, or None where singular;
    columns scaled to one size first (the position sums run to 10^6 and more)."""
    scale = np.sqrt(np.diag(xx))
    if not scale.all():
        return None
    try:
        return np.linalg.solve(xx / np.outer(scale, scale), xy / scale) / scale
    except np.linalg.LinAlgError:
        return None
