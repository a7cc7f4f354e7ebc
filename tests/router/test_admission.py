"""The admission matrix: every cluster policy x worker intent x realized kind, with its reason."""

from dataclasses import replace

import pytest

from kvpact.router.admission import admit, admit_plan
from kvpact.shared.features import FeatureState
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode
from kvpact.shared.intent import Fallback, PagedAttentionMode, PagedBackend, cache_intent
from tests.router.doubles import (
    EAGER_CPU_REASON,
    PAGED_ATTN_REALIZED,
    eager_realized,
    paged_attn_off,
    paged_realized,
)

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

PLANNED_PAGED = LoadingPlan((PAGED_ATTN_REALIZED,), PagedBackend.TORCH)
PLANNED_EAGER = LoadingPlan((paged_attn_off(Fallback("device", EAGER_CPU_REASON)),))


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


# ---- every other feature: router --policy NAME=MODE over the worker's reported feature states ----

NO_CUDA = FeatureState("cuda-graphs", AUTO, False, "no-cuda-device", "no CUDA device: ...", "device")
GRAPHS = FeatureState("cuda-graphs", ON, True)
GRAPHS_OFF = FeatureState(
    "cuda-graphs", OFF, False, "off-by-request", "it was started with --cuda-graphs off"
)
GRAPHS_AUTO_ON = FeatureState("cuda-graphs", AUTO, True)

# (the cuda-graphs policy, the worker's cuda-graphs state or None) -> admitted?, words
FEATURE_MATRIX = [
    (ON, GRAPHS, True, ["realized a PAGED KV cache"]),
    (ON, GRAPHS_AUTO_ON, True, ["realized a PAGED KV cache"]),
    (ON, NO_CUDA, False, ["--policy cuda-graphs=on", "realized cuda-graphs off under --cuda-graphs auto",
                          "[device] no-cuda-device: no CUDA device"]),
    (ON, GRAPHS_OFF, False, ["started with --cuda-graphs off", "start it with --cuda-graphs on"]),
    (ON, None, False, ["reported no cuda-graphs state", "drop --policy cuda-graphs=on"]),
    (OFF, GRAPHS, False, ["started with --cuda-graphs on", "--policy cuda-graphs=off"]),
    (OFF, GRAPHS_AUTO_ON, False, ["realized cuda-graphs on under --cuda-graphs auto", "--cuda-graphs off"]),
    (OFF, NO_CUDA, True, []),
    (AUTO, NO_CUDA, True, []),
    (AUTO, None, True, []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "state", "admitted", "words"),
    FEATURE_MATRIX,
    ids=[f"policy-{m.value}-{s.requested.value + '-' + str(s.realized) if s else 'unreported'}"
         for m, s, *_ in FEATURE_MATRIX],
)  # fmt: skip
def test_feature_policy_matrix(mode, state, admitted, words):
    realized = replace(PAGED, features=(FeatureState("paged-attn", AUTO, True), *([state] if state else [])))
    decision = admit(AUTO, cache_intent(AUTO), realized, {"cuda-graphs": mode, "cpu-kernels": AUTO})
    assert decision.admitted is admitted, decision.reason
    for w in words:
        assert w in decision.reason
    if not admitted:
        assert decision.policy_failure and decision.feature == "cuda-graphs"


def test_a_plan_that_cannot_meet_a_feature_policy_is_refused_before_loading():
    plan = LoadingPlan(features=(PAGED_ATTN_REALIZED, NO_CUDA), backend=PagedBackend.TORCH)
    decision = admit_plan(AUTO, cache_intent(AUTO), plan, {"cuda-graphs": ON})
    assert (decision.admitted, decision.pending, decision.feature) == (False, False, "cuda-graphs")
    assert "plans cuda-graphs off" in decision.reason
    assert admit_plan(AUTO, cache_intent(AUTO), plan, {"cuda-graphs": AUTO}).pending


def test_a_worker_that_failed_its_own_feature_on_is_a_policy_failure_naming_the_feature():
    failure = StartupFailure(
        StartupFailureCode.FEATURE_REQUIRED, "no CUDA device: ...", "device", "cuda-graphs"
    )
    decision = admit(AUTO, cache_intent(AUTO), failure)
    assert decision.policy_failure and decision.feature == "cuda-graphs"
    assert (
        decision.reason
        == "its startup failed (feature-required) [device]: --cuda-graphs on: no CUDA device: ..."
    )
