"""Schedulers: which sequences run in the next step, and how many of their tokens.

`base.Scheduler` is the interface the engine drives; `eager.EagerScheduler` batches over eager
slots, `paged.PagedScheduler` over a block pool. `kvpact.shared.scheduler_choice.select_scheduler` picks one
from the cache that was actually built.

The package re-exports nothing: `kvpact.worker.engine.sequence` imports `block_manager.BlockTable`, and
an eager import of `base` here (which imports `sequence`) would close an import loop.
"""
