"""One sequence's key/value cache, indexed by position.

Invariant: positions [0, length) hold the keys and values of the sequence's first
`length` tokens, for every layer. Rolling back after a rejected draft is moving
`length` back (`truncate`): stale entries past it are simply overwritten later.
Storage grows by doubling, so appending is amortised O(1) and no fixed maximum
length has to be chosen up front.
"""

from __future__ import annotations

import torch

from specserve.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, capacity: int = 128):
        shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [L, kv_heads, capacity, head_dim]
        self.values = torch.empty(shape, dtype=dtype, device=device)  # [L, kv_heads, capacity, head_dim]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, length: int) -> None:
        """Make room for `length` positions, keeping what is stored."""
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:2] + (capacity,) + old.shape[3:])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (rollback after a rejection)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length
