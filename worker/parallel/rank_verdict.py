"""What each tensor-parallel rank found on its own device before any weight is read (`RankVerdict`), what
went wrong on a rank (`RankProblem`), and what rank 0 then tells every rank to build (`RankBuild`).

NOTE: every rank runs the worker's own pre-load plan (startup/engine_setup.plan_startup) on its own
device; rank 0 alone decides, from all verdicts, what every rank builds: each feature is realized alike on
every rank (checks.every_rank; the cache's kind and pool size: checks.paged_every_rank), never mixed. A
rank's refusal or failure comes back to rank 0 as data and is raised there naming the rank (`worker a
rank 2: ...`). Plain dataclasses: they travel pickled over gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.shared.errors import (
    ConfigError,
    FeatureRequiredError,
    KvpactError,
    ModelLoadError,
    PagedAttentionRequiredError,
)
from kvpact.shared.features import FeatureState
from kvpact.shared.reasons import PAGED_ATTN


@dataclass(frozen=True, slots=True)
class RankProblem:
    """An exception a rank met, as data. `kind`: required | config | load | memory | internal."""

    kind: str
    message: str  # a *_REQUIRED error's reason; otherwise the error's text
    component: str = ""
    feature: str = ""
    code: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> RankProblem:
        if isinstance(exc, FeatureRequiredError):
            return cls("required", exc.reason, exc.component, exc.feature, exc.code)
        if isinstance(exc, ConfigError):
            return cls("config", str(exc))
        if isinstance(exc, ModelLoadError):
            return cls("load", str(exc))
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return cls("memory", f"out of memory: {exc}")
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def error(self, rank: int, device: str) -> KvpactError | MemoryError:
        """The exception rank 0 raises for it, its message naming the rank (and `.rank` set)."""
        where = f"rank {rank} ({device}): "
        exc: KvpactError | MemoryError
        if self.kind == "required" and self.feature == PAGED_ATTN:
            exc = PagedAttentionRequiredError(where + self.message, self.component, self.code)
        elif self.kind == "required":
            exc = FeatureRequiredError(
                where + self.message, self.component, feature=self.feature, code=self.code
            )
        elif self.kind == "config":
            exc = ConfigError(where + self.message)
        elif self.kind == "memory":
            exc = MemoryError(where + self.message)
        else:  # a load failure, or an internal one: the rank could not build its shard
            exc = ModelLoadError(where + self.message)
        exc.rank = rank  # type: ignore[union-attr]
        return exc


@dataclass(frozen=True, slots=True)
class RankVerdict:
    rank: int
    device: str
    features: tuple[FeatureState, ...] = ()  # what the rank's own plan realizes of each feature
    num_blocks: int = 0  # its paged pool's blocks (when it realizes paged-attn)
    problem: RankProblem | None = None  # its plan failed (a refused `on`, a bad flag): no features then

    def state(self, feature: str) -> FeatureState | None:
        return next((f for f in self.features if f.name == feature), None)

    @property
    def paged(self) -> bool:
        state = self.state(PAGED_ATTN)
        return state is not None and state.realized

    def unmet(self, feature: str) -> str | None:
        """Why this rank cannot realize `feature` (its refusal of `--FEATURE on`, or its fallback under
        auto), or None: it can, or its plan failed for another feature or a flag (raised on its own)."""
        if self.problem is not None:
            wanted = self.problem.kind == "required" and self.problem.feature == feature
            return self.problem.message if wanted else None
        state = self.state(feature)
        if state is None or state.realized:
            return None
        return state.message or "(no reason given)"


@dataclass(frozen=True, slots=True)
class RankBuild:
    """What every rank builds, decided by rank 0 from all verdicts (the same on every rank)."""

    model: str
    dtype: str
    cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    paged: bool
    num_blocks: int = 0
    block_size: int = 0
    backend: str = ""  # PagedBackend's value (paged only)
    cpu_kernels: bool = False
