"""Several routers as one tier (docs/performance.md, "Running the router tier on several cores"): each
router fronts its own workers, and a client given every router's address with gRPC round_robin spreads
its requests over all of them."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from kvpact.client import AsyncClient
from tests.factories.eventually import eventually_async
from tests.router.doubles import WorkerDouble, one_worker_router, run_async


@run_async
async def test_a_round_robin_client_spreads_requests_over_several_routers():
    async with AsyncExitStack() as stack:
        routers = []
        for name in ("a", "b", "c"):
            router, _ = await stack.enter_async_context(one_worker_router(WorkerDouble(name)))
            routers.append(router)
        target = "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in routers)
        client = await stack.enter_async_context(
            AsyncClient(target, timeout=10, options=[("grpc.lb_policy_name", "round_robin")])
        )
        # round_robin connects to every router; until all are connected the ready ones take the calls.
        seen: set[str] = set()

        async def every_router_answered() -> bool:
            seen.add((await client.complete("w", max_tokens=1)).worker_id)
            return seen == {"a", "b", "c"}

        await eventually_async(every_router_answered, what="every router to answer")
        done = await asyncio.gather(*(client.complete("xyz", max_tokens=3) for _ in range(30)))
    assert {c.token_ids for c in done} == {(3, 4, 5)}
    counts = {w: sum(1 for c in done if c.worker_id == w) for w in ("a", "b", "c")}
    assert min(counts.values()) >= 5, counts  # every router served its share
