"""The one report the router prints when the cluster fails to start. Pure text.

For each registered worker: what it was asked (its spec's intent, as the flags that say it), what it
realized (or, still loading, what it planned; or why it failed), its admission, and whether it was
told to shut down; then the cause and the exit code. Operators read it top to bottom; a Ray job
fails with the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.router.admission import fallback_reasons
from kvpact.router.registry import WorkerEntry
from kvpact.shared.errors import EXIT_POLICY
from kvpact.shared.handshake import LoadingPlan
from kvpact.shared.intent import CacheIntent, PagedAttentionMode
from kvpact.shared.realized import RealizedCache
from kvpact.shared.scheduler_choice import CacheKind


@dataclass(frozen=True, slots=True)
class FailedStartup:
    policy: PagedAttentionMode
    num_expected: int
    cause: str
    exit_code: int
    workers: list[WorkerEntry]
    shutdown: dict[str, str]  # worker id -> "sent" or why not


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
    if intent.no_kv_cache:
        parts.append("--no-kv-cache")
    return " ".join(parts)


def describe_realized(realized: RealizedCache) -> str:
    if realized.kind is CacheKind.PAGED:
        backend = realized.backend.value if realized.backend else "unknown"
        text = (
            f"PAGED ({backend} backend), {realized.num_blocks} blocks x {realized.block_size} tokens = "
            f"{realized.capacity_tokens} tokens"
        )
    else:
        text = f"EAGER, {realized.num_blocks} slots = {realized.capacity_tokens} tokens"
    text += f", max model len {realized.max_model_len}"
    if realized.fallbacks:
        text += f"; fell back because {fallback_reasons(realized)}"
    return text


def describe_plan(plan: LoadingPlan) -> str:
    """A pre-load plan, e.g. `PAGED (torch backend)` or `EAGER; fell back because [device] ...`."""
    if plan.kind is CacheKind.PAGED:
        text = f"PAGED ({plan.backend.value if plan.backend else 'unknown'} backend)"
    else:
        text = "EAGER"
    if plan.fallbacks:
        text += f"; fell back because {fallback_reasons(plan)}"
    return text


def render_failure_report(failed: FailedStartup) -> str:
    admitted = sum(1 for w in failed.workers if w.serving)
    lines = [
        f"kvpact router: the cluster FAILED to start (--paged-attn {failed.policy.value}, "
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
        lines.append(f"  asked:     {describe_intent(w.spec.cache)}")
        if w.realized is not None:
            lines.append(f"  realized:  {describe_realized(w.realized)}")
        elif w.plan is not None:
            lines.append(f"  planned:   {describe_plan(w.plan)}")
        if w.failure is not None:
            where = f" [{w.failure.component}]" if w.failure.component else ""
            lines.append(f"  failed:    ({w.failure.code.value}){where} {w.failure.reason}")
        else:  # a failure is its own admission reason; say it once
            lines.append(f"  admission: {w.state_reason}")
        lines.append(f"  shutdown:  {failed.shutdown.get(w.worker_id, 'not asked')}")
        lines.append("")
    meaning = (
        "the --paged-attn policy cannot be honored by every worker"
        if failed.exit_code == EXIT_POLICY
        else "the cluster did not come up"
    )
    lines.append(f"exit code {failed.exit_code}: {meaning}")
    return "\n".join(lines)
