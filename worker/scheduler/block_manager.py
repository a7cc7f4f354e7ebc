"""Paged KV cache block manager with prefix caching (pure Python; the engine thread owns it).

The KV pool is `num_blocks` blocks of `block_size` token slots. A sequence owns a `BlockTable`:
the ids of its blocks in position order; position p lives in slot
`block_ids[p // block_size] * block_size + p % block_size`.

Prefix caching: once a block is full and its KV computed, `commit` registers its hash, chained
over the whole prefix, `hash(parent_hash, block_token_ids)`, so equal tokens after a different
prefix never match. `allocate` reuses the longest run of cached leading blocks of a new
sequence (ref count + 1), but never the whole prompt: the last token is always computed, since
its logits are needed. A freed cached block keeps its hash and stays reusable until evicted.

Free queue: the ref-0 blocks, least recently freed first. A fresh block is popped from the
front, dropping its hash from the cache map if it had one (eviction = LRU among free blocks).
`free` appends a table's blocks in reverse order, so a sequence's tail is evicted before its
head (heads are likelier shared). The blocks one allocation pops go into the table in ascending
id order, so a prompt's K/V lie forwards in memory (`_append_fresh`). Reusing a cached ref-0
block takes it out of the middle, so the queue must remove in O(1) from anywhere: it is an
`OrderedDict[int, None]` — the C-level doubly linked list in CPython's OrderedDict gives O(1)
pop-front, append and delete-by-key without hand-written node bookkeeping (vLLM writes an
intrusive list to avoid per-block Python objects; here a block is an int, so the dict is both
simpler and as fast).

Forking (n > 1 completions of one prompt): `fork` gives a fresh table the same blocks as a live one
(ref count + 1 each, the partial last block included), so the prompt's K/V are computed and stored
once. A table that is about to write into a block it shares copies it first (copy on write): `grow`
with `write_from` swaps the shared block holding that position for a fresh one and returns the
(src, dst) pair, which the cache copies before the step writes. Only a partial last block is ever
written, so only it is ever copied; the other holders keep the original.

Invariants (checked by `_check()` after every mutating call when `debug=True`):
  1. ref count 0  <=>  the block is in the free queue; ref counts are never negative.
  2. every block is free-queued or referenced, and its ref count equals the number of live
     tables holding it; no table holds a block twice.
  3. a hash maps to exactly one block, and that block's stored hash is that hash; a block
     with a stored hash is in the map (no stale hashes); prefix caching off -> no hashes.
  4. block tables only grow: each live table's `block_ids` equals the manager's own copy, set by
     `allocate`/`fork` and extended by `grow`, whose copy on write may swap an uncommitted shared
     block for a private one; `num_committed_blocks <= len(block_ids)`.
  5. `num_free_blocks == len(free queue)`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from kvpact.shared.errors import KvpactError

BlockHash = NewType("BlockHash", bytes)  # 16-byte blake2b of (parent hash, block token ids)

_ROOT_HASH = BlockHash(b"")


class OutOfBlocksError(KvpactError):
    """More KV blocks were asked for than are free; check `can_allocate`/`can_grow` first."""


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: depends on every token before it, not just its own."""
    payload = parent_hash + array("q", token_ids).tobytes()
    return BlockHash(hashlib.blake2b(payload, digest_size=16).digest())


def block_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slot of each position p in [start, end): block block_ids[p // block_size], offset
    p % block_size (a block's positions are consecutive slots, so one range per block)."""
    slots: list[int] = []
    for b in range(start // block_size, -(-end // block_size)):
        shift = (block_ids[b] - b) * block_size  # position p of block b lives in slot p + shift
        slots.extend(range(max(start, b * block_size) + shift, min(end, (b + 1) * block_size) + shift))
    return slots


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks, append-only while it lives."""

    block_ids: list[int]
    num_committed_blocks: int = 0  # leading full blocks whose hash is known (prefix cache)
    last_hash: BlockHash = _ROOT_HASH  # chain hash of block num_committed_blocks - 1


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, debug: bool = False
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.debug = debug
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[int, tuple[BlockTable, list[int]]] = {}  # id(table) -> (table, own copy)

    # ---- queries (take no refs) ----

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_cached_tokens(self, token_ids: Sequence[int], reuse: bool = True) -> int:
        return len(self._cached_prefix(token_ids, reuse)[0]) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int, reuse: bool = True) -> bool:
        block_ids, _ = self._cached_prefix(token_ids, reuse)
        num_reused_free = sum(1 for b in block_ids if self._ref_counts[b] == 0)
        num_fresh = max(0, self._num_blocks_for(num_tokens) - len(block_ids))
        return num_reused_free + num_fresh <= self.num_free_blocks

    def can_grow(self, table: BlockTable, num_tokens: int, write_from: int | None = None) -> bool:
        num_new = self._num_blocks_for(num_tokens) - len(table.block_ids)
        return max(0, num_new) + self._must_copy(table, write_from) <= self.num_free_blocks

    def slot_mapping(self, table: BlockTable, start: int, end: int) -> list[int]:
        if not 0 <= start <= end <= len(table.block_ids) * self.block_size:
            raise ValueError(
                f"positions [{start}, {end}) are outside the table's "
                f"{len(table.block_ids)} blocks of {self.block_size}; grow it first"
            )
        return block_slots(table.block_ids, start, end, self.block_size)

    # ---- mutations ----

    def allocate(
        self, table: BlockTable, token_ids: Sequence[int], num_tokens: int, reuse: bool = True
    ) -> int:
        if table.block_ids or id(table) in self._tables:
            raise ValueError(
                "allocate() needs a fresh, empty BlockTable; this one is live "
                "(use grow() to extend it, or free() it first)"
            )
        cached_ids, last_hash = self._cached_prefix(token_ids, reuse)
        num_cached = len(cached_ids) * self.block_size
        if num_tokens < num_cached or num_tokens > len(token_ids):
            raise ValueError(
                f"num_tokens ({num_tokens}) must lie in [num_cached_tokens={num_cached}, "
                f"len(token_ids)={len(token_ids)}]"
            )
        if not self.can_allocate(token_ids, num_tokens, reuse):
            raise OutOfBlocksError(
                f"allocating {num_tokens} tokens needs more than the "
                f"{self.num_free_blocks} free blocks; check can_allocate() first"
            )
        for b in cached_ids:
            if self._ref_counts[b] == 0:
                del self._free_queue[b]
            self._ref_counts[b] += 1
        own = list(cached_ids)
        table.block_ids.extend(cached_ids)
        table.num_committed_blocks = len(cached_ids)
        table.last_hash = last_hash
        self._tables[id(table)] = (table, own)
        self._append_fresh(table, own, self._num_blocks_for(num_tokens) - len(cached_ids))
        self._check()
        return num_cached

    def grow(
        self, table: BlockTable, num_tokens: int, write_from: int | None = None
    ) -> list[tuple[int, int]]:
        """Blocks for `num_tokens` tokens. `write_from`: the first position the coming step writes; if
        the block holding it is shared (a fork), it is swapped for a fresh copy first. Returns the block
        copies (src, dst) the cache must make before that step writes (empty unless one was shared)."""
        own = self._own_copy(table, "grow")
        must_copy = self._must_copy(table, write_from)
        num_new = max(0, self._num_blocks_for(num_tokens) - len(table.block_ids))
        if num_new + must_copy > self.num_free_blocks:
            raise OutOfBlocksError(
                f"growing to {num_tokens} tokens needs {num_new + must_copy} new blocks but "
                f"{self.num_free_blocks} are free; check can_grow() first"
            )
        copies = []
        if must_copy:
            assert write_from is not None
            i = write_from // self.block_size
            assert i >= table.num_committed_blocks, "a committed block is never written"
            src = table.block_ids[i]
            dst, _ = self._free_queue.popitem(last=False)
            self._evict_hash(dst)
            self._ref_counts[dst] = 1
            self._ref_counts[src] -= 1  # still held by the tables it is shared with
            table.block_ids[i] = own[i] = dst
            copies.append((src, dst))
        self._append_fresh(table, own, num_new)
        self._check()
        return copies

    def fork(self, parent: BlockTable, child: BlockTable) -> None:
        """`child` (fresh, empty) shares every block of live `parent`; their next writes copy on write."""
        parent_own = self._own_copy(parent, "fork")
        if child.block_ids or id(child) in self._tables:
            raise ValueError("fork() needs a fresh, empty BlockTable for the child")
        for b in parent_own:
            self._ref_counts[b] += 1
        child.block_ids.extend(parent_own)
        child.num_committed_blocks = parent.num_committed_blocks
        child.last_hash = parent.last_hash
        self._tables[id(child)] = (child, list(parent_own))
        self._check()

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        self._own_copy(table, "commit")
        if num_computed_tokens > min(len(token_ids), len(table.block_ids) * self.block_size):
            raise ValueError(
                f"num_computed_tokens ({num_computed_tokens}) exceeds the sequence "
                f"({len(token_ids)} tokens) or its {len(table.block_ids)} blocks"
            )
        if not self.enable_prefix_caching:
            return
        bs, parent = self.block_size, table.last_hash
        for i in range(table.num_committed_blocks, num_computed_tokens // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            if parent not in self._hash_to_block:  # a duplicate keeps its own block, unregistered
                block_id = table.block_ids[i]
                self._hash_to_block[parent] = block_id
                self._block_hashes[block_id] = parent
            table.num_committed_blocks = i + 1
        table.last_hash = parent
        self._check()

    def free(self, table: BlockTable) -> None:
        if self._tables.pop(id(table), None) is None:
            if table.block_ids:
                raise ValueError("free() of a BlockTable this manager did not allocate")
            return  # never allocated, or already freed: nothing to drop
        for b in reversed(table.block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free_queue[b] = None
        table.block_ids.clear()
        table.num_committed_blocks = 0
        table.last_hash = _ROOT_HASH
        self._check()

    # ---- internals ----

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, token_ids: Sequence[int], reuse: bool = True) -> tuple[list[int], BlockHash]:
        """Leading cached blocks of token_ids (never all of it) and the last one's hash; none where
        `reuse` is False (a sequence whose prompt's logprobs must be computed token by token)."""
        block_ids: list[int] = []
        parent = _ROOT_HASH
        if not self.enable_prefix_caching or not reuse:
            return block_ids, parent
        bs = self.block_size
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
            parent = h
        return block_ids, parent

    def _must_copy(self, table: BlockTable, write_from: int | None) -> int:
        """1 if the block holding position `write_from` is shared with another table, else 0."""
        if write_from is None:
            return 0
        i = write_from // self.block_size
        return int(i < len(table.block_ids) and self._ref_counts[table.block_ids[i]] > 1)

    def _evict_hash(self, block_id: int) -> None:
        evicted = self._block_hashes[block_id]
        if evicted is not None:
            del self._hash_to_block[evicted]
            self._block_hashes[block_id] = None

    def _append_fresh(self, table: BlockTable, own: list[int], num_new: int) -> None:
        """The `num_new` least recently freed blocks, in ascending id order: the same blocks LRU evicts,
        laid out for reading. A freed sequence's blocks return in reverse (above), so without the sort
        the next prompt would take them descending, and reading K/V block by block backwards through
        memory defeats the CPU's prefetcher (`python -m benchmarks.decode_attention --placement`)."""
        fresh = sorted(self._free_queue.popitem(last=False)[0] for _ in range(max(0, num_new)))
        for block_id in fresh:
            self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
        table.block_ids.extend(fresh)
        own.extend(fresh)

    def _own_copy(self, table: BlockTable, op: str) -> list[int]:
        entry = self._tables.get(id(table))
        if entry is None:
            raise ValueError(f"{op}() of a BlockTable that is not live; allocate() it first")
        return entry[1]

    def _check(self) -> None:
        if not self.debug:
            return
        holders = [0] * self.num_blocks
        for table, own in self._tables.values():
            assert table.block_ids == own, f"table changed outside the manager: {table.block_ids} != {own}"
            assert len(set(own)) == len(own), f"a table holds a block twice: {own}"
            assert 0 <= table.num_committed_blocks <= len(own), f"more committed than held: {table}"
            for b in own:
                holders[b] += 1
        for b, ref in enumerate(self._ref_counts):
            queued = b in self._free_queue
            assert ref == holders[b], f"block {b}: ref count {ref} but {holders[b]} live tables hold it"
            assert (ref == 0) == queued, f"block {b}: ref count {ref} but in free queue = {queued}"
            h = self._block_hashes[b]
            assert h is None or self._hash_to_block.get(h) == b, f"block {b}: its hash maps elsewhere"
        for h, b in self._hash_to_block.items():
            assert self._block_hashes[b] == h, f"a hash maps to block {b}, whose stored hash differs"
        assert self.enable_prefix_caching or not self._hash_to_block, "hashes with prefix caching off"
        assert self.num_free_blocks == holders.count(0), "num_free_blocks != number of ref-0 blocks"
