"""Continuous batching over a paged block pool, with chunked prefill, prefix caching and preemption.

A running sequence holds blocks for exactly the tokens computed so far plus those scheduled in this
step; blocks are taken one step at a time (`grow`), so many short sequences share a pool that could
hold only a few max_model_len ones. When the pool runs dry, the most recently admitted running
sequence is preempted: its blocks are freed, it goes back to the FRONT of `waiting` with its
generated tokens kept, and on readmission those tokens are recomputed as part of its prompt (the
prefix cache often still holds its committed blocks, so little is actually recomputed).

n > 1 completions: only index 0 queues, carrying the others in `pending_forks`, and is admitted only
with seats for all n (`max_num_seqs`). The step that computes the end of its prompt forks them: they
share its blocks (block manager `fork`), sample their first token from its logits, and join `running`
after it. Each one's first write into the shared partial block copies it (copy on write, in `grow`).
"""

from __future__ import annotations

from kvpact.worker.engine.sequence import ScheduledChunk, Sequence, SequenceStatus
from kvpact.worker.scheduler.base import Scheduler, SchedulerOutput
from kvpact.worker.scheduler.block_manager import BlockManager, BlockTable


class PagedScheduler(Scheduler):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prompt_tokens_beside_decodes: int | None = None,
    ) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, prompt_tokens_beside_decodes)
        self.block_manager = block_manager
        self._num_reserved = 0  # seats held for the pending forks of running sequences

    def add_group(self, seqs: list[Sequence]) -> None:
        head, *forks = seqs
        head.pending_forks = forks
        self.add(head)

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._num_reserved -= len(seq.pending_forks)
        seq.pending_forks = []  # index 0 ends first (abort and failure end a request in index order)
        super().finish(seq)

    def schedule(self) -> SchedulerOutput:
        # Algorithm (one step; `budget` = max_num_batched_tokens, of which `prompt` (prompt_allowance)
        # may be prompt tokens: fewer while a sequence decodes):
        # 1. Running sequences, oldest first, each take min(uncomputed tokens, budget) tokens: 1 while
        #    decoding, the next prompt chunk (also at most `prompt`) while prefilling. Before a
        #    sequence is scheduled its blocks grow to cover them; while the pool cannot, preempt the
        #    most recently admitted running sequence (possibly this one, which then ends the pass).
        # 2. Only if nobody was preempted: admit from the head of `waiting` (FIFO, nobody overtakes it)
        #    while fewer than max_num_seqs run, budget is left, and the free blocks could hold the
        #    whole of its tokens. Admission reuses cached prefix blocks (those tokens skip prefill) and
        #    allocates blocks for the first chunk only.
        #    A sequence with pending forks needs seats for all of them too.
        # 3. A chunk that completes a prompt with pending forks forks them (they join `running` after
        #    this pass). A chunk that first writes into a block it shares copies it (chunk.block_copies).
        # Decodes and prefill chunks share the step; every chunk's blocks are held when this returns.
        out = SchedulerOutput()
        bm = self.block_manager
        budget, prompt = self.max_num_batched_tokens, self.prompt_allowance()
        forked: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1:  # a prompt chunk
                n = min(n, prompt)
                prompt -= n
                if n == 0:
                    i += 1
                    continue
            while not bm.can_grow(seq.block_table, start + n, start) and seq in self.running:
                self._preempt(self.running[-1])
                out.num_preempted += 1
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: it was the newest, so nothing is left to schedule
            copies = bm.grow(seq.block_table, start + n, start)
            out.chunks.append(self._chunk(seq, start, n, forked))
            out.chunks[-1].block_copies = tuple(copies)
            budget -= n
            i += 1
        if not out.num_preempted:
            self._admit(out, min(budget, prompt), forked)
        self.running += forked
        return out

    def _admit(self, out: SchedulerOutput, budget: int, forked: list[Sequence]) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            seats = 1 + len(seq.pending_forks)
            if len(self.running) + len(forked) + self._num_reserved + seats > self.max_num_seqs:
                break
            reuse = not seq.needs_prompt_logprobs
            if not bm.can_allocate(seq.token_ids, seq.num_tokens, reuse):
                break
            num_cached = bm.num_cached_tokens(seq.token_ids, reuse)
            n = min(seq.num_tokens - num_cached, budget)
            num_cached = bm.allocate(seq.block_table, seq.token_ids, num_cached + n, reuse)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_admissions == 0:
                seq.num_cached_tokens = num_cached
                if bm.enable_prefix_caching:
                    self.num_prefix_queries += seq.num_tokens
                    self.num_prefix_hits += num_cached
            self._start_running(seq)
            self._num_reserved += len(seq.pending_forks)
            out.chunks.append(self._chunk(seq, num_cached, n, forked))
            budget -= n

    def _chunk(self, seq: Sequence, start: int, n: int, forked: list[Sequence]) -> ScheduledChunk:
        """The chunk; if it completes the prompt of a sequence with pending forks, they fork here."""
        chunk = ScheduledChunk(seq, start, n)
        if seq.pending_forks and chunk.samples:
            for fork in seq.pending_forks:
                self.block_manager.fork(seq.block_table, fork.block_table)
                fork.status = SequenceStatus.RUNNING
                fork.num_admissions += 1
                fork.num_cached_tokens = seq.num_cached_tokens
                # its prompt's logprobs (echo) are the ones this step completes: shared, never recomputed
                fork.prompt_logprobs, fork.prompt_top_logprobs = seq.prompt_logprobs, seq.prompt_top_logprobs
            chunk.forks, seq.pending_forks = tuple(seq.pending_forks), []
            self._num_reserved -= len(chunk.forks)
            forked += chunk.forks
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        self._num_reserved -= len(seq.pending_forks)  # taken again when it is admitted again
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq.block_table)
        seq.block_table = BlockTable(block_ids=[])
        seq.num_computed_tokens = 0

    def _computed(self, seq: Sequence) -> None:
        self.block_manager.commit(seq.block_table, seq.token_ids, seq.num_computed_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks
