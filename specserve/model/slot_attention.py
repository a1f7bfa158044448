"""Attention that reads each sequence's keys and values where they lie in the cache pool
(`CachePool`), for the static step of CUDA graphs (model/graphs.py): a Triton kernel.

Why: the static step otherwise gathers every sequence's first `bucket` positions out of
the pool into a batch tensor, for keys and values, every layer, then runs SDPA over
them. That copy is two kernels a layer, and it reads and writes the whole bucket; and
SDPA spreads one decode query over (batch x kv heads) thread blocks alone, so at 16k
positions two blocks read 8 MB each, a layer. Here one program takes one row, one kv
head and one split of the positions (flash-decoding): it reads its keys in place,
keeps a running softmax over them for the kv head's group of query heads, and a second
kernel combines the splits. A row sees the positions up to its own (causal, also within
a verification's rows).

Triton is imported only when this runs (CUDA machines have it with PyTorch); its
interpreter (TRITON_INTERPRET=1) runs the same kernels on the CPU in tests.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from typing import Callable, NamedTuple

import torch

log = logging.getLogger("specserve")

# Positions one program reads: at least MIN_SPLIT (a short sequence's few positions still
# spread over several programs: one program's loop waits on each block's loads in turn),
# and no more than MAX_SPLITS splits (the combining kernel holds every split's output).
MIN_SPLIT = 64
MAX_SPLITS = 64
BLOCK_POSITIONS = 64  # positions a program's loop reads at once


def available() -> bool:
    """Whether Triton is installed (found, not imported: importing reads TRITON_INTERPRET)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def works_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and compute grouped-query attention here, tried once
    on a small pool: a machine where Triton cannot build gets the gathered copy with a
    warning instead of a failed step."""
    from specserve.model.decoder import grouped_attention

    try:
        generator = torch.Generator().manual_seed(0)
        keys, values = (torch.randn(2, 2, 300, 64, generator=generator).to(device, dtype) for _ in range(2))
        q = torch.randn(2, 4, 64, generator=generator).to(device, dtype)  # [rows, heads, head_dim]
        got = slot_attention(
            q, keys, values, torch.tensor([1, 0], device=device), torch.tensor([299, 0], device=device), 300
        )
        for row, (slot, position) in enumerate(((1, 299), (0, 0))):
            seen = slice(0, position + 1)
            expected = grouped_attention(q[row][:, None], keys[slot][:, seen], values[slot][:, seen])[:, 0]
            torch.testing.assert_close(got[row].float(), expected.float(), atol=2e-2, rtol=2e-2)
    except Exception as error:  # Triton fails in many ways (no compiler, an old GPU): report any
        log.warning(
            "attention in place does not run here (%s: %s); gathering each step's keys instead",
            type(error).__name__,
            str(error)[:200],
        )
        return False
    return True


def slot_attention(
    q: torch.Tensor,  # [R, heads, head_dim]: every row's queries, RoPE applied
    keys: torch.Tensor,  # [slots + 1, kv_heads, capacity, head_dim]: one layer of the pool (a view)
    values: torch.Tensor,  # [slots + 1, kv_heads, capacity, head_dim]
    row_slots: torch.Tensor,  # [R] int64: the slot each row's sequence holds
    row_positions: torch.Tensor,  # [R] int64: each row's position; it sees keys 0 ..= position
    bucket: int,  # positions any row may see: > every row's position
) -> torch.Tensor:  # [R, heads, head_dim] in q's dtype
    """Grouped-query attention of every row against its own slot's positions, read in
    place; shapes (and so launches) depend on (R, bucket) only."""
    kernels = _kernels()
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    split = max(MIN_SPLIT, math.ceil(bucket / MAX_SPLITS))
    splits = math.ceil(bucket / split)
    partial_max = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)  # [R, H, S]
    partial_sum = torch.empty_like(partial_max)  # [R, H, S]
    partial_out = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)  # [R, H, S, D]
    kernels.attend[(rows, kv_heads, splits)](
        q,
        keys,
        values,
        row_slots,
        row_positions,
        partial_max,
        partial_sum,
        partial_out,
        *q.stride()[:2],
        *keys.stride()[:3],
        *values.stride()[:3],
        1.0 / math.sqrt(head_dim),
        GROUP=group,
        GROUP_PADDED=max(16, 1 << (group - 1).bit_length()),  # tl.dot takes 16 rows at the least
        HEAD_DIM=head_dim,
        SPLIT=split,
        SPLITS=splits,
        BLOCK=BLOCK_POSITIONS,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 exactly (tf32: a 16-bit dot's default)
    )
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)  # [R, H, D]
    kernels.combine[(rows, heads)](
        partial_max,
        partial_sum,
        partial_out,
        out,
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        SPLITS=splits,
        SPLITS_PADDED=1 << (splits - 1).bit_length(),
    )
    return out


def store_keys_and_values(
    k: torch.Tensor,  # [R, kv_heads, head_dim]: every row's new keys (any strides but the last)
    v: torch.Tensor,  # [R, kv_heads, head_dim]
    keys: torch.Tensor,  # [slots + 1, kv_heads, capacity, head_dim]: one layer of the pool (a view)
    values: torch.Tensor,
    row_slots: torch.Tensor,  # [R] int64
    row_positions: torch.Tensor,  # [R] int64
) -> None:
    """keys[slot, :, position] = k and values[...] = v for every row, in one launch
    (indexed assignment takes two kernels a tensor, and a copy of a strided k or v)."""
    rows, kv_heads, head_dim = k.shape
    _kernels().store[(rows, kv_heads)](
        k,
        v,
        keys,
        values,
        row_slots,
        row_positions,
        *k.stride()[:2],
        *v.stride()[:2],
        *keys.stride()[:3],
        *values.stride()[:3],
        HEAD_DIM=head_dim,
    )


@functools.cache
def _kernels():
    """The kernels, defined at first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(
        q_ptr,
        k_ptr,
        v_ptr,
        slots_ptr,
        positions_ptr,
        max_ptr,
        sum_ptr,
        out_ptr,
        stride_q_row,
        stride_q_head,
        stride_k_slot,
        stride_k_head,
        stride_k_pos,
        stride_v_slot,
        stride_v_head,
        stride_v_pos,
        scale,
        GROUP: tl.constexpr,
        GROUP_PADDED: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        SPLIT: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots_ptr + row)
        position = tl.load(positions_ptr + row)
        g = tl.arange(0, GROUP_PADDED)  # [G]: the kv head's query heads, padded
        d = tl.arange(0, HEAD_DIM)  # [D]
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
            mask=(g < GROUP)[:, None],
            other=0.0,
        )  # [G, D]
        k_base = k_ptr + slot * stride_k_slot + kv_head * stride_k_head
        v_base = v_ptr + slot * stride_v_slot + kv_head * stride_v_head
        running_max = tl.full([GROUP_PADDED], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PADDED], tl.float32)
        acc = tl.zeros([GROUP_PADDED, HEAD_DIM], tl.float32)
        first = split * SPLIT
        end = tl.minimum(first + SPLIT, position + 1)  # a split past the row's position reads nothing
        for start in range(first, end, BLOCK):
            p = start + tl.arange(0, BLOCK)  # [N]
            seen = p < end
            k = tl.load(k_base + p[:, None] * stride_k_pos + d[None, :], mask=seen[:, None], other=0.0)  # [N, D]
            v = tl.load(v_base + p[:, None] * stride_v_pos + d[None, :], mask=seen[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [G, N]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))  # [G]: finite, the block holds a seen key
            weights = tl.exp(scores - new_max[:, None])  # [G, N]
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            running_max = new_max
        at = (row * GROUP * tl.num_programs(1) + heads) * SPLITS + split  # [G]: index of (row, head, split)
        live = g < GROUP
        tl.store(max_ptr + at, running_max, mask=live)
        tl.store(sum_ptr + at, running_sum, mask=live)
        tl.store(out_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None])

    @triton.jit
    def combine(
        max_ptr,
        sum_ptr,
        part_ptr,
        out_ptr,
        stride_out_row,
        stride_out_head,
        HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_PADDED: tl.constexpr,
    ):
        row, head = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, SPLITS_PADDED)  # [S]
        d = tl.arange(0, HEAD_DIM)  # [D]
        at = (row * tl.num_programs(1) + head) * SPLITS + s
        real = s < SPLITS
        maxima = tl.load(max_ptr + at, mask=real, other=float("-inf"))  # [S]; -inf: a split that read nothing
        sums = tl.load(sum_ptr + at, mask=real, other=0.0)
        parts = tl.load(part_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=real[:, None], other=0.0)  # [S, D]
        top = tl.max(maxima, 0)  # finite: split 0 holds position 0
        weights = tl.where(maxima > float("-inf"), tl.exp(maxima - top), 0.0)  # [S]
        total = tl.sum(weights * sums, 0)
        out = tl.sum(weights[:, None] * parts, 0) / total  # [D]
        tl.store(out_ptr + row * stride_out_row + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def store(
        k_ptr,
        v_ptr,
        keys_ptr,
        values_ptr,
        slots_ptr,
        positions_ptr,
        stride_k_row,
        stride_k_head,
        stride_v_row,
        stride_v_head,
        stride_keys_slot,
        stride_keys_head,
        stride_keys_pos,
        stride_values_slot,
        stride_values_head,
        stride_values_pos,
        HEAD_DIM: tl.constexpr,
    ):
        row, kv_head = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots_ptr + row)
        position = tl.load(positions_ptr + row)
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + row * stride_k_row + kv_head * stride_k_head + d)
        v = tl.load(v_ptr + row * stride_v_row + kv_head * stride_v_head + d)
        at_keys = slot * stride_keys_slot + kv_head * stride_keys_head + position * stride_keys_pos
        at_values = slot * stride_values_slot + kv_head * stride_values_head + position * stride_values_pos
        tl.store(keys_ptr + at_keys + d, k)
        tl.store(values_ptr + at_values + d, v)

    return _Kernels(attend, combine, store)


class _Kernels(NamedTuple):
    attend: Callable
    combine: Callable
    store: Callable
