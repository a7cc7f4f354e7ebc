"""KV caches. Each cache builds, per step, the `AttentionStep` the model calls in every layer
(worker/engine/attention.py): `eager.EagerCache` (contiguous per-slot regions) and `paged.PagedCache`
(block pools with the torch or Triton backend). `sizing` turns budgets and flags into their sizes.

Both take a step's chunks in the model runner's flat order: the `num_decodes` one-token chunks
first, then the longer (prefill / extend) chunks.
"""

from __future__ import annotations

from typing import Protocol

from kvpact.shared.scheduler_choice import CacheKind
from kvpact.worker.engine.attention import AttentionStep
from kvpact.worker.engine.sequence import ScheduledChunk


class KVCache(Protocol):
    kind: CacheKind
    kernels: str  # which attention kernels run, and why not faster ones (logged at startup)

    @property
    def memory_bytes(self) -> int: ...

    def attention_step(self, chunks: list[ScheduledChunk], num_decodes: int) -> AttentionStep: ...
