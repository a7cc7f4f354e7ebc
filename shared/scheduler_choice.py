"""The final backstop: pick the scheduler from what was actually built, not from what was asked.

The scheduler follows the cache one to one (a paged cache runs the paged scheduler, any other the default
one), so its kind is the cache's kind: `RealizedCache.scheduler` derives its name, nothing stores it."""

from __future__ import annotations

import enum

from kvpact.shared.errors import PagedAttentionRequiredError
from kvpact.shared.intent import CacheIntent
from kvpact.shared.reasons import NOT_PAGED_CACHE


class CacheKind(enum.Enum):
    PAGED = "paged"
    EAGER = "eager"


def select_scheduler(requested: CacheIntent, realized: CacheKind | None) -> CacheKind:
    """The kind of scheduler to run: required + paged cache -> paged; required + anything else -> error
    (never a silent default scheduler); not required -> whichever cache was realized (`None` = no KV cache
    at all)."""
    if realized is CacheKind.PAGED:
        return CacheKind.PAGED
    if requested.required:
        built = "no KV cache" if realized is None else f"an {realized.value} KV cache"
        raise PagedAttentionRequiredError(NOT_PAGED_CACHE.message(built=built), NOT_PAGED_CACHE.component)
    return CacheKind.EAGER
