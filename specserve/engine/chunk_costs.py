"""What a prompt chunk costs by where it lies, so that a step beside decoding sequences
costs about what a whole chunk at a prompt's start does.

A chunk token at position p attends to the p positions before it: its step costs
seconds per token ~= base + slope * p, so n tokens from position p cost what
n * (1 + (p + (n - 1) / 2) / C) tokens cost at position 0, where C = base / slope (the
horizon: the position where a token's attention costs as much as the rest of its
arithmetic). `ChunkCosts` fits base and slope from the reading steps the engine times,
and gives the longest chunk that a budget in tokens at position 0 pays for.
"""

from __future__ import annotations

import math

from specserve.config import ModelConfig
from specserve.spec.adaptive import LinearFit

# Positions read in a step's chunks, spread this far (the decaying standard deviation of
# their mean positions), before the fitted horizon replaces the one from arithmetic: a
# slope fitted over a few steps of one prompt is mostly noise.
MIN_POSITION_SPREAD = 512.0
# The fitted horizon is held to at least this share of the arithmetic one, so that a noisy
# fit (a machine shared with other work) cannot cut a long prompt into slivers; on the
# CPU's int4 layers it was 0.4-0.7 (benchmarks/EXPERIMENTS.md, "A prompt chunk's step over
# a long context").
MIN_HORIZON_SHARE = 0.25
# Weight of older reading steps after each new one: a memory of ~30 chunks.
CHUNK_TIMING_DECAY = 0.97


def arithmetic_horizon(config: ModelConfig) -> float:
    """The position at which a token's attention (QK and PV over each head) costs as many
    multiply-adds as its layers' projections and MLP: the horizon before any is measured.
    Kernels run attention less efficiently than their matmuls (on the CPU's int4 layers
    the measured horizon is 0.4-0.7 of this), so it prices long contexts cheap until fitted."""
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    return (projections + mlp) / (2 * heads * head_dim)


class ChunkCosts:
    """Fitted seconds per chunk token against the chunk's mean position, and the chunk
    lengths a budget pays for."""

    def __init__(self, prior_horizon: float):
        if prior_horizon <= 0:
            raise ValueError(f"prior_horizon must be > 0, got {prior_horizon}")
        self.prior_horizon = prior_horizon
        self.fit: LinearFit | None = None

    def observe(self, tokens: int, mean_position: float, seconds: float) -> None:
        """A reading step fed `tokens` prompt tokens whose mean position was
        `mean_position`, in `seconds` (the whole forward: decoding rows beside them too)."""
        if tokens <= 0 or seconds <= 0:
            return
        if self.fit is None:
            # A fit seeded with its first point twice has no spread, so it answers only
            # once the positions read have spread (`horizon`).
            point = (mean_position, seconds / tokens)
            self.fit = LinearFit((point, point), decay=CHUNK_TIMING_DECAY)
        else:
            self.fit.add(mean_position, seconds / tokens)

    @property
    def horizon(self) -> float:
        """C: the fitted base / slope where the positions read have spread (at least
        MIN_HORIZON_SHARE of the prior's; infinite where positions cost nothing), else
        the prior's."""
        fit = self.fit
        if fit is None:
            return self.prior_horizon
        mean_x = fit.sx / fit.sw
        spread = math.sqrt(max(fit.sxx / fit.sw - mean_x * mean_x, 0.0))
        base, slope = fit.coefficients()
        if spread < MIN_POSITION_SPREAD:
            return self.prior_horizon
        if slope <= 0:  # measured: a position costs nothing
            return math.inf
        # A base at 0 (fitted far from position 0, attention seemingly all) meets the floor.
        return max(base / slope, MIN_HORIZON_SHARE * self.prior_horizon)

    @staticmethod
    def cost(start: int, tokens: int, horizon: float) -> float:
        """What `tokens` chunk tokens from position `start` cost, in tokens at position 0."""
        return tokens * (1 + (start + (tokens - 1) / 2) / horizon)

    @staticmethod
    def chunk_length(start: int, budget: float, horizon: float) -> int:
        """The most tokens from position `start` that `budget` (tokens at position 0)
        pays for at `horizon`; at least 1, so that a prompt always advances."""
        if math.isinf(horizon):
            return max(int(budget * (1 + 1e-9)), 1)
        # n * (1 + (start + (n - 1) / 2) / C) <= budget, a quadratic in n:
        # n^2 / (2C) + n (1 + (start - 1/2) / C) - budget <= 0.
        a = 1 / (2 * horizon)
        b = 1 + (start - 0.5) / horizon
        n = max(int(2 * budget / (b + math.sqrt(b * b + 4 * a * budget))), 1)  # the root, in a stable form
        # The root in floating point may land a token either side of the boundary.
        within = budget * (1 + 1e-9)
        while ChunkCosts.cost(start, n + 1, horizon) <= within:
            n += 1
        while n > 1 and ChunkCosts.cost(start, n, horizon) > within:
            n -= 1
        return n
