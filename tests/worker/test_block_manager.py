"""Block manager: exact block ids, prefix-cache hits and evictions, misuse, random interleavings."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpact.worker.scheduler.block_manager import BlockManager, BlockTable, OutOfBlocksError

BS = 4


def make_manager(num_blocks: int = 8, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching, debug=True)


def run(bm: BlockManager, tokens: list[int], num_tokens: int | None = None) -> BlockTable:
    """Allocate and 'compute' a sequence's first num_tokens (default: all), committing them."""
    num_tokens = len(tokens) if num_tokens is None else num_tokens
    table = BlockTable([])
    bm.allocate(table, tokens, num_tokens)
    bm.commit(table, tokens, num_tokens)
    return table


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- exact ids ----


def test_first_and_second_sequence_get_ids_in_order():
    bm = make_manager()
    a, b = BlockTable([]), BlockTable([])
    assert bm.allocate(a, seq(0, 10), 10) == 0
    assert a.block_ids == [0, 1, 2] and bm.num_free_blocks == 5
    bm.allocate(b, seq(100, 6), 6)
    assert b.block_ids == [3, 4]
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 6
    c = run(bm, seq(200, 12))  # queue is [5, 6, 7, 2, 1, 0]: never-used blocks, then a's tail first
    assert c.block_ids == [5, 6, 7]
    d = run(bm, seq(300, 5))
    assert d.block_ids == [1, 2]  # the queue's next two (2, then 1), laid out ascending for reading


def test_a_prompt_takes_the_least_recently_freed_blocks_in_ascending_order():
    bm = make_manager()
    bm.free(run(bm, seq(0, 32)))  # every block; freed tail first: queue 7 6 5 4 3 2 1 0
    # the five least recently freed, laid out ascending: K/V read block by block runs forward in memory
    assert run(bm, seq(100, 20)).block_ids == [3, 4, 5, 6, 7]


def test_eviction_is_lru_among_cached_blocks_tail_first():
    bm = make_manager()
    a_tokens, d_tokens = seq(0, 12), seq(50, 8)
    a = run(bm, a_tokens)  # [0, 1, 2]
    d = run(bm, d_tokens)  # [3, 4]
    bm.free(a)  # queue: 5 6 7 | 2 1 0
    bm.free(d)  # queue: 5 6 7 | 2 1 0 | 4 3
    probe_a, probe_d = a_tokens + [99], d_tokens + [99]
    assert (bm.num_cached_tokens(probe_a), bm.num_cached_tokens(probe_d)) == (12, 8)
    assert run(bm, seq(100, 12)).block_ids == [5, 6, 7]  # uncached blocks first: no eviction
    assert bm.num_cached_tokens(probe_a) == 12
    assert run(bm, seq(200, 4)).block_ids == [2]  # a's tail goes first
    assert (bm.num_cached_tokens(probe_a), bm.num_cached_tokens(probe_d)) == (8, 8)
    assert run(bm, seq(300, 8)).block_ids == [0, 1]  # then a's head (laid out ascending); d survives
    assert (bm.num_cached_tokens(probe_a), bm.num_cached_tokens(probe_d)) == (0, 8)
    assert bm.num_free_blocks == 2


def test_slot_mapping():
    bm = make_manager()
    run(bm, seq(0, 20))  # takes 0..4
    t = run(bm, seq(100, 10))
    assert t.block_ids == [5, 6, 7]
    assert bm.slot_mapping(t, 2, 6) == [22, 23, 24, 25]
    assert bm.slot_mapping(t, 9, 12) == [29, 30, 31]
    assert bm.slot_mapping(t, 3, 3) == []
    with pytest.raises(ValueError, match="grow it first"):
        bm.slot_mapping(t, 10, 13)


# ---- prefix caching ----


def test_shared_three_block_prefix():
    bm = make_manager()
    prefix = seq(0, 12)
    a = run(bm, prefix + [1, 1, 1, 1, 1])  # 17 tokens -> [0, 1, 2, 3, 4]; 4 full blocks committed
    b_tokens = prefix + [2, 2, 2, 2, 2, 2]
    assert bm.num_cached_tokens(b_tokens) == 3 * BS
    b = BlockTable([])
    assert bm.allocate(b, b_tokens, len(b_tokens)) == 3 * BS
    assert b.block_ids == [0, 1, 2, 5, 6] and b.num_committed_blocks == 3
    assert [bm.ref_count(i) for i in range(8)] == [2, 2, 2, 1, 1, 1, 1, 0]
    bm.free(a)
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 0, 0, 1, 1, 0]
    assert bm.num_free_blocks == 3
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_whole_prompt_cached_computes_last_block_and_keeps_duplicate_unregistered():
    bm = make_manager()
    tokens = seq(0, 12)
    bm.free(run(bm, tokens))  # blocks 0 1 2 cached; queue 3 4 5 6 7 2 1 0
    assert bm.num_cached_tokens(tokens) == 8  # not 12: the last token's logits are needed
    b = BlockTable([])
    assert bm.allocate(b, tokens, 12) == 8
    assert b.block_ids == [0, 1, 3]  # 0 and 1 taken out of the queue's middle, 3 fresh
    bm.commit(b, tokens, 12)  # block 2 already holds this hash: 3 stays private
    assert b.num_committed_blocks == 3
    bm.free(b)  # queue 4 5 6 7 2 3 1 0
    c = BlockTable([])
    assert bm.allocate(c, tokens + [7], 13) == 12
    assert c.block_ids == [0, 1, 2, 4]


def test_reused_free_block_is_taken_before_fresh_blocks_are_popped():
    bm = make_manager(num_blocks=3)
    a_tokens = seq(0, 5)
    bm.free(run(bm, a_tokens))  # block 0 cached; queue 2 1 0
    bm.free(run(bm, seq(50, 8)))  # takes 2 1 (laid out 1 2); queue 0 2 1: cached block 0 at the front
    b_tokens = a_tokens[:4] + [9, 9, 9, 9]
    assert bm.can_allocate(b_tokens, 8)
    b = BlockTable([])
    assert bm.allocate(b, b_tokens, 8) == 4
    assert b.block_ids == [0, 2]  # 0 reused from the queue's middle, not popped (and evicted) as fresh


def test_can_allocate_counts_reused_free_blocks():
    bm = make_manager()
    tokens = seq(0, 12)
    bm.free(run(bm, tokens))
    run(bm, seq(100, 20))  # 3..7; only the cached 2 1 0 are free
    assert bm.num_free_blocks == 3
    assert bm.num_cached_tokens(tokens + [5]) == 12
    assert not bm.can_allocate(tokens + [5], 13)  # 3 reused + 1 fresh > 3 free
    assert bm.can_allocate(tokens, 12)  # 2 reused + 1 fresh
    with pytest.raises(OutOfBlocksError, match="can_allocate"):
        bm.allocate(BlockTable([]), tokens + [5], 13)
    assert bm.num_free_blocks == 3 and bm.num_cached_tokens(tokens + [5]) == 12  # nothing changed


def test_hash_is_chained_over_the_prefix():
    bm = make_manager()
    run(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.num_cached_tokens([9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0  # same 2nd block, other prefix
    assert bm.num_cached_tokens([5, 6, 7, 8, 0]) == 0  # same block, other position
    assert bm.num_cached_tokens([1, 2, 3, 4, 0, 0, 0, 0, 0]) == 4
    assert bm.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_partial_blocks_are_not_cached_until_full():
    bm = make_manager()
    tokens = seq(0, 10)
    t = run(bm, tokens, 6)  # chunked prefill: 1 full block committed
    assert (t.num_committed_blocks, bm.num_cached_tokens(tokens)) == (1, 4)
    bm.grow(t, 10)
    assert t.block_ids == [0, 1, 2]
    bm.commit(t, tokens, 10)
    assert (t.num_committed_blocks, bm.num_cached_tokens(tokens + [0])) == (2, 8)


def test_prefix_caching_off_never_hits():
    bm = make_manager(prefix_caching=False)
    tokens = seq(0, 13)
    bm.free(run(bm, tokens))
    assert bm.num_cached_tokens(tokens) == 0
    t = BlockTable([])
    assert bm.allocate(t, tokens, 13) == 0
    assert t.block_ids == [4, 5, 6, 7]
    bm.commit(t, tokens, 13)
    assert t.num_committed_blocks == 0
    bm.free(t)
    assert bm.num_free_blocks == 8


# ---- lifecycle ----


def test_decode_grow_abort_and_preempt_return_every_block():
    bm = make_manager()
    tokens = seq(0, 6)
    t = run(bm, tokens)  # [0, 1]
    for new in range(5):  # decode: grow one position per step, then commit
        tokens.append(100 + new)
        assert bm.can_grow(t, len(tokens))
        bm.grow(t, len(tokens))
        bm.commit(t, tokens, len(tokens))
    assert t.block_ids == [0, 1, 2] and t.num_committed_blocks == 2
    bm.grow(t, len(tokens))  # no-op when blocks already cover the positions
    assert t.block_ids == [0, 1, 2]
    other = run(bm, seq(500, 20), 9)  # chunked prefill in flight ...
    bm.free(other)  # ... aborted
    bm.free(t)  # preempted (recompute) ...
    assert bm.num_free_blocks == 8
    again = BlockTable([])
    assert bm.allocate(again, tokens, len(tokens)) == 8  # ... re-admitted: 2 blocks from cache
    assert again.block_ids[:2] == [0, 1]
    bm.free(again)
    bm.free(again)  # double free is a no-op on the cleared table
    assert bm.num_free_blocks == 8


def test_misuse_raises_clear_errors():
    bm = make_manager()
    t = run(bm, seq(0, 5))
    with pytest.raises(ValueError, match="fresh, empty BlockTable"):
        bm.allocate(t, seq(0, 5), 5)
    with pytest.raises(OutOfBlocksError, match="can_grow"):
        bm.grow(t, 9 * BS)
    assert not bm.can_grow(t, 9 * BS) and bm.can_grow(t, 8 * BS)
    with pytest.raises(ValueError, match="allocate\\(\\) it first"):
        bm.grow(BlockTable([]), 4)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.commit(t, seq(0, 5), 9)
    tokens = seq(0, 12)
    bm.free(run(bm, tokens))
    with pytest.raises(ValueError, match="num_cached_tokens=8"):
        bm.allocate(BlockTable([]), tokens, 4)
    with pytest.raises(ValueError, match="did not allocate"):
        bm.free(BlockTable([3]))


def test_check_catches_corruption():
    bm = make_manager()
    t = run(bm, seq(0, 9))
    t.block_ids.pop()  # a table is append-only
    with pytest.raises(AssertionError, match="changed outside the manager"):
        bm.grow(t, 9)
    bm = make_manager()
    t = run(bm, seq(0, 9))
    bm._ref_counts[7] = 1  # noqa: SLF001 - a ref without a holder
    with pytest.raises(AssertionError, match="block 7: ref count 1 but 0 live tables"):
        bm.free(t)


# ---- random interleavings ----

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0]]
PROMPTS = st.builds(
    lambda p, s: PREFIXES[p] + s, st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(0, 2), max_size=9)
).filter(bool)
NUM_TABLES = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Tables allocate, prefill in chunks, decode, get preempted and freed. A model of the KV pool
    records, per slot, the token prefix whose KV was written there; every computed position of a
    live sequence must still read back its own prefix (shared and cached blocks included)."""

    prefix_caching = True

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, enable_prefix_caching=self.prefix_caching, debug=True)
        self.tables = [BlockTable([]) for _ in range(NUM_TABLES)]
        self.tokens: list[list[int] | None] = [None] * NUM_TABLES  # None: not live
        self.computed = [0] * NUM_TABLES
        self.kv: dict[int, tuple[int, ...]] = {}

    def _compute(self, i: int, end: int) -> None:
        tokens, start = self.tokens[i], self.computed[i]
        for p, slot in enumerate(self.bm.slot_mapping(self.tables[i], start, end), start):
            self.kv[slot] = tuple(tokens[: p + 1])
        self.computed[i] = end
        self.bm.commit(self.tables[i], tokens, end)

    def _admit(self, i: int, tokens: list[int], chunk: int) -> None:
        cached = self.bm.num_cached_tokens(tokens)
        assert cached % BS == 0 and cached < len(tokens)
        assert cached == 0 or self.prefix_caching
        num_tokens = min(len(tokens), cached + chunk)
        if not self.bm.can_allocate(tokens, num_tokens):
            free_before = self.bm.num_free_blocks
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(self.tables[i], tokens, num_tokens)
            assert self.bm.num_free_blocks == free_before and not self.tables[i].block_ids
            return
        assert self.bm.allocate(self.tables[i], tokens, num_tokens) == cached
        self.tokens[i], self.computed[i] = list(tokens), cached
        self._compute(i, num_tokens)

    @rule(i=st.integers(0, NUM_TABLES - 1), tokens=PROMPTS, chunk=st.integers(1, 8))
    def allocate(self, i, tokens, chunk):
        if self.tokens[i] is None:
            self._admit(i, tokens, chunk)

    @rule(i=st.integers(0, NUM_TABLES - 1), chunk=st.integers(1, 8), sampled=st.integers(0, 2))
    def step(self, i, chunk, sampled):
        if self.tokens[i] is None:
            return
        if self.computed[i] == len(self.tokens[i]):
            self.tokens[i].append(sampled)  # decode: the sampled token's KV comes next step
        start = self.computed[i]
        end = min(len(self.tokens[i]), start + chunk)
        table = self.tables[i]
        if not self.bm.can_grow(table, end, write_from=start):
            with pytest.raises(OutOfBlocksError):
                self.bm.grow(table, end, write_from=start)
            return
        for src, dst in self.bm.grow(table, end, write_from=start):  # copy on write, as the cache does
            for k in range(BS):
                if src * BS + k in self.kv:
                    self.kv[dst * BS + k] = self.kv[src * BS + k]
        self._compute(i, end)

    @rule(i=st.integers(0, NUM_TABLES - 1), j=st.integers(0, NUM_TABLES - 1))
    def fork(self, i, j):
        """j (not live) shares i's blocks (n > 1): then both write on, each copying a shared block first."""
        if self.tokens[i] is None or self.tokens[j] is not None:
            return
        self.bm.fork(self.tables[i], self.tables[j])
        self.tokens[j], self.computed[j] = list(self.tokens[i]), self.computed[i]

    @rule(i=st.integers(0, NUM_TABLES - 1))
    def free(self, i):
        self.bm.free(self.tables[i])
        self.tokens[i] = None

    @rule(i=st.integers(0, NUM_TABLES - 1), chunk=st.integers(1, 8))
    def preempt(self, i, chunk):
        tokens = self.tokens[i]
        if tokens is not None:
            self.free(i)
            self._admit(i, tokens, chunk)

    @invariant()
    def kv_reads_back(self):
        for i, tokens in enumerate(self.tokens):
            if tokens is None:
                continue
            for p, slot in enumerate(self.bm.slot_mapping(self.tables[i], 0, self.computed[i])):
                assert self.kv[slot] == tuple(tokens[: p + 1]), f"table {i} position {p} reads stale KV"
        live = {b for i, t in enumerate(self.tables) if self.tokens[i] is not None for b in t.block_ids}
        assert self.bm.num_free_blocks + len(live) == self.bm.num_blocks

    def teardown(self):
        for table in self.tables:
            self.bm.free(table)
        assert self.bm.num_free_blocks == self.bm.num_blocks


class BlockManagerNoCacheMachine(BlockManagerMachine):
    prefix_caching = False


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerNoCacheMachine = BlockManagerNoCacheMachine.TestCase
TestBlockManagerNoCacheMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


def test_fork_shares_every_block_and_the_first_write_into_the_shared_partial_one_copies_it():
    bm = BlockManager(num_blocks=8, block_size=4, debug=True)
    parent, child, other = BlockTable([]), BlockTable([]), BlockTable([])
    tokens = list(range(100, 106))  # 6 tokens: one full block and a partial one
    bm.allocate(parent, tokens, 6)
    bm.commit(parent, tokens, 6)
    bm.fork(parent, child)
    bm.fork(parent, other)
    assert child.block_ids == other.block_ids == parent.block_ids == [0, 1]
    assert (bm.ref_count(0), bm.ref_count(1), bm.num_free_blocks) == (3, 3, 6)
    assert child.num_committed_blocks == 1  # the full block keeps its hash
    # position 6 lies in shared block 1: the child copies it first (src 1 -> fresh dst 2)
    assert bm.can_grow(child, 7, write_from=6)
    assert bm.grow(child, 7, write_from=6) == [(1, 2)]
    assert child.block_ids == [0, 2] and bm.ref_count(1) == 2
    assert bm.grow(other, 7, write_from=6) == [(1, 3)]
    # the last holder writes in place; a write into a fresh block copies nothing
    assert bm.grow(parent, 7, write_from=6) == [] and parent.block_ids == [0, 1]
    assert bm.grow(parent, 9, write_from=8) == [] and parent.block_ids == [0, 1, 4]
    assert bm.num_free_blocks == 3
    for table in (child, other, parent):
        bm.free(table)
    assert bm.num_free_blocks == 8 and bm.ref_count(0) == 0


def test_copy_on_write_needs_a_free_block_and_says_so():
    bm = BlockManager(num_blocks=2, block_size=4, debug=True)
    parent, child = BlockTable([]), BlockTable([])
    bm.allocate(parent, [1, 2, 3, 4, 5], 5)
    bm.fork(parent, child)
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(child, 6, write_from=5)
    assert bm.can_grow(child, 6)  # without a write position: no copy counted
    with pytest.raises(OutOfBlocksError):
        bm.grow(child, 6, write_from=5)
    with pytest.raises(ValueError, match="fresh, empty BlockTable"):
        bm.fork(parent, parent)
