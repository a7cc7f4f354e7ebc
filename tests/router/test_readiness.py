"""Router health is readiness: SERVING only while at least one admitted worker is live, per model too."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.router.readiness import model_service
from kvpact.v1 import worker_pb2
from tests.factories.eventually import eventually_async
from tests.router.doubles import (
    ManualClock,
    WorkerDouble,
    ready,
    registry_stub,
    run_async,
    running_router,
    serving_double,
)


async def check(address: str, service: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def eventually(address: str, service: str, expected: str, timeout_s: float = 5.0) -> None:
    """Health of `service` at `address` reaches `expected` within `timeout_s`."""

    async def reached() -> bool:
        return await check(address, service) == expected

    await eventually_async(reached, timeout_s, f"health {service!r} to be {expected}")


@run_async
async def test_serving_while_a_worker_is_live_per_model_and_not_when_all_are_dead():
    clock = ManualClock()  # heartbeat ages move only when the test says so
    async with (
        running_router(
            clock=clock, num_expected_workers=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5
        ) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        address = f"127.0.0.1:{router.port}"
        tiny, other = model_service("tiny"), model_service("other")
        assert await check(address, "") == "NOT_SERVING"
        assert await check(address, tiny) == "NOT_FOUND"  # no worker of that model yet

        admitted = {"a": await registry.Register(ready("a", a.address))}
        hs = ready("b", b.address)
        hs.model_name = "other"
        admitted["b"] = await registry.Register(hs)
        assert all(admission.admitted for admission in admitted.values())
        rid = {worker_id: admission.registration_id for worker_id, admission in admitted.items()}
        for service in ("", "kvpact.v1.Generation", tiny, other):
            assert await check(address, service) == "SERVING", service

        # b beats, a falls silent: "tiny" has no live worker, the cluster still serves "other"
        clock.advance(0.3)
        await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="b", registration_id=rid["b"]))
        clock.advance(0.3)  # a: 0.6 s silent (past --heartbeat-timeout 0.5); b: 0.3 s
        await eventually(address, tiny, "NOT_SERVING")
        assert await check(address, other) == "SERVING"
        assert await check(address, "") == "SERVING"
        clock.advance(0.3)  # b: 0.6 s silent too
        await eventually(address, other, "NOT_SERVING")
        assert await check(address, "") == "NOT_SERVING"
        assert await check(address, "kvpact.v1.Generation") == "NOT_SERVING"

        await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="a", registration_id=rid["a"]))  # back
        await eventually(address, tiny, "SERVING")
        await eventually(address, "", "SERVING")
