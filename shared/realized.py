"""What a worker actually built: its KV cache, scheduler and every feature's state. Data only: how it is shown
is kvpact.shared.describe's (`describe_realized`, `realized_table`), which imports this, never the reverse.

NOTE: what was built of each feature is `features` (one FeatureState each, paged-attn included) and nothing
else: the cache's kind, the scheduler and paged-attn's fallbacks are properties of it (`BuiltFeatures`, shared
with the pre-load plan), never stored beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.shared.features import FeatureState
from kvpact.shared.intent import CacheDtype, Fallback, PagedBackend
from kvpact.shared.reasons import PAGED_ATTN, PREFIX_CACHING
from kvpact.shared.scheduler_choice import CacheKind


def realizes(features: tuple[FeatureState, ...], name: str) -> bool:
    """Whether `name` is realized (or planned) among `features`; a feature absent is not."""
    return any(f.name == name and f.realized for f in features)


class BuiltFeatures:
    """The views of `features` that a realized cache and a pre-load plan both give (declared once, here)."""

    __slots__ = ()
    features: tuple[FeatureState, ...]

    def _check_features(self) -> None:
        if not any(f.name == PAGED_ATTN for f in self.features):
            raise ValueError(
                f"{type(self).__name__}: features must hold paged-attn's state, got {self.features}"
            )

    def feature(self, name: str) -> FeatureState | None:
        return next((f for f in self.features if f.name == name), None)

    def realizes(self, name: str) -> bool:
        return realizes(self.features, name)

    @property
    def kind(self) -> CacheKind:
        """PAGED exactly when paged-attn is realized (the cache is the feature)."""
        return CacheKind.PAGED if self.realizes(PAGED_ATTN) else CacheKind.EAGER

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """paged-attn's fallback, if it took one (asked auto, realized off): the door takes at most one."""
        s = self.feature(PAGED_ATTN)
        return (Fallback(s.component, s.message, s.code),) if s is not None and s.fell_back else ()


@dataclass(frozen=True, slots=True)
class RealizedCache(BuiltFeatures):
    max_model_len: int
    capacity_tokens: int
    max_concurrency: int  # sequences of max_model_len that fit at once
    num_blocks: int  # PAGED: blocks in the pool; EAGER: slots
    memory_bytes: int
    cache_dtype: CacheDtype
    features: tuple[FeatureState, ...]  # every feature, as built (paged-attn's decides the kind)
    backend: PagedBackend | None = None  # PAGED only
    block_size: int = 0  # PAGED only
    tensor_parallel_size: int = 1  # ranks, each holding the KV of its own heads (the same kind on all)
    rank_devices: tuple[str, ...] = ()  # each rank's device, rank order (empty: not reported)

    def __post_init__(self) -> None:
        self._check_features()

    @property
    def scheduler(self) -> str:
        """The scheduler that runs over this cache: it follows the cache one to one (select_scheduler)."""
        return "paged" if self.kind is CacheKind.PAGED else "default"

    @property
    def prefix_caching(self) -> bool:
        """Whether the worker serves from a prefix cache: derived from `features`, never stored."""
        return self.realizes(PREFIX_CACHING)
