"""Schedulers: which sequences run in the next step, and how many of their tokens.

`base.Scheduler` is the interface the engine drives; `eager.EagerScheduler` batches over eager
slots, `paged.PagedScheduler` over a block pool. `kvpact.shared.scheduler_choice.select_scheduler` picks one
from the cache that was actually built.
"""

from kvpact.worker.scheduler.base import Scheduler, SchedulerOutput
from kvpact.worker.scheduler.eager import EagerScheduler
from kvpact.worker.scheduler.paged import PagedScheduler

__all__ = ["EagerScheduler", "PagedScheduler", "Scheduler", "SchedulerOutput"]
