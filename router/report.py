"""The one report the router prints when the cluster fails to start. Pure text.

For each registered worker: what it was asked (its spec's intent, as the flags that say it), what it
realized (or, still loading, what it planned; or why it failed), its admission, and whether it was
told to shut down; then the cause and the exit code. Operators read it top to bottom; a Ray job
fails with the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpact.router.admission import UNIFORM
from kvpact.router.registry import WorkerEntry
from kvpact.shared.describe import (
    describe_feature_flags,
    describe_intent,
    describe_labels,
    describe_plan,
    describe_realized,
)
from kvpact.shared.errors import EXIT_POLICY
from kvpact.shared.features import FeatureMode
from kvpact.shared.intent import PagedAttentionMode


@dataclass(frozen=True, slots=True)
class FailedStartup:
    policy: PagedAttentionMode
    num_expected: int
    cause: str
    exit_code: int
    workers: list[WorkerEntry]
    shutdown: dict[str, str]  # worker id -> "sent" or why not
    policies: dict[str, FeatureMode] = field(default_factory=dict)  # router --policy; absent = auto
    feature: str = ""  # the feature whose policy failed it (Startup.feature); "" = paged-attn or none
    uniform: tuple[str, ...] = ()  # router --uniform (its fields are shown when a mismatch failed it)


def render_failure_report(failed: FailedStartup) -> str:
    admitted = sum(1 for w in failed.workers if w.serving)
    others = "".join(
        f"--policy {name}={mode.value}, "
        for name, mode in failed.policies.items()
        if mode is not FeatureMode.AUTO
    )
    lines = [
        f"kvpact router: the cluster FAILED to start (--paged-attn {failed.policy.value}, {others}"
        f"--expect-workers {failed.num_expected}, {admitted} admitted)",
        f"cause: {failed.cause}",
        "",
    ]
    if not failed.workers:
        lines += ["no worker registered", ""]
    for w in failed.workers:
        lines.append(
            f'worker "{w.worker_id}" at {w.address or "(no address)"}, model {w.model_name or "?"}: '
            f"{w.state.value.upper()}"
        )
        if w.labels:
            lines.append(f"  placed:    {describe_labels(w.labels)}")
        asked = " ".join(
            filter(None, (describe_intent(w.spec.cache), describe_feature_flags(w.spec.features)))
        )
        lines.append(f"  asked:     {asked}")
        if w.realized is not None:
            lines.append(f"  realized:  {describe_realized(w.realized)}")
        elif w.plan is not None:
            lines.append(f"  planned:   {describe_plan(w.plan)}")
        if w.fingerprint is not None and failed.feature == UNIFORM:
            lines.append(f"  config:    {w.fingerprint.describe(failed.uniform)}")
        for f in w.features:
            if not f.realized and failed.policies.get(f.name, FeatureMode.AUTO) is not FeatureMode.AUTO:
                lines.append(f"  feature:   {f.name} off [{f.component}] {f.code}: {f.message}")
        if w.failure is not None:
            where = f" [{w.failure.component}]" if w.failure.component else ""
            feature = f" --{w.failure.feature} on:" if w.failure.feature not in ("", "paged-attn") else ""
            lines.append(f"  failed:    ({w.failure.code.value}){where}{feature} {w.failure.reason}")
        else:  # a failure is its own admission reason; say it once
            lines.append(f"  admission: {w.state_reason}")
        lines.append(f"  shutdown:  {failed.shutdown.get(w.worker_id, 'not asked')}")
        lines.append("")
    if failed.exit_code != EXIT_POLICY:
        meaning = "the cluster did not come up"
    elif failed.feature == UNIFORM:
        meaning = (
            f"the workers serving one model name are not interchangeable (router --uniform "
            f"{','.join(failed.uniform)})"
        )
    elif failed.feature in ("", "paged-attn"):
        meaning = "the --paged-attn policy cannot be honored by every worker"
    else:
        meaning = (
            f"the {failed.feature} policy (--policy {failed.feature}, or a worker's --{failed.feature} on) "
            "cannot be honored by every worker"
        )
    lines.append(f"exit code {failed.exit_code}: {meaning}")
    return "\n".join(lines)
