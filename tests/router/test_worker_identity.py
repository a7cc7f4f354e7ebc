"""One worker id, one worker (issue 11, item 6), in-process against real Worker servers (doubles):
a duplicate id is refused while its holder answers, taken over once it does not, heartbeats count only
for their registration, every relayed call ends with a status, and health follows the live workers."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.client import AsyncClient, KvpactRpcError
from kvpact.v1 import router_pb2, worker_pb2
from tests.router.doubles import WorkerDouble, ready, registry_stub, run_async, running_router, serving_double


async def health_of(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


@run_async
async def test_a_duplicate_id_is_refused_while_its_holder_answers_and_taken_over_once_it_does_not():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a", delay_s=0.02)) as holder,
        serving_double(WorkerDouble("a")) as impostor,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        first = await registry.Register(ready("a", holder.address))
        assert first.admitted and first.registration_id
        stream = client.generate("hello", max_tokens=40)
        chunks = [await anext(stream)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry.Register(ready("a", impostor.address))
        assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
        assert err.value.details() == (
            f'worker id "a" is held by a live worker at {holder.address} (admitted); give this worker '
            "another --worker-id, or stop that one first"
        )
        chunks += [c async for c in stream]  # the holder's stream is untouched
        assert sum(len(c.token_ids) for c in chunks) == 40 and chunks[-1].finish_reason == "length"
        [status] = (await client.cluster_status()).workers
        assert (status.address, status.state) == (holder.address, router_pb2.WORKER_STATE_ADMITTED)
        assert (await client.complete("x", max_tokens=1)).worker_id == "a"
        assert impostor.requests == []

        # The same worker registering again (same address) replaces its own entry.
        again = await registry.Register(ready("a", holder.address))
        assert again.admitted and again.registration_id != first.registration_id

    async with (
        running_router() as router,
        registry_stub(router) as registry,
        serving_double(WorkerDouble("a")) as restarted,
    ):
        async with serving_double(WorkerDouble("a")) as gone:
            assert (await registry.Register(ready("a", gone.address))).admitted
        # `gone` no longer answers: a worker restarted with the same id (another port) takes over.
        admission = await registry.Register(ready("a", restarted.address))
        assert admission.admitted
        assert router.cluster.registry.get("a").address == restarted.address


@run_async
async def test_a_heartbeat_counts_only_for_its_own_registration():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
    ):
        first = await registry.Register(ready("a", a.address))
        second = await registry.Register(ready("a", a.address))
        stale = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", registration_id=first.registration_id)
        )
        assert stale.known is False  # the worker behind `first` must register again
        assert (await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="a"))).known is False
        current = await registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="a", registration_id=second.registration_id)
        )
        assert current.known and not current.shutdown


@run_async
async def test_health_is_not_serving_while_no_worker_is_alive_and_a_dead_workers_load_is_not_shown():
    async with (
        running_router(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.4) as router,
        serving_double(WorkerDouble("a")) as a,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=10) as client,
    ):
        address = f"127.0.0.1:{router.port}"
        admission = await registry.Register(ready("a", a.address))
        busy = worker_pb2.WorkerLoad(num_running=3, num_free_blocks=10, num_total_blocks=64)
        rid = admission.registration_id
        beat = worker_pb2.HeartbeatRequest(worker_id="a", registration_id=rid, load=busy)
        assert (await registry.Heartbeat(beat)).known
        assert await health_of(address) == health_pb2.HealthCheckResponse.SERVING
        assert (await client.cluster_status()).health == "SERVING"

        for _ in range(100):  # silent: marked DEAD after 0.4 s
            if router.cluster.registry.get("a").state.value == "dead":
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert await health_of(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        status = await client.cluster_status()
        assert status.health == "NOT_SERVING" and status.state == router_pb2.CLUSTER_STATE_SERVING
        assert status.workers[0].state == router_pb2.WORKER_STATE_DEAD
        assert not status.workers[0].HasField("load")  # not its last load, as if still running

        assert (await registry.Heartbeat(beat)).known  # revived
        assert await health_of(address) == health_pb2.HealthCheckResponse.SERVING


@run_async
async def test_a_relayed_call_whose_worker_channel_is_cut_ends_with_unavailable():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a", delay_s=0.05)) as a,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        stream = client.generate("hello", max_tokens=200)
        await anext(stream)
        await router.cluster.channels.close_all()  # what replacing a worker's address does to its channel
        with pytest.raises(KvpactRpcError) as err:
            async for _ in stream:
                pass
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        assert err.value.details.startswith('worker "a": the call to it was cut off (request id ')
