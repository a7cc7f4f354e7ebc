"""What a worker actually built: its KV cache, scheduler and every fallback, and how to show it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpact.shared.intent import CacheDtype, Fallback, PagedBackend
from kvpact.shared.scheduler_choice import CacheKind, SchedulerKind


@dataclass(frozen=True, slots=True)
class RealizedCache:
    kind: CacheKind
    scheduler: SchedulerKind
    max_model_len: int
    capacity_tokens: int
    max_concurrency: int  # sequences of max_model_len that fit at once
    num_blocks: int  # PAGED: blocks in the pool; EAGER: slots
    memory_bytes: int
    cache_dtype: CacheDtype
    backend: PagedBackend | None = None  # PAGED only
    block_size: int = 0  # PAGED only
    prefix_caching: bool = False
    fallbacks: tuple[Fallback, ...] = field(default_factory=tuple)

    def table(self, title: str = "realized KV cache") -> str:
        """A small readable table, logged once at startup and printed by `make serve` (shared/describe.py)."""
        from kvpact.shared.describe import realized_table

        return realized_table(self, title)
