"""The router in-process against real Worker servers on loopback (WorkerDouble): startup, relay,
routing, cancellation, deadlines, heartbeats, auth, health and reflection."""

import asyncio
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpact.client import AsyncClient, KvpactRpcError
from kvpact.router.server import STATUS_FOR_ERROR
from kvpact.router.service import GenerationService
from kvpact.shared.handshake import LoadingPlan
from kvpact.shared.intent import Fallback
from kvpact.shared.rpc_errors import ErrorInterceptor
from kvpact.v1 import cache_pb2, generation_pb2, router_pb2, router_pb2_grpc, worker_pb2
from tests.factories.eventually import eventually_async
from tests.router.doubles import (
    EAGER_CPU_REASON,
    ManualClock,
    WorkerDouble,
    eager_realized,
    failed,
    loading,
    one_worker_router,
    paged_attn_off,
    ready,
    registry_stub,
    run_async,
    running_router,
    serving_double,
)

TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"


def target(router):
    return f"127.0.0.1:{router.port}"


@run_async
async def test_starting_then_serving_with_health_and_status():
    async with (
        running_router(policy=_mode("on"), num_expected_workers=2) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
        grpc.aio.insecure_channel(target(router)) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvpact.v1.Generation"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("hi")
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        assert err.value.details == "cluster is starting (0 of 2 workers admitted)"

        admission = await registry.Register(ready("a", a.address))
        assert admission.admitted and admission.heartbeat_interval_ms == 2000
        assert admission.cluster_policy == 2  # PAGED_ATTENTION_MODE_ON
        status = await client.cluster_status()
        assert status.state == router_pb2.CLUSTER_STATE_STARTING
        with pytest.raises(KvpactRpcError, match=r"1 of 2 workers admitted"):
            await client.list_models()

        assert (await registry.Register(ready("b", b.address))).admitted
        status = await client.cluster_status()
        assert status.state == router_pb2.CLUSTER_STATE_SERVING
        assert [
            (w.worker_id, w.state, w.realized.kind, w.realized.capacity_tokens) for w in status.workers
        ] == [
            ("a", router_pb2.WORKER_STATE_ADMITTED, 1, 1024),
            ("b", router_pb2.WORKER_STATE_ADMITTED, 1, 1024),
        ]
        assert (
            status.workers[0].requested.cache.mode == 2
            and status.workers[0].capabilities.device_kind == "cpu"
        )
        for service in ("", "kvpact.v1.Generation"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert [(m.name, m.max_model_len, m.num_workers) for m in await client.list_models()] == [
            ("tiny", 256, 2)
        ]


@run_async
async def test_reflection_lists_the_services():
    async with running_router() as router, grpc.aio.insecure_channel(target(router)) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names = set()
        async for reply in stub.ServerReflectionInfo(iter([request])):
            names |= {s.name for s in reply.list_services_response.service}
        assert {"kvpact.v1.Generation", "kvpact.v1.Registry", "grpc.health.v1.Health"} <= names


@run_async
async def test_a_worker_that_cannot_honor_on_fails_the_cluster_at_once():
    async with (
        # a third worker never comes: the router lingers for it no longer than --failed-linger
        running_router(
            policy=_mode("on"), num_expected_workers=3, startup_timeout_s=60, failed_linger_s=0.3
        ) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        started = time.monotonic()
        admission = await registry.Register(failed("b", TRITON_REASON, address=b.address))
        assert not admission.admitted and TRITON_REASON in admission.reason
        assert await asyncio.wait_for(router.wait(), 2.0) == 78
        assert time.monotonic() - started < 2.0
        assert a.shutdown_reasons and b.shutdown_reasons  # every registered worker was told to stop
        assert TRITON_REASON in a.shutdown_reasons[0]
        report = router.report.getvalue()
        assert report.count("kvpact router: the cluster FAILED to start") == 1
        assert 'worker "a"' in report and 'worker "b"' in report and TRITON_REASON in report
        assert "--paged-attn on --pa-backend triton" in report
        assert report.rstrip().endswith(
            "exit code 78: the --paged-attn policy cannot be honored by every worker"
        )
        status = await _status(router)
        assert status.state == router_pb2.CLUSTER_STATE_FAILED and status.failure_report == report.rstrip(
            "\n"
        )


@run_async
async def test_a_worker_whose_realized_state_misses_the_policy_fails_the_startup():
    async with (
        running_router(policy=_mode("on"), num_expected_workers=2, failed_linger_s=0.3) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
    ):
        eager = eager_realized(Fallback("device", EAGER_CPU_REASON))
        admission = await registry.Register(ready("a", a.address, eager, mode="auto"))
        assert not admission.admitted and EAGER_CPU_REASON in admission.reason
        assert await asyncio.wait_for(router.wait(), 2.0) == 78
        assert EAGER_CPU_REASON in router.report.getvalue()


@run_async
async def test_a_late_worker_that_misses_the_policy_is_refused_alone():
    async with (
        running_router(policy=_mode("on")) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        late = await registry.Register(failed("late", TRITON_REASON))
        assert not late.admitted and TRITON_REASON in late.reason
        off = await registry.Register(ready("off", "127.0.0.1:1", eager_realized(), mode="off"))
        assert not off.admitted and "started with --paged-attn off" in off.reason
        assert router.cluster.finished.is_set() is False
        completion = await client.complete("hello", max_tokens=3)
        assert completion.worker_id == "a" and completion.finish_reason == "length"
        states = {w.worker_id: w.state for w in (await client.cluster_status()).workers}
        assert states == {
            "a": router_pb2.WORKER_STATE_ADMITTED,
            "late": router_pb2.WORKER_STATE_FAILED,
            "off": router_pb2.WORKER_STATE_REFUSED,
        }
        beat = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="off", registration_id=off.registration_id)
        )
        assert beat.known and beat.shutdown


@run_async
async def test_generate_relays_exactly_what_the_worker_streams():
    async with (
        running_router(policy=_mode("auto")) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        eager = eager_realized(Fallback("device", EAGER_CPU_REASON))
        admission = await registry.Register(ready("a", a.address, eager, mode="auto"))
        assert admission.admitted and EAGER_CPU_REASON in admission.reason
        chunks = [c async for c in client.generate([1, 2, 3, 4], max_tokens=5, temperature=0.0)]
        # The tokens and text as the worker streamed them; chunks that were ready together may have been
        # merged into one message (router/coalesce.py), so only the last one carries the finish.
        assert [t for c in chunks for t in c.token_ids] == [4, 5, 6, 7, 8]
        assert "".join(c.text for c in chunks) == "t4 t5 t6 t7 t8 "
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert chunks[-1].usage.completion_tokens == 5 and {c.worker_id for c in chunks} == {"a"}
        forwarded = a.requests[-1]
        assert (
            forwarded.model == "tiny" and forwarded.request_id
        )  # the router named the model and the request
        assert forwarded.sampling.HasField("temperature") and forwarded.sampling.temperature == 0.0

        completion = await client.chat([{"role": "user", "content": "hey"}], max_tokens=2, request_id="r1")
        assert (
            completion.token_ids == (0, 1) and completion.text == "t0 t1 " and completion.request_id == "r1"
        )
        assert a.requests[-1].chat.messages[0].content == "hey"
        status = await client.cluster_status()
        assert [f.reason for f in status.workers[0].realized.fallbacks] == [EAGER_CPU_REASON]


@run_async
async def test_models_route_by_name():
    async with (
        running_router(num_expected_workers=2) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        await registry.Register(ready("a", a.address, mode="auto", model="llama"))
        await registry.Register(ready("b", b.address, mode="auto", model="qwen"))
        assert (await client.complete("x", model="qwen", max_tokens=1)).worker_id == "b"
        assert (await client.complete("x", model="llama", max_tokens=1)).worker_id == "a"
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("x", model="mistral")
        assert err.value.code is grpc.StatusCode.NOT_FOUND
        assert err.value.details == "model 'mistral' is not served here; served models: llama, qwen"
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("x")
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


@run_async
async def test_the_balance_spreads_concurrent_streams():
    async with (
        running_router(num_expected_workers=2) as router,
        serving_double(WorkerDouble("a", delay_s=0.02)) as a,
        serving_double(WorkerDouble("b", delay_s=0.02)) as b,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        await registry.Register(ready("a", a.address))
        await registry.Register(ready("b", b.address))
        done = await asyncio.gather(*(client.complete("x", max_tokens=5) for _ in range(20)))
        counts = {w: sum(1 for c in done if c.worker_id == w) for w in ("a", "b")}
        assert sum(counts.values()) == 20 and abs(counts["a"] - counts["b"]) <= 2, counts


@run_async
async def test_client_cancellation_cancels_the_worker_call():
    a = WorkerDouble("a", delay_s=0.05)
    async with one_worker_router(a) as (router, client):
        stream = client.generate("hello", max_tokens=1000)
        first = await anext(stream)
        assert first.token_ids and len(a.active) == 1
        await stream.aclose()  # cancels the client call
        await eventually_async(lambda: not a.active, what="the worker's request to be cancelled")
        assert len(a.cancelled) == 1
        await eventually_async(
            lambda: router.cluster.registry.get("a").num_outstanding == 0, what="outstanding 0"
        )


class _NoDeadline:
    """The little of a grpc.aio ServicerContext that the relay reads."""

    def time_remaining(self):
        return None


@pytest.mark.parametrize("intercepted", [False, True], ids=["handler", "through-the-interceptor"])
@run_async
async def test_closing_the_relay_ends_the_worker_call_before_close_returns(intercepted):
    """What the gRPC server does when a client goes away mid-stream: it closes the handler's generator.
    The worker call must be over when that returns, not whenever an abandoned generator is finalized."""
    a = WorkerDouble("a", delay_s=0.05)
    async with one_worker_router(a) as (router, _):
        handler = GenerationService(router.cluster).Generate
        if intercepted:
            handler = ErrorInterceptor(STATUS_FOR_ERROR, "router").wrap_stream("Generate", handler)
        relay = handler(generation_pb2.GenerateRequest(text="hello", max_tokens=1000), _NoDeadline())
        assert (await anext(relay)).token_ids
        entry = router.cluster.registry.get("a")
        assert entry.num_outstanding == 1
        await relay.aclose()
        assert entry.num_outstanding == 0
        await eventually_async(lambda: a.cancelled, what="the worker's request to be cancelled")


@run_async
async def test_a_deadline_shorter_than_the_generation_is_deadline_exceeded_and_reaches_the_worker():
    a = WorkerDouble("a", delay_s=0.05)
    async with one_worker_router(a) as (_, client):
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("hello", max_tokens=1000, timeout=0.5)
        assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert a.timeouts[-1] is not None and 0 < a.timeouts[-1] < 0.55  # the deadline travelled on
        await eventually_async(lambda: not a.active, what="the worker's request to end")
        # No deadline from the client: none to the worker either.
        await client.complete("x", max_tokens=1)
        assert a.timeouts[-1] is None


@run_async
async def test_an_unreachable_worker_is_unavailable_naming_it_but_not_its_address():
    async with (
        running_router() as router,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        await registry.Register(ready("gone", "127.0.0.1:1"))
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("x", timeout=5)
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        assert err.value.details.startswith('worker "gone" could not serve request ')
        assert "127.0.0.1" not in err.value.details and "the router's log has the cause" in err.value.details


@run_async
async def test_heartbeats_keep_workers_alive_and_silence_marks_them_dead():
    clock = ManualClock()  # heartbeat ages move only when the test says so
    async with (
        running_router(clock=clock, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.4) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        admission = await registry.Register(ready("a", a.address))
        assert admission.heartbeat_interval_ms == 100
        before_first_beat = (await client.cluster_status()).workers[0].load
        realized_blocks = ready("a", a.address).ready.num_blocks
        assert before_first_beat.num_free_blocks == before_first_beat.num_total_blocks == realized_blocks > 0
        assert (await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="nobody"))).known is False
        load = worker_pb2.WorkerLoad(
            num_running=2, num_waiting=1, num_free_blocks=40, num_total_blocks=64, tokens_per_second=12.5
        )
        rid = admission.registration_id
        beat = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", load=load, registration_id=rid)
        )
        assert beat.known and not beat.shutdown
        assert (await client.cluster_status()).workers[0].load == load
        clock.advance(0.3)  # under --heartbeat-timeout since the last beat: a beat keeps it alive
        again = worker_pb2.HeartbeatRequest(worker_id="a", load=load, registration_id=rid)
        assert (await registry.Heartbeat(again)).known
        clock.advance(0.3)
        assert (await client.complete("x", max_tokens=1)).worker_id == "a"

        clock.advance(0.2)  # 0.5 s of silence, past --heartbeat-timeout 0.4
        await eventually_async(lambda: router.cluster.registry.get("a").state.value == "dead", what="DEAD")
        status = await client.cluster_status()
        assert status.workers[0].state == router_pb2.WORKER_STATE_DEAD
        assert status.workers[0].seconds_since_heartbeat == pytest.approx(0.5)
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("x")
        assert err.value.code is grpc.StatusCode.UNAVAILABLE and "no live worker" in err.value.details

        revived = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", load=load, registration_id=rid)
        )
        assert revived.known
        assert (await client.complete("x", max_tokens=1)).worker_id == "a"


@run_async
async def test_auth_token_is_required_for_register_and_heartbeat():
    async with (
        running_router(auth_tokens=("s3cret",)) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
    ):
        for handshake in (ready("a", a.address), ready("a", a.address, token="wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await registry.Register(handshake)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "s3cret" not in err.value.details()
        assert router.cluster.registry.get("a") is None
        admission = await registry.Register(ready("a", a.address, token="s3cret"))
        assert admission.admitted
        rid = admission.registration_id
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="a", registration_id=rid))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        ok = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", auth_token="s3cret", registration_id=rid)
        )
        assert ok.known


@run_async
async def test_startup_timeout_names_who_is_missing():
    async with (
        running_router(num_expected_workers=3, startup_timeout_s=0.5) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
    ):
        await registry.Register(ready("a", a.address))
        assert await asyncio.wait_for(router.wait(), 5.0) == 1
        report = router.report.getvalue()
        assert '1 of 3 workers admitted: 2 missing (registered: "a")' in report
        assert a.shutdown_reasons


@run_async
async def test_a_loading_worker_is_told_to_stop_when_another_fails_and_named_in_the_report():
    async with (
        running_router(policy=_mode("on"), num_expected_workers=2, startup_timeout_s=60) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        announced = await registry.Register(loading("a", a.address))
        assert not announced.admitted and announced.pending
        assert "plans a PAGED KV cache (torch backend)" in announced.reason
        status = await _status(router)
        assert status.state == router_pb2.CLUSTER_STATE_STARTING
        [a_status] = status.workers
        assert a_status.state == router_pb2.WORKER_STATE_LOADING
        assert a_status.planned.planned_kind == cache_pb2.CACHE_KIND_PAGED
        assert a_status.planned.planned_backend == cache_pb2.PAGED_BACKEND_TORCH
        assert not a_status.HasField("realized")
        with pytest.raises(KvpactRpcError, match=r"0 of 2 workers admitted"):  # loading is not admitted
            async with AsyncClient(target(router)) as client:
                await client.complete("hi")
        assert a.requests == []

        started = time.monotonic()
        refused = await registry.Register(failed("b", TRITON_REASON, address=b.address))
        assert not refused.admitted and not refused.pending
        assert await asyncio.wait_for(router.wait(), 2.0) == 78
        assert time.monotonic() - started < 2.0
        assert a.shutdown_reasons and TRITON_REASON in a.shutdown_reasons[0]  # the loading worker too
        report = router.report.getvalue()
        a_block = report.split('worker "a"')[1].split('worker "b"')[0]
        assert ": LOADING" in a_block
        assert "planned:   PAGED (torch backend)" in a_block
        assert "shutdown:  sent" in a_block
        assert "0 admitted" in report


@run_async
async def test_a_worker_that_does_not_answer_its_shutdown_in_time_is_asked_again_until_it_does():
    # a loading worker's event loop can be slow to answer (session 33 saw 0.8 s pass on a loaded host)
    healthy = WorkerDouble("a")
    healthy.shutdown_delays = [0.6]  # the first Shutdown outlasts the router's 0.2 s bound
    async with (
        running_router(
            policy=_mode("on"), num_expected_workers=2, shutdown_timeout_s=0.2, failed_linger_s=20
        ) as router,
        serving_double(healthy) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(loading("a", a.address))).pending
        started = time.monotonic()
        await registry.Register(failed("b", TRITON_REASON, address=b.address))
        assert await asyncio.wait_for(router.wait(), 5.0) == 78  # long before --failed-linger's 20 s
        assert time.monotonic() - started < 5.0 and len(a.shutdown_reasons) >= 2  # asked again
        block = router.report.getvalue().split('worker "a"')[1].split('worker "b"')[0]
        assert "shutdown:  could not be told (DEADLINE_EXCEEDED" in block and "asked again" in block


@run_async
async def test_a_worker_whose_port_is_closed_is_not_asked_again_and_the_router_exits_at_once():
    closed = socket.socket()  # a port nobody listens on: the worker's process is gone
    closed.bind(("127.0.0.1", 0))
    gone = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    async with (
        running_router(policy=_mode("on"), num_expected_workers=2, failed_linger_s=20) as router,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(loading("a", gone))).pending
        started = time.monotonic()
        await registry.Register(failed("b", TRITON_REASON, address=b.address))
        assert await asyncio.wait_for(router.wait(), 5.0) == 78  # not --failed-linger's 20 s
        assert time.monotonic() - started < 5.0
        block = router.report.getvalue().split('worker "a"')[1].split('worker "b"')[0]
        assert "shutdown:  could not be told (UNAVAILABLE" in block and "asked again" not in block


@run_async
async def test_a_plan_that_misses_the_policy_fails_the_cluster_before_it_loads():
    plan = LoadingPlan((paged_attn_off(Fallback("device", EAGER_CPU_REASON)),))
    async with (
        running_router(policy=_mode("on"), num_expected_workers=2, startup_timeout_s=60) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(loading("a", a.address))).pending
        refused = await registry.Register(loading("b", b.address, plan, mode="auto"))
        assert not refused.admitted and not refused.pending
        assert f"plans an EAGER KV cache under --paged-attn auto because [device] {EAGER_CPU_REASON}" in (
            refused.reason
        )
        assert await asyncio.wait_for(router.wait(), 2.0) == 78
        # "a" is told to stop; "b" is not: a Shutdown could reach it before its refusal, and it would exit
        # 0 instead of 78 (a clean-clone run saw that race)
        assert a.shutdown_reasons and not b.shutdown_reasons
        report = router.report.getvalue()
        assert "shutdown:  not asked (its refusal tells it to stop)" in report.split('worker "b"')[-1]
        assert 'worker "b" was refused while the cluster was starting' in report
        assert f"planned:   EAGER; fell back because [device] {EAGER_CPU_REASON}" in report


@run_async
async def test_loading_then_ready_is_admitted_and_serves():
    async with (
        running_router(policy=_mode("on"), num_expected_workers=1) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
        AsyncClient(target(router)) as client,
    ):
        assert (await registry.Register(loading("a", a.address))).pending
        admission = await registry.Register(ready("a", a.address))
        assert admission.admitted and not admission.pending
        status = await client.cluster_status()
        assert status.state == router_pb2.CLUSTER_STATE_SERVING
        assert [(w.worker_id, w.state) for w in status.workers] == [("a", router_pb2.WORKER_STATE_ADMITTED)]
        assert status.workers[0].realized.kind == cache_pb2.CACHE_KIND_PAGED
        assert status.workers[0].planned.planned_kind == cache_pb2.CACHE_KIND_PAGED  # what it announced
        assert [c.token_ids[0] async for c in client.generate("hey", max_tokens=2)] == [3, 4]


@run_async
async def test_a_loading_worker_is_never_marked_dead_and_the_timeout_names_it_as_loading():
    clock = ManualClock()
    async with (
        running_router(
            clock=clock,
            num_expected_workers=2,
            startup_timeout_s=1.0,
            heartbeat_interval_s=0.05,
            heartbeat_timeout_s=0.2,
        ) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(loading("a", a.address))).pending
        clock.advance(10.0)  # far past --heartbeat-timeout without a heartbeat; the liveness watcher
        # runs every 0.025 s until the startup timeout (1 s), and never marks it DEAD:
        assert await asyncio.wait_for(router.wait(), 5.0) == 1
        report = router.report.getvalue()
        assert '0 of 2 workers admitted: 1 still loading ("a"), 1 missing (registered: "a")' in report
        assert a.shutdown_reasons


def bad_spec_handshake(*, mode: int = cache_pb2.PAGED_ATTENTION_MODE_ON, memory_fraction: float = 0.5):
    """A failed-outcome handshake whose spec an honest worker could never send."""
    hs = worker_pb2.Handshake(worker_id="w", failed=worker_pb2.StartupFailure(reason="x"))
    hs.spec.cache.mode = mode  # type: ignore[assignment]
    hs.spec.cache.paged.memory_fraction = memory_fraction
    return hs


@run_async
async def test_bad_handshakes_are_invalid_argument():
    zero_threads = bad_spec_handshake()
    zero_threads.spec.threads = 0
    async with running_router() as router, registry_stub(router) as registry:
        for handshake, words in [
            (worker_pb2.Handshake(address="x:1"), "worker_id is empty"),
            (worker_pb2.Handshake(worker_id="w"), "neither `ready` nor `failed`"),
            (bad_spec_handshake(mode=42), "WorkerSpec is malformed"),
            (bad_spec_handshake(memory_fraction=7.0), "--pa-memory-fraction must be in (0, 1]"),
            (zero_threads, "--threads: expected a whole number > 0"),  # the bounds the worker's parser checks
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await registry.Register(handshake)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


@run_async
async def test_hundreds_of_concurrent_streams_share_one_worker_channel():
    async with one_worker_router(WorkerDouble("a", delay_s=0.01), client_timeout=30) as (router, client):

        async def one(i):
            return [c.token_ids[0] async for c in client.generate("p" * i, max_tokens=20)]

        results = await asyncio.gather(*(one(i) for i in range(300)))
        assert all(r == [(i + k) % 1000 for k in range(20)] for i, r in enumerate(results))
        assert router.cluster.registry.get("a").num_outstanding == 0


def _mode(value):
    from kvpact.shared.intent import PagedAttentionMode

    return PagedAttentionMode(value)


async def _status(router):
    async with AsyncClient(target(router)) as client:
        return await client.cluster_status()


@run_async
async def test_complete_refuses_n_above_one_naming_generate_and_carries_top_logprobs():
    double = WorkerDouble("a")
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Complete(generation_pb2.GenerateRequest(text="hi", max_tokens=4, n=2), timeout=10)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "call Generate for n > 1" in (info.value.details() or "")
            sampling = generation_pb2.SamplingParams(logprobs=True, top_logprobs=2)
            one = await stub.Complete(
                generation_pb2.GenerateRequest(text="hi", max_tokens=4, n=1, sampling=sampling), timeout=10
            )
            assert len(one.token_ids) == 4
            # top_logprobs come along, one per token, in order
            assert [list(t.token_ids) for t in one.top_logprobs] == [[t, t + 1] for t in one.token_ids]
