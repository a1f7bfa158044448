"""One sequence's key/value cache, indexed by position.

Invariant: positions [0, length) hold the keys and values of the sequence's first
`length` tokens, for every layer. Rolling back after a rejected draft is moving
`length` back (`truncate`): stale entries past it are simply overwritten later.

A cache owns its storage and grows it by doubling, so appending is amortised O(1) and
no fixed maximum length has to be chosen up front. Or it takes a slot of a
`CachePool` (every sequence's cache in one preallocated tensor, for CUDA graphs,
model/graphs.py): the slot is taken at the first `reserve` (a waiting request holds
none) and handed back by `release`, and it never grows past the pool's capacity.
"""

from __future__ import annotations

import torch

from specserve.config import ModelConfig
from specserve.errors import ConfigError


def bytes_per_position(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one position holds, over every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


class CachePool:
    """`num_slots` caches of `capacity` positions in one tensor per kind, plus a scratch
    slot (index num_slots) that a graph's padding rows write to."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, num_slots: int, capacity: int):
        shape = self.shape(config, num_slots, capacity)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [slots + 1, L, kv_heads, capacity, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @staticmethod
    def shape(config: ModelConfig, num_slots: int, capacity: int) -> tuple[int, ...]:
        """Of the keys, and of the values: every slot and the scratch one."""
        return (num_slots + 1, config.num_layers, config.num_kv_heads, capacity, config.head_dim)

    @staticmethod
    def bytes_needed(config: ModelConfig, dtype: torch.dtype, num_slots: int, capacity: int) -> int:
        return (num_slots + 1) * capacity * bytes_per_position(config, dtype)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(
                f"all {self.scratch} KV cache slots are taken: more sequences run than the pool was made for"
            )
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = 128,
        pool: CachePool | None = None,
    ):
        self.pool, self.slot = pool, None
        self.length = 0
        if pool is not None:  # storage comes with the slot, at the first reserve
            self.keys = self.values = None
            return
        shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [L, kv_heads, capacity, head_dim]
        self.values = torch.empty(shape, dtype=dtype, device=device)  # [L, kv_heads, capacity, head_dim]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def capacity_for(self, length: int) -> int:
        """The positions of storage this cache holds once it has room for `length`: its
        capacity doubled as often as needed, whatever the steps it grows in (a pool
        slot's is fixed)."""
        if self.pool is not None:
            return self.pool.capacity
        capacity = max(self.capacity, 1)
        while capacity < length:
            capacity *= 2
        return capacity

    def reserve(self, length: int) -> None:
        """Make room for `length` positions, keeping what is stored."""
        if self.pool is not None:
            if length > self.pool.capacity:
                raise ConfigError(
                    f"{length} positions do not fit a KV cache slot of {self.pool.capacity}; raise --max-model-len"
                )
            if self.slot is None:
                self.slot = self.pool.acquire()
                self.keys, self.values = (
                    self.pool.keys[self.slot],
                    self.pool.values[self.slot],
                )  # [L, kv_heads, capacity, head_dim]
            return
        if length <= self.capacity:
            return
        capacity = self.capacity_for(length)
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

    def release(self) -> None:
        """Hand a pool slot back (the sequence is done); a cache of its own keeps its
        storage until it is dropped."""
        if self.pool is not None and self.slot is not None:
            self.pool.release(self.slot)
            self.slot, self.keys, self.values, self.length = None, None, None, 0
