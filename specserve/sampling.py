"""Sampling parameters, the logits -> probabilities transform, sampling by the inverse
of the cumulative distribution (`sample`), and the same transform and a draw inside a
CUDA graph from the device's generator (`probs_on_device`, `draw_on_device`: for
multi-step chains and a proposer's chains of guesses).

Where a draw's uniform comes from:
- An unseeded request draws from its own stream (`SamplingParams.make_generator`), in
  whatever order its steps ask.
- A seeded request's draw for the token at index p of its text (prompt included) is
  `keyed_uniforms(seed_key(seed), p)`: a hash of the seed and p, whatever was drawn
  before. So the token at p is a function of the target's distribution there and of the
  seed alone, the same whichever steps, drafts or neighbours led to it (spec/verify.py,
  `verify_keyed`).

One transform (temperature, then min-p, top-k and top-p) serves the target and the draft:
the verifier is lossless only if both distributions went through the same one.
Temperature 0 means greedy: no probabilities are formed at all. As in vLLM, so does any
temperature below `GREEDY_TEMPERATURE`: dividing float32 logits by less turns every
gap between them into an infinity, and the distribution is the argmax's one-hot anyway.

Invariant: for any `SamplingParams` that validates, `logits_to_probs` of finite logits
gives finite probabilities that sum to 1 (the most likely token always keeps its mass),
so no request's parameters can make the sampler fail.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.errors import ConfigError
from specserve.logprobs import MAX_LOGPROBS

if TYPE_CHECKING:
    from specserve.spec.prediction import PredictedText
    from specserve.structured.guide import Guide

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# The penalties' arithmetic runs in float32: a repetition penalty must stay positive and
# finite there (1e-300 rounds to 0, and a logit divided by it to infinity).
FLOAT32_TINY, FLOAT32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max

# OpenAI's range of a logit bias: -100 bans a token, 100 all but forces it.
LOGIT_BIAS_MAX = 100.0

# The likeliest ids top-p looks among first (`top_p_kept`), and the buckets of probability
# a wider nucleus is summed in: probabilities whose float32 bits agree above bit 16 (sign,
# exponent and 7 mantissa bits, so a bucket spans under 1% of its values).
TOP_P_CANDIDATES = 256
TOP_P_BUCKET_SHIFT = 16
NUM_BUCKETS = 1 << (31 - TOP_P_BUCKET_SHIFT)  # of a float32's magnitude bits
TOP_P_SORTED_VOCAB = 4096  # a vocabulary this small is sorted whole: cheaper than either
TOP_K_DIRECT = 1024  # a top-k this small takes topk's partial sort (`kth_largest`); past it, buckets
# What torch.Generator.manual_seed takes.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Past any vocabulary, and what a multi-step chain's tensors hold (model/graphs.py): a
# larger top-k would fail the step of every request in the chain beside it.
TOP_K_MAX = 2**31 - 1


class InvalidSamplingValue(ConfigError):
    """A sampling parameter outside its range, named, so that the server's error can
    name the request's field."""

    def __init__(self, param: str, rule: str, value: object):
        super().__init__(f"{param} {rule}, got {value!r}")
        self.param, self.rule, self.value = param, rule, value


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0  # vLLM's: ids less likely than min_p times the likeliest are cut; 0: none
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; n: each output token's logprob and its n most likely alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (specserve/logprobs.py)
    # Penalties on the target's logits (specserve/penalties.py); 0, 0 and 1 are off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's: special tokens (EOS, chat markers) left out of the text; their ids still count.
    skip_special_tokens: bool = True
    # vLLM's: the stop string (or stop token's text) that ended the output stays in its text.
    include_stop_str_in_output: bool = False
    # vLLM's: no stop token id (EOS or the request's own) and no stop string ends the
    # output before this many tokens (penalties.py gives the ids no probability).
    min_tokens: int = 0
    # OpenAI's: each token id's bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX], added to its
    # logit before the penalties. Given as a dict or (id, bias) pairs (a later pair of
    # the same id wins), kept as pairs, ids ascending.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: the only ids the request may sample (after bias and penalties every other
    # id gets no probability); kept distinct, ascending. Empty: every id.
    allowed_token_ids: tuple[int, ...] = ()
    # Structured outputs (vLLM's guided_*, OpenAI's response_format): the pattern the
    # output must follow; every id that would leave it gets no probability, last of all
    # (specserve/structured/).
    guide: Guide | None = None
    # vLLM's bad_words as token id sequences: the last id of each gets no probability
    # where the text ends with the ones before it (a one-id word: everywhere).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # OpenAI's predicted outputs: the text the answer is expected to be, drafted from
    # (specserve/spec/prediction.py); the answer stays the target's own.
    prediction: PredictedText | None = None

    def __post_init__(self) -> None:
        try:
            pairs = tuple(sorted(dict(self.logit_bias).items()))
        except (TypeError, ValueError):
            raise InvalidSamplingValue("logit_bias", "must map token ids to biases", self.logit_bias) from None
        object.__setattr__(self, "logit_bias", pairs)
        try:
            allowed = tuple(sorted(set(self.allowed_token_ids)))
        except TypeError:
            raise InvalidSamplingValue("allowed_token_ids", "must be token ids", self.allowed_token_ids) from None
        object.__setattr__(self, "allowed_token_ids", allowed)
        try:
            bad_words = tuple(dict.fromkeys(tuple(word) for word in self.bad_words_ids))
        except TypeError:
            raise InvalidSamplingValue("bad_words_ids", "must be token id sequences", self.bad_words_ids) from None
        object.__setattr__(self, "bad_words_ids", bad_words)
        checks = [  # (parameter, within its range, the range)
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be an integer >= 1"),
            (
                "min_tokens",
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                f"must be an integer in [0, max_tokens] ({self.max_tokens})",
            ),
            ("temperature", 0 <= self.temperature < math.inf, "must be a finite number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, f"must be in [{SEED_MIN}, {SEED_MAX}]"),
            ("top_k", -1 <= self.top_k <= TOP_K_MAX, f"must be -1, 0 (off) or a positive integer up to {TOP_K_MAX}"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            (
                "repetition_penalty",
                FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX,
                f"must be a number in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}]",
            ),
            (
                "logit_bias",
                all(isinstance(i, int) and i >= 0 and -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX for i, b in pairs),
                f"must map token ids >= 0 to numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]",
            ),
            (
                "allowed_token_ids",
                all(isinstance(i, int) and i >= 0 for i in allowed),
                "must be token ids >= 0",
            ),
            (
                "bad_words_ids",
                all(word and all(isinstance(i, int) and i >= 0 for i in word) for word in bad_words),
                "must be non-empty sequences of token ids >= 0",
            ),
        ]
        for param, ok, rule in checks:
            if not ok:
                raise InvalidSamplingValue(param, rule, getattr(self, param))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (`penalties.processed_logits`):
        such a request's tokens cannot come from the raw logits' argmax."""
        return (
            self.penalized
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or self.guide is not None
            or bool(self.bad_words_ids)
        )

    @property
    def masks_on_host(self) -> bool:
        """Whether a row's mask depends on the text before it in a way only the host
        follows (a guide's state, bad words' prefixes): such a request is processed row by
        row on the host, not in a graphed chain (the fused C step hands its rows back)."""
        return self.guide is not None or bool(self.bad_words_ids)

    @functools.cached_property
    def bad_words_by_prefix(self) -> dict[int, dict[tuple[int, ...], list[int]]]:
        """bad_words_ids by the length of the prefix before their last id: {n: {prefix:
        last ids}}, so that a row looks up one suffix of its text per length."""
        by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in self.bad_words_ids:
            by_prefix.setdefault(len(word) - 1, {}).setdefault(word[:-1], []).append(word[-1])
        return by_prefix

    @functools.cached_property
    def allowed_ids(self) -> torch.Tensor:  # [A] int64 on the CPU
        """allowed_token_ids as a tensor, made once: a step's rows read it."""
        return torch.tensor(self.allowed_token_ids, dtype=torch.int64)

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A request's own random stream on the models' device: seeded runs repeat,
        whatever else runs beside (a seed's stream on a GPU is not the CPU's)."""
        generator = torch.Generator(device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probs [n, V] float32 after temperature, min-p, top-k and top-p."""
    assert not params.greedy, "greedy decoding takes the argmax, not probabilities"
    logits = logits.float()
    # Shifted so that the largest is 0: after the division it stays 0 and the rest at
    # most that (-inf where the gap overflows), never inf - inf.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.min_p > 0:  # p < min_p * p_max, where the likeliest logit is 0: below log(min_p)
        logits = logits.masked_fill(logits < min_p_floor(torch.tensor(params.min_p)), float("-inf"))
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        logits = logits.masked_fill(logits < kth_largest(logits, params.top_k), float("-inf"))
    if params.top_p < 1:
        logits = logits.masked_fill(~top_p_kept(logits.softmax(dim=-1), params.top_p), float("-inf"))
    return logits.softmax(dim=-1)


def min_p_floor(min_ps: torch.Tensor) -> torch.Tensor:
    """min_p (any shape) -> float32 the least logit min-p keeps, of logits shifted so that
    the likeliest is 0 (-inf for 0: no cut); one computation for the host and a graph."""
    return min_ps.to(torch.float32).log()


def kth_largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [n, V] float32, at most 0 (shifted so that the likeliest is 0) -> [n, 1] each
    row's k-th largest. On a CPU topk's partial sort costs ms a row for a k of thousands
    (4 ms at 100,000 of 152k ids), paid by the whole batch, so past TOP_K_DIRECT the logits are
    counted in buckets of their float32 bits (as `_bucketed_top_p_kept`'s) and only the
    bucket holding the k-th is sorted."""
    if k <= TOP_K_DIRECT or logits.device.type != "cpu":  # a GPU's topk is fast and launches once
        return logits.topk(k, dim=-1).values[:, -1:]
    n = logits.shape[0]
    buckets = buckets_of(logits)  # [n, V]: a non-positive float's bucket ascends as its value descends
    rows = torch.arange(n, device=logits.device)[:, None] * NUM_BUCKETS  # [n, 1]
    counts = torch.bincount((buckets + rows).flatten(), minlength=n * NUM_BUCKETS).view(n, NUM_BUCKETS)
    reached = counts.cumsum(dim=-1)  # [n, B]: ids in each bucket and those of larger logits
    boundary = (reached < k).sum(dim=-1)  # [n]: the bucket holding the k-th
    kth = torch.empty(n, 1, device=logits.device)
    for row, bucket in enumerate(boundary.tolist()):
        before = int(reached[row, bucket] - counts[row, bucket])  # ids of larger logits, in buckets above
        members = logits[row][buckets[row] == bucket]
        kth[row, 0] = members.sort(descending=True).values[k - before - 1]
    return kth


def buckets_of(values: torch.Tensor) -> torch.Tensor:
    """float32 [n, V] -> int64 [n, V] in [0, NUM_BUCKETS): the magnitude bits above
    TOP_P_BUCKET_SHIFT, which order floats of one sign by their size."""
    return ((values.contiguous().view(torch.int32) & 0x7FFFFFFF) >> TOP_P_BUCKET_SHIFT).long()


def top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [n, V] -> [n, V] bool: the ids top-p keeps. Likeliest first (ties: the lower
    id first, as argmax), an id is dropped once the ids before it already cover top_p; the
    likeliest always stays (a top_p that rounds to 0 in float32 would drop it too).

    On a CPU no row of a large vocabulary is sorted whole (7-13 ms a row of 152k ids on
    a core, paid by every request in the batch at each of the row's steps). A row whose
    likeliest TOP_P_CANDIDATES ids cover top_p, as nearly all do, sorts those alone: ids
    past them would be dropped by a full sort too, the mass before each being at least
    theirs. A wider nucleus (a high temperature flattens the distribution) is found by
    mass per bucket of probability (`_bucketed_top_p_kept`)."""
    vocab = probs.shape[-1]
    if vocab <= TOP_P_SORTED_VOCAB or probs.device.type != "cpu":  # a GPU sorts a row in microseconds
        return _kept_in_order(*probs.sort(dim=-1, descending=True, stable=True), top_p, vocab)[0]
    values, ids = probs.topk(TOP_P_CANDIDATES, dim=-1, sorted=False)  # [n, C]
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    kept, covered = _kept_in_order(values, ids.gather(-1, order), top_p, vocab)
    if not bool(covered.all()):
        wide = (~covered).nonzero()[:, 0]
        kept[wide] = _bucketed_top_p_kept(probs[wide], top_p)
    return kept


def _kept_in_order(
    values: torch.Tensor, ids: torch.Tensor, top_p: float, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids likeliest first (values, ids [n, C], ties by id) -> which of the vocabulary's
    ids top-p keeps among them [n, V] bool, and whether they cover top_p [n] bool."""
    cumulative = values.cumsum(dim=-1)  # [n, C]
    kept = cumulative - values < top_p
    kept[:, 0] = True
    covered = cumulative[:, -1] >= top_p
    return torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device).scatter_(-1, ids, kept), covered


def _bucketed_top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_kept` by buckets of probability: float32 bits order non-negative floats as
    their values, so a bucket (the bits above TOP_P_BUCKET_SHIFT) holds a range of
    probabilities, and every id of a bucket above the one where the mass from the top
    reaches top_p is kept, every id below it dropped; only that bucket's ids are sorted.
    probs [n, V] float32, non-negative -> [n, V] bool."""
    buckets = buckets_of(probs)  # [n, V]
    mass = torch.zeros(probs.shape[0], NUM_BUCKETS, device=probs.device)  # [n, B]
    mass.scatter_add_(-1, buckets, probs)
    from_top = mass.flip(-1).cumsum(dim=-1).flip(-1)  # [n, B]: the mass of each bucket and those above
    boundary = (from_top >= top_p).sum(dim=-1) - 1  # [n]: -1 where rounding leaves the whole row short
    kept = buckets > boundary[:, None]  # [n, V]
    for row, bucket in enumerate(boundary.tolist()):
        if bucket < 0:
            continue
        members = (buckets[row] == bucket).nonzero()[:, 0]  # ascending ids
        values, order = probs[row, members].sort(descending=True, stable=True)
        before = from_top[row, bucket] - mass[row, bucket] + values.cumsum(dim=0) - values  # the mass before each
        kept[row, members[order]] = before < top_p
    return kept.scatter_(-1, probs.argmax(dim=-1, keepdim=True), True)


def sample(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """probs [n, V] (non-negative; a row need not sum to 1) -> token ids [n] int64, one
    draw per row by the inverse of the cumulative distribution: one uniform a row, from
    the request's stream (`generator`) or given (`uniforms` [n] in [0, 1), a seeded
    request's `keyed_uniforms`), where torch.multinomial draws V exponentials (2.3 ms a
    row over 152k ids on a CPU core, against 0.13 ms here). An id of zero probability is
    never drawn; the cumulative sum is float32 rounded from a float64 running total on
    the CPU, so a boundary is off by at most ~6e-8 of the row's mass. A row with no mass
    (or a NaN) raises, as torch.multinomial does."""
    cumulative = probs.float().cumsum(dim=-1)  # [n, V]
    if not bool((cumulative[:, -1] > 0).all()):
        raise ValueError("sampling from a distribution with no mass (all zero, or NaN)")
    if uniforms is None:
        uniforms = torch.rand(len(cumulative), generator=generator, dtype=cumulative.dtype, device=cumulative.device)
    return inverse_cdf(cumulative, uniforms)


def inverse_cdf(cumulative: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """cumulative [n, V] float32 (rows with mass), uniforms [n] in [0, 1) -> [n] int64: the
    first id whose cumulative sum exceeds its row's uniform share of the total; nothing
    read back to the host."""
    total = cumulative[:, -1:]  # [n, 1]
    u = uniforms.to(total).view(total.shape) * total  # [n, 1]
    # u < total, also where the product rounds up: the first id whose cumulative exceeds
    # u then has mass of its own.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, u, right=True).squeeze(-1)


# A 32-bit mixing function (Chris Wellons' lowbias32 shape, with multipliers below 2^31
# so that no product of 32-bit values overflows int64): the same on Python ints and on
# int64 tensors, on any device and inside a CUDA graph.
MASK32 = 0xFFFFFFFF


def _mix32(x):  # int, or int64 tensor, of values in [0, 2^32)
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request's seed (any int `SamplingParams` takes) as the 32-bit key of its draws."""
    seed %= 2**64
    return _mix32((seed & MASK32) ^ _mix32((seed >> 32) ^ 0x9E3779B9))


def _keyed_bits(key, position):  # ints, or int64 tensors: 24 bits of a hash of both
    return _mix32(key ^ _mix32(position & MASK32)) >> 8


def keyed_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys, positions int64 [n] (keys from `seed_key`, positions >= 0) -> uniforms [n]
    float32 in [0, 1), on their device, each a hash of its key and position with 24 bits
    of resolution (float32's, as the cumulative sum `sample` searches)."""
    return _keyed_bits(keys, positions).to(torch.float32) * 2.0**-24


def keyed_uniform(key: int, position: int) -> float:
    """`keyed_uniforms` of one key and position, on the host (exact in float32)."""
    return _keyed_bits(key, position) * 2.0**-24


def probs_on_device(
    logits: torch.Tensor,  # [n, V]
    temperatures: torch.Tensor,  # [n] float32; a row at 0 or less: the softmax (the caller takes its argmax)
    top_ks: torch.Tensor | None = None,  # [n] int64, 0 or less: no cut; None: no row cuts
    top_ps: torch.Tensor | None = None,  # [n] float32, 1: no cut; None: no row cuts
    cut_rows: torch.Tensor | None = None,  # [m] int64: the only rows that may cut (repeats allowed); None: any
    min_ps: torch.Tensor | None = None,  # [n] float32, 0: no cut; None: no row cuts
) -> torch.Tensor:  # [n, V] float32
    """Each row's distribution as `logits_to_probs` gives it (temperature, then min-p,
    top-k and top-p), with nothing read back to the host and no shape that depends on
    the values, so a CUDA graph can hold it. Top-k and top-p sort each row that may cut
    once: so one request cutting costs a batch one row's sort, not every row's."""
    logits = logits.float()
    divisors = torch.where(temperatures > 0, temperatures, 1.0)[:, None]  # [n, 1]
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / divisors  # [n, V]
    cuts = (top_ks, top_ps, min_ps)
    if any(values is not None for values in cuts):
        if cut_rows is None:
            scaled = top_k_top_p_on_device(scaled, *cuts)
        else:  # a repeated row is cut alike both times
            picked = [None if values is None else values[cut_rows] for values in cuts]
            scaled = scaled.index_copy(0, cut_rows, top_k_top_p_on_device(scaled[cut_rows], *picked))
    return scaled.softmax(dim=-1)


def draw_on_device(
    probs: torch.Tensor,  # [n, V]
    uniforms: torch.Tensor | None = None,  # [n] float32: a keyed row's draw, NaN for the others; None: none keyed
) -> torch.Tensor:  # [n] int64
    """One draw per row of probs, as a CUDA graph can hold it: the exponential race
    (argmax of p / E, E ~ Exp(1), which picks i with probability p_i) drawn from the
    device's default generator, whose state a graph advances on every replay; or, where
    a row has a uniform (a seeded request's keyed draw), the inverse of the cumulative
    distribution at it, as `sample` draws it."""
    # Clamped: a draw of exactly 0 would make p / E infinite, or NaN where p is 0.
    race = torch.empty_like(probs).exponential_().clamp_min_(FLOAT32_TINY)  # [n, V]
    raced = (probs / race).argmax(dim=-1)  # [n]
    if uniforms is None:
        return raced
    return torch.where(uniforms.isnan(), raced, inverse_cdf(probs.cumsum(dim=-1), uniforms.nan_to_num(0.0)))


def top_k_top_p_on_device(
    scaled: torch.Tensor,  # [n, V] float32: logits after the temperature
    top_ks: torch.Tensor | None,  # [n] int64, 0 or less: no cut
    top_ps: torch.Tensor | None,  # [n] float32, 1: no cut
    min_ps: torch.Tensor | None = None,  # [n] float32, 0: no cut
) -> torch.Tensor:  # [n, V]: the ids cut at -inf
    """`logits_to_probs`' cuts with one sort of every row and no host: below min_p times
    the likeliest's probability, then below the k-th largest logit (ties with it stay),
    then, likeliest first (ties: the lower id first), every id whose predecessors
    already cover top_p of what top-k kept."""
    if min_ps is not None:  # scaled's likeliest logit is 0
        scaled = scaled.masked_fill(scaled < min_p_floor(min_ps)[:, None], float("-inf"))
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)  # [n, V]
    if top_ks is not None:
        ks = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)  # [n]
        kth = ordered.gather(-1, (ks - 1)[:, None])  # [n, 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_ps is not None:
        probs = ordered.softmax(dim=-1)  # [n, V]: renormalised over what top-k kept
        covered = probs.cumsum(dim=-1) - probs  # [n, V]: the mass before each id
        cut = (covered >= top_ps[:, None]) & (top_ps[:, None] < 1)
        cut[:, 0] = False  # the likeliest always stays
        ordered = ordered.masked_fill(cut, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
