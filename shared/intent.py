"""The operator's PagedAttention intent: its mode, and the paged cache's settings.

The intent travels unchanged: CLI flag -> `CacheIntent` -> worker -> capability check -> loader ->
cache -> scheduler -> handshake -> router. It is never reduced to a bool before the last decision; the
mode is the one form of it (`CacheIntent.required` derives "on" from it).

    auto -> CacheIntent(AUTO, PagedAttentionConfig())   try it where it works; fall back and say why
    on   -> CacheIntent(ON, PagedAttentionConfig())     it must work, or startup fails naming the reason
    off  -> CacheIntent(OFF, None)                      never

While a worker starts, paged-attn is one feature of the `Ledger` (shared/features.py): its config is in
force until the ledger's door, `Ledger.fall_back`, records a finding (auto) or raises (on). Checks know
*compatibility*, the mode knows *policy*, and the door combines them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpact.shared.errors import ConfigError
from kvpact.shared.features import FeatureMode
from kvpact.shared.options import UINT64_MAX, check_options, option

DEFAULT_BLOCK_SIZE = 16
CACHE = "KV cache and PagedAttention"  # the --help group of `worker` these options are shown in
PAGED_ATTN_HELP = (
    "PagedAttention policy. auto: use it where this worker supports it (CUDA with Triton), otherwise "
    "fall back to the eager KV cache and record why (CPU and MPS stay eager). on: required; startup "
    "fails naming the reason if it cannot be realized (CPU/MPS use the torch paged backend). "
    "off: never use it. Default: auto."
)
GPU_DEFAULT_MEMORY_FRACTION = 0.9  # the paged budget's share of free GPU memory when no --pa-* budget is set


PagedAttentionMode = FeatureMode  # paged-attn's mode is one feature's mode (shared/features.py)


class PagedBackend(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


class CacheDtype(enum.Enum):
    AUTO = "auto"  # the model's dtype
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


@dataclass(frozen=True, slots=True)
class PagedAttentionConfig:
    """How to build the paged cache. At most one of the three budgets is set (none = device default).
    Whether it is required is the mode's (CacheIntent.required), never stored here."""

    block_size: int = option(
        DEFAULT_BLOCK_SIZE,
        "--pa-block-size",
        f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
        minimum=1,
        group=CACHE,
    )
    memory_fraction: float | None = option(
        None,
        "--pa-memory-fraction",
        "KV cache budget: F x the memory free at startup (GPU memory, or available RAM on CPU), less "
        "the weights and activation headroom; F in (0, 1] is the share of free memory this worker may use "
        f"in all (the CUDA default is {GPU_DEFAULT_MEMORY_FRACTION:g})",
        type=float,
        metavar="F",
        group=CACHE,
        exclusive="budget",
    )
    memory_bytes: int | None = option(
        None,
        "--pa-memory-bytes",
        "KV cache budget in bytes",
        minimum=1,
        maximum=UINT64_MAX,
        group=CACHE,
        exclusive="budget",
    )
    context_tokens: int | None = option(
        None,
        "--pa-context-tokens",
        "KV cache budget in tokens",
        minimum=1,
        maximum=UINT64_MAX,
        group=CACHE,
        exclusive="budget",
    )
    cache_dtype: CacheDtype = option(
        CacheDtype.AUTO,
        "--pa-cache-dtype",
        "KV element type (default: the model's)",
        choices=tuple(d.value for d in CacheDtype),
        convert=CacheDtype,
        group=CACHE,
    )
    backend: PagedBackend = option(
        PagedBackend.AUTO,
        "--pa-backend",
        "paged attention kernels: triton (CUDA) or torch (any device); auto picks (default auto)",
        choices=tuple(b.value for b in PagedBackend),
        convert=PagedBackend,
        group=CACHE,
    )

    def __post_init__(self) -> None:
        budgets = [b for b in (self.memory_fraction, self.memory_bytes, self.context_tokens) if b is not None]
        if len(budgets) > 1:
            raise ConfigError(
                "--pa-memory-fraction, --pa-memory-bytes and --pa-context-tokens are mutually exclusive; "
                "give one"
            )
        check_options(self)
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"--pa-memory-fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True, slots=True)
class CacheIntent:
    """What the operator asked for. `paged` is None exactly when mode is OFF."""

    mode: PagedAttentionMode = option(
        PagedAttentionMode.AUTO,
        "--paged-attn",
        PAGED_ATTN_HELP,
        choices=tuple(m.value for m in PagedAttentionMode),
        convert=PagedAttentionMode,
        group=CACHE,
    )
    paged: PagedAttentionConfig | None = field(default_factory=PagedAttentionConfig)

    def __post_init__(self) -> None:
        if (self.paged is None) != (self.mode is PagedAttentionMode.OFF):
            raise ValueError(
                f"CacheIntent: paged config must be present exactly when mode is not off ({self})"
            )

    @property
    def required(self) -> bool:
        return self.mode is PagedAttentionMode.ON


def paged_config_for_mode(
    mode: PagedAttentionMode, settings: PagedAttentionConfig | None = None
) -> PagedAttentionConfig | None:
    """The CLI mapping: auto and on -> the config (`settings`, the --pa-* flags), off -> None."""
    if mode is PagedAttentionMode.OFF:
        return None
    return settings or PagedAttentionConfig()


def cache_intent(mode: PagedAttentionMode, settings: PagedAttentionConfig | None = None) -> CacheIntent:
    return CacheIntent(mode=mode, paged=paged_config_for_mode(mode, settings))


@dataclass(frozen=True, slots=True)
class Fallback:
    """Where PagedAttention was found impossible under `auto`, and why (`code`: the reason's code in
    shared/reasons.py; "" from an older sender): a view of paged-attn's FeatureState (shared/realized.py),
    and the wire's form of it for older readers."""

    component: str
    reason: str
    code: str = ""
