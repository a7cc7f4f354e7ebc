"""The optional features a worker may realize, each under one intent, `worker --FEATURE auto|on|off`:

    auto  use it where it works; else it realizes off through the fallback door, with a named reason
    on    realized, or startup fails (exit 78) naming the reason, before any weight is read where it can
    off   never

What was asked is `FeatureIntents` (one option field per feature; paged-attn's mode is CacheIntent's, as
it carries the paged cache's settings too). What was built is one `FeatureState` per feature: realized
or not, and the reason. `Ledger` holds every feature's, paged-attn's included, while a worker starts;
`Ledger.fall_back` is the one door (tests/test_architecture.py keeps it the only one).

Invariant: no feature changes another's mode. A feature whose needs are not met (prefix caching without
the paged cache) realizes off; it never turns what it needs on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from kvpact.shared import reasons
from kvpact.shared.errors import FeatureRequiredError, PagedAttentionRequiredError
from kvpact.shared.options import check_options, option
from kvpact.shared.reasons import (
    CPU_KERNELS,
    CUDA_GRAPHS,
    PAGED_ATTN,
    PREFIX_CACHING,
    QUANT_KERNELS,
    Finding,
)

FEATURES = (PAGED_ATTN, PREFIX_CACHING, CPU_KERNELS, QUANT_KERNELS, CUDA_GRAPHS)  # their order everywhere
GROUP = "optional features (auto: use where it works, else fall back naming why; on: or exit 78; off)"


class FeatureMode(enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


def parse_mode(value: object, flag: str) -> FeatureMode:
    """auto/on/off, or a YAML boolean (true = on, false = off), as the cluster file may write it."""
    if isinstance(value, bool):
        return FeatureMode.ON if value else FeatureMode.OFF
    try:
        return FeatureMode(str(value))
    except ValueError:
        raise ValueError(f"{flag}: expected auto, on or off, got {value!r}") from None


def _mode_option(feature: str, help: str) -> FeatureMode:
    return option(  # type: ignore[no-any-return]
        FeatureMode.AUTO,
        f"--{feature}",
        help + " Default: auto.",
        choices=tuple(m.value for m in FeatureMode),
        convert=FeatureMode,
        group=GROUP,
    )


@dataclass(frozen=True, slots=True)
class FeatureIntents:
    """What the operator asked of each feature besides paged-attn (CacheIntent.mode)."""

    prefix_caching: FeatureMode = _mode_option(
        PREFIX_CACHING,
        "reuse the KV blocks of repeated prompt prefixes. Needs the paged KV cache (it never turns "
        "--paged-attn on): auto realizes off on the eager cache, on fails startup there.",
    )
    cpu_kernels: FeatureMode = _mode_option(
        CPU_KERNELS,
        "the C kernels (kernels/cpu_paged.c): paged decode and write, and, where the weights are "
        "float32, RMSNorm and the linear layers of batches of up to 64 rows (of every batch, with the "
        "weights packed in place, on a CPU with AVX-512 or AVX2), and decode steps of up to 64 "
        "sequences through every layer in one C call. Need a CPU device, a float32 or bfloat16 "
        "KV cache and a C compiler: auto falls back to pure torch naming why, on fails startup.",
    )
    quant_kernels: FeatureMode = _mode_option(
        QUANT_KERNELS,
        "steps of a few rows (6 with AVX-512, 2 with AVX2) read a GGUF's own 4-bit weights: the decoder "
        "projections as Q4_1 and a Q8_0 LM head as Q8_0, kept beside the float32 copy (~0.2 of its "
        "bytes), summed in float32 (a batch-1 step of the bundled model ~3x faster). Needs cpu-kernels "
        "(it never turns it on), a float32 model, layers in one C call (no tensor parallel, one "
        "--device-map entry), AVX2 or AVX-512, and projections stored as Q4_1 in a GGUF file, every "
        "value checked after loading: auto realizes off naming why, on fails startup.",
    )
    cuda_graphs: FeatureMode = _mode_option(
        CUDA_GRAPHS,
        "capture decode steps in CUDA graphs, replayed for every decode-only step. Needs a CUDA device "
        "and the Triton paged cache; captured and checked against eager steps after loading: auto "
        "realizes off naming why, on fails startup.",
    )

    def __post_init__(self) -> None:
        check_options(self)

    def mode(self, feature: str) -> FeatureMode:
        value: FeatureMode = getattr(self, feature.replace("-", "_"))
        return value

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name.replace("_", "-") for f in fields(FeatureIntents))


@dataclass(frozen=True, slots=True)
class FeatureState:
    """What was built of one feature. `code`/`message`/`component` say why it is off ("" when realized)."""

    name: str
    requested: FeatureMode
    realized: bool
    code: str = ""
    message: str = ""
    component: str = ""

    @property
    def fell_back(self) -> bool:
        """Off although it was not asked off: what the fallback metric counts."""
        return not self.realized and self.requested is not FeatureMode.OFF


def off_by_request(name: str) -> FeatureState:
    message = reasons.OFF_BY_REQUEST.message(feature=name)
    r = reasons.OFF_BY_REQUEST
    return FeatureState(name, FeatureMode.OFF, False, r.code, message, r.component)


@dataclass(slots=True)
class Ledger:
    """Each feature's mode (paged-attn's first), and the finding that turned it off, while a worker starts:
    a feature is in force until its first finding, and states() is what it realizes."""

    modes: dict[str, FeatureMode]
    findings: dict[str, Finding] = field(default_factory=dict)

    def in_force(self, feature: str) -> bool:
        return self.modes[feature] is not FeatureMode.OFF and feature not in self.findings

    def fall_back(self, feature: str, finding: Finding) -> None:
        """The door: off, or already fallen back: nothing. on: raise FeatureRequiredError naming the flag,
        component and reason. auto: record it (the feature realizes off)."""
        if not self.in_force(feature):
            return
        if self.modes[feature] is FeatureMode.ON:
            if feature == PAGED_ATTN:
                raise PagedAttentionRequiredError(finding.message, finding.component, finding.code)
            raise FeatureRequiredError(finding.message, finding.component, feature=feature, code=finding.code)
        self.findings[feature] = finding

    def state(self, feature: str) -> FeatureState:
        mode = self.modes[feature]
        if mode is FeatureMode.OFF:
            return off_by_request(feature)
        found = self.findings.get(feature)
        if found is None:
            return FeatureState(feature, mode, True)
        return FeatureState(feature, mode, False, found.code, found.message, found.component)

    def states(self) -> tuple[FeatureState, ...]:
        return tuple(self.state(f) for f in self.modes)


def updated_states(
    before: tuple[FeatureState, ...], now: tuple[FeatureState, ...]
) -> tuple[FeatureState, ...]:
    """`before` with each state `now` reports in its place (by name), then any new ones: a beat that
    omits a feature (an older or partial sender) leaves that feature as it was."""
    fresh = {s.name: s for s in now}
    known = {s.name for s in before}
    return tuple(fresh.get(s.name, s) for s in before) + tuple(s for s in now if s.name not in known)


def describe_features(states: tuple[FeatureState, ...]) -> str:
    """A FEATURES cell: each feature's realized state, `+` on / `-` off, e.g. `+paged-attn -cuda-graphs`;
    a `!` marks one that fell back (asked auto or on, realized off)."""
    return " ".join(("+" if s.realized else "!" if s.fell_back else "-") + s.name for s in states)
