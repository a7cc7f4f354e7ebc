"""Admission: does a worker's realized state meet the cluster's --paged-attn policy? Pure.

    cluster on   -> realized PAGED only (with the paged scheduler)
    cluster off  -> realized EAGER only
    cluster auto -> either

A worker whose own intent contradicts the policy (worker off under cluster on, worker on under cluster
off) is refused for that, whatever it built. A worker that reported a startup failure is refused with
its failure. Every reason is a sentence an operator can act on.

A worker's pre-load plan (Handshake.loading) is judged by the same rules (`admit_plan`): refused, or
pending until the worker registers again with `ready`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.shared.describe import describe_kind, fallback_reasons
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode
from kvpact.shared.intent import CacheIntent, PagedAttentionMode
from kvpact.shared.realized import RealizedCache
from kvpact.shared.scheduler_choice import CacheKind, SchedulerKind

ON, OFF, AUTO = PagedAttentionMode.ON, PagedAttentionMode.OFF, PagedAttentionMode.AUTO


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: str
    policy_failure: bool = False  # refused because of --paged-attn (exit 78), not a crash or bad model
    pending: bool = False  # a pre-load plan that meets the policy: not admitted until the worker is ready


def admit(
    policy: PagedAttentionMode, requested: CacheIntent, outcome: RealizedCache | StartupFailure
) -> Decision:
    """Decide for one worker: `requested` is the intent it was started with, `outcome` what it built
    (or why it could not start)."""
    if isinstance(outcome, StartupFailure):
        return _failed(outcome)
    return _judge(policy, requested, outcome, outcome.scheduler, "realized")


def admit_plan(policy: PagedAttentionMode, requested: CacheIntent, plan: LoadingPlan) -> Decision:
    """Decide on a worker's pre-load plan (Handshake.loading), by the same rules as `admit`: a planned
    PAGED cache runs the paged scheduler (select_scheduler follows the cache). A plan that meets the
    policy is `pending` (not admitted yet: the worker registers again with `ready` once loaded); one that
    does not is refused, so the cluster fails before that worker reads a weight."""
    scheduler = SchedulerKind.PAGED if plan.kind is CacheKind.PAGED else SchedulerKind.DEFAULT
    decision = _judge(policy, requested, plan, scheduler, "plans")
    if not decision.admitted:
        return decision
    return Decision(admitted=False, reason=f"loading: {decision.reason}", pending=True)


def _judge(
    policy: PagedAttentionMode,
    requested: CacheIntent,
    outcome: RealizedCache | LoadingPlan,
    scheduler: SchedulerKind,
    verb: str,
) -> Decision:
    """`verb`: "realized" (a ready worker) or "plans" (a worker announcing its pre-load plan)."""
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
            return _refuse(f"it was started with --paged-attn on yet {verb} {built} ({why})")
        return _refuse(
            f"the cluster policy is --paged-attn on and it {verb} {built} under --paged-attn "
            f"{mode.value} because {why}"
        )
    if policy is ON and scheduler is not SchedulerKind.PAGED:
        return _refuse(
            f"the cluster policy is --paged-attn on and it {verb} {built} but runs the "
            f"{scheduler.value} scheduler, not the paged one, so it does not run PagedAttention"
        )
    if policy is OFF and outcome.kind is not CacheKind.EAGER:
        return _refuse(
            f"the cluster policy is --paged-attn off and it {verb} {built} under --paged-attn "
            f"{mode.value}; start it with --paged-attn off"
        )
    reason = f"{verb} {built} under cluster policy --paged-attn {policy.value}"
    if outcome.fallbacks:
        reason += f" (fell back: {fallback_reasons(outcome)})"
    return Decision(admitted=True, reason=reason)


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
