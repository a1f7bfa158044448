"""Prefix caching (`--enable-prefix-caching`): the keys and values of finished and
running sequences, found again by a new prompt that starts with the same tokens.

Why: a chat client sends the whole conversation every turn, so turn n's prompt is turn
n - 1's prompt and answer plus a new message. Without this the engine prefills all of
it again, and on a CPU a prefill is slow (the 1.5B target in float32 reads ~1000 prompt
tokens in ~10 s); with it, time to first token follows the new message only.

A position's key and value depend on the tokens up to it alone (causal attention), so
any sequence that starts with the same tokens may start from a copy of them. Stored
prefixes are found in blocks of BLOCK tokens, as vLLM's automatic prefix caching does:
each block is keyed by a hash of every token up to its end (a chain), so one dict
lookup per block finds the longest stored prefix; a hit is checked against the stored
tokens, so a hash collision costs a miss, never wrong keys.

Each model has a store of its own (the target's in the engine, the draft's in
DraftModelProposer), holding at most `max_tokens` positions; the least recently used
entries go first. A new entry copies its sequence's cache (the cache may be a pool
slot, which goes back to the pool), and an entry whose every block a longer entry also
holds (the previous turn of the same conversation) is dropped, so a conversation costs
one entry.

Running sequences are sources too (`live`): requests that share a system prompt or a
document and arrive together find it in the cache of the one that read it first, as
far as it has read it, without a copy being stored for them. The engine looks before
each prompt chunk, not only once: prompt chunks share one budget per step, so the
first request reads the shared part while the others wait for budget, and each of them
then copies what it read. And a sequence whose next chunk another one reads in the same
step waits a step to copy it (`read_elsewhere`), where budget was left to read it twice.

The copied keys and values are those the earlier sequence computed: a prompt chunk and
a decode step round differently (Segment's docstring), so outputs may differ from a
run without the cache where two tokens nearly tie, as with vLLM's prefix caching.
Speculation stays lossless against the target as served: a plain and a speculative
engine given the same requests hold the same entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specserve.model.kv_cache import KVCache

BLOCK = 16  # tokens per hashed block: a prefix is stored and found in whole blocks


@dataclass(eq=False)
class _Entry:
    token_ids: list[int]  # the stored positions' tokens, a whole number of blocks
    keys: torch.Tensor  # [L, kv_heads, len(token_ids), head_dim]
    values: torch.Tensor  # [L, kv_heads, len(token_ids), head_dim]
    hashes: list[int]  # chain hash of each block
    blocks_held: int = 0  # of its blocks, those whose hash still leads here


def block_hashes(token_ids: list[int]) -> list[int]:
    """The chain hash of each whole block of `token_ids`: block j's hash covers
    token_ids[: (j + 1) * BLOCK]."""
    hashes, previous = [], 0
    for end in range(BLOCK, len(token_ids) + 1, BLOCK):
        previous = hash((previous, *token_ids[end - BLOCK : end]))
        hashes.append(previous)
    return hashes


def read_elsewhere(token_ids: list[int], start: int, end: int, reading: Iterable[tuple[list[int], int]]) -> bool:
    """Whether a whole block of token_ids[start:end], which a sequence is about to read,
    is read this step by another sequence, reading (its tokens, up to its end): then
    waiting a step and copying it costs less than reading it twice."""
    return any(shared_blocks(token_ids[:end], tokens[:their_end]) > start for tokens, their_end in reading)


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
        self.num_tokens = 0  # positions held by every entry
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id(entry), least recently used first
        self._by_hash: dict[int, tuple[_Entry, int]] = {}  # block hash -> (newest entry holding it, its block index)
        # Prompt tokens looked up and found, as vLLM counts them (metrics, usage).
        self.queried_tokens = self.hit_tokens = 0

    def count_query(self, num_tokens: int) -> None:
        """Count a new sequence's prompt tokens as looked up (once; `load` counts the hits)."""
        self.queried_tokens += num_tokens

    def cached_length(self, token_ids: list[int], limit: int, live: Iterable[tuple[list[int], KVCache]] = ()) -> int:
        """The prefix `load` would extend a cache to (without copying or counting it)."""
        return self._longest(token_ids, limit, live)[1]

    def load(self, token_ids: list[int], cache: KVCache, limit: int,
             live: Iterable[tuple[list[int], KVCache]] = ()) -> int:
        """Extend `cache` (holding token_ids[: cache.length]) to the longest prefix of
        token_ids[:limit] that the store or a `live` source holds (a running sequence's
        tokens and cache: the positions it has computed); returns the positions copied
        (0: nothing longer found)."""
        source, length = self._longest(token_ids, limit, live)
        start = cache.length
        if length <= start:
            return 0
        cache.reserve(length)
        cache.keys[:, :, start:length].copy_(source.keys[:, :, start:length])
        cache.values[:, :, start:length].copy_(source.values[:, :, start:length])
        cache.length = length
        if isinstance(source, _Entry):
            self._entries.move_to_end(id(source))
        self.hit_tokens += length - start
        return length - start

    def _longest(self, token_ids: list[int], limit: int,
                 live: Iterable[tuple[list[int], KVCache]]) -> tuple[_Entry | KVCache | None, int]:
        """Where the longest prefix of token_ids[:limit] is held (a stored entry or a live
        cache; None: nowhere), and its length."""
        found = self._find(token_ids, limit)
        source, length = (found[0], found[1]) if found is not None else (None, 0)
        for source_tokens, source_cache in live:
            shared = shared_blocks(token_ids[:limit], source_tokens[: source_cache.length])
            if shared > length:
                source, length = source_cache, shared
        return source, length

    def _find(self, token_ids: list[int], limit: int) -> tuple[_Entry, int] | None:
        """The entry holding the longest stored prefix of token_ids[:limit], and its length."""
        found = None
        for j, block_hash in enumerate(block_hashes(token_ids[:limit])):
            hit = self._by_hash.get(block_hash)
            if hit is None or hit[1] != j:
                break
            found = hit[0], (j + 1) * BLOCK
        if found is not None and found[0].token_ids[: found[1]] != token_ids[: found[1]]:
            return None  # a hash collision: a miss, never another prompt's keys
        return found

    def store(self, token_ids: list[int], cache: KVCache) -> None:
        """Keep the whole blocks of `cache`'s positions (token_ids[: cache.length]) for
        later prompts; call before the cache is released."""
        length = min(cache.length, len(token_ids), self.max_tokens) // BLOCK * BLOCK
        if length == 0:
            return
        hashes = block_hashes(token_ids[:length])
        held = self._by_hash.get(hashes[-1])
        if held is not None and held[1] == len(hashes) - 1:  # stored already (or longer)
            self._entries.move_to_end(id(held[0]))
            return
        entry = _Entry(list(token_ids[:length]), cache.keys[:, :, :length].clone(),
                       cache.values[:, :, :length].clone(), hashes)
        for index, block_hash in enumerate(hashes):
            previous = self._by_hash.get(block_hash)
            if previous is not None:
                self._let_go(previous[0])
            self._by_hash[block_hash] = entry, index
            entry.blocks_held += 1
        self._entries[id(entry)] = entry
        self.num_tokens += length
        while self.num_tokens > self.max_tokens:
            self._drop(next(iter(self._entries.values())))

    def _let_go(self, entry: _Entry) -> None:
        """One of entry's blocks now leads to a newer entry; with none left, it goes."""
        entry.blocks_held -= 1
        if entry.blocks_held == 0:
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        for block_hash in entry.hashes:
            if self._by_hash.get(block_hash, (None, 0))[0] is entry:  # not taken over by a newer entry
                del self._by_hash[block_hash]
        del self._entries[id(entry)]
        self.num_tokens -= len(entry.token_ids)

    def __len__(self) -> int:
        return len(self._entries)
