"""What a worker tells the router besides its spec and realized cache: its pre-load plan, a startup
failure, and its load.

Converted to and from protobuf in shared/handshake_pb.py (`plan_*_pb`, `failure_*_pb`, `load_*_pb`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpact.shared.features import FeatureState
from kvpact.shared.intent import PagedBackend
from kvpact.shared.realized import BuiltFeatures


class StartupFailureCode(enum.Enum):
    PAGED_ATTENTION_REQUIRED = "paged-attention-required"  # --paged-attn on cannot be honored
    FEATURE_REQUIRED = "feature-required"  # another --FEATURE on cannot be honored (`feature` names it)
    INVALID_CONFIG = "invalid-config"
    MODEL_LOAD = "model-load"
    OUT_OF_MEMORY = "out-of-memory"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class LoadingPlan(BuiltFeatures):
    """The pre-load verdict a worker announces before it loads weights: what it will build. Its kind and
    fallbacks are paged-attn's planned state (BuiltFeatures); `backend` is set for a PAGED plan only."""

    features: tuple[FeatureState, ...]  # every feature, as planned
    backend: PagedBackend | None = None
    verdict_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._check_features()


@dataclass(frozen=True, slots=True)
class StartupFailure:
    """Why a worker could not start. `component` is where it was found ("device", "cache-budget", ...)."""

    code: StartupFailureCode
    reason: str
    component: str = ""
    feature: str = ""  # the feature whose `on` could not be honored (a *_REQUIRED code), else ""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load, from its heartbeats and Stats. Blocks are free slots for an EAGER cache."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    tokens_per_second: float = 0.0
    num_preemptions: int = 0
    kernel_compiles_after_ready: int = 0  # Triton compiles mid-serving (the warm-up should leave 0)
    # Counters that reveal a silent degradation while serving (the router judges them: router/drift.py).
    eager_steps_under_graphs: int = 0  # decode-only steps run eagerly under realized cuda-graphs
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int = 0  # of those, tokens the prefix cache served
