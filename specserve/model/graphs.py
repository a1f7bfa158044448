"""CUDA graphs of the decode step (on by default on a GPU, `Decoder.use_cuda_graphs`).

Why: eager PyTorch launches each of a step's ~400 kernels (28 layers of ~15) from
Python, so at small batch a GPU step is bound by launches, not by the GPU
(benchmarks/EXPERIMENTS.md, "The first GPU run"). A CUDA graph replays a whole step's
kernels with one launch.

A graph replays the same kernels on the same addresses with the same shapes, so the
step it captures (`static_forward`) is not Decoder.forward's ragged one:
- every sequence's cache is a slot of one `CachePool` (kv_cache.py), found by index;
- every sequence feeds n rows, the most any of them feeds this step (1: a decode step;
  k + 1: a verification of k drafts; past MAX_GRAPH_ROWS, a read of a few dozen tokens,
  the next power of two); a sequence with fewer (another k, a prompt chunk) and the
  rows that pad the batch to a power of two write their keys and values to the pool's
  scratch slot, and their logits are dropped;
- attention reads each slot in place, every row up to its own position
  (slot_attention.py, where Triton runs), or else a gathered copy of the first `bucket`
  positions of each slot under a causal mask; `bucket` is the smallest power of two
  from MIN_BUCKET holding the batch's longest sequence, at most the pool's capacity.
A graph is captured for each (batch, rows, bucket), and the features a head proposer
asks the target for (`Capture`), the first time a step needs it, and kept while the
graphs' tensors fit their budget (`CapturedSteps`). Reads of more than
MAX_GRAPH_ROWS tokens a sequence (a short prompt, a draft model's backlog after plain
steps, a head's catch-up) run as graphs of 32 to MAX_READ_ROWS rows while the padded
batch holds at most MAX_STEP_ROWS rows: eagerly such a read is a launch-bound forward,
several replays' time, and with many sequences a segment at a time far more
(benchmarks/EXPERIMENTS.md, "Adaptive k on a GPU where nothing is accepted", "Prompts
read beside decoding sequences"). A read computes the logits of the rows asked for alone
(`StepKey.scored`: a prompt chunk's last row at most), so its size is its activations',
not a logits row per token. A longer read runs eagerly, on the same slots.

On a CPU no graphs exist: there the same static step runs eagerly, which is how the
tests check it against Decoder.forward (Triton's kernels by its interpreter). Its speed
on a GPU: benchmarks/README.md, "Current results: GPU".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from specserve.logprobs import MAX_LOGPROBS, TokenLogprob, logprobs_on_device
from specserve.model import slot_attention
from specserve.model.decoder import attention_backends, batched_grouped_attention, grouped_mask, in_asked_order
from specserve.model.kv_cache import CachePool, KVCache
from specserve.penalties import counted_text, kept_where_any, penalised
from specserve.sampling import SamplingParams, draw_on_device, keyed_uniforms, probs_on_device, seed_key

if TYPE_CHECKING:
    from specserve.config import ModelConfig
    from specserve.model.decoder import Capture, Decoder, Segment

MAX_GRAPH_ROWS = 16  # rows per sequence any row count has a graph of: k + 1 for k up to 15 drafts
MAX_READ_ROWS = 128  # past that, powers of two: the most tokens of a sequence a graph reads
MAX_STEP_ROWS = 2048  # rows of a padded batch (sequences x rows), past MAX_GRAPH_ROWS a sequence
MIN_BUCKET = 256  # positions attention reads at the least

log = logging.getLogger("specserve")


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_count(n: int) -> int:
    """A ChainKey's count of rows: n padded to a power of two; 0 for none."""
    return next_power_of_two(n) if n else 0


def padded_rows(rows: list[int], size: int, among: int) -> list[int]:
    """rows padded to `size` with a row of [0, among) outside them, which asks for nothing
    (greedy, unprocessed, uncut, no logprobs): its work changes nothing or is dropped.
    One exists wherever padding is needed, as size <= among."""
    outside = next((i for i in range(among) if i not in rows), None)
    return rows + [outside] * (size - len(rows))


def cuts(params: SamplingParams) -> bool:
    """Whether a request's draws are cut by min-p, top-k or top-p (ChainKey.filtered)."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0)


class StepInputs(NamedTuple):
    """The static tensors a captured step reads, written before each replay."""

    input_ids: torch.Tensor  # [B, n] int64: each sequence's new tokens, padded to n
    starts: torch.Tensor  # [B] int64: positions each sequence has cached already
    slots: torch.Tensor  # [B] int64: each sequence's pool slot
    lengths: torch.Tensor  # [B] int64: each sequence's new tokens (the rest of its n rows pad)
    features: torch.Tensor | None  # [B n, F]: a head's input feature of each row; None for a decoder
    scored: torch.Tensor | None = None  # [StepKey.scored] int64: the rows whose logits it computes; None: all


class StepRows(NamedTuple):
    """Where a step's B x n rows sit in the pool, shared by every layer."""

    slots: torch.Tensor  # [B n] int64: each row's slot (a padding row's: the scratch slot)
    positions: torch.Tensor  # [B n] int64: each row's position (a padding row's: its row index)
    cos: torch.Tensor  # [B n, head_dim]
    rotated_sin: torch.Tensor  # [B n, head_dim]
    grouped: torch.Tensor | None  # the gathered copy's mask [B, 1, g n, bucket]; None in place


def step_rows(static: StaticDecode, inputs: StepInputs, bucket: int) -> StepRows:
    """The rows' slots, positions and RoPE, with shapes that depend on (B, n, bucket) only."""
    batch, n = inputs.input_ids.shape
    device = inputs.input_ids.device
    offsets = torch.arange(n, device=device)  # [n]
    real = offsets < inputs.lengths[:, None]  # [B, n]
    # A padding row sits at its row index (within every table) in the scratch slot.
    # (Broadcast, not repeat_interleave: on CUDA that reads the repeats back to size its output, a sync.)
    positions = torch.where(real, inputs.starts[:, None] + offsets, offsets)  # [B, n]
    row_slots = torch.where(real, inputs.slots[:, None], static.pool.scratch).flatten()  # [B n]
    row_positions = positions.flatten()  # [B n]
    grouped = None
    if not static.in_place:  # the gathered copy's mask, [B, 1, g n, bucket]: built once for every layer
        visible = torch.arange(bucket, device=device) <= positions[..., None]  # [B, n, bucket]
        grouped = grouped_mask(visible, static.config.num_heads // static.config.num_kv_heads)
    cos, rotated_sin = static.rope[0][row_positions], static.rope[1][row_positions]
    return StepRows(row_slots, row_positions, cos, rotated_sin, grouped)


def attend(
    static: StaticDecode,
    layer: int,
    q: torch.Tensor,  # [B n, heads, head_dim], rotated
    k: torch.Tensor,  # [B n, kv_heads, head_dim], rotated
    v: torch.Tensor,  # [B n, kv_heads, head_dim]
    rows: StepRows,
    inputs: StepInputs,
    bucket: int,
) -> torch.Tensor:  # [B n, heads * head_dim]
    """Store the rows' keys and values in `layer` of the pool, then attend each row to
    its slot's positions up to its own: in place, or over a gathered copy of the first
    `bucket` positions of each slot."""
    batch, n = inputs.input_ids.shape
    layer_keys, layer_values = static.pool.keys[:, layer], static.pool.values[:, layer]  # [slots + 1, kv, cap, d]
    if static.in_place:
        slot_attention.store_keys_and_values(k, v, layer_keys, layer_values, rows.slots, rows.positions)
        out = slot_attention.slot_attention(q, layer_keys, layer_values, rows.slots, rows.positions, bucket)
        return out.view(batch * n, -1)
    layer_keys[rows.slots, :, rows.positions] = k
    layer_values[rows.slots, :, rows.positions] = v
    keys = layer_keys[:, :, :bucket][inputs.slots]  # [B, kv_heads, bucket, head_dim]
    values = layer_values[:, :, :bucket][inputs.slots]
    heads_first = q.view(batch, n, -1, q.shape[-1]).transpose(1, 2)  # [B, heads, n, head_dim]
    out = batched_grouped_attention(heads_first, keys, values, grouped=rows.grouped)  # [B, heads, n, head_dim]
    return out.transpose(1, 2).reshape(batch * n, -1)


def decoder_step(decoder: Decoder, static: StaticDecode, inputs: StepInputs, key: StepKey) -> list[torch.Tensor]:
    """Decoder.forward for B sequences of up to n new tokens each, with shapes that
    depend on the key alone: no host syncs, no Python branch on a tensor's value.
    Writes the new keys and values into the pool (a padding row's into the scratch
    slot, at its row index) and reads each sequence's first `bucket` positions. Returns
    every row's logits [B n, head_size] float32 (with key.scored, the scored rows'
    [scored, head_size]), then the features Capture asks for: [B n, len(key.layers) *
    hidden], then [B n, hidden]."""
    rows = step_rows(static, inputs, key.bucket)
    h = decoder.embed_tokens(inputs.input_ids.flatten())  # [B n, hidden]
    captured = []  # the inputs of the captured layers, in layer order
    for i, block in enumerate(decoder.layers):
        if i in key.layers:
            captured.append(h)
        q, k, v = block.project_rotated_qkv(h, rows.cos, rows.rotated_sin)  # [B n, heads or kv_heads, head_dim]
        h = block.finish(h, attend(static, i, q, k, v, rows, inputs, key.bucket))  # [B n, hidden]
    outputs = [decoder.score(h if inputs.scored is None else h[inputs.scored])]
    if key.layers:
        outputs.append(in_asked_order(key.layers, captured))
    if key.final:
        outputs.append(decoder.norm(h))
    return outputs


class StepKey(NamedTuple):
    """What a captured step is made for: its shape, and the features it captures."""

    batch: int  # sequences, padded to a power of two
    rows: int  # rows a sequence feeds
    bucket: int  # positions attention may read
    layers: tuple[int, ...] = ()  # Capture.layers
    final: bool = False  # Capture.final
    # A read's: the rows whose logits it computes, padded to a power of two; 0: every row.
    scored: int = 0


StepFunction = Callable[["StaticDecode", StepInputs, StepKey], list[torch.Tensor]]


class _Step:
    """One StepKey's static inputs and outputs, and on a GPU its graph."""

    def __init__(self, static: StaticDecode, key: StepKey):
        device = static.pool.keys.device
        self.input_ids = torch.zeros(key.batch, key.rows, dtype=torch.int64, device=device)  # [B, n]
        self.index = torch.zeros(3, key.batch, dtype=torch.int64, device=device)  # [3, B]: starts, slots, lengths
        self.scratch = static.pool.scratch
        self.index[1] = self.scratch  # capturing runs the step: no rows of any sequence
        self.features = None  # [B n, F]
        if static.feature_size:
            self.features = torch.zeros(
                key.batch * key.rows, static.feature_size, dtype=static.pool.keys.dtype, device=device
            )
        # [S] int64: the step's rows whose logits it computes (padding: row 0)
        self.scored = torch.zeros(key.scored, dtype=torch.int64, device=device) if key.scored else None
        inputs = StepInputs(self.input_ids, *self.index, self.features, self.scored)
        self.forward: Callable[[], list[torch.Tensor]] = lambda: static.step(static, inputs, key)
        self.graph: torch.cuda.CUDAGraph | None = None
        if static.capture:
            self.graph, self.outputs = capture_graph(self.forward, static.memory)

    def run(
        self,
        input_ids: torch.Tensor,
        segments: list[Segment],
        features: torch.Tensor | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """input_ids [T] of the segments, in order (and features [T, F]) -> the step's
        logits of logits_rows [R, ...] (None: of all T rows), then its other outputs for
        the T rows, [T, ...] each."""
        batch, rows = self.input_ids.shape
        padding = batch - len(segments)
        lengths = [s.num_tokens for s in segments]
        # Where each of the step's B x n rows takes its token from the stream (a padding
        # row: the first token, whatever it is), and where each token's outputs land.
        sources, outputs, offset = [], [], 0
        for b, length in enumerate(lengths):
            sources += [offset + i for i in range(length)] + [0] * (rows - length)
            outputs += [b * rows + i for i in range(length)]
            offset += length
        sources += [0] * (rows * padding)
        host = torch.tensor(
            [s.cache.length for s in segments]
            + [0] * padding
            + [s.cache.slot for s in segments]
            + [self.scratch] * padding
            + lengths
            + [0] * padding
            + sources
            + outputs,
            dtype=torch.int64,
            device="cpu",
        )
        moved = host.to(self.index.device)  # one copy to the device
        self.index.copy_(moved[: 3 * batch].view(3, batch))
        rows_of_sources = moved[3 * batch : 3 * batch + batch * rows]
        rows_of_tokens = moved[3 * batch + batch * rows :]
        self.input_ids.view(-1).copy_(input_ids[rows_of_sources])
        if self.features is not None:
            self.features.copy_(features[rows_of_sources])
        if self.scored is not None:  # logits_rows' rows of the step; the rest pad with row 0
            self.scored.zero_()
            self.scored[: len(logits_rows)] = rows_of_tokens[logits_rows]
        if self.graph is None:
            outputs = self.forward()
        else:
            self.graph.replay()
            outputs = self.outputs
        # Gathers, so copies: the next replay overwrites the graph's outputs.
        logits, *rest = outputs
        if self.scored is not None:  # the scored rows, in order: written before the step ran
            logits = logits[: len(logits_rows)].clone()
        else:
            logits = logits[rows_of_tokens if logits_rows is None else rows_of_tokens[logits_rows]]
        return [logits] + [output[rows_of_tokens] for output in rest]


def capture_graph(forward: Callable[[], list[torch.Tensor]], memory) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """Record `forward` as a CUDA graph, after warm-up runs on a side stream (PyTorch's
    recipe: lazy initialisation, cuBLAS workspaces and kernel choices happen outside
    the capture). Returns the graph and its output tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory):
        outputs = forward()
    return graph, outputs


class ChainKey(NamedTuple):
    """What a captured chain is made for."""

    batch: int  # sequences, padded to a power of two
    positions: int  # draft positions after the first guess
    bucket: int  # positions attention may read
    layers: tuple[int, ...] = ()  # a decoder's Capture.layers, every position's
    final: bool = False  # a decoder's Capture.final
    # Some sequences sample (TokenChain.run's params): how many, padded to a power of two
    # (only their rows are drawn); 0: none. And some of those cut by top-k or top-p: how
    # many, likewise (only their rows are sorted).
    sampled: int = 0
    filtered: int = 0
    keyed: bool = False  # and some of those with a seed (sampling.keyed_uniforms)
    confidences: bool = True  # each token's probability (a proposer's), or none (the target's)
    # A target's: some sequences ask for each token's logprob and the MAX_LOGPROBS
    # likeliest: how many, padded to a power of two (only their rows' are computed).
    logprobs: int = 0
    # A proposer's: the vocabulary its sampled and processed rows are drawn over, the
    # logits widened to it (a head's draft vocabulary, a draft's common head); 0: the
    # logits' own columns.
    vocab: int = 0
    draft_probs: bool = False  # and each sampled row's distribution (rejection sampling's)
    # Some sequences' logits are processed (bias, penalties, min_tokens): the most distinct ids
    # of a text and stop ids of a sequence the chain holds, and how many sequences (only
    # their rows are processed), each a power of two; 0: none.
    distinct: int = 0
    stops: int = 0
    processed: int = 0
    # And the most logit bias entries of a processed sequence, a power of two; 0: none.
    biases: int = 0
    # And the most allowed ids of one (SamplingParams.allowed_token_ids), likewise.
    allowed: int = 0


class ProcessedText(NamedTuple):
    """What a sequence whose logits are processed (penalties.processed_logits) brings to
    a chain: its prompt's distinct ids [P] int64, its output so far, its stop ids."""

    prompt_ids: torch.Tensor
    output_ids: list[int]
    stop_ids: frozenset[int]


class Chained(NamedTuple):
    """A chain's further tokens of each sequence, their confidences (empty lists where
    not asked for), their logprobs where a sequence's params ask (else None), and with
    ChainKey.draft_probs the distributions each sampled sequence's guesses were drawn
    from, by its index: [positions, vocab] on the device (a seeded one's hold what it
    would have been drawn from)."""

    tokens: list[list[int]]
    confidences: list[list[float]]
    logprobs: list[list[TokenLogprob] | None]
    probs: dict[int, torch.Tensor] | None = None


class TokenChain:
    """k positions of B sequences as one static step (a graph on a GPU): each
    position's token (mapped to a token id through `target_ids`, a head's draft
    vocabulary) and, for a head, its output feature feed the next position on the
    device, and one read-back returns every token, its confidence and, for a request
    that asks, its logprobs (specserve/logprobs.py: the raw logits'). A sequence's token
    is the argmax, or where its params sample (`ChainKey.sampled`) a draw from the
    distribution `logits_to_probs` gives (`probs_on_device`, `draw_on_device`): from the device's own
    generator, or a seeded request's keyed draw of that position, the one its host steps
    would take; of the logits a step by step decode would process, where its params ask
    (`ChainKey.distinct`: bias, penalties and min_tokens, `penalties.processed_logits`).

    A target's chain is multi-step decoding (Engine.num_scheduler_steps): its tokens, as
    many decode steps would give them, and the features a head reads of every position
    it fed (`Capture`), as those steps would capture them. A proposer's chain drafts
    each sequence's guesses as `Guesser.guess` would, position by position: a greedy
    one's argmax (of its processed scores, where its params ask), a sampled one's draw
    and, for an unseeded one, the distribution it was drawn from (`ChainKey.draft_probs`),
    the sampled and processed rows over the target's whole vocabulary (`ChainKey.vocab`).

    Why: drafting a position at a time reads each guess back before the next step can be
    fed, so on a GPU a position costs a replay, a read-back and the host's bookkeeping,
    several times what its weights need (benchmarks/EXPERIMENTS.md, "An EAGLE head's own
    steps graphed and compiled"). A greedy token needs no host, nor does a draw from
    the device's own generator or a keyed one, a penalty or a token's logprobs; so one
    sampled or penalised request keeps no batch a position a step. And each of those is
    computed on the rows of the requests that ask alone (ChainKey.sampled, filtered,
    processed, logprobs: gathered, then written back), so such a request costs its
    batch its own rows' work over the vocabulary, not every row's.

    Contract: greedy and keyed tokens are what the model's static steps position by
    position would give (only the bucket of positions attention reads may differ, which
    changes no value but rounding); a sampled token follows the distribution such a
    step's logits give. A keyed row draws the token at index `draw_from` + j of its
    text at position j (the target's: its cache's length + 1).
    The chain writes its positions at cache.length + j of each cache without counting
    them in `length`: the caller counts what it keeps.
    """

    def __init__(self, static: StaticDecode, key: ChainKey, target_ids: torch.Tensor | None):
        device = static.pool.keys.device
        self.scratch = static.pool.scratch
        self.index = torch.zeros(3, key.batch, dtype=torch.int64, device=device)  # [3, B]: starts, slots, lengths
        self.index[1] = self.scratch  # capturing runs the chain: no rows of any sequence
        self.tokens = torch.zeros(key.batch, dtype=torch.int64, device=device)  # [B]: each one's first guess
        self.features = None  # [B, F]: each one's feature that made its first guess
        if static.feature_size:
            self.features = torch.zeros(key.batch, static.feature_size, dtype=static.pool.keys.dtype, device=device)
        # Only the S sampled rows draw (ChainKey.sampled): [S] int64, which, padded with a
        # greedy one (temperature 0: its draw is not taken). Of each: [4, S] float32 its
        # temperature, top-k (0: none), top-p and min-p; [2, S] int64 its key of its draws
        # (sampling.seed_key), -1 where it has none, and the index in its text of the token
        # its first position draws. [filtered] int64: which of them min-p, top-k or top-p cut,
        # padded with one that does not (`padded_rows`).
        self.sampled_rows = torch.zeros(key.sampled, dtype=torch.int64, device=device) if key.sampled else None
        self.sampling = torch.zeros(4, key.sampled, dtype=torch.float32, device=device) if key.sampled else None
        self.draws = torch.full((2, key.sampled), -1, dtype=torch.int64, device=device) if key.keyed else None
        self.cut_rows = torch.zeros(key.filtered, dtype=torch.int64, device=device) if key.filtered else None
        # [L] int64: the rows whose logprobs are computed (ChainKey.logprobs), padded (`padded_rows`)
        self.logprob_rows = torch.zeros(key.logprobs, dtype=torch.int64, device=device) if key.logprobs else None
        if key.distinct:
            # Only the P processed rows are processed (ChainKey.processed): [B] bool, where a
            # row is; [P] int64, which, padded with an unprocessed one (processed as if
            # penalised by nothing). Of each: [4, P] repetition (1: off), frequency and
            # presence penalties and output tokens to come before min_tokens; [3, P,
            # distinct] its text's distinct ids, their counts in its output and whether its
            # prompt holds them (0 padding adds nothing); [2, P, stops] stop ids, 1 where
            # there is one.
            self.processed = torch.zeros(key.batch, dtype=torch.bool, device=device)
            self.processed_rows = torch.zeros(key.processed, dtype=torch.int64, device=device)
            self.penalties = torch.zeros(4, key.processed, dtype=torch.float32, device=device)
            self.text = torch.zeros(3, key.processed, key.distinct, dtype=torch.float32, device=device)
            self.stop_ids = torch.zeros(2, key.processed, key.stops, dtype=torch.float32, device=device)
            # [2, P, biases]: each one's logit bias, ids and values (0 padding adds nothing)
            self.bias = torch.zeros(2, key.processed, key.biases, dtype=torch.float32, device=device)
            # [2, P, allowed]: each one's allowed ids, 1 where there is one (a row with none allows every id)
            self.allowed = torch.zeros(2, key.processed, key.allowed, dtype=torch.float32, device=device)

        def forward() -> list[torch.Tensor]:
            """guesses [B, positions] (token ids), confidences [B, positions] (or [B, 0]);
            with key.logprobs, each asking row's token's logprob [L, positions], the
            likeliest ids' [L, positions, MAX_LOGPROBS] (or the vocabulary's size) and
            their ids; with key.draft_probs, the sampled rows' distributions [S,
            positions, vocab]; then a decoder's captured features, each [B, positions, F]."""
            starts, slots, lengths = self.index
            tokens, features = self.tokens, self.features
            guesses, confidences, captured, logprobs, draft_probs = [], [], [], [], []
            spread = None  # with key.distinct: each processed row's counts, prompt ids, stop ids, bias and allowed ids
            step_key = StepKey(key.batch, 1, key.bucket, key.layers, key.final)
            for j in range(key.positions):
                inputs = StepInputs(tokens[:, None], starts + j, slots, lengths, features)
                logits, *rest = static.step(static, inputs, step_key)  # [B, width], then [B, F] each
                if static.feature_size:
                    features = rest[0]  # a head's output feature feeds its next position
                else:
                    captured.append(rest)  # a decoder's features of this position
                scores = self._widened(logits, target_ids) if key.vocab else logits  # [B, V]: columns are ids
                if key.distinct:
                    rows = self.processed_rows
                    if spread is None:
                        spread = self._texts_over(scores[rows])
                    scores = scores.index_copy(0, rows, self._processed(scores[rows], j, *spread))
                chosen, confidence = self._greedy(logits, scores, target_ids)  # [B] columns of scores, [B]
                if key.sampled:
                    rows = self.sampled_rows
                    temperatures, top_ks, top_ps, min_ps = self.sampling  # [S] each
                    uniforms = None
                    if key.keyed:  # the draw for the token at index draw_from + j
                        keys, draw_from = self.draws
                        uniforms = keyed_uniforms(keys.clamp_min(0), draw_from + j)  # [S]
                        uniforms = uniforms.masked_fill(keys < 0, float("nan"))
                    cut_by = {}
                    if key.filtered:
                        cut_by = dict(top_ks=top_ks.long(), top_ps=top_ps, cut_rows=self.cut_rows, min_ps=min_ps)
                    probs = probs_on_device(scores[rows], temperatures, **cut_by)  # [S, V]
                    drawn = torch.where(temperatures > 0, draw_on_device(probs, uniforms), chosen[rows])  # [S]
                    if confidence is not None:  # a draw's probability, as Guesser.guess gives it
                        drawn_confidence = probs.gather(1, drawn[:, None])[:, 0]
                        confidence = confidence.index_copy(
                            0, rows, torch.where(temperatures > 0, drawn_confidence, confidence[rows])
                        )
                    chosen = chosen.index_copy(0, rows, drawn)
                    if key.draft_probs:
                        draft_probs.append(probs)
                if confidence is not None:
                    confidences.append(confidence)
                if key.logprobs:  # as logprobs.token_logprobs: the raw logits'
                    rows = self.logprob_rows
                    top = min(MAX_LOGPROBS, logits.shape[-1])
                    logprobs.append(logprobs_on_device(logits[rows], chosen[rows], top))  # [L], [L, top] twice
                tokens = chosen if key.vocab or target_ids is None else target_ids[chosen]  # [B] token ids
                if key.distinct:  # the next position's penalties count this token
                    counted = tokens[self.processed_rows, None]  # [P, 1]
                    spread[0].scatter_add_(1, counted, torch.ones_like(spread[0][:, :1]))
                guesses.append(tokens)
            stacked = [torch.stack(guesses, dim=1)]
            stacked.append(torch.stack(confidences, dim=1) if confidences else stacked[0][:, :0].float())
            stacked += [torch.stack(kind, dim=1) for kind in zip(*logprobs)]  # [B, positions(, MAX_LOGPROBS)]
            stacked += [torch.stack(draft_probs, dim=1)] if draft_probs else []  # [S, positions, vocab]
            return stacked + [torch.stack(kind, dim=1) for kind in zip(*captured)]  # each [B, positions, F]

        self.forward = forward
        self.key = key
        self.graph: torch.cuda.CUDAGraph | None = None
        if static.capture:
            self.graph, self.outputs = capture_graph(forward, static.memory)

    def _widened(self, logits: torch.Tensor, target_ids: torch.Tensor | None) -> torch.Tensor:
        """A proposer's logits [B, width] -> float32 [B, key.vocab], -inf at the ids its
        columns do not score, as Guesser.guess widens a sampled or processed row."""
        wide = logits.new_full((logits.shape[0], self.key.vocab), float("-inf"), dtype=torch.float32)
        if target_ids is None:  # a draft's common head: the first ids
            wide[:, : logits.shape[1]] = logits
            return wide
        return wide.index_copy(1, target_ids, logits.float())

    def _greedy(
        self, logits: torch.Tensor, scores: torch.Tensor, target_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's greedy choice, a column of scores [B, V] (logits [B, width]
        widened and processed where the key asks), and its probability where the key
        asks for confidences (Guesser.greedy_guesses). A widened chain's unprocessed rows
        choose among their own columns, as a guess step by step does (ties included)."""
        wanted = self.key.confidences
        if self.key.vocab:
            own = logits.argmax(dim=-1)
            own = own if target_ids is None else target_ids[own]  # [B] ids
            own_confidence = logits.softmax(dim=-1).amax(dim=-1) if wanted else None
            if not self.key.distinct:  # no row processed
                return own, own_confidence
        chosen = scores.argmax(dim=-1)  # [B]
        confidence = scores.softmax(dim=-1).amax(dim=-1) if wanted else None
        if not self.key.vocab:
            return chosen, confidence
        processed = self.processed  # [B]
        chosen = torch.where(processed, chosen, own)
        if confidence is not None:
            confidence = torch.where(processed, confidence, own_confidence)
        return chosen, confidence

    def _texts_over(
        self, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each processed row's text spread over the vocabulary of its logits [P, V]: its
        output counts [P, V] float32 (the chain adds its tokens as it goes), its prompt's
        ids and its stop ids [P, V] bool, its logit bias [P, V] float32, and the ids it may
        sample [P, V] bool (every id in a row that names none, or none of these columns:
        penalties.allowed_only)."""
        ids, stop_ids = self.text[0].long(), self.stop_ids[0].long()
        dense = torch.zeros_like(logits, dtype=torch.float32)  # [P, V]
        counts = dense.scatter_add(1, ids, self.text[1])
        in_prompt = dense.scatter_add(1, ids, self.text[2]) > 0
        stop_mask = dense.scatter_add(1, stop_ids, self.stop_ids[1]) > 0
        bias = dense.scatter_add(1, self.bias[0].long(), self.bias[1]) if self.key.biases else None
        allowed = None
        if self.key.allowed:
            # Ids past these columns (a narrower head's) are left out: their flags go to column 0, unset.
            fits = self.allowed[0] < logits.shape[-1]  # [P, allowed]
            allowed = dense.scatter_add(1, self.allowed[0].long() * fits, self.allowed[1] * fits) > 0
            allowed |= ~allowed.any(dim=-1, keepdim=True)  # a row that names none allows every id
        return counts, in_prompt, stop_mask, bias, allowed

    def _processed(
        self,
        logits: torch.Tensor,
        j: int,
        counts: torch.Tensor,
        in_prompt: torch.Tensor,
        stop_mask: torch.Tensor,
        bias: torch.Tensor | None,
        allowed: torch.Tensor | None,
    ) -> torch.Tensor:
        """The processed rows' logits [P, V] at position j -> float32 [P, V] as
        penalties.processed_logits gives them, row by row: biased, penalised for the row's
        text so far (`_texts_over`, this chain's tokens counted), every id it may not
        sample given no probability, and its stop ids none before its min_tokens-th token."""
        repetition, frequency, presence, early = self.penalties[:, :, None]  # [P, 1] each
        scores = logits.float() if bias is None else logits.float() + bias
        scores = penalised(scores, counts, in_prompt, repetition, frequency, presence)
        if allowed is not None:
            scores = kept_where_any(scores, scores.masked_fill(~allowed, float("-inf")))
        return scores.masked_fill(stop_mask & (early > j), float("-inf"))

    def _set_sampling(self, params: list[SamplingParams], sampled: list[int], draw_from: list[int]) -> None:
        """The sampled sequences' rows (`sampled`, padded with a greedy row), settings,
        keys of their draws and which of them cut, into the chain's inputs."""
        rows = padded_rows(sampled, self.key.sampled, self.key.batch)
        settings = [(params[i].temperature, max(params[i].top_k, 0), params[i].top_p, params[i].min_p) for i in sampled]
        settings += [(0.0, 0, 1.0, 0.0)] * (len(rows) - len(sampled))  # temperature 0: its draw is not taken
        self.sampled_rows.copy_(torch.tensor(rows, dtype=torch.int64, device="cpu"))
        self.sampling.copy_(torch.tensor(settings, dtype=torch.float32, device="cpu").T)
        if self.cut_rows is not None:
            cut = [r for r, i in enumerate(sampled) if cuts(params[i])]  # among the sampled rows
            self.cut_rows.copy_(torch.tensor(padded_rows(cut, self.key.filtered, self.key.sampled), device="cpu"))
        if self.draws is not None:
            keys = [-1 if params[i].seed is None else seed_key(params[i].seed) for i in sampled]
            starts = [draw_from[i] for i in sampled]
            padding = len(rows) - len(sampled)
            self.draws.copy_(torch.tensor([keys + [-1] * padding, starts + [0] * padding], device="cpu"))

    def _set_texts(self, params: list[SamplingParams], texts: list[ProcessedText | None]) -> None:
        """Each processed sequence's penalties and text into the chain's inputs, the rows
        that pad them an unprocessed row's: no penalty, nothing counted."""
        processed_rows = [i for i, processed in enumerate(texts) if processed is not None]
        penalties = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * self.key.processed, device="cpu").T  # [4, P]
        text = torch.zeros(3, self.key.processed, self.key.distinct, device="cpu")
        stop_ids = torch.zeros(2, self.key.processed, self.key.stops, device="cpu")
        bias = torch.zeros(2, self.key.processed, self.key.biases, device="cpu")
        allowed = torch.zeros(2, self.key.processed, self.key.allowed, device="cpu")
        for r, i in enumerate(processed_rows):
            processed, q = texts[i], params[i]
            early = max(0, q.min_tokens - len(processed.output_ids))
            penalties[:, r] = torch.tensor([q.repetition_penalty, q.frequency_penalty, q.presence_penalty, early])
            ids, in_prompt, emitted, _ = counted_text(processed.prompt_ids, processed.output_ids)
            text[:, r, : len(ids)] = torch.stack([ids.float(), emitted, in_prompt.float()])
            stops = sorted(processed.stop_ids) if early else []
            stop_ids[0, r, : len(stops)] = torch.tensor(stops, dtype=torch.float32, device="cpu")
            stop_ids[1, r, : len(stops)] = 1.0
            if q.logit_bias:
                bias[:, r, : len(q.logit_bias)] = torch.tensor(q.logit_bias, dtype=torch.float32, device="cpu").T
            if q.allowed_token_ids:
                allowed[0, r, : len(q.allowed_token_ids)] = q.allowed_ids
                allowed[1, r, : len(q.allowed_token_ids)] = 1.0
        flags = torch.zeros(self.key.batch, dtype=torch.bool, device="cpu")
        flags[processed_rows] = True
        self.processed.copy_(flags)
        rows = padded_rows(processed_rows, self.key.processed, self.key.batch)
        self.processed_rows.copy_(torch.tensor(rows, dtype=torch.int64, device="cpu"))
        self.penalties.copy_(penalties)
        self.text.copy_(text)
        self.stop_ids.copy_(stop_ids)
        self.bias.copy_(bias)
        self.allowed.copy_(allowed)

    def run(
        self,
        first_tokens: list[int],
        features: torch.Tensor | None,
        caches: list[KVCache],
        capture: Capture | None = None,
        params: list[SamplingParams] | None = None,  # with ChainKey.sampled, logprobs or distinct: each one's
        texts: list[ProcessedText | None] | None = None,  # with ChainKey.distinct: each processed one's
        draw_from: list[int] | None = None,  # with ChainKey.keyed: see TokenChain; None: each cache's length + 1
    ) -> Chained:
        """first_tokens and (a head's) features [n, F]: each sequence's first guess and the
        feature that made it -> each one's further guesses, their confidences, logprobs
        and draft probabilities; a decoder's `capture` (as its ChainKey asks) is filled
        with the features of every position fed, [n * positions, F], sequence by
        sequence."""
        batch = self.tokens.shape[0]
        n, padding = len(caches), batch - len(caches)
        host = torch.tensor(
            [c.length for c in caches]
            + [0] * padding
            + [c.slot for c in caches]
            + [self.scratch] * padding
            + [1] * n
            + [0] * padding
            + first_tokens
            + [0] * padding,
            dtype=torch.int64,
            device="cpu",
        )
        moved = host.to(self.index.device)  # one copy to the device
        self.index.copy_(moved[: 3 * batch].view(3, batch))
        self.tokens.copy_(moved[3 * batch :])
        if self.features is not None:
            self.features[:n].copy_(features)
        sampled = [i for i, q in enumerate(params or ()) if not q.greedy]
        asked = [i for i, q in enumerate(params or ()) if q.logprobs is not None] if self.key.logprobs else []
        if self.logprob_rows is not None:
            self.logprob_rows.copy_(torch.tensor(padded_rows(asked, self.key.logprobs, self.key.batch), device="cpu"))
        if self.sampled_rows is not None:
            self._set_sampling(params, sampled, [c.length + 1 for c in caches] if draw_from is None else draw_from)
        if self.key.distinct:
            self._set_texts(params, texts)
        if self.graph is None:
            outputs = self.forward()
        else:
            self.graph.replay()
            outputs = self.outputs
        guesses, confidences, *rest = outputs
        logprob_parts = rest[:3] if self.key.logprobs else []
        rest = rest[len(logprob_parts) :]
        # Copies: the next replay overwrites the graph's outputs.
        probs = None
        if self.key.draft_probs:
            kept = rest.pop(0)[: len(sampled)].clone()  # [len(sampled), positions, vocab]
            probs = {i: kept[r] for r, i in enumerate(sampled)}
        if capture is not None:
            capture.fill([rows[:n].flatten(0, 1).clone() for rows in rest])
        # One read-back for all (token ids are exact in float64): each sequence's tokens
        # and confidences, then each asking one's logprobs.
        parts = [torch.cat([guesses[:n], confidences[:n]], dim=1)]  # [n, positions + width]
        if asked:
            parts.append(torch.cat([part[: len(asked)].flatten(1) for part in logprob_parts], dim=1))
        read = torch.cat([part.double().flatten() for part in parts]).tolist()
        positions, per_row = guesses.shape[1], parts[0].shape[1]
        rows = [read[i * per_row : (i + 1) * per_row] for i in range(n)]
        tokens = [[int(t) for t in r[:positions]] for r in rows]
        logprobs: list[list[TokenLogprob] | None] = [None] * n
        if asked:
            start, size, top_width = n * per_row, parts[1].shape[1], logprob_parts[1].shape[-1]
            for r, i in enumerate(asked):
                flat = read[start + r * size : start + (r + 1) * size]
                logprobs[i] = chained_logprobs(flat, tokens[i], top_width, params[i].logprobs)
        return Chained(tokens, [r[positions:] for r in rows], logprobs, probs)


def chained_logprobs(flat: list[float], tokens: list[int], width: int, num_top: int) -> list[TokenLogprob]:
    """One sequence's logprobs from its read-back row: each token's logprob [P], then
    the `width` likeliest logprobs of each position [P, width] and their ids, flat."""
    positions = len(tokens)
    chosen, values, ids = flat[:positions], flat[positions : positions * (1 + width)], flat[positions * (1 + width) :]
    top = [slice(j * width, j * width + num_top) for j in range(positions)]
    return [
        TokenLogprob(token, chosen[j], tuple(zip(map(int, ids[top[j]]), values[top[j]])))
        for j, token in enumerate(tokens)
    ]


def held_bytes(captured: object) -> int:
    """Bytes of the tensors a captured step or chain holds as its attributes (lists of
    them too): its static inputs and, on a GPU, its graph's outputs. Its activations
    are not among them: they live in the pool every capture shares (StaticDecode.memory)."""
    storages: dict[int, int] = {}
    for value in vars(captured).values():
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class CapturedSteps:
    """A StaticDecode's captured steps and chains by key, least recently used first,
    within a budget of the bytes they hold (`held_bytes`). Each new key (a batch size,
    a bucket, a sampling or logit-bias shape) holds its own; past the budget the least
    recently used are dropped, and captured again if they are met again, so that
    requests of ever new shapes cannot fill the GPU. A capture that runs out of GPU
    memory is tried once more after every other entry is dropped, so that memory taken
    elsewhere fails no batch while old captures can give it back."""

    def __init__(self, budget: int | None):
        self.budget = budget  # bytes; None: no bound
        self.entries: OrderedDict[tuple[str, tuple], tuple[object, int]] = OrderedDict()  # (kind, key): (entry, bytes)
        self.held = 0
        self.dropped = 0  # entries dropped, over the budget or to capture one more
        self.over_budget = False  # once: the warning is logged

    def keys_of(self, kind: str) -> list[tuple]:
        return [key for entry_kind, key in self.entries if entry_kind == kind]

    def get(self, kind: str, key: tuple, make: Callable[[], object]) -> object:
        """The entry of (kind, key), made (captured) if it has none; marked as used now."""
        if (kind, key) in self.entries:
            self.entries.move_to_end((kind, key))
            return self.entries[kind, key][0]
        try:
            entry = make()
        except torch.OutOfMemoryError:
            if not self.entries:
                raise
            log.warning(
                "capturing a decode step ran out of GPU memory: the %d captured before it are dropped "
                "and it is captured once more (lower --max-num-seqs or --max-model-len to leave them "
                "more GPU memory)",
                len(self.entries),
            )
            while self.entries:
                self._drop_oldest()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what they held, back for the allocations outside the graphs
            entry = make()
        size = held_bytes(entry)
        self.entries[kind, key] = (entry, size)
        self.held += size
        while self.budget is not None and self.held > self.budget and len(self.entries) > 1:
            self._drop_oldest()
            if not self.over_budget:
                self.over_budget = True
                log.warning(
                    "captured decode steps hold more than their %.2f GiB: the least recently used are "
                    "dropped and captured again when needed (lower --max-num-seqs or --max-model-len "
                    "to leave them more GPU memory)",
                    self.budget / 2**30,
                )
        return entry

    def _drop_oldest(self) -> None:
        _, (old, freed) = self.entries.popitem(last=False)
        vars(old).clear()  # its graph and tensors go now, not when a cycle is collected
        self.held -= freed
        self.dropped += 1


class StaticDecode:
    """A model's pool of cache slots and its captured steps: a decoder's
    (`decoder_step`, through Decoder.use_cuda_graphs) or an EAGLE head's."""

    def __init__(
        self,
        config: ModelConfig,  # of the cached layers
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int,
        capacity: int,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, rotated_sin [>= capacity, head_dim], held for the graphs
        step: StepFunction,  # one static step: reads StepInputs, returns [B n, ...] outputs
        feature_size: int = 0,  # width of StepInputs.features; 0: none
        captured_bytes: int | None = None,  # what the captured steps may hold (CapturedSteps); None: no bound
    ):
        self.config = config
        self.pool = CachePool(config, dtype, device, num_slots, capacity)
        self.rope = rope  # held here: a graph reads these addresses
        self.step = step
        self.feature_size = feature_size
        self.capture = device.type == "cuda"
        # Attention in place where Triton runs it (CUDA); tests set it on the CPU under Triton's interpreter.
        self.in_place = self.capture and slot_attention.available() and slot_attention.works_on(device, dtype)
        self.memory = torch.cuda.graph_pool_handle() if self.capture else None  # shared by every graph
        self.captured = CapturedSteps(captured_bytes)

    @property
    def steps(self) -> list[StepKey]:
        """The keys of the steps captured and kept, least recently used first."""
        return self.captured.keys_of("step")

    @property
    def chains(self) -> list[ChainKey]:
        """The keys of the chains captured and kept, least recently used first."""
        return self.captured.keys_of("chain")

    def handles(self, segments: list[Segment]) -> bool:
        """Whether a forward over `segments` can be a static step: every cache in this
        pool, each with new tokens, and rows for them (`step_rows_for`)."""
        return (
            bool(segments)
            and all(s.cache.pool is self.pool and s.num_tokens > 0 for s in segments)
            and self.step_rows_for(segments) is not None
        )

    def step_rows_for(self, segments: list[Segment]) -> int | None:
        """Rows a sequence feeds in the static step over `segments`: the most new tokens
        of any, past MAX_GRAPH_ROWS the next power of two (a read), or None where no
        graph takes them (see the module's docstring)."""
        rows = max(s.num_tokens for s in segments)
        if rows <= MAX_GRAPH_ROWS:
            return rows
        rows = next_power_of_two(rows)
        fits = rows <= min(MAX_READ_ROWS, self.pool.capacity)  # a padding row sits at its row index
        return rows if fits and next_power_of_two(len(segments)) * rows <= MAX_STEP_ROWS else None

    def run(
        self,
        input_ids: torch.Tensor,  # [T]
        segments: list[Segment],
        capture: Capture | None = None,  # a decoder's features to capture (its StepKey's layers and final)
        features: torch.Tensor | None = None,  # [T, feature_size]: a head's input features
        logits_rows: torch.Tensor | None = None,  # [R] on the device: rows of the T whose logits are wanted
    ) -> list[torch.Tensor]:
        """The step's outputs (see `handles`): the logits of logits_rows [R, width]
        float32 (None: of every row, [T, width]), then the other outputs for the T rows,
        [T, ...] each: a decoder's features `capture` asks for, in Capture's order; a
        head's output features. A read computes the logits of logits_rows alone
        (StepKey.scored): a prompt's chunk wants its last row's at most. The caches'
        slots must be taken (KVCache.reserve) and their lengths not yet advanced."""
        rows = self.step_rows_for(segments)
        end = max(s.cache.length + s.num_tokens for s in segments)
        bucket = min(max(next_power_of_two(end), MIN_BUCKET), self.pool.capacity)
        key = StepKey(next_power_of_two(len(segments)), rows, bucket)
        if rows > MAX_GRAPH_ROWS and logits_rows is not None:
            key = key._replace(scored=next_power_of_two(max(len(logits_rows), 1)))
        if capture is not None:
            key = key._replace(layers=tuple(capture.layers), final=capture.final)
        step = self.captured.get("step", key, lambda: _Step(self, key))
        return step.run(input_ids, segments, features, logits_rows)

    @torch.inference_mode()
    def token_chain(
        self,
        first_tokens: list[int],  # each sequence's first guess
        features: torch.Tensor | None,  # [n, feature_size]: the features that made them (a head's)
        caches: list[KVCache],
        positions: int,
        target_ids: torch.Tensor | None = None,  # [width]: the token id of each logits column; None: the column
        capture: Capture | None = None,  # a decoder's features of every position fed, filled in place
        params: list[SamplingParams] | None = None,  # each sequence's; None: every one greedy
        confidences: bool = True,  # False: none computed (a target's chain)
        texts: list[ProcessedText | None] | None = None,  # each sequence's whose logits are processed
        vocab: int = 0,  # a proposer's: the target's vocabulary size (ChainKey.vocab), no logprobs; 0: a target's chain
        draw_from: list[int] | None = None,  # see TokenChain.run
    ) -> Chained | None:
        """`positions` further tokens for each sequence, their confidences, logprobs and
        a proposer's draft probabilities (see TokenChain), or None where a cache lacks a
        slot or the room."""
        if any(c.slot is None or c.length + positions > self.pool.capacity for c in caches):
            return None
        end = max(c.length for c in caches) + positions
        bucket = min(max(next_power_of_two(end), MIN_BUCKET), self.pool.capacity)
        sampled = sum(not p.greedy for p in params) if params is not None else 0
        filtered = sum(map(cuts, params)) if sampled else 0
        keyed = sampled and any(not p.greedy and p.seed is not None for p in params)
        # A proposer's guesses need no logprobs, whatever its requests ask: only a target's chain gives them.
        logprobs = sum(p.logprobs is not None for p in params) if params is not None and not vocab else 0
        processed = [t for t in texts or () if t is not None]
        distinct = max([next_power_of_two(len(t.prompt_ids) + len(t.output_ids)) for t in processed], default=0)
        stops = max([next_power_of_two(max(len(t.stop_ids), 1)) for t in processed], default=0)
        biases = max([len(p.logit_bias) for p, t in zip(params or (), texts or ()) if t is not None], default=0)
        allowed = max([len(p.allowed_token_ids) for p, t in zip(params or (), texts or ()) if t is not None], default=0)
        widened = vocab if sampled or processed else 0
        key = ChainKey(
            next_power_of_two(len(caches)),
            positions,
            bucket,
            sampled=padded_count(sampled),
            filtered=padded_count(filtered),
            keyed=keyed,
            confidences=confidences,
            logprobs=padded_count(logprobs),
            distinct=distinct,
            stops=stops,
            processed=padded_count(len(processed)),
            biases=padded_count(biases),
            allowed=padded_count(allowed),
            vocab=widened,
            draft_probs=bool(widened) and any(not p.greedy and p.seed is None for p in params or ()),
        )
        if capture is not None:
            key = key._replace(layers=tuple(capture.layers), final=capture.final)
        with attention_backends(self.pool.keys.device):
            chain = self.captured.get("chain", key, lambda: TokenChain(self, key, target_ids))
            return chain.run(first_tokens, features, caches, capture, params, texts, draw_from)
