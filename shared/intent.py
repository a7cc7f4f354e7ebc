"""The operator's PagedAttention intent, and the single door through which it may fall back.

The intent travels unchanged: CLI flag -> `CacheIntent` -> worker -> capability check -> loader ->
cache -> scheduler -> handshake -> router. It is never reduced to a bool before the last decision;
`PagedAttentionConfig.required` is the bit that survives.

    auto -> PagedAttentionConfig(required=False)   try it where it works; fall back and say why
    on   -> PagedAttentionConfig(required=True)    it must work, or startup fails naming the reason
    off  -> None                                   never

While a worker starts, a `PagedAttentionState` holds the config still in force. Only
`disable_paged_attention` may clear it (tests/test_architecture.py enforces this): loaders and caches
know *compatibility*, the config knows *policy*, and this helper combines them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from kvpact.shared.errors import ConfigError, PagedAttentionRequiredError

DEFAULT_BLOCK_SIZE = 16


class PagedAttentionMode(enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


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
    """How to build the paged cache. At most one of the three budgets is set (none = device default)."""

    required: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    memory_fraction: float | None = None
    memory_bytes: int | None = None
    context_tokens: int | None = None
    cache_dtype: CacheDtype = CacheDtype.AUTO
    backend: PagedBackend = PagedBackend.AUTO
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        budgets = [b for b in (self.memory_fraction, self.memory_bytes, self.context_tokens) if b is not None]
        if len(budgets) > 1:
            raise ConfigError(
                "--pa-memory-fraction, --pa-memory-bytes and --pa-context-tokens are mutually exclusive; "
                "give one"
            )
        if self.block_size <= 0:
            raise ConfigError(f"--pa-block-size must be positive, got {self.block_size}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"--pa-memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError(f"--pa-memory-bytes must be positive, got {self.memory_bytes}")
        if self.context_tokens is not None and self.context_tokens <= 0:
            raise ConfigError(f"--pa-context-tokens must be positive, got {self.context_tokens}")


@dataclass(frozen=True, slots=True)
class CacheIntent:
    """What the operator asked for. `paged` is None exactly when mode is OFF."""

    mode: PagedAttentionMode = PagedAttentionMode.AUTO
    paged: PagedAttentionConfig | None = field(default_factory=PagedAttentionConfig)
    no_kv_cache: bool = False

    def __post_init__(self) -> None:
        if (self.paged is None) != (self.mode is PagedAttentionMode.OFF):
            raise ValueError(
                f"CacheIntent: paged config must be present exactly when mode is not off ({self})"
            )
        if self.paged is not None and self.paged.required != (self.mode is PagedAttentionMode.ON):
            raise ValueError(f"CacheIntent: required must be true exactly when mode is on ({self})")

    @property
    def required(self) -> bool:
        return self.mode is PagedAttentionMode.ON


def paged_config_for_mode(
    mode: PagedAttentionMode, settings: PagedAttentionConfig | None = None
) -> PagedAttentionConfig | None:
    """The CLI mapping: auto -> config(required=False), on -> config(required=True), off -> None.

    `settings` carries the other --pa-* flags; its `required` is overwritten by the mode."""
    if mode is PagedAttentionMode.OFF:
        return None
    return replace(settings or PagedAttentionConfig(), required=mode is PagedAttentionMode.ON)


def cache_intent(
    mode: PagedAttentionMode, settings: PagedAttentionConfig | None = None, *, no_kv_cache: bool = False
) -> CacheIntent:
    return CacheIntent(mode=mode, paged=paged_config_for_mode(mode, settings), no_kv_cache=no_kv_cache)


@dataclass(frozen=True, slots=True)
class Fallback:
    """One place where PagedAttention was found impossible under `auto`, and why."""

    component: str
    reason: str


@dataclass(slots=True)
class PagedAttentionState:
    """The paged config still in force while a worker starts, and every fallback taken so far."""

    intent: CacheIntent
    paged_config: PagedAttentionConfig | None
    fallbacks: list[Fallback] = field(default_factory=list)

    @classmethod
    def from_intent(cls, intent: CacheIntent) -> PagedAttentionState:
        return cls(intent=intent, paged_config=intent.paged)

    @property
    def enabled(self) -> bool:
        return self.paged_config is not None

    @property
    def required(self) -> bool:
        return self.paged_config is not None and self.paged_config.required


def disable_paged_attention(state: PagedAttentionState, reason: str, *, component: str) -> None:
    """The single fallback door. `reason` completes "PagedAttention cannot be used here because ...".

    Config absent (off, or already fallen back): nothing to do. `required` (on): raise
    PagedAttentionRequiredError naming the flag, the component and the reason. Otherwise (auto):
    clear the config and record the fallback.
    """
    if state.paged_config is None:
        return
    if state.paged_config.required:
        raise PagedAttentionRequiredError(reason, component)
    state.paged_config = None
    state.fallbacks.append(Fallback(component=component, reason=reason))
