"""worker.scheduler: which chunks each step runs, driven without a model (a step "samples" token 0).

Exact outcomes: chunk (request, start, num_tokens) lists, block ids, preemption order, queues.
"""

from __future__ import annotations

import torch

from kvpact.worker.engine.request import SamplingParams
from kvpact.worker.engine.sequence import Sequence, SequenceStatus
from kvpact.worker.scheduler.base import Scheduler
from kvpact.worker.scheduler.block_manager import BlockManager
from kvpact.worker.scheduler.eager import EagerScheduler
from kvpact.worker.scheduler.paged import PagedScheduler


def seq(name: str, num_prompt: int, max_tokens: int = 100, first_token: int = 10) -> Sequence:
    prompt = list(range(first_token, first_token + num_prompt))
    return Sequence.create(
        0, name, prompt, SamplingParams(temperature=0), max_tokens, frozenset(), torch.device("cpu")
    )


def step(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule, "run" (every sampling chunk appends token 0), finish sequences at max_tokens."""
    out = scheduler.schedule()
    scheduler.on_step_done(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.seq.append_token(0, None)
            if chunk.seq.check_stop_token() is not None:
                scheduler.finish(chunk.seq)
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


# ---- default (slot) scheduler ----


def test_eager_scheduler_admits_into_free_slots_fifo_and_batches_decodes():
    s = EagerScheduler(num_slots=2, max_num_batched_tokens=100)
    a, b, c = seq("a", 5, max_tokens=2), seq("b", 3, max_tokens=3), seq("c", 4)
    for x in (a, b, c):
        s.add(x)
    assert step(s) == [("a", 0, 5), ("b", 0, 3)]  # c waits: no free slot
    assert (a.slot, b.slot, s.num_free_blocks) == (0, 1, 0)
    assert step(s) == [("a", 5, 1), ("b", 3, 1)]  # a reaches max_tokens=2 and frees slot 0
    assert a.is_finished and s.num_free_blocks == 1
    assert step(s) == [("b", 4, 1), ("c", 0, 4)]  # c joins the running batch in slot 0
    assert c.slot == 0 and b.is_finished


def test_eager_scheduler_chunks_prompts_to_the_token_budget():
    s = EagerScheduler(num_slots=4, max_num_batched_tokens=8)
    a, b = seq("a", 20), seq("b", 3)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 8)]  # budget spent on a's first chunk; b waits for budget, not a slot
    assert step(s) == [("a", 8, 8)]
    assert step(s) == [("a", 16, 4), ("b", 0, 3)]
    assert step(s) == [("a", 20, 1), ("b", 3, 1)]


def test_eager_scheduler_abort_frees_the_slot_and_waiting_aborts_leave_the_queue():
    s = EagerScheduler(num_slots=1, max_num_batched_tokens=100)
    a, b = seq("a", 4), seq("b", 4)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b)  # waiting
    s.finish(a)  # running
    assert (s.num_free_blocks, list(s.waiting), s.running, s.has_work()) == (1, [], [], False)
    assert a.status is SequenceStatus.FINISHED and a.slot is None


def test_eager_scheduler_carries_fewer_prompt_tokens_while_a_sequence_decodes():
    """prompt_tokens_beside_decodes (the CPU default): a step with no decode takes the whole budget, one
    with decodes at most that many prompt tokens, every decode still in it."""
    s = EagerScheduler(num_slots=4, max_num_batched_tokens=100)
    s.prompt_tokens_beside_decodes = 4
    a, b, c = seq("a", 20), seq("b", 10, first_token=50), seq("c", 3, first_token=70)
    s.add(a)
    assert step(s) == [("a", 0, 20)]  # alone: one chunk
    s.add(b)
    s.add(c)
    assert step(s) == [("a", 20, 1), ("b", 0, 4)]  # a decodes: 4 prompt tokens; c waits for them
    assert step(s) == [("a", 21, 1), ("b", 4, 4)]
    assert step(s) == [("a", 22, 1), ("b", 8, 2), ("c", 0, 2)]


# ---- paged scheduler ----


def paged(
    num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, budget: int = 100, prefix: bool = True
):
    return PagedScheduler(BlockManager(num_blocks, block_size, prefix, debug=True), max_num_seqs, budget)


def test_paged_scheduler_takes_blocks_one_step_at_a_time():
    s = paged(num_blocks=8)
    a = seq("a", 6)
    s.add(a)
    assert step(s) == [("a", 0, 6)]
    assert a.block_table.block_ids == [0, 1]
    step(s)  # position 6 fits block 1
    step(s)  # position 7 fits block 1
    assert a.block_table.block_ids == [0, 1]
    step(s)  # position 8 needs a third block
    assert a.block_table.block_ids == [0, 1, 2] and s.num_free_blocks == 5


def test_paged_scheduler_mixes_decodes_and_prefill_chunks_under_the_token_budget():
    s = paged(num_blocks=32, budget=6)
    a, b = seq("a", 3), seq("b", 10, first_token=50)
    s.add(a)
    assert step(s) == [("a", 0, 3)]
    s.add(b)
    assert step(s) == [("a", 3, 1), ("b", 0, 5)]
    assert step(s) == [("a", 4, 1), ("b", 5, 5)]
    assert step(s) == [("a", 5, 1), ("b", 10, 1)]


def test_paged_scheduler_carries_fewer_prompt_tokens_while_a_sequence_decodes():
    s = paged(num_blocks=32, budget=100)
    s.prompt_tokens_beside_decodes = 4
    a, b, c = seq("a", 10), seq("b", 10, first_token=50), seq("c", 9, first_token=70)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 10), ("b", 0, 10)]  # no decode yet: a burst's first step, whole budget
    s.add(c)
    assert step(s) == [("a", 10, 1), ("b", 10, 1), ("c", 0, 4)]
    assert step(s) == [("a", 11, 1), ("b", 11, 1), ("c", 4, 4)]
    assert step(s) == [("a", 12, 1), ("b", 12, 1), ("c", 8, 1)]  # c's last prompt token samples
    s.prompt_tokens_beside_decodes = None  # an explicit --max-num-batched-tokens: no separate bound
    d = seq("d", 30, first_token=90)
    s.add(d)
    assert step(s)[-1] == ("d", 0, 30)


def test_paged_scheduler_admits_only_when_the_whole_prompt_fits():
    s = paged(num_blocks=4, block_size=4)
    a, b = seq("a", 9), seq("b", 8, first_token=50)  # a: 3 blocks; b: 2 blocks, only 1 left
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 9)]
    assert list(s.waiting) == [b] and s.num_free_blocks == 1


def test_paged_scheduler_respects_max_num_seqs():
    s = paged(num_blocks=64, max_num_seqs=2)
    for name in "abc":
        s.add(seq(name, 2, first_token=ord(name)))
    assert [c[0] for c in step(s)] == ["a", "b"]
    assert [x.request_id for x in s.waiting] == ["c"]


def test_paged_preemption_frees_the_newest_requeues_it_first_and_recomputes_its_tokens():
    s = paged(num_blocks=4, block_size=4, prefix=False)
    a, b, c = seq("a", 4, max_tokens=3), seq("b", 4, first_token=30), seq("c", 4, first_token=60)
    d = seq("d", 8, first_token=90)
    for x in (a, b, c, d):
        s.add(x)
    assert step(s) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]  # 3 blocks; d (2 blocks) does not fit
    # a and b both need a second block for position 4: a takes the free one, b preempts c (the newest)
    assert step(s) == [("a", 4, 1), ("b", 4, 1)]
    assert s.num_preemptions == 1
    assert [x.request_id for x in s.waiting] == ["c", "d"]  # c went back to the FRONT
    assert c.status is SequenceStatus.WAITING
    assert (c.num_computed_tokens, c.block_table.block_ids) == (0, [])
    assert c.token_ids == [60, 61, 62, 63, 0]  # its generated token is kept
    assert step(s) == [("a", 5, 1), ("b", 5, 1)]  # a reaches max_tokens and frees 2 blocks
    assert a.is_finished and s.num_free_blocks == 2
    # c is readmitted ahead of d and recomputes prompt + generated token as one 5-token prefill
    assert step(s) == [("b", 6, 1), ("c", 0, 5)]
    assert c.num_admissions == 2 and list(s.waiting) == [d]


def test_paged_preemption_of_the_scheduled_sequence_itself_ends_the_pass():
    s = paged(num_blocks=4, block_size=4, prefix=False)
    a, b = seq("a", 4), seq("b", 8, first_token=30)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 4), ("b", 0, 8)]  # 3 of 4 blocks
    # a takes the last block; b needs a third one, and the newest running sequence is b itself
    assert step(s) == [("a", 4, 1)]
    assert s.num_preemptions == 1 and list(s.waiting) == [b] and s.running == [a]
    assert s.num_free_blocks == 2


def test_paged_prefix_cache_hit_skips_the_cached_blocks():
    s = paged(num_blocks=16, block_size=4)
    first = seq("first", 14, max_tokens=1)
    s.add(first)
    step(s)  # computes 14 tokens (3 full blocks committed), samples, finishes: blocks freed but cached
    assert first.is_finished and s.num_free_blocks == 16
    second = seq("second", 14, max_tokens=1)  # same 14 prompt tokens
    s.add(second)
    assert step(s) == [("second", 12, 2)]
    assert second.num_cached_tokens == 12
    # What the heartbeat carries (WorkerLoad.prefix_cache_queries / _hits): prompt tokens looked up, served.
    assert (s.num_prefix_queries, s.num_prefix_hits) == (28, 12)


def test_without_prefix_caching_nothing_is_looked_up():
    s = paged(num_blocks=16, block_size=4, prefix=False)
    for name in ("first", "second"):
        s.add(seq(name, 14, max_tokens=1))
        step(s)
    assert (s.num_prefix_queries, s.num_prefix_hits) == (0, 0)


# ---- n > 1: forks ----


def group(name: str, num_prompt: int, n: int, max_tokens: int = 100) -> list[Sequence]:
    prompt = list(range(10, 10 + num_prompt))
    return [
        Sequence.create(
            i,
            name,
            prompt,
            SamplingParams(temperature=0),
            max_tokens,
            frozenset(),
            torch.device("cpu"),
            index=i,
        )
        for i in range(n)
    ]


def test_paged_n_prefills_once_forks_at_the_prompt_end_and_copies_the_partial_block_on_write():
    bm = BlockManager(num_blocks=16, block_size=4, debug=True)
    s = PagedScheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = group("r", 6, n=4)
    s.add_group(seqs)
    assert list(s.waiting) == [seqs[0]] and seqs[0].pending_forks == seqs[1:]
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.forks) == (0, 6, tuple(seqs[1:]))  # one prefill, 4 samplers
    assert [x.block_table.block_ids for x in seqs] == [[0, 1]] * 4 and bm.num_free_blocks == 14
    s.on_step_done(out)
    for x in seqs:
        x.append_token(20 + x.index, None)
    out = s.schedule()
    # every one decodes position 6, in shared block 1: the first three copy it, the last writes in place
    assert [(c.seq.index, c.start, c.num_tokens) for c in out.chunks] == [
        (0, 6, 1),
        (1, 6, 1),
        (2, 6, 1),
        (3, 6, 1),
    ]
    assert [c.block_copies for c in out.chunks] == [((1, 2),), ((1, 3),), ((1, 4),), ()]
    assert [x.block_table.block_ids for x in seqs] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert bm.num_free_blocks == 11  # 4 sequences of 7 tokens: 5 blocks, not 8
    for x in seqs:
        s.finish(x)
    assert bm.num_free_blocks == 16


def test_paged_n_waits_for_seats_for_all_its_completions_and_an_abort_before_the_fork_frees_all():
    bm = BlockManager(num_blocks=16, block_size=4, debug=True)
    s = PagedScheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    other = seq("other", 3)
    s.add(other)
    seqs = group("r", 10, n=4)
    s.add_group(seqs)
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["other"]  # 1 + 4 seats > 4: r waits
    s.finish(other)
    out = s.schedule()
    assert [(c.seq.index, c.start, c.num_tokens, c.forks) for c in out.chunks] == [(0, 0, 4, ())]  # a chunk
    for x in seqs:  # aborted mid-prefill, index order
        s.finish(x)
    assert bm.num_free_blocks == 16 and not s.running and not s.waiting
    assert all(x.is_finished for x in seqs)
    again = group("again", 3, n=4)  # its seats were given back: a new n=4 fits at once
    s.add_group(again)
    assert [len(c.forks) for c in s.schedule().chunks] == [3]
