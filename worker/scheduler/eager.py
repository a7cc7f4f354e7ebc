"""Slot-based continuous batching over the eager cache (the EagerScheduler).

Each running sequence owns one slot: a contiguous K/V region reserved at max_model_len, so a running
sequence never runs out of cache and nothing is ever preempted. A request waits for a free slot and
joins the running batch in the next step after one frees.
"""

from __future__ import annotations

from collections import deque

from kvpact.worker.engine.sequence import ScheduledChunk, Sequence
from kvpact.worker.scheduler.base import Scheduler, SchedulerOutput


class EagerScheduler(Scheduler):
    def __init__(
        self, num_slots: int, max_num_batched_tokens: int, prompt_tokens_beside_decodes: int | None = None
    ) -> None:
        super().__init__(num_slots, max_num_batched_tokens, prompt_tokens_beside_decodes)
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    def schedule(self) -> SchedulerOutput:
        # Algorithm (one step):
        # 1. Running sequences, oldest first, each take their uncomputed tokens (1 while decoding; the
        #    rest of the prompt while prefilling, cut to what is left of the token budget).
        # 2. While a slot is free and budget is left, the head of `waiting` takes the slot and starts
        #    its prompt (chunked to the budget). FIFO: nobody overtakes the head.
        # Prompt tokens (1 and 2) are at most prompt_allowance(): fewer while a sequence decodes.
        out = SchedulerOutput()
        budget, prompt = self.max_num_batched_tokens, self.prompt_allowance()
        for seq in self.running:
            if budget == 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1:  # a prompt chunk
                n = min(n, prompt)
                prompt -= n
                if n == 0:
                    continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        budget = min(budget, prompt)
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            self._start_running(seq)
            n = min(seq.num_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, 0, n))
            budget -= n
        return out

    def _release(self, seq: Sequence) -> None:
        assert seq.slot is not None
        self.free_slots.append(seq.slot)
        seq.slot = None
        seq.num_computed_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_slots)

    @property
    def num_total_blocks(self) -> int:
        return self.num_slots
