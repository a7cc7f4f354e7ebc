"""The failure report: one block naming each worker, what it was asked, what it realized and why."""

from dataclasses import replace

from kvpact.router.registry import WorkerEntry, WorkerState
from kvpact.router.report import FailedStartup, render_failure_report
from kvpact.shared.describe import describe_intent, describe_realized
from kvpact.shared.features import FeatureIntents, FeatureMode, FeatureState
from kvpact.shared.handshake import StartupFailure, StartupFailureCode
from kvpact.shared.intent import (
    Fallback,
    PagedAttentionConfig,
    PagedAttentionMode,
    PagedBackend,
    cache_intent,
)
from kvpact.v1 import worker_pb2
from tests.router.doubles import EAGER_CPU_REASON, PAGED_ATTN_REALIZED, eager_realized, paged_realized, spec

TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"


def entry(worker_id, *, realized=None, failure=None, state, reason, mode="on", backend=PagedBackend.AUTO):
    return WorkerEntry(
        worker_id=worker_id,
        address=f"127.0.0.1:500{len(worker_id)}",
        model_name="tiny",
        spec=spec(mode, backend=backend),
        capabilities=worker_pb2.Capabilities(),
        realized=realized,
        failure=failure,
        state=state,
        state_reason=reason,
        last_heartbeat=0.0,
    )


def test_describe_intent_uses_the_flags():
    on = cache_intent(
        PagedAttentionMode.ON, PagedAttentionConfig(backend=PagedBackend.TRITON, context_tokens=64)
    )
    assert (
        describe_intent(on) == "--paged-attn on --pa-backend triton --pa-block-size 16 --pa-context-tokens 64"
    )
    assert describe_intent(cache_intent(PagedAttentionMode.OFF)) == "--paged-attn off"


def test_describe_realized():
    assert describe_realized(paged_realized()) == (
        "PAGED (torch backend), 64 blocks x 16 tokens = 1024 tokens, max model len 256"
    )
    assert describe_realized(eager_realized(Fallback("device", EAGER_CPU_REASON))) == (
        f"EAGER, 4 slots = 1024 tokens, max model len 256; fell back because [device] {EAGER_CPU_REASON}"
    )


def test_report_names_every_worker_what_it_was_asked_realized_and_why():
    a = entry("a", realized=paged_realized(), state=WorkerState.ADMITTED, reason="realized a PAGED KV cache")
    b = entry(
        "b",
        failure=StartupFailure(StartupFailureCode.PAGED_ATTENTION_REQUIRED, TRITON_REASON, "device"),
        state=WorkerState.FAILED,
        reason=f"its startup failed (paged-attention-required) [device]: {TRITON_REASON}",
        backend=PagedBackend.TRITON,
    )
    report = render_failure_report(
        FailedStartup(
            policy=PagedAttentionMode.ON,
            num_expected=2,
            cause=f'worker "b" was refused: {TRITON_REASON}',
            exit_code=78,
            workers=[a, b],
            shutdown={"a": "sent", "b": "could not be told (UNAVAILABLE: refused)"},
        )
    )
    assert report == "\n".join(
        [
            "kvpact router: the cluster FAILED to start (--paged-attn on, --expect-workers 2, 1 admitted)",
            f'cause: worker "b" was refused: {TRITON_REASON}',
            "",
            'worker "a" at 127.0.0.1:5001, model tiny: ADMITTED',
            "  asked:     --paged-attn on --pa-block-size 16",
            "  realized:  PAGED (torch backend), 64 blocks x 16 tokens = 1024 tokens, max model len 256",
            "  admission: realized a PAGED KV cache",
            "  shutdown:  sent",
            "",
            'worker "b" at 127.0.0.1:5001, model tiny: FAILED',
            "  asked:     --paged-attn on --pa-backend triton --pa-block-size 16",
            f"  failed:    (paged-attention-required) [device] {TRITON_REASON}",
            "  shutdown:  could not be told (UNAVAILABLE: refused)",
            "",
            "exit code 78: the --paged-attn policy cannot be honored by every worker",
        ]
    )


def test_report_without_workers():
    report = render_failure_report(
        FailedStartup(
            policy=PagedAttentionMode.AUTO,
            num_expected=1,
            cause="startup timed out",
            exit_code=1,
            workers=[],
            shutdown={},
        )
    )
    assert "no worker registered" in report
    assert report.endswith("exit code 1: the cluster did not come up")


def test_report_says_where_a_labelled_worker_runs():
    b = entry("b", realized=paged_realized(), state=WorkerState.ADMITTED, reason="realized a PAGED KV cache")
    b.labels = {"ray.node": "4b1c0e", "ray.bundle": "1"}
    report = render_failure_report(
        FailedStartup(PagedAttentionMode.ON, 2, "startup timed out", 1, workers=[b], shutdown={"b": "sent"})
    )
    assert (
        'worker "b" at 127.0.0.1:5001, model tiny: ADMITTED\n'
        "  placed:    ray.bundle=1 ray.node=4b1c0e\n  asked:" in report
    )


def test_report_names_each_workers_feature_that_a_policy_constrains_and_a_failed_feature_on():
    no_cuda = FeatureState(
        "cuda-graphs", FeatureMode.AUTO, False, "no-cuda-device", "no CUDA device", "device"
    )
    realized = replace(paged_realized(), features=(PAGED_ATTN_REALIZED, no_cuda))
    a = entry("a", realized=realized, state=WorkerState.REFUSED,
              reason="the cluster policy is --policy cuda-graphs=on and ...")  # fmt: skip
    a.spec = replace(a.spec, features=FeatureIntents(prefix_caching=FeatureMode.OFF))
    failed = StartupFailure(StartupFailureCode.FEATURE_REQUIRED, "no CUDA device", "device", "cuda-graphs")
    b = entry("b", failure=failed, state=WorkerState.FAILED, reason="its startup failed")
    report = render_failure_report(
        FailedStartup(PagedAttentionMode.AUTO, 2, 'worker "a" was refused', 78, workers=[a, b],
                      shutdown={}, policies={"cuda-graphs": FeatureMode.ON}, feature="cuda-graphs")
    )  # fmt: skip
    lines = report.splitlines()
    assert lines[0].startswith(
        "kvpact router: the cluster FAILED to start (--paged-attn auto, --policy cuda-graphs=on,"
    )
    assert "  asked:     --paged-attn on --pa-block-size 16 --prefix-caching off" in lines
    assert "  feature:   cuda-graphs off [device] no-cuda-device: no CUDA device" in lines
    assert "  failed:    (feature-required) [device] --cuda-graphs on: no CUDA device" in lines
    assert lines[-1] == (
        "exit code 78: the cuda-graphs policy (--policy cuda-graphs, or a worker's --cuda-graphs on) "
        "cannot be honored by every worker"
    )
