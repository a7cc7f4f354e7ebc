"""Drift while serving (issue 21, item 6): router/drift.py's judgment, and the router acting on it in-process
(real Registry and Generation servers on loopback, a Worker double): one log event, the metric, the state
reason in ClusterStatus and `router status`'s table; under `on` the heartbeat reply says drain.
tests/integration/test_drift.py runs it with a real worker process."""

from dataclasses import replace

from prometheus_client import generate_latest
from structlog.testing import capture_logs

from kvpact.client import AsyncClient, render_cluster_status
from kvpact.router.drift import REALIZED_UNDER_OFF, Drift, judge
from kvpact.shared import handshake_pb
from kvpact.shared.features import FeatureMode, FeatureState, updated_states
from kvpact.shared.handshake import WorkerLoad
from kvpact.shared.reasons import CPU_KERNELS_BUILD
from kvpact.v1 import router_pb2, worker_pb2
from tests.router.doubles import (
    PAGED_ATTN_REALIZED,
    paged_realized,
    ready,
    registry_stub,
    run_async,
    running_router,
)

ON, OFF, AUTO = FeatureMode.ON, FeatureMode.OFF, FeatureMode.AUTO
KERNELS_ON = FeatureState("cpu-kernels", AUTO, True)
BUILD = CPU_KERNELS_BUILD.found(error="cc exited 1")
KERNELS_OFF = FeatureState("cpu-kernels", AUTO, False, BUILD.code, BUILD.message, BUILD.component)
PREFIX_ON = FeatureState("prefix-caching", AUTO, True)
IDLE = WorkerLoad()


def test_a_feature_lost_while_serving_violates_on_and_is_only_reported_under_auto():
    for mode, violates in ((ON, True), (AUTO, False)):
        (d,) = judge({"cpu-kernels": mode}, (KERNELS_ON, PREFIX_ON), (KERNELS_OFF, PREFIX_ON), IDLE, IDLE)
        assert d == Drift(
            "cpu-kernels",
            "c-kernels-build",
            f"cpu-kernels realized off while serving under --policy cpu-kernels={mode.value} "
            "([build] c-kernels-build: the C kernels cannot be built here: cc exited 1)",
            violates,
        )


def test_nothing_changed_no_states_or_a_feature_back_on_is_no_drift():
    assert judge({"cpu-kernels": ON}, (KERNELS_ON,), (KERNELS_ON,), IDLE, IDLE) == []
    assert judge({"cpu-kernels": ON}, (KERNELS_OFF,), (KERNELS_OFF,), IDLE, IDLE) == []  # judged on change
    assert judge({"cpu-kernels": AUTO}, (KERNELS_OFF,), (KERNELS_ON,), IDLE, IDLE) == []
    assert judge({"cpu-kernels": ON}, (), (KERNELS_OFF,), IDLE, IDLE) == []  # nothing to compare with


def test_a_feature_that_turns_on_under_policy_off_violates_it():
    (d,) = judge({"cpu-kernels": OFF}, (KERNELS_OFF,), (KERNELS_ON,), IDLE, IDLE)
    assert (d.reason, d.violates) == (REALIZED_UNDER_OFF, True)
    assert d.message == "cpu-kernels realized on while serving under --policy cpu-kernels=off"


def test_the_counters_eager_steps_under_graphs_and_compiles_after_ready():
    before, after = WorkerLoad(eager_steps_under_graphs=2), WorkerLoad(eager_steps_under_graphs=5)
    (d,) = judge({"cuda-graphs": ON}, (), (), before, after)
    assert d == Drift(
        "cuda-graphs",
        "eager-steps-while-serving",
        "3 decode steps ran eagerly while serving although CUDA graphs were realized "
        "(under --policy cuda-graphs=on)",
        True,
    )
    assert not judge({}, (), (), before, after)[0].violates  # auto: reported
    assert judge({}, (), (), after, after) == []
    (c,) = judge({"paged-attn": ON}, (), (), IDLE, WorkerLoad(kernel_compiles_after_ready=1))
    assert (c.feature, c.reason, c.violates) == ("paged-attn", "kernel-compile-after-ready", False)
    assert c.message.startswith("1 Triton paged kernel variants compiled after the worker was ready")


def beat(rid: str, *features: FeatureState) -> worker_pb2.HeartbeatRequest:
    return worker_pb2.HeartbeatRequest(
        worker_id="a", registration_id=rid, features=[handshake_pb.feature_to_pb(f) for f in features]
    )


@run_async
async def test_the_router_reports_drift_under_auto_and_drains_under_on():
    realized = replace(paged_realized(), features=(PAGED_ATTN_REALIZED, PREFIX_ON, KERNELS_ON))
    for mode in (AUTO, ON):
        async with (
            running_router(policies=(("cpu-kernels", mode),)) as router,
            registry_stub(router) as registry,
            AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
        ):
            admission = await registry.Register(ready("a", "127.0.0.1:1", realized))
            assert admission.admitted, admission.reason
            rid = admission.registration_id
            assert not (await registry.Heartbeat(beat(rid, PREFIX_ON, KERNELS_ON))).drain
            with capture_logs() as logs:
                reply = await registry.Heartbeat(beat(rid, PREFIX_ON, KERNELS_OFF))
                again = await registry.Heartbeat(beat(rid, PREFIX_ON, KERNELS_OFF))
            events = [e for e in logs if e["event"] == "worker_drift"]
            assert len(events) == 1, logs  # one change, one event
            assert (events[0]["worker_id"], events[0]["feature"], events[0]["reason"]) == (
                "a", "cpu-kernels", "c-kernels-build"
            )  # fmt: skip
            assert events[0]["action"] == ("drain" if mode is ON else "report")
            assert (reply.drain, again.drain) == ((True, True) if mode is ON else (False, False))
            metrics = generate_latest(router.metrics.prometheus).decode()
            assert 'kvpact_worker_drift_total{feature="cpu-kernels",reason="c-kernels-build"} 1.0' in metrics
            assert (
                'kvpact_worker_feature_realized{feature="cpu-kernels",realized="off",requested="auto"} 1.0'
                in metrics
            )
            (w,) = (await client.cluster_status()).workers
            expected_reason = (
                f"drift: cpu-kernels realized off while serving under --policy cpu-kernels={mode.value} "
                "([build] c-kernels-build: the C kernels cannot be built here: cc exited 1)"
            )
            if mode is ON:
                assert w.state == router_pb2.WORKER_STATE_DRAINING
                assert w.state_reason == f"draining: {expected_reason}"
                assert reply.drain_reason == expected_reason
            else:
                assert w.state == router_pb2.WORKER_STATE_ADMITTED and w.state_reason == expected_reason
            # the beat's states replace those it names; paged-attn, which it omits, stays as admitted
            assert [(f.name, f.realized) for f in w.realized.features] == [
                ("paged-attn", True), ("prefix-caching", True), ("cpu-kernels", False)
            ]  # fmt: skip
            table = render_cluster_status(await client.cluster_status())
            assert "+prefix-caching !cpu-kernels" in table
            assert f"  a: {w.state_reason}" in table


def test_a_beat_updates_the_states_it_names_and_keeps_the_others_in_their_order():
    graphs = FeatureState("cuda-graphs", AUTO, True)
    before = (PAGED_ATTN_REALIZED, PREFIX_ON, KERNELS_ON)
    assert updated_states(before, (KERNELS_OFF, graphs)) == (
        PAGED_ATTN_REALIZED,
        PREFIX_ON,
        KERNELS_OFF,
        graphs,
    )
    assert updated_states(before, ()) == before
