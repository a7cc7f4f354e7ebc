"""Graceful drain at the router (issue 11, item 3), in-process against real Worker servers (doubles):
a worker that says it is draining is DRAINING in ClusterStatus and gets nothing new, then leaves; a
router told to stop says NOT_SERVING and refuses new calls at once while in-flight streams finish."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.client import AsyncClient, KvpactRpcError
from kvpact.router.registry import WorkerState
from kvpact.v1 import router_pb2, worker_pb2
from tests.router.doubles import WorkerDouble, ready, registry_stub, run_async, running_router, serving_double


@run_async
async def test_a_draining_worker_gets_nothing_new_is_shown_draining_and_leaves():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a", delay_s=0.02)) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        admitted = {}
        for double in (a, b):
            admitted[double.worker_id] = await registry.Register(ready(double.worker_id, double.address))
        stream = client.generate("long", max_tokens=30)
        assert (await anext(stream)).worker_id == "a"
        rid = admitted["a"].registration_id
        beat = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", registration_id=rid, draining=True)
        )
        assert beat.known and not beat.shutdown
        by_id = {w.worker_id: w for w in (await client.cluster_status()).workers}
        assert by_id["a"].state == router_pb2.WORKER_STATE_DRAINING
        assert [(await client.complete(f"n{i}", max_tokens=1)).worker_id for i in range(3)] == ["b"] * 3
        assert len([c async for c in stream]) == 29  # its in-flight stream finishes
        left = await registry.Deregister(worker_pb2.DeregisterRequest(worker_id="a", registration_id=rid))
        assert left.known
        assert [w.worker_id for w in (await client.cluster_status()).workers] == ["b"]
        stale = await registry.Deregister(worker_pb2.DeregisterRequest(worker_id="b", registration_id="old"))
        assert not stale.known and router.cluster.registry.get("b") is not None


@run_async
async def test_a_stopping_router_is_not_serving_refuses_new_calls_and_lets_in_flight_streams_finish():
    async with (
        running_router(drain_timeout_s=10) as router,
        serving_double(WorkerDouble("a", delay_s=0.02)) as a,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
        grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel,
    ):
        admission = await registry.Register(ready("a", a.address))
        stream = client.generate("long", max_tokens=40)
        await anext(stream)
        drain = asyncio.create_task(router.cluster.drain_and_exit(0))
        await asyncio.sleep(0.1)
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("new", max_tokens=1)
        assert err.value.code is grpc.StatusCode.UNAVAILABLE and "the router is stopping" in err.value.details
        beat = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", registration_id=admission.registration_id)
        )
        assert beat.router_stopping  # the workers are told
        assert not router.cluster.finished.is_set()
        assert len([c async for c in stream]) == 39  # the in-flight stream finishes
        await asyncio.wait_for(drain, 5)
        assert router.cluster.finished.is_set() and router.cluster.exit_code == 0


@run_async
async def test_a_stopping_router_waits_for_a_stream_whose_worker_has_already_left_the_registry():
    """A worker deregisters once its engine is done, while the router may still be relaying that worker's
    chunks (seen under `ray job stop`: two streams cut at 103 and 105 of 200 tokens, gRPC's bare
    "Cancelling all calls"). The drain waits for every relay, whichever worker it came from."""
    async with (
        running_router(drain_timeout_s=10) as router,
        serving_double(WorkerDouble("a", delay_s=0.02)) as a,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        admission = await registry.Register(ready("a", a.address))
        stream = client.generate("long", max_tokens=40)
        await anext(stream)
        drain = asyncio.create_task(router.cluster.drain_and_exit(0))
        left = worker_pb2.DeregisterRequest(worker_id="a", registration_id=admission.registration_id)
        assert (await registry.Deregister(left)).known
        await asyncio.sleep(0.2)
        assert not router.cluster.finished.is_set()  # still relaying a's stream
        assert len([c async for c in stream]) == 39
        await asyncio.wait_for(drain, 5)
        assert router.cluster.finished.is_set() and router.cluster.exit_code == 0


@run_async
async def test_registry_drain_routes_nothing_new_and_says_drain_in_every_heartbeat_reply_until_it_leaves():
    """Registry.Drain (kvpact-launch scaling down): DRAINING at once, `drain` with its reason in each
    heartbeat reply (a worker that was DEAD and beats again stays DRAINING), gone once it deregisters."""
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        rid = (await registry.Register(ready("a", a.address))).registration_id
        await registry.Register(ready("b", b.address))
        beat = worker_pb2.HeartbeatRequest(worker_id="a", registration_id=rid)
        assert not (await registry.Heartbeat(beat)).drain
        reply = await registry.Drain(worker_pb2.DrainRequest(worker_id="a", reason="scale-down"))
        assert (reply.known, reply.state) == (True, "draining")
        assert not (await registry.Drain(worker_pb2.DrainRequest(worker_id="zz"))).known
        by_id = {w.worker_id: w for w in (await client.cluster_status()).workers}
        assert by_id["a"].state == router_pb2.WORKER_STATE_DRAINING
        assert by_id["a"].state_reason == "draining: scale-down"
        assert [(await client.complete(f"n{i}", max_tokens=1)).worker_id for i in range(3)] == ["b"] * 3
        told = await registry.Heartbeat(beat)
        assert (told.known, told.drain, told.drain_reason, told.shutdown) == (True, True, "scale-down", False)
        router.cluster.registry.get("a").state = WorkerState.DEAD  # missed beats meanwhile
        assert (await registry.Heartbeat(beat)).drain
        assert router.cluster.registry.get("a").state is WorkerState.DRAINING  # not revived to ADMITTED
        await registry.Deregister(worker_pb2.DeregisterRequest(worker_id="a", registration_id=rid))
        assert [w.worker_id for w in (await client.cluster_status()).workers] == ["b"]


@run_async
async def test_registry_drain_reports_the_streams_in_flight_as_the_drain_found_them():
    """kvpact-launch prints the count the reply carries: the streams on the worker when it was drained,
    not what is left after the router updated its health (they go on finishing meanwhile)."""
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
    ):
        await registry.Register(ready("a", a.address))
        entry = router.cluster.registry.get("a")
        entry.num_outstanding = 2  # two streams relaying when the drain comes
        refresh = router.cluster.refresh_health

        async def while_they_finish() -> None:
            entry.num_outstanding = 0
            await refresh()

        router.cluster.refresh_health = while_they_finish  # type: ignore[method-assign]
        reply = await registry.Drain(worker_pb2.DrainRequest(worker_id="a", reason="scale-down"))
        assert (reply.known, reply.state, reply.num_outstanding) == (True, "draining", 2)
