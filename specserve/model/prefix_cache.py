"""Prefix caching (`--enable-prefix-caching`): the keys and values of finished and
running sequences, found again by a new prompt that starts with the same tokens.

Why: a chat client sends the whole conversation every turn, so turn n's prompt is turn
n - 1's prompt and answer plus a new message. Without this the engine prefills all of
it again, and on a CPU a prefill is slow (the 1.5B target in float32 reads ~1000 prompt
tokens in ~10 s); with it, time to first token follows the new message only.

A position's key and value depend on the tokens up to it alone (causal attention), so
any sequence that starts with the same tokens may start from a copy of them. Prefixes
are stored in blocks of BLOCK positions, as vLLM's automatic prefix caching stores
them: a block is keyed by its tokens and the block before it, so one dict lookup per
block finds the longest stored prefix, and the key is compared whole on a lookup (a
hash collision costs nothing but a comparison, never wrong keys). Blocks are shared:
the turns of a conversation, or conversations that start with the same system prompt,
hold their common blocks once.

Each model has a store of its own (the target's in the engine, the draft's in
DraftModelProposer), holding at most `max_tokens` positions. Storing a sequence copies
the blocks of its cache that are not stored yet (the cache may be a pool slot, which
goes back to the pool). The least recently used blocks go first; a prefix that is used
is touched from its last block to its first, so a block is always used more recently
than the blocks after it, and the block that goes is one that no stored block follows.

Running sequences are sources too (`live`): requests that share a system prompt or a
document and arrive together find it in the cache of the one that read it first, as
far as it has read it, without a copy being stored for them. The engine looks before
each prompt chunk, not only once: prompt chunks share one budget per step, so the
first request reads the shared part while the others wait for budget, and each of them
then copies what it read. And a sequence whose next chunk is mostly what another one
reads in the same step waits a step to copy it (`read_elsewhere`) rather than read it
twice.

The copied keys and values are those the earlier sequence computed. On our CPU kernels
a prompt chunk and a decode step compute the same bits (Segment's docstring), so the
cache changes no output; elsewhere they round differently, so outputs may differ from
a run without the cache where two tokens nearly tie, as with vLLM's prefix caching.
Speculation stays lossless against the target as served: a plain and a speculative
engine given the same requests hold the same entries.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specserve.model.kv_cache import KVCache

log = logging.getLogger("specserve")

BLOCK = 16  # positions per stored block: a prefix is stored and found in whole blocks

# A block's key: the id of the block before it (ROOT for a prefix's first) and its tokens.
# An id is never reused while it names a stored block's parent: a block goes only after
# every block that follows it (see the module's docstring).
BlockKey = tuple[int, tuple[int, ...]]
ROOT = 0


@dataclass(eq=False)
class _Block:
    key: BlockKey
    keys: torch.Tensor  # [L, kv_heads, BLOCK, head_dim]
    values: torch.Tensor  # [L, kv_heads, BLOCK, head_dim]


def _key_after(chain: list[_Block], tokens: list[int]) -> BlockKey:
    """The key of the block of `tokens` that follows the stored blocks `chain`."""
    return id(chain[-1]) if chain else ROOT, tuple(tokens)


def read_elsewhere(token_ids: list[int], start: int, end: int, reading: Iterable[tuple[list[int], int]]) -> bool:
    """Whether at least half of token_ids[start:end], the chunk a sequence is about to
    read, another sequence reads in this step (`reading`: its tokens, up to its end), in
    whole blocks. Then the sequence had better wait a step and copy that part: reading
    it would compute it twice, and the step's delay costs it less than the half it
    would have read of its own."""
    for tokens, their_end in reading:
        shared = min(shared_blocks(token_ids, tokens[:their_end]), end)
        if shared > start and 2 * (shared - start) >= end - start:
            return True
    return False


def copy_prefix(source: KVCache, cache: KVCache, length: int) -> int:
    """Extend `cache` to `length` positions copied from `source`, which holds the same
    tokens there; returns the positions copied."""
    start = cache.length
    if length <= start:
        return 0
    cache.reserve(length)
    cache.keys[:, :, start:length].copy_(source.keys[:, :, start:length])
    cache.values[:, :, start:length].copy_(source.values[:, :, start:length])
    cache.length = length
    return length - start


class ChunkReads:
    """The chunks of tokens one forward reads, so that a sequence whose chunk another
    reads in the same forward waits a step and copies it (`read_elsewhere`): the
    engine's prompt chunks, and a draft model's catch-up chunks."""

    def __init__(self) -> None:
        self.reading: list[tuple[list[int], int]] = []  # (tokens, end) of each chunk read

    def claim(self, token_ids: list[int], start: int, end: int, shares: bool = True) -> bool:
        """Whether a sequence reads token_ids[start:end] in this forward: False where it
        shares with others and another reads most of it (it waits); else it is counted
        as read."""
        if shares and read_elsewhere(token_ids, start, end, self.reading):
            return False
        self.reading.append((token_ids, end))
        return True


def shared_blocks(a: list[int], b: list[int]) -> int:
    """How many tokens of whole BLOCKs `a` and `b` start with alike."""
    end = min(len(a), len(b)) // BLOCK * BLOCK
    if a[:end] == b[:end]:
        return end
    return next(start for start in range(0, end, BLOCK) if a[start : start + BLOCK] != b[start : start + BLOCK])


class PrefixCache:
    def __init__(self, max_tokens: int):
        if max_tokens < BLOCK:
            raise ValueError(f"a prefix cache holds at least one block of {BLOCK} tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self._blocks: OrderedDict[BlockKey, _Block] = OrderedDict()  # least recently used first
        # Prompt tokens looked up and found, as vLLM counts them (metrics, usage).
        self.queried_tokens = self.hit_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Positions held."""
        return len(self._blocks) * BLOCK

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def count_query(self, num_tokens: int) -> None:
        """Count a new sequence's prompt tokens as looked up (once; `load` counts the hits)."""
        self.queried_tokens += num_tokens

    def cached_length(self, token_ids: list[int], limit: int, live: Iterable[tuple[list[int], KVCache]] = ()) -> int:
        """The prefix `load` would extend a cache to (without copying or counting it)."""
        return self._longest(token_ids, limit, live)[1]

    def load(
        self, token_ids: list[int], cache: KVCache, limit: int, live: Iterable[tuple[list[int], KVCache]] = ()
    ) -> int:
        """Extend `cache` (holding token_ids[: cache.length]) to the longest prefix of
        token_ids[:limit] that the store or a `live` source holds (a running sequence's
        tokens and cache: the positions it has computed); returns the positions copied
        (0: nothing longer found)."""
        source, length = self._longest(token_ids, limit, live)
        start = cache.length
        if length <= start:
            return 0
        if isinstance(source, KVCache):
            copy_prefix(source, cache, length)
        else:
            cache.reserve(length)
            for j in range(start // BLOCK, length // BLOCK):
                first = max(start, j * BLOCK)  # a cache may end inside a block
                cache.keys[:, :, first : (j + 1) * BLOCK].copy_(source[j].keys[:, :, first - j * BLOCK :])
                cache.values[:, :, first : (j + 1) * BLOCK].copy_(source[j].values[:, :, first - j * BLOCK :])
            self._touch(source)
            cache.length = length
        self.hit_tokens += length - start
        return length - start

    def _longest(
        self, token_ids: list[int], limit: int, live: Iterable[tuple[list[int], KVCache]]
    ) -> tuple[list[_Block] | KVCache, int]:
        """Where the longest prefix of token_ids[:limit] is held (stored blocks, maybe
        none, or a live cache), and its length."""
        token_ids = token_ids[:limit]
        chain = self._find(token_ids)
        source, length = chain, len(chain) * BLOCK
        for source_tokens, source_cache in live:
            shared = shared_blocks(token_ids, source_tokens[: source_cache.length])
            if shared > length:
                source, length = source_cache, shared
        return source, length

    def _find(self, token_ids: list[int]) -> list[_Block]:
        """The stored blocks of token_ids' longest stored prefix, in order."""
        chain: list[_Block] = []
        for start in range(0, len(token_ids) // BLOCK * BLOCK, BLOCK):
            block = self._blocks.get(_key_after(chain, token_ids[start : start + BLOCK]))
            if block is None:
                break
            chain.append(block)
        return chain

    def store(self, token_ids: list[int], cache: KVCache) -> None:
        """Keep the whole blocks of `cache`'s positions (token_ids[: cache.length]) for
        later prompts; call before the cache is released."""
        length = min(cache.length, len(token_ids), self.max_tokens) // BLOCK * BLOCK
        chain = self._find(token_ids[:length])
        for start in range(len(chain) * BLOCK, length, BLOCK):  # the blocks not stored yet
            end = start + BLOCK
            block = _Block(
                _key_after(chain, token_ids[start:end]),
                cache.keys[:, :, start:end].clone(),
                cache.values[:, :, start:end].clone(),
            )
            self._blocks[block.key] = block
            chain.append(block)
        self._touch(chain)
        while self.num_tokens > self.max_tokens:
            self._blocks.popitem(last=False)

    def _touch(self, chain: list[_Block]) -> None:
        """Mark a prefix's blocks used, its first block last (the most recently used)."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)


def release_into(prefix_cache: PrefixCache | None, token_ids: list[int], cache: KVCache) -> None:
    """Store `cache`'s prefix in `prefix_cache` (where there is one), then release `cache`.
    A prefix that cannot be stored (a full GPU while copying a block) is only not kept:
    the cache is released all the same, since a pool slot left taken would fail every
    later step that needs one."""
    try:
        if prefix_cache is not None:
            prefix_cache.store(token_ids, cache)
    except Exception:
        log.exception("storing a prefix of %d tokens failed; it is not kept", len(token_ids))
    finally:
        cache.release()
