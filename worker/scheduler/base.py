"""The interface both schedulers implement, and the queues they share.

The engine drives a scheduler like this, one step at a time, from its single thread:

    scheduler.add_group(seqs)           # a request's n sequences (n = 1 mostly)
    out = scheduler.schedule()          # reserves cache for every chunk in `out`
    ... run the model on out.chunks (first copying their block_copies), sample ...
    scheduler.on_step_done(out)         # the chunks' K/V are now computed
    scheduler.finish(seq)               # for each finished or aborted sequence: frees its cache

Invariants: a sequence is in exactly one of `waiting` (FIFO; preempted sequences re-enter at the
front) and `running` (admission order, oldest first) until `finish`; only running sequences hold
cache; `schedule()` never returns more than `max_num_batched_tokens` tokens or `max_num_seqs`
running sequences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from kvpact.worker.engine.sequence import ScheduledChunk, Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_preempted: int = 0  # sequences preempted while building this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler(ABC):
    def __init__(
        self, max_num_seqs: int, max_num_batched_tokens: int, prompt_tokens_beside_decodes: int | None = None
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens ({max_num_batched_tokens}) "
                "must be >= 1"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prompt_tokens_beside_decodes = (
            prompt_tokens_beside_decodes  # sizing.DeviceDefaults' (None: no bound)
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at a sequence's first admission, and those it served
        # (the paged scheduler with prefix caching counts them; the heartbeat carries them to the router).
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    def prompt_allowance(self) -> int:
        """Prompt tokens this step may carry: the whole budget, or, while a running sequence decodes, at
        most prompt_tokens_beside_decodes (each decode waits for the whole step)."""
        cap = self.prompt_tokens_beside_decodes
        if cap is None or not any(s.num_uncomputed_tokens == 1 for s in self.running):
            return self.max_num_batched_tokens
        return min(cap, self.max_num_batched_tokens)

    # ---- queues ----

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        self.waiting.append(seq)

    def add_group(self, seqs: list[Sequence]) -> None:
        """The n sequences of one request (index order). Here: n independent sequences, each prefilling
        its own copy of the prompt (the eager cache cannot share); the paged scheduler forks instead."""
        for seq in seqs:
            self.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from its queue and free its cache (idempotent)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def on_step_done(self, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            for seq in (chunk.seq, *chunk.forks):
                seq.num_computed_tokens = chunk.end
                self._computed(seq)

    # ---- what a cache kind adds ----

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def _release(self, seq: Sequence) -> None:
        """Free the cache a running sequence holds."""

    def _computed(self, seq: Sequence) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook after a sequence's chunk was computed (the paged scheduler registers full blocks)."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    @abstractmethod
    def num_total_blocks(self) -> int: ...

    # ---- shared helpers ----

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.num_admissions += 1
        self.running.append(seq)
