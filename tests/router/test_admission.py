"""The admission matrix: every cluster policy x worker intent x realized kind, with its reason."""

from dataclasses import replace

import pytest

from kvpact.router.admission import admit, admit_plan
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode
from kvpact.shared.intent import Fallback, PagedAttentionMode, PagedBackend, cache_intent
from kvpact.shared.scheduler_choice import CacheKind, SchedulerKind
from tests.router.doubles import EAGER_CPU_REASON, eager_realized, paged_realized

AUTO, ON, OFF = PagedAttentionMode.AUTO, PagedAttentionMode.ON, PagedAttentionMode.OFF
PAGED = paged_realized()
EAGER_FELL_BACK = eager_realized(Fallback("device", EAGER_CPU_REASON))
EAGER_PLAIN = eager_realized()

# (cluster policy, worker intent, realized) -> admitted?, words the reason must contain
MATRIX = [
    (ON, ON, PAGED, True, ["realized a PAGED KV cache (torch backend)", "--paged-attn on"]),
    (ON, ON, EAGER_PLAIN, False, ["started with --paged-attn on yet realized an EAGER KV cache"]),
    (ON, AUTO, PAGED, True, ["realized a PAGED KV cache"]),
    (
        ON,
        AUTO,
        EAGER_FELL_BACK,
        False,
        ["cluster policy is --paged-attn on", "under --paged-attn auto", f"[device] {EAGER_CPU_REASON}"],
    ),
    (ON, OFF, EAGER_PLAIN, False, ["started with --paged-attn off", "cluster policy is --paged-attn on"]),
    (OFF, ON, PAGED, False, ["started with --paged-attn on", "cluster policy is --paged-attn off"]),
    (
        OFF,
        AUTO,
        PAGED,
        False,
        ["cluster policy is --paged-attn off", "realized a PAGED KV cache", "start it with --paged-attn off"],
    ),
    (OFF, AUTO, EAGER_FELL_BACK, True, ["realized an EAGER KV cache", EAGER_CPU_REASON]),
    (OFF, OFF, EAGER_PLAIN, True, ["realized an EAGER KV cache under cluster policy --paged-attn off"]),
    (AUTO, ON, PAGED, True, ["realized a PAGED KV cache"]),
    (AUTO, AUTO, PAGED, True, ["realized a PAGED KV cache"]),
    (
        AUTO,
        AUTO,
        EAGER_FELL_BACK,
        True,
        ["realized an EAGER KV cache", f"fell back: [device] {EAGER_CPU_REASON}"],
    ),
    (AUTO, OFF, EAGER_PLAIN, True, ["realized an EAGER KV cache"]),
]


@pytest.mark.parametrize(
    ("policy", "intent", "realized", "admitted", "words"),
    MATRIX,
    ids=[f"cluster-{p.value}-worker-{i.value}-{r.kind.value}" for p, i, r, *_ in MATRIX],
)
def test_admission_matrix(policy, intent, realized, admitted, words):
    decision = admit(policy, cache_intent(intent), realized)
    assert decision.admitted is admitted
    for word in words:
        assert word in decision.reason
    assert decision.policy_failure is (not admitted)


@pytest.mark.parametrize("intent", [ON, AUTO])
def test_on_refuses_a_paged_cache_reported_with_the_default_scheduler(intent):
    """The worker's own backstop (select_scheduler) never builds this; the router does not trust that."""
    incoherent = replace(PAGED, scheduler=SchedulerKind.DEFAULT)
    decision = admit(ON, cache_intent(intent), incoherent)
    assert not decision.admitted and decision.policy_failure
    assert "runs the default scheduler, not the paged one" in decision.reason
    assert admit(AUTO, cache_intent(intent), incoherent).admitted  # auto admits whatever was realized


def test_off_realized_without_fallback_has_no_reason_appended():
    decision = admit(OFF, cache_intent(OFF), EAGER_PLAIN)
    assert decision.reason == "realized an EAGER KV cache under cluster policy --paged-attn off"


@pytest.mark.parametrize("policy", list(PagedAttentionMode))
def test_a_reported_startup_failure_is_refused_with_its_reason(policy):
    failure = StartupFailure(StartupFailureCode.PAGED_ATTENTION_REQUIRED, "no CUDA device", "device")
    decision = admit(policy, cache_intent(ON), failure)
    assert not decision.admitted
    assert decision.reason == "its startup failed (paged-attention-required) [device]: no CUDA device"
    assert decision.policy_failure


def test_a_model_load_failure_is_not_a_policy_failure():
    failure = StartupFailure(StartupFailureCode.MODEL_LOAD, "config.json is missing", "loader")
    decision = admit(AUTO, cache_intent(AUTO), failure)
    assert not decision.admitted and not decision.policy_failure
    assert "config.json is missing" in decision.reason


def test_eager_without_any_reported_reason_says_so():
    decision = admit(ON, cache_intent(AUTO), EAGER_PLAIN)
    assert "it reported no fallback reason" in decision.reason


# -- a worker's pre-load plan (Handshake.loading) --------------------------------------------------

PLANNED_PAGED = LoadingPlan(CacheKind.PAGED, PagedBackend.TORCH)
PLANNED_EAGER = LoadingPlan(CacheKind.EAGER, fallbacks=(Fallback("device", EAGER_CPU_REASON),))


def test_on_refuses_a_plan_for_an_eager_cache_with_its_fallback_reason():
    decision = admit_plan(ON, cache_intent(AUTO), PLANNED_EAGER)
    assert not decision.admitted and not decision.pending and decision.policy_failure
    assert decision.reason == (
        "the cluster policy is --paged-attn on and it plans an EAGER KV cache under --paged-attn auto "
        f"because [device] {EAGER_CPU_REASON}"
    )


@pytest.mark.parametrize("intent", [ON, AUTO])
def test_on_keeps_a_plan_for_a_paged_cache_pending(intent):
    decision = admit_plan(ON, cache_intent(intent), PLANNED_PAGED)
    assert not decision.admitted and decision.pending and not decision.policy_failure
    assert "plans a PAGED KV cache (torch backend)" in decision.reason


@pytest.mark.parametrize(
    ("policy", "intent", "plan", "pending"),
    [
        (OFF, AUTO, PLANNED_PAGED, False),
        (OFF, AUTO, PLANNED_EAGER, True),
        (ON, OFF, PLANNED_EAGER, False),
        (AUTO, AUTO, PLANNED_EAGER, True),
        (AUTO, ON, PLANNED_PAGED, True),
    ],
)
def test_a_plan_is_judged_by_the_same_rules_as_a_realized_cache(policy, intent, plan, pending):
    decision = admit_plan(policy, cache_intent(intent), plan)
    assert decision.pending is pending and not decision.admitted
    assert decision.policy_failure is (not pending)
