"""Worker health is readiness: NOT_SERVING while loading, SERVING once admitted, NOT_SERVING again while
it stops (drains) or once its engine loop has stopped. Observed with grpc.health.v1 Check and Watch."""

from __future__ import annotations

import asyncio
import queue
import signal
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.v1 import generation_pb2, worker_pb2_grpc
from kvpact.worker.options import WorkerOptions
from kvpact.worker.process import WorkerProcess
from tests.factories.eventually import eventually, eventually_async
from tests.factories.processes import (
    health_status,
    running,
    wait_for_exit,
    wait_for_line,
    worker_argv,
)
from tests.worker.conftest import worker_spec
from tests.worker.test_process import RecordingRegistry, serving

START_TIMEOUT_S = 60.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def watch_health(address: str) -> tuple[queue.Queue[int], grpc.Channel]:
    """Every status the worker's overall health reports, in order, on a queue (a background Watch)."""
    statuses: queue.Queue[int] = queue.Queue()
    channel = grpc.insecure_channel(address)
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)

    def pump() -> None:
        try:
            for reply in stream:
                statuses.put(reply.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    return statuses, channel


def next_status(statuses: queue.Queue[int], timeout_s: float = 20.0) -> int:
    return statuses.get(timeout=timeout_s)


def test_loading_then_loaded_but_not_admitted_then_admitted_then_draining(tiny_llama, tmp_path):
    gate = threading.Event()
    registry = RecordingRegistry(plan_delay_s=1.0, ready_gate=gate)
    with serving(registry) as router:
        args = ["--model", str(tiny_llama), "--router", router, "--worker-id", "w-ready"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            address = wait_for_line(worker, r"^worker \S+ listening on (\S+)$", START_TIMEOUT_S).group(1)
            assert health_status(address) == "NOT_SERVING"  # loading (its plan is being announced)
            wait_for_line(worker, r"^worker w-ready serving ", START_TIMEOUT_S)
            # loaded, registered `ready`, not admitted yet: still not ready for traffic
            assert health_status(address) == "NOT_SERVING"
            # the worker says "serving" just before it sends its `ready` handshake: wait for it to arrive
            eventually(lambda: registry.handshakes[-1].WhichOneof("outcome") == "ready", what="ready")
            assert registry.handshakes[-1].WhichOneof("outcome") == "ready"
            statuses, channel = watch_health(address)
            assert next_status(statuses) == NOT_SERVING
            gate.set()
            assert next_status(statuses) == SERVING
            assert "admitted by router" in worker.stdout()
            worker.popen.send_signal(signal.SIGTERM)
            assert next_status(statuses) == NOT_SERVING  # draining: before the server goes away
            assert wait_for_exit(worker, 30) == 0, worker.output()
            channel.close()


def test_a_stopped_engine_turns_health_not_serving_and_the_worker_exits_1(tiny_llama):
    process = WorkerProcess(WorkerOptions(spec=worker_spec(tiny_llama), worker_id="w-dies"))

    async def scenario() -> int:
        run = asyncio.create_task(process.run())
        await eventually_async(lambda: process.engine is not None, START_TIMEOUT_S, "the engine to be built")
        address = process.handshake.address
        # health_status blocks: poll it from a thread, the server answers on this loop
        await asyncio.to_thread(eventually, lambda: health_status(address) == "SERVING", 10, "SERVING")
        statuses, channel = await asyncio.to_thread(watch_health, address)
        assert await asyncio.to_thread(next_status, statuses) == SERVING

        def broken_schedule() -> None:
            raise RuntimeError("scheduler state corrupted")

        assert process.engine is not None
        process.engine.step_loop.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
        async with grpc.aio.insecure_channel(address) as worker:
            stub = worker_pb2_grpc.WorkerStub(worker)
            request = generation_pb2.GenerateRequest(text="hello", max_tokens=4)
            try:
                async for _ in stub.Generate(request, timeout=20):
                    pass
            except grpc.aio.AioRpcError:
                pass
        assert await asyncio.to_thread(next_status, statuses) == NOT_SERVING
        channel.close()
        return await asyncio.wait_for(run, 30)

    assert asyncio.run(scenario()) == 1
