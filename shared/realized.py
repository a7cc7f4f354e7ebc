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
        """A small readable table, logged once at startup and printed by `make serve`."""
        rows = [
            ("kind", self.kind.value.upper()),
            ("backend", self.backend.value if self.backend else "eager (contiguous per slot)"),
            ("scheduler", self.scheduler.value),
            ("cache dtype", self.cache_dtype.value),
            ("max model len", str(self.max_model_len)),
        ]
        if self.kind is CacheKind.PAGED:
            rows += [
                ("block size", str(self.block_size)),
                ("blocks", str(self.num_blocks)),
                ("prefix caching", "on" if self.prefix_caching else "off"),
            ]
        else:
            rows.append(("slots", str(self.num_blocks)))
        rows += [
            ("capacity", f"{self.capacity_tokens} tokens"),
            ("max concurrency", f"{self.max_concurrency} x {self.max_model_len} tokens"),
            ("memory", f"{self.memory_bytes / 2**20:.1f} MiB"),
        ]
        rows += [(f"fallback ({f.component})", f.reason) for f in self.fallbacks]
        width = max(len(k) for k, _ in rows)
        lines = [title, "-" * len(title)] + [f"{k.ljust(width)}  {v}" for k, v in rows]
        return "\n".join(lines)
