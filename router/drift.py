"""Drift while serving: a worker whose heartbeat says it no longer realizes what it was admitted with. Pure.

NOTE: each heartbeat carries every feature's realized state and the runtime counters (WorkerLoad);
`judge` compares one beat with the worker's previous one (its ready handshake, for the first beat):

    a feature realized before and off now          drift of that feature, with its state's reason
    eager_steps_under_graphs grew                  drift of cuda-graphs (eager-steps-while-serving)
    kernel_compiles_after_ready grew               drift of paged-attn (kernel-compile-after-ready)

A drift `violates` the cluster's policy when the policy is `on` and the feature is off now (for
eager steps: `--policy cuda-graphs=on`), or `off` and it is on now: the router then drains the worker.
Otherwise (`auto`, and a kernel compile under any policy) it is reported only. Judged on changes, so
one change is one event. A beat with no states (an older worker) judges the counters only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpact.shared import reasons
from kvpact.shared.features import FeatureMode, FeatureState
from kvpact.shared.handshake import WorkerLoad
from kvpact.shared.reasons import CUDA_GRAPHS, PAGED_ATTN

REALIZED_UNDER_OFF = "realized-under-policy-off"  # the reason code when a feature turns on under `off`


@dataclass(frozen=True, slots=True)
class Drift:
    feature: str
    reason: str  # a code of shared/reasons.py (the metric's `reason` label)
    message: str  # for the operator: the log event, ClusterStatus' state reason, the drain reason
    violates: bool  # the policy is not met any more: drain the worker


def judge(
    policies: Mapping[str, FeatureMode],
    before: tuple[FeatureState, ...],
    now: tuple[FeatureState, ...],
    load_before: WorkerLoad,
    load_now: WorkerLoad,
) -> list[Drift]:
    """Every drift between two beats; `policies` is every feature's cluster policy (absent: auto)."""
    drifts = []
    previous = {s.name: s for s in before}
    for s in now:
        was = previous.get(s.name)
        if was is None or was.realized == s.realized:
            continue
        mode = policies.get(s.name, FeatureMode.AUTO)
        flag = f"--policy {s.name}={mode.value}"
        if not s.realized:
            why = f"[{s.component}] {s.code}: {s.message}" if s.code else "it gave no reason"
            message = f"{s.name} realized off while serving under {flag} ({why})"
            drifts.append(Drift(s.name, s.code or "unknown", message, mode is FeatureMode.ON))
        elif mode is FeatureMode.OFF:
            message = f"{s.name} realized on while serving under {flag}"
            drifts.append(Drift(s.name, REALIZED_UNDER_OFF, message, True))
    eager = load_now.eager_steps_under_graphs - load_before.eager_steps_under_graphs
    if eager > 0:
        mode = policies.get(CUDA_GRAPHS, FeatureMode.AUTO)
        found = reasons.EAGER_STEPS_WHILE_SERVING.found(count=eager)
        message = f"{found.message} (under --policy {CUDA_GRAPHS}={mode.value})"
        drifts.append(Drift(CUDA_GRAPHS, found.code, message, mode is FeatureMode.ON))
    compiles = load_now.kernel_compiles_after_ready - load_before.kernel_compiles_after_ready
    if compiles > 0:
        found = reasons.KERNEL_COMPILE_AFTER_READY.found(count=compiles)
        drifts.append(Drift(PAGED_ATTN, found.code, found.message, False))
    return drifts
