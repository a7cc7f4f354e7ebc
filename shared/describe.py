"""How kvpact shows an intent, a realized cache and a pre-load plan: the one renderer every place uses
(the worker's startup log and `make serve`, the router's admission reasons, failure report and
ClusterStatus, the client's status table).

    describe_intent(intent)      the flags that say it: `--paged-attn on --pa-backend triton ...`
    describe_asked(intent)       short: `on (torch)`
    describe_feature_flags(f)    the other features asked other than auto: `--cuda-graphs on`
    describe_kind(x)             `a PAGED KV cache (torch backend)` / `an EAGER KV cache`
    describe_realized(realized)  one line: kind, blocks/slots, capacity, max model len, fallbacks
    describe_compact(realized)   table cells: (`PAGED torch 1456x16`, `23296 tok`)
    describe_plan(plan)          `PAGED (torch backend)` / `EAGER; fell back because ...`
    realized_table(realized)     the multi-line table (the worker's startup log, `make serve`)
    fallback_reasons(x)          `[component] reason; ...`
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvpact.shared.features import FeatureIntents, FeatureState
from kvpact.shared.intent import CacheIntent, PagedBackend
from kvpact.shared.scheduler_choice import CacheKind

if TYPE_CHECKING:
    from kvpact.shared.handshake import LoadingPlan
    from kvpact.shared.realized import RealizedCache


def describe_intent(intent: CacheIntent) -> str:
    """The intent as the worker flags that express it, e.g. `--paged-attn on --pa-backend triton`."""
    parts = [f"--paged-attn {intent.mode.value}"]
    config = intent.paged
    if config is not None:
        if config.backend.value != "auto":
            parts.append(f"--pa-backend {config.backend.value}")
        parts.append(f"--pa-block-size {config.block_size}")
        if config.context_tokens is not None:
            parts.append(f"--pa-context-tokens {config.context_tokens}")
        if config.memory_bytes is not None:
            parts.append(f"--pa-memory-bytes {config.memory_bytes}")
        if config.memory_fraction is not None:
            parts.append(f"--pa-memory-fraction {config.memory_fraction:g}")
        if config.cache_dtype.value != "auto":
            parts.append(f"--pa-cache-dtype {config.cache_dtype.value}")
    return " ".join(parts)


def describe_feature_flags(features: FeatureIntents) -> str:
    """The flags of the features asked other than auto, e.g. `--cuda-graphs on --prefix-caching off`."""
    modes = ((name, features.mode(name)) for name in features.names())
    return " ".join(f"--{name} {mode.value}" for name, mode in modes if mode.value != "auto")


def describe_asked(intent: CacheIntent) -> str:
    """The mode, and the backend when one was asked for: `auto`, `on (torch)`."""
    backend = intent.paged.backend if intent.paged is not None else PagedBackend.AUTO
    return intent.mode.value + (f" ({backend.value})" if backend is not PagedBackend.AUTO else "")


def _backend(x: RealizedCache | LoadingPlan) -> str:
    return x.backend.value if x.backend else "unknown"


def describe_kind(x: RealizedCache | LoadingPlan) -> str:
    if x.kind is CacheKind.PAGED:
        return f"a PAGED KV cache ({_backend(x)} backend)"
    return "an EAGER KV cache"


def fallback_reasons(x: RealizedCache | LoadingPlan) -> str:
    return "; ".join(f"[{f.component}] {f.reason}" if f.component else f.reason for f in x.fallbacks)


def describe_realized(realized: RealizedCache) -> str:
    if realized.kind is CacheKind.PAGED:
        text = (
            f"PAGED ({_backend(realized)} backend), {realized.num_blocks} blocks x {realized.block_size} "
            f"tokens = {realized.capacity_tokens} tokens"
        )
    else:
        text = f"EAGER, {realized.num_blocks} slots = {realized.capacity_tokens} tokens"
    text += f", max model len {realized.max_model_len}"
    if realized.fallbacks:
        text += f"; fell back because {fallback_reasons(realized)}"
    return text


def describe_compact(realized: RealizedCache) -> tuple[str, str]:
    """The REALIZED and CAPACITY cells of the cluster status table."""
    if realized.kind is CacheKind.PAGED:
        kind = f"PAGED {_backend(realized)} {realized.num_blocks}x{realized.block_size}"
    else:
        kind = f"EAGER {realized.num_blocks} slots"
    return kind, f"{realized.capacity_tokens} tok"


def describe_plan(plan: LoadingPlan) -> str:
    """A pre-load plan, e.g. `PAGED (torch backend)` or `EAGER; fell back because [device] ...`."""
    text = f"PAGED ({_backend(plan)} backend)" if plan.kind is CacheKind.PAGED else "EAGER"
    if plan.fallbacks:
        text += f"; fell back because {fallback_reasons(plan)}"
    return text


def realized_table(realized: RealizedCache, title: str = "realized KV cache") -> str:
    """A small readable table, logged once at startup and printed by `make serve`."""
    rows = [
        ("kind", realized.kind.value.upper()),
        ("backend", realized.backend.value if realized.backend else "eager (contiguous per slot)"),
        ("scheduler", realized.scheduler),
        ("cache dtype", realized.cache_dtype.value),
        ("max model len", str(realized.max_model_len)),
    ]
    if realized.kind is CacheKind.PAGED:
        rows += [
            ("block size", str(realized.block_size)),
            ("blocks", str(realized.num_blocks)),
            ("prefix caching", "on" if realized.prefix_caching else "off"),
        ]
    else:
        rows.append(("slots", str(realized.num_blocks)))
    rows += [
        ("capacity", f"{realized.capacity_tokens} tokens"),
        ("max concurrency", f"{realized.max_concurrency} x {realized.max_model_len} tokens"),
        ("memory", f"{realized.memory_bytes / 2**20:.1f} MiB"),
    ]
    if realized.tensor_parallel_size > 1:  # memory above is rank 0's: each rank holds its own heads' KV
        rows.append(("ranks", f"{realized.tensor_parallel_size} ({', '.join(realized.rank_devices)})"))
    rows += [(f"fallback ({f.component})", f.reason) for f in realized.fallbacks]
    # paged-attn is the kind and fallback rows above; every other feature gets its own row
    rows += [(f.name, describe_feature(f)) for f in realized.features if f.name != "paged-attn"]
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)] + [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def describe_feature(state: FeatureState) -> str:
    """`on (asked auto)` or `off (asked auto): no-cuda-device: no CUDA device: ...`."""
    asked = f"(asked {state.requested.value})"
    if state.realized:
        return f"on {asked}"
    return f"off {asked}: {state.code}: {state.message}" if state.code else f"off {asked}"


def describe_labels(labels: Mapping[str, str]) -> str:
    """A worker's labels (where it runs), e.g. `ray.bundle=1 ray.node=4b1c0e`, sorted by key."""
    return " ".join(f"{key}={labels[key]}" for key in sorted(labels))
