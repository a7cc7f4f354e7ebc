"""What a worker actually built: its KV cache, scheduler and every fallback. Data only: how it is shown is
kvpact.shared.describe's (`describe_realized`, `realized_table`), which imports this, never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpact.shared.features import FeatureState
from kvpact.shared.intent import CacheDtype, Fallback, PagedBackend
from kvpact.shared.reasons import PREFIX_CACHING
from kvpact.shared.scheduler_choice import CacheKind


@dataclass(frozen=True, slots=True)
class RealizedCache:
    kind: CacheKind
    max_model_len: int
    capacity_tokens: int
    max_concurrency: int  # sequences of max_model_len that fit at once
    num_blocks: int  # PAGED: blocks in the pool; EAGER: slots
    memory_bytes: int
    cache_dtype: CacheDtype
    backend: PagedBackend | None = None  # PAGED only
    block_size: int = 0  # PAGED only
    fallbacks: tuple[Fallback, ...] = field(default_factory=tuple)  # paged-attn's, in the order taken
    features: tuple[FeatureState, ...] = field(default_factory=tuple)  # every feature, as built
    tensor_parallel_size: int = 1  # ranks, each holding the KV of its own heads (the same kind on all)
    rank_devices: tuple[str, ...] = ()  # each rank's device, rank order (empty: not reported)

    @property
    def scheduler(self) -> str:
        """The scheduler that runs over this cache: it follows the cache one to one (select_scheduler)."""
        return "paged" if self.kind is CacheKind.PAGED else "default"

    @property
    def prefix_caching(self) -> bool:
        """Whether the worker serves from a prefix cache: derived from `features`, never stored."""
        return any(f.name == PREFIX_CACHING and f.realized for f in self.features)
