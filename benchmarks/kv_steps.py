"""What the KV cache holds after every engine step, read on the engine's own step thread.

`StepLog.attach(engine)` wraps the engine's `scheduler.on_step_done` (benchmarks only: the product has
no such hook) so that, right after each step's K/V were written, one `StepSample` records:

    running, waiting       sequences in the scheduler's queues
    blocks_in_use          PAGED: pool blocks referenced by a live table; EAGER: occupied slots
    allocated_tokens       PAGED: blocks_in_use x block_size; EAGER: every slot x max_model_len (the
                           eager cache reserves all of it up front, occupied or not)
    tokens_held            token positions whose K/V is in the cache: PAGED counts each block once
                           (a prefix block shared by several sequences holds its tokens once), filled
                           up to each holder's computed tokens; EAGER sums the running sequences'
                           computed tokens
    preemptions            the scheduler's running total

At that point every running sequence's cache covers exactly its computed tokens (the scheduler grew it
for the step's chunk, and the chunk is now computed), so `tokens_held / allocated_tokens` is the
fraction of allocated KV memory holding real tokens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvpact.worker.engine.engine import Engine
from kvpact.worker.scheduler.paged import PagedScheduler


@dataclass(frozen=True, slots=True)
class StepSample:
    t: float  # seconds since the log was attached
    running: int
    waiting: int
    blocks_in_use: int
    allocated_tokens: int
    tokens_held: int
    preemptions: int

    @property
    def fraction(self) -> float:
        return self.tokens_held / self.allocated_tokens if self.allocated_tokens else 0.0


@dataclass(slots=True)
class StepLog:
    samples: list[StepSample] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started: float = field(default_factory=time.monotonic)

    @classmethod
    def attach(cls, engine: Engine, max_model_len: int) -> StepLog:
        """Call before the first request: the sample runs on the step thread after every step."""
        log = cls()
        scheduler = engine.step_loop.scheduler
        done = scheduler.on_step_done

        def on_step_done(out: Any) -> None:
            done(out)
            sample = log._sample(scheduler, max_model_len)
            with log._lock:
                log.samples.append(sample)

        scheduler.on_step_done = on_step_done  # type: ignore[method-assign]
        return log

    def snapshot(self) -> list[StepSample]:
        with self._lock:
            return list(self.samples)

    def _sample(self, scheduler: Any, max_model_len: int) -> StepSample:
        running = scheduler.running
        if isinstance(scheduler, PagedScheduler):
            bm = scheduler.block_manager
            bs = bm.block_size
            filled: dict[int, int] = {}
            for seq in running:
                computed = seq.num_computed_tokens
                for i, block in enumerate(seq.block_table.block_ids):
                    n = min(bs, max(0, computed - i * bs))
                    if n > filled.get(block, 0):
                        filled[block] = n
            in_use = bm.num_blocks - bm.num_free_blocks
            allocated = in_use * bs
            held = sum(filled.values())
        else:
            in_use = len(running)
            allocated = scheduler.num_total_blocks * max_model_len
            held = sum(seq.num_computed_tokens for seq in running)
        return StepSample(
            t=time.monotonic() - self._started,
            running=len(running),
            waiting=len(scheduler.waiting),
            blocks_in_use=in_use,
            allocated_tokens=allocated,
            tokens_held=held,
            preemptions=scheduler.num_preemptions,
        )


def paged_peak(samples: list[StepSample]) -> StepSample:
    """The step with the most blocks in use; of those, the one whose real-token fraction is lowest
    (the conservative reading when the pool stays full for many steps)."""
    most = max(s.blocks_in_use for s in samples)
    return min((s for s in samples if s.blocks_in_use == most), key=lambda s: s.fraction)


def eager_peak(samples: list[StepSample]) -> StepSample:
    """The step holding the most tokens (the eager cache's allocation never changes, so this is its
    best fraction: the generous reading for the cache being compared against)."""
    return max(samples, key=lambda s: s.tokens_held)
