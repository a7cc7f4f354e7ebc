"""What a worker tells the router besides its spec and realized cache: a startup failure, and its load.

Converted to and from protobuf in shared/wire.py (`failure_*_pb`, `load_*_pb`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StartupFailureCode(enum.Enum):
    PAGED_ATTENTION_REQUIRED = "paged-attention-required"  # --paged-attn on cannot be honored
    INVALID_CONFIG = "invalid-config"
    MODEL_LOAD = "model-load"
    OUT_OF_MEMORY = "out-of-memory"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class StartupFailure:
    """Why a worker could not start. `component` is where it was found ("device", "cache-budget", ...)."""

    code: StartupFailureCode
    reason: str
    component: str = ""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load, from its heartbeats and Stats. Blocks are free slots for an EAGER cache."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    tokens_per_second: float = 0.0
    num_preemptions: int = 0
