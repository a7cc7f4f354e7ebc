"""Admission: does a worker's realized state meet the cluster's --paged-attn policy? Pure.

    cluster on   -> realized PAGED only (with the paged scheduler)
    cluster off  -> realized EAGER only
    cluster auto -> either

A worker whose own intent contradicts the policy (worker off under cluster on, worker on under cluster
off) is refused for that, whatever it built. A worker that reported a startup failure is refused with
its failure. Every reason is a sentence an operator can act on.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.handshake import StartupFailure, StartupFailureCode
from shared.intent import CacheIntent, PagedAttentionMode
from shared.realized import RealizedCache
from shared.scheduler_choice import CacheKind, SchedulerKind

ON, OFF, AUTO = PagedAttentionMode.ON, PagedAttentionMode.OFF, PagedAttentionMode.AUTO


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: str
    policy_failure: bool = False  # refused because of --paged-attn (exit 78), not a crash or bad model


def admit(
    policy: PagedAttentionMode, requested: CacheIntent, outcome: RealizedCache | StartupFailure
) -> Decision:
    """Decide for one worker: `requested` is the intent it was started with, `outcome` what it built
    (or why it could not start)."""
    if isinstance(outcome, StartupFailure):
        return _failed(outcome)
    mode = requested.mode
    if policy is ON and mode is OFF:
        return _refuse(
            "it was started with --paged-attn off and the cluster policy is --paged-attn on; "
            "start it with --paged-attn on (or auto where PagedAttention works)"
        )
    if policy is OFF and mode is ON:
        return _refuse(
            "it was started with --paged-attn on and the cluster policy is --paged-attn off; "
            "start it with --paged-attn off (or auto)"
        )
    built = describe_kind(outcome)
    if policy is ON and outcome.kind is not CacheKind.PAGED:
        why = fallback_reasons(outcome) or "it reported no fallback reason"
        if mode is ON:
            return _refuse(f"it was started with --paged-attn on yet realized {built} ({why})")
        return _refuse(
            f"the cluster policy is --paged-attn on and it realized {built} under --paged-attn "
            f"{mode.value} because {why}"
        )
    if policy is ON and outcome.scheduler is not SchedulerKind.PAGED:
        return _refuse(
            f"the cluster policy is --paged-attn on and it realized {built} but runs the "
            f"{outcome.scheduler.value} scheduler, not the paged one, so it does not run PagedAttention"
        )
    if policy is OFF and outcome.kind is not CacheKind.EAGER:
        return _refuse(
            f"the cluster policy is --paged-attn off and it realized {built} under --paged-attn "
            f"{mode.value}; start it with --paged-attn off"
        )
    reason = f"realized {built} under cluster policy --paged-attn {policy.value}"
    if outcome.fallbacks:
        reason += f" (fell back: {fallback_reasons(outcome)})"
    return Decision(admitted=True, reason=reason)


def describe_kind(realized: RealizedCache) -> str:
    if realized.kind is CacheKind.PAGED:
        backend = realized.backend.value if realized.backend else "unknown"
        return f"a PAGED KV cache ({backend} backend)"
    return "an EAGER KV cache"


def fallback_reasons(realized: RealizedCache) -> str:
    return "; ".join(f"[{f.component}] {f.reason}" if f.component else f.reason for f in realized.fallbacks)


def _failed(failure: StartupFailure) -> Decision:
    where = f" [{failure.component}]" if failure.component else ""
    policy = failure.code in (StartupFailureCode.PAGED_ATTENTION_REQUIRED, StartupFailureCode.INVALID_CONFIG)
    return Decision(
        admitted=False,
        reason=f"its startup failed ({failure.code.value}){where}: {failure.reason}",
        policy_failure=policy,
    )


def _refuse(reason: str) -> Decision:
    return Decision(admitted=False, reason=reason, policy_failure=True)
