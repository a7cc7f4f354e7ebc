"""Overload and worker loss at the router (issue 11, items 1 and 2), in-process against real Worker
servers (doubles): the per-worker bound refuses with RESOURCE_EXHAUSTED naming it, a full worker sends
the request to one with room, a gone worker's not-yet-produced request is retried once elsewhere (and the
worker marked DEAD at once), and a stream that had produced tokens is never retried."""

import asyncio

import grpc
import pytest

from kvpact.client import AsyncClient, KvpactRpcError
from kvpact.router.balancing.route import route, with_room
from kvpact.router.errors import Overloaded
from kvpact.router.registry import Registry, WorkerState
from kvpact.v1 import router_pb2
from tests.router.doubles import WorkerDouble, ready, registry_stub, run_async, running_router, serving_double
from tests.router.test_route import entry

FULL = (grpc.StatusCode.RESOURCE_EXHAUSTED, "5 requests are already waiting (--max-waiting 5); retry later")


def test_route_only_offers_workers_with_room_to_the_balance():
    registry = Registry()
    for e in (entry("a", outstanding=2), entry("b", outstanding=4, free=99)):
        registry.add(e)
    assert [e.worker_id for e in with_room(registry.entries(), 3)] == ["a"]
    assert route(registry, "tiny", max_in_flight=3).worker_id == "a"
    assert route(registry, "tiny", max_in_flight=8, exclude={"a"}).worker_id == "b"
    with pytest.raises(Overloaded) as err:
        route(registry, "tiny", max_in_flight=2)
    assert err.value.details == (
        "every live worker of model 'tiny' already has 2 requests in flight from this router "
        "(--max-in-flight-per-worker 2); retry later, or add workers"
    )


@run_async
async def test_past_the_per_worker_bound_a_request_is_refused_at_once_and_accepted_ones_complete():
    async with (
        running_router(max_in_flight_per_worker=2) as router,
        serving_double(WorkerDouble("a", delay_s=0.05)) as a,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        streams = [client.generate(f"p{i}", max_tokens=10) for i in range(2)]
        firsts = [await anext(s) for s in streams]
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("one too many", max_tokens=1)
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(--max-in-flight-per-worker 2)" in err.value.details
        for first, stream in zip(firsts, streams, strict=True):
            rest = [c async for c in stream]
            assert len([first, *rest]) == 10 and rest[-1].finish_reason == "length"
        assert (await client.complete("room again", max_tokens=1)).worker_id == "a"


@run_async
async def test_a_full_worker_sends_the_request_to_one_with_room_and_all_full_is_resource_exhausted():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        for double in (a, b):
            assert (await registry.Register(ready(double.worker_id, double.address))).admitted
        a.refuse = FULL  # "a" is chosen first (same load, lower id) and is full
        reply = await client.complete("hi", max_tokens=3)
        assert reply.worker_id == "b" and len(reply.token_ids) == 3
        b.refuse = FULL
        with pytest.raises(KvpactRpcError) as err:
            await client.complete("hi", max_tokens=3)
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-waiting 5" in err.value.details
        states = {w.worker_id: w.state for w in (await client.cluster_status()).workers}
        assert states == {"a": router_pb2.WORKER_STATE_ADMITTED, "b": router_pb2.WORKER_STATE_ADMITTED}


@run_async
async def test_a_gone_worker_is_marked_dead_at_once_and_its_unstarted_request_retried_once_elsewhere():
    async with (
        running_router(heartbeat_timeout_s=60) as router,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        assert (await registry.Register(ready("a", "127.0.0.1:1"))).admitted  # nobody listens there
        assert (await registry.Register(ready("b", b.address))).admitted
        chunks = [c async for c in client.generate("hi", max_tokens=4)]
        assert {c.worker_id for c in chunks} == {"b"} and len(b.requests) == 1
        assert [t for c in chunks for t in c.token_ids] == WorkerDouble.tokens_for(b.requests[0])
        gone = router.cluster.registry.get("a")
        assert gone.state is WorkerState.DEAD and gone.state_reason.startswith(
            'a call to it failed: worker "a"'
        )
        assert (await client.cluster_status()).health == "SERVING"  # b is alive


@run_async
async def test_a_stream_that_produced_tokens_is_not_retried_and_ends_with_the_workers_status():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        async with serving_double(WorkerDouble("a", delay_s=0.05)) as a:
            assert (await registry.Register(ready("a", a.address))).admitted
            stream = client.generate("hi", max_tokens=100)
            first = await anext(stream)
            assert first.worker_id == "a"
            assert (await registry.Register(ready("b", b.address))).admitted
        # "a" stopped mid-stream (its server is gone)
        with pytest.raises(KvpactRpcError) as err:
            async for _ in stream:
                pass
        assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert 'worker "a"' in err.value.details
        await asyncio.sleep(0)
        assert b.requests == []  # never retried: the client already had tokens
