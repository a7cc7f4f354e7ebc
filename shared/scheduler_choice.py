"""The final backstop: pick the scheduler from what was actually built, not from what was asked."""

from __future__ import annotations

import enum

from kvpact.shared.errors import PagedAttentionRequiredError
from kvpact.shared.intent import CacheIntent
from kvpact.shared.reasons import NOT_PAGED_CACHE


class CacheKind(enum.Enum):
    PAGED = "paged"
    EAGER = "eager"


class SchedulerKind(enum.Enum):
    PAGED = "paged"
    DEFAULT = "default"


def select_scheduler(requested: CacheIntent, realized: CacheKind | None) -> SchedulerKind:
    """required + paged cache -> paged; required + anything else -> error (never a silent default
    scheduler); not required -> whichever cache was realized (`None` = no KV cache at all)."""
    if realized is CacheKind.PAGED:
        return SchedulerKind.PAGED
    if requested.required:
        built = "no KV cache" if realized is None else f"an {realized.value} KV cache"
        raise PagedAttentionRequiredError(NOT_PAGED_CACHE.message(built=built), NOT_PAGED_CACHE.component)
    return SchedulerKind.DEFAULT
