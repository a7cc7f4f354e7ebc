"""Admission: does a worker's realized state meet the cluster's --paged-attn policy? Pure.

    cluster on   -> realized PAGED only (with the paged scheduler)
    cluster off  -> realized EAGER only
    cluster auto -> either

A worker whose own intent contradicts the policy (worker off under cluster on, worker on under cluster
off) is refused for that, whatever it built. A worker that reported a startup failure is refused with
its failure. Every reason is a sentence an operator can act on.

A worker's pre-load plan (Handshake.loading) is judged by the same rules (`admit_plan`): refused, or
pending until the worker registers again with `ready`.

Every other feature (router --policy NAME=MODE) is judged the same way, on the worker's reported
feature states (`_judge_features`): on -> realized only; off -> not realized only; auto -> either. A
worker started with --NAME off under policy on (or on under off) is refused for that; a worker that
reports no state for a feature the policy constrains (an older worker) is refused naming it.

Interchangeable workers (router --uniform, `admit_uniform`): a worker whose realized-config fingerprint
differs, in a field the list names, from a worker already serving (or loading) its model name is refused,
both values named; one that reports no fingerprint is refused too, while the list names anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpact.shared.describe import describe_kind, fallback_reasons
from kvpact.shared.features import FeatureMode, FeatureState
from kvpact.shared.fingerprint import Fingerprint, mismatch
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode
from kvpact.shared.intent import CacheIntent, PagedAttentionMode
from kvpact.shared.realized import RealizedCache
from kvpact.shared.scheduler_choice import CacheKind

ON, OFF, AUTO = PagedAttentionMode.ON, PagedAttentionMode.OFF, PagedAttentionMode.AUTO
UNIFORM = "uniform"  # Decision.feature of a refusal by router --uniform (not a feature: the report says so)


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: str
    policy_failure: bool = False  # refused because of a feature policy (exit 78), not a crash or bad model
    pending: bool = False  # a pre-load plan that meets the policy: not admitted until the worker is ready
    feature: str = ""  # the feature whose policy it failed ("paged-attn", "cuda-graphs", ...)


Policies = Mapping[str, FeatureMode]  # feature name -> the cluster's mode, for the features but paged-attn


def admit(
    policy: PagedAttentionMode,
    requested: CacheIntent,
    outcome: RealizedCache | StartupFailure,
    policies: Policies | None = None,
) -> Decision:
    """Decide for one worker: `requested` is the intent it was started with, `outcome` what it built
    (or why it could not start); `policies` the other features' cluster policies (None: all auto)."""
    if isinstance(outcome, StartupFailure):
        return _failed(outcome)
    decision = _judge(policy, requested, outcome, "realized")
    if decision.admitted:
        return _judge_features(policies or {}, outcome.features, "realized") or decision
    return decision


def admit_plan(
    policy: PagedAttentionMode, requested: CacheIntent, plan: LoadingPlan, policies: Policies | None = None
) -> Decision:
    """Decide on a worker's pre-load plan (Handshake.loading), by the same rules as `admit`: a planned
    PAGED cache runs the paged scheduler (select_scheduler follows the cache). A plan that meets the
    policy is `pending` (not admitted yet: the worker registers again with `ready` once loaded); one that
    does not is refused, so the cluster fails before that worker reads a weight."""
    decision = _judge(policy, requested, plan, "plans")
    if decision.admitted:
        decision = _judge_features(policies or {}, plan.features, "plans") or decision
    if not decision.admitted:
        return decision
    return Decision(admitted=False, reason=f"loading: {decision.reason}", pending=True)


def _judge(
    policy: PagedAttentionMode,
    requested: CacheIntent,
    outcome: RealizedCache | LoadingPlan,
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
    if policy is OFF and outcome.kind is not CacheKind.EAGER:
        return _refuse(
            f"the cluster policy is --paged-attn off and it {verb} {built} under --paged-attn "
            f"{mode.value}; start it with --paged-attn off"
        )
    reason = f"{verb} {built} under cluster policy --paged-attn {policy.value}"
    if outcome.fallbacks:
        reason += f" (fell back: {fallback_reasons(outcome)})"
    return Decision(admitted=True, reason=reason)


def judge_planned_features(policies: Policies, states: tuple[FeatureState, ...]) -> Decision | None:
    """`policies` (paged-attn's included) against a plan's feature states, as admission judges them: the
    first refusal, or None (kvpact-launch --plan, on each worker's `--plan-only --json`)."""
    return _judge_features(policies, states, "plans")


def _judge_features(policies: Policies, states: tuple[FeatureState, ...], verb: str) -> Decision | None:
    """The first feature whose policy the worker's states do not meet, as a refusal; None when all do."""
    by_name = {s.name: s for s in states}
    for name, mode in policies.items():
        if mode is FeatureMode.AUTO:
            continue
        flag = f"--policy {name}={mode.value}"
        s = by_name.get(name)
        if s is None:
            return _refuse(
                f"the cluster policy is {flag} and it reported no {name} state (a worker older than this "
                f"router); upgrade it, or drop {flag}",
                name,
            )
        if mode is FeatureMode.ON and s.requested is FeatureMode.OFF:
            return _refuse(
                f"it was started with --{name} off and the cluster policy is {flag}; "
                f"start it with --{name} on (or auto where it works)",
                name,
            )
        if mode is FeatureMode.OFF and s.requested is FeatureMode.ON:
            return _refuse(
                f"it was started with --{name} on and the cluster policy is {flag}; "
                f"start it with --{name} off (or auto)",
                name,
            )
        if mode is FeatureMode.ON and not s.realized:
            return _refuse(
                f"the cluster policy is {flag} and it {verb} {name} off under --{name} {s.requested.value} "
                f"because [{s.component}] {s.code}: {s.message}",
                name,
            )
        if mode is FeatureMode.OFF and s.realized:
            return _refuse(
                f"the cluster policy is {flag} and it {verb} {name} on under --{name} {s.requested.value}; "
                f"start it with --{name} off",
                name,
            )
    return None


def admit_uniform(
    fingerprint: Fingerprint | None, peers: Sequence[tuple[str, Fingerprint]], names: Sequence[str]
) -> Decision | None:
    """A refusal when `fingerprint` differs from a peer's (worker id, fingerprint: the workers already
    serving or loading the same model name) in a field of `names` (router --uniform); None when it agrees."""
    if not names:
        return None
    if fingerprint is None:
        return _refuse(
            f"it reported no realized-config fingerprint (a worker older than this router) and the router "
            f"checks --uniform {','.join(names)}; upgrade it, or start the router with --uniform none",
            UNIFORM,
        )
    for peer_id, peer in peers:
        reason = mismatch(fingerprint, peer_id, peer, names)
        if reason:
            return _refuse(reason, UNIFORM)
    return None


_POLICY_CODES = (
    StartupFailureCode.PAGED_ATTENTION_REQUIRED,
    StartupFailureCode.FEATURE_REQUIRED,
    StartupFailureCode.INVALID_CONFIG,
)


def _failed(failure: StartupFailure) -> Decision:
    where = f" [{failure.component}]" if failure.component else ""
    feature = f" --{failure.feature} on:" if failure.feature not in ("", "paged-attn") else ""
    return Decision(
        admitted=False,
        reason=f"its startup failed ({failure.code.value}){where}:{feature} {failure.reason}",
        policy_failure=failure.code in _POLICY_CODES,
        feature=failure.feature,
    )


def _refuse(reason: str, feature: str = "paged-attn") -> Decision:
    return Decision(admitted=False, reason=reason, policy_failure=True, feature=feature)
