"""CUDA graphs of the decode step (on by default on a GPU, `Decoder.use_cuda_graphs`).

Why: eager PyTorch launches each of a step's ~400 kernels (28 layers of ~15) from
Python, so at small batch a GPU step is bound by launches, not by the GPU
(benchmarks/EXPERIMENTS.md, "The first GPU run"). A CUDA graph replays a whole step's
kernels with one launch.

A graph replays the same kernels on the same addresses with the same shapes, so the
step it captures (`static_forward`) is not Decoder.forward's ragged one:
- every sequence's cache is a slot of one `CachePool` (kv_cache.py), found by index;
- every sequence feeds n rows, the most any of them feeds this step (1: a decode step;
  k + 1: a verification of k drafts); a sequence with fewer (another k, a prompt chunk)
  and the rows that pad the batch to a power of two write their keys and values to
  the pool's scratch slot, and their logits are dropped;
- attention reads each slot in place, every row up to its own position
  (slot_attention.py, where Triton runs), or else a gathered copy of the first `bucket`
  positions of each slot under a causal mask; `bucket` is the smallest power of two
  from MIN_BUCKET holding the batch's longest sequence, at most the pool's capacity.
A graph is captured for each (batch, rows, bucket), and the features a head proposer
asks the target for (`Capture`), the first time a step needs it. A
prompt's prefill of more than MAX_GRAPH_ROWS rows runs eagerly, on the same slots.

On a CPU no graphs exist: there the same static step runs eagerly, which is how the
tests check it against Decoder.forward (Triton's kernels by its interpreter). Its speed
on a GPU: benchmarks/README.md, "Current results: GPU".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from specserve.model import slot_attention
from specserve.model.decoder import batched_grouped_attention, grouped_mask, in_asked_order
from specserve.model.kv_cache import CachePool

if TYPE_CHECKING:
    from specserve.model.decoder import Capture, Decoder, Segment

MAX_GRAPH_ROWS = 16  # rows per sequence a graph takes: k + 1 for k up to 15 drafts
MIN_BUCKET = 256  # positions attention reads at the least


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def static_forward(
    decoder: Decoder,
    pool: CachePool,
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, rotated_sin [>= capacity, head_dim] (Decoder.rope_table)
    input_ids: torch.Tensor,  # [B, n] int64: each sequence's new tokens, padded to n
    starts: torch.Tensor,  # [B] int64: positions each sequence has cached already
    slots: torch.Tensor,  # [B] int64: each sequence's pool slot
    lengths: torch.Tensor,  # [B] int64: each sequence's new tokens (the rest of its n rows pad)
    bucket: int,  # positions of each slot that attention reads: >= every start + length
    scratch: int,  # the pool's scratch slot
    in_place: bool = False,  # attention reads the pool where it lies (slot_attention.py), not a gathered copy
    capture_layers: tuple[int, ...] = (),  # Capture.layers: the inputs of these layers, as features
    capture_final: bool = False,  # Capture.final: the last hidden state after the final norm
) -> list[torch.Tensor]:  # every row's logits [B n, head_size] float32, then the features asked for
    """Decoder.forward for B sequences of up to n new tokens each, with shapes that
    depend on (B, n, bucket) only: no host syncs, no Python branch on a tensor's value.
    Writes the new keys and values into the pool (a padding row's into the scratch
    slot, at its row index) and reads each sequence's first `bucket` positions. The
    features are Capture's, for every row: [B n, len(capture_layers) * hidden], then
    [B n, hidden]."""
    batch, n = input_ids.shape
    device = input_ids.device
    offsets = torch.arange(n, device=device)  # [n]
    real = offsets < lengths[:, None]  # [B, n]
    # A padding row sits at its row index (within every table) in the scratch slot.
    # (Broadcast, not repeat_interleave: on CUDA that reads the repeats back to size its output, a sync.)
    positions = torch.where(real, starts[:, None] + offsets, offsets)  # [B, n]
    row_slots = torch.where(real, slots[:, None], scratch).flatten()  # [B n]
    row_positions = positions.flatten()  # [B n]
    cos, rotated_sin = rope[0][row_positions], rope[1][row_positions]  # [B n, head_dim]
    config = decoder.config
    if not in_place:  # the gathered copy's mask, [B, 1, g n, bucket]: built once for every layer
        visible = torch.arange(bucket, device=device) <= positions[..., None]  # [B, n, bucket]
        grouped = grouped_mask(visible, config.num_heads // config.num_kv_heads)
    h = decoder.embed_tokens(input_ids.flatten())  # [B n, hidden]
    captured = []  # the inputs of the captured layers, in layer order
    for i, block in enumerate(decoder.layers):
        if i in capture_layers:
            captured.append(h)
        q, k, v = block.project_rotated_qkv(h, cos, rotated_sin)  # [B n, heads or kv_heads, head_dim]
        layer_keys, layer_values = pool.keys[:, i], pool.values[:, i]  # [slots + 1, kv_heads, capacity, head_dim]
        if in_place:
            slot_attention.store_keys_and_values(k, v, layer_keys, layer_values, row_slots, row_positions)
            out = slot_attention.slot_attention(q, layer_keys, layer_values, row_slots, row_positions, bucket)
            h = block.finish(h, out.view(batch * n, -1))  # [B n, hidden]
            continue
        layer_keys[row_slots, :, row_positions] = k
        layer_values[row_slots, :, row_positions] = v
        keys = layer_keys[:, :, :bucket][slots]  # [B, kv_heads, bucket, head_dim]
        values = layer_values[:, :, :bucket][slots]
        heads_first = q.view(batch, n, -1, q.shape[-1]).transpose(1, 2)  # [B, heads, n, head_dim]
        out = batched_grouped_attention(heads_first, keys, values, grouped=grouped)  # [B, heads, n, head_dim]
        h = block.finish(h, out.transpose(1, 2).reshape(batch * n, -1))  # [B n, hidden]
    outputs = [decoder.score(h)]
    if capture_layers:
        outputs.append(in_asked_order(capture_layers, captured))
    if capture_final:
        outputs.append(decoder.norm(h))
    return outputs


class StepKey(NamedTuple):
    """What a captured step is made for: its shape, and the features it captures."""

    batch: int  # sequences, padded to a power of two
    rows: int  # rows a sequence feeds
    bucket: int  # positions attention may read
    layers: tuple[int, ...] = ()  # Capture.layers
    final: bool = False  # Capture.final


class _Step:
    """One StepKey's static inputs and outputs, and on a GPU its graph."""

    def __init__(self, static: StaticDecode, key: StepKey):
        device = static.decoder.device
        self.input_ids = torch.zeros(key.batch, key.rows, dtype=torch.int64, device=device)  # [B, n]
        self.index = torch.zeros(3, key.batch, dtype=torch.int64, device=device)  # [3, B]: starts, slots, lengths
        self.index[1] = static.pool.scratch  # capturing runs the step: no rows of any sequence
        self.scratch = static.pool.scratch

        def forward() -> list[torch.Tensor]:
            starts, slots, lengths = self.index
            return static_forward(
                static.decoder,
                static.pool,
                static.rope,
                self.input_ids,
                starts,
                slots,
                lengths,
                key.bucket,
                self.scratch,
                static.in_place,
                key.layers,
                key.final,
            )

        self.forward: Callable[[], list[torch.Tensor]] = forward
        self.graph: torch.cuda.CUDAGraph | None = None
        if static.capture:
            self.graph, self.outputs = _capture(forward, static.memory)

    def run(self, input_ids: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
        """input_ids [T] of the segments, in order -> [T, head_size] logits, then the
        features captured, [T, ...] each."""
        batch, rows = self.input_ids.shape
        padding = batch - len(segments)
        lengths = [s.num_tokens for s in segments]
        # Where each of the step's B x n rows takes its token from the stream (a padding
        # row: the first token, whatever it is), and where each token's logits land.
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
        self.input_ids.view(-1).copy_(input_ids[moved[3 * batch : 3 * batch + batch * rows]])
        if self.graph is None:
            outputs = self.forward()
        else:
            self.graph.replay()
            outputs = self.outputs
        # Gathers, so copies: the next replay overwrites the graph's outputs.
        rows_of_tokens = moved[3 * batch + batch * rows :]
        return [output[rows_of_tokens] for output in outputs]


def _capture(forward: Callable[[], list[torch.Tensor]], memory) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
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


class StaticDecode:
    """A decoder's pool of cache slots and its captured steps."""

    def __init__(self, decoder: Decoder, num_slots: int, capacity: int):
        self.decoder = decoder
        self.pool = CachePool(decoder.config, decoder.dtype, decoder.device, num_slots, capacity)
        self.rope = decoder.rope_table(capacity)  # held here: a graph reads these addresses
        self.capture = decoder.device.type == "cuda"
        # Attention in place where Triton runs it (CUDA); tests set it on the CPU under Triton's interpreter.
        self.in_place = (
            self.capture and slot_attention.available() and slot_attention.works_on(decoder.device, decoder.dtype)
        )
        self.memory = torch.cuda.graph_pool_handle() if self.capture else None  # shared by every graph
        self.steps: dict[StepKey, _Step] = {}

    def handles(self, segments: list[Segment]) -> bool:
        """Whether a forward over `segments` can be a static step: every cache in this
        pool, 1 to MAX_GRAPH_ROWS new tokens each."""
        return bool(segments) and all(
            s.cache.pool is self.pool and 0 < s.num_tokens <= MAX_GRAPH_ROWS for s in segments
        )

    def run(self, input_ids: torch.Tensor, segments: list[Segment], capture: Capture | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [T, head_size] float32 (see `handles`), and the
        features `capture` asks for, filled in as Decoder.forward fills them; the caches'
        slots must be taken (KVCache.reserve) and their lengths not yet advanced."""
        rows = max(s.num_tokens for s in segments)
        end = max(s.cache.length + s.num_tokens for s in segments)
        bucket = min(max(next_power_of_two(end), MIN_BUCKET), self.pool.capacity)
        key = StepKey(next_power_of_two(len(segments)), rows, bucket)
        if capture is not None:
            key = key._replace(layers=tuple(capture.layers), final=capture.final)
        if key not in self.steps:
            self.steps[key] = _Step(self, key)
        logits, *features = self.steps[key].run(input_ids, segments)
        if key.layers:
            capture.layer_inputs = features.pop(0)
        if key.final:
            capture.final_hidden = features.pop(0)
        return logits
