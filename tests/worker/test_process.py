"""A worker process's life with a router: startup failures, the handshake, heartbeats, stopping, exit codes.

The router here is `RecordingRegistry`: a real Registry gRPC server on loopback, written for these
tests, that records every Handshake and heartbeat and answers as each test tells it (a `loading` plan
is answered `pending` unless told otherwise).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
import structlog.testing

from kvpact.shared.handshake import WorkerLoad
from kvpact.v1 import cache_pb2, worker_pb2, worker_pb2_grpc
from kvpact.worker.registration import RouterLink
from tests.factories.eventually import eventually
from tests.factories.processes import (
    free_port,
    running,
    stop,
    wait_for_exit,
    wait_for_line,
    worker_argv,
)
from tests.factories.tiny_models import make_tiny_llama

START_TIMEOUT_S = 60.0


class RecordingRegistry(worker_pb2_grpc.RegistryServicer):
    def __init__(
        self,
        admission: worker_pb2.Admission | None = None,
        heartbeat_replies: tuple[worker_pb2.HeartbeatReply, ...] = (),
        token: str = "",
        plan_admission: worker_pb2.Admission | None = None,
        plan_delay_s: float = 0.0,
        ready_gate: threading.Event | None = None,
    ) -> None:
        self.admission = admission or worker_pb2.Admission(
            admitted=True, cluster_policy=cache_pb2.PAGED_ATTENTION_MODE_AUTO, heartbeat_interval_ms=100
        )
        # The answer to a `loading` handshake (the pre-load plan), after `plan_delay_s`.
        self.plan_admission = plan_admission or worker_pb2.Admission(
            pending=True, cluster_policy=cache_pb2.PAGED_ATTENTION_MODE_AUTO
        )
        self.plan_delay_s = plan_delay_s
        self.ready_gate = ready_gate  # a `ready` handshake is answered once this is set (bounded: 30 s)
        self.heartbeat_replies = list(heartbeat_replies)
        self.token = token
        self.handshakes: list[worker_pb2.Handshake] = []
        self.heartbeats: list[worker_pb2.HeartbeatRequest] = []
        self._lock = threading.Lock()

    def Register(self, request, context):
        if request.auth_token != self.token:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
        with self._lock:
            self.handshakes.append(request)
        if request.WhichOneof("outcome") == "loading":
            time.sleep(self.plan_delay_s)
            return self.plan_admission
        if self.ready_gate is not None and request.WhichOneof("outcome") == "ready":
            self.ready_gate.wait(30)
        return self.admission

    def Heartbeat(self, request, context):
        if request.auth_token != self.token:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")
        with self._lock:
            self.heartbeats.append(request)
            return (
                self.heartbeat_replies.pop(0)
                if self.heartbeat_replies
                else worker_pb2.HeartbeatReply(known=True)
            )


@contextmanager
def serving(registry: RecordingRegistry, port: int = 0) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


GRPC_CORE_LOG = re.compile(r"^[EWI]\d{4} ")  # gRPC C-core's own stderr lines (e.g. a failed bind)


def human_lines(stderr: str) -> list[str]:
    """stderr without JSON log lines and gRPC C-core lines: what the worker itself says to an operator."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and not line.startswith("{") and not GRPC_CORE_LOG.match(line)
    ]


def log_events(stderr: str) -> list[str]:
    return [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("with_router", [False, True], ids=["standalone", "with-router"])
def test_on_that_cannot_be_honored_exits_78_before_loading(model_dir, tmp_path, with_router):
    registry = RecordingRegistry()
    with serving(registry) as router:
        args = [
            "--model",
            str(model_dir),
            "--paged-attn",
            "on",
            "--pa-backend",
            "triton",
            "--worker-id",
            "w-cpu",
        ]
        if with_router:  # as kvpact-launch starts it: the node's IP advertised, its Ray placement as labels
            args += ["--router", router, "--advertise-host", "10.1.2.3", "--label", "ray.bundle=3"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            assert wait_for_exit(worker, START_TIMEOUT_S) == 78, worker.output()
            stderr = worker.stderr()
    reason = "the Triton paged backend needs a CUDA device and this worker runs on cpu"
    required = "PagedAttention was explicitly requested (--paged-attn on)"
    assert human_lines(stderr) == [f"worker w-cpu: startup failed: {required}, but {reason}. [device]"]
    assert "Traceback" not in stderr
    events = log_events(stderr)
    assert "startup failed" in events
    assert "model_loaded" not in events  # refused before a weight was read
    if not with_router:
        assert registry.handshakes == []
        return
    [handshake] = registry.handshakes
    assert handshake.WhichOneof("outcome") == "failed"
    assert handshake.address.startswith("10.1.2.3:")  # the advertised host, with the port it bound
    assert dict(handshake.labels) == {"ray.bundle": "3"}
    assert handshake.failed.code == worker_pb2.STARTUP_FAILURE_CODE_PAGED_ATTENTION_REQUIRED
    assert handshake.failed.component == "device"
    assert handshake.failed.reason == reason
    assert handshake.worker_id == "w-cpu"
    assert handshake.model_name == model_dir.name  # named before loading, so the router's report names it
    assert handshake.spec.cache.mode == cache_pb2.PAGED_ATTENTION_MODE_ON
    assert handshake.spec.cache.paged.backend == cache_pb2.PAGED_BACKEND_TRITON
    # the device was probed before the plan failed, so the router still learns what it is
    assert handshake.capabilities.device_kind == "cpu"
    assert handshake.capabilities.torch_version != ""


def test_started_before_its_router_it_retries_registers_and_heartbeats(model_dir, tmp_path):
    """The router comes up late: the worker waits for it to acknowledge its plan before loading; the
    router's first heartbeat reply forgets the worker (re-register), a later one asks it to stop (exit 0)."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    port = free_port()
    registry = RecordingRegistry(
        heartbeat_replies=(
            worker_pb2.HeartbeatReply(known=False),
            worker_pb2.HeartbeatReply(known=True),
            worker_pb2.HeartbeatReply(known=True, shutdown=True),
        ),
        token="s3cret",
    )
    args = ["--model", str(model_dir), "--router", f"127.0.0.1:{port}", "--worker-id", "w-late"]
    args += ["--auth-token-file", str(token_file)]
    with running(worker_argv(*args), log_dir=tmp_path) as worker:
        wait_for_line(worker, r'"event": "pre-load verdict"', START_TIMEOUT_S, stream="stderr")
        time.sleep(0.5)  # announcing its plan, to a router that is not up yet
        assert "model_loaded" not in log_events(worker.stderr())
        with serving(registry, port):
            assert wait_for_exit(worker, START_TIMEOUT_S) == 0, worker.output()
    plan, *readies = registry.handshakes
    assert plan.WhichOneof("outcome") == "loading"
    assert len(readies) == 2  # the first registration, and again after known=false
    for handshake in readies:
        assert handshake.WhichOneof("outcome") == "ready"
        assert handshake.worker_id == "w-late"
        assert handshake.model_name == model_dir.name
        assert handshake.address.startswith("127.0.0.1:")
        assert handshake.capabilities.device_kind == "cpu"
        assert handshake.ready.kind == cache_pb2.CACHE_KIND_EAGER  # auto on CPU
        assert [(f.component, f.reason) for f in handshake.ready.fallbacks] == [
            ("device", "eager is the CPU default (use --paged-attn on for the torch paged backend)")
        ]
    assert len(registry.heartbeats) == 3
    assert all(h.worker_id == "w-late" and h.load.num_total_blocks > 0 for h in registry.heartbeats)
    # Each beat carries every feature's realized state, as the ready handshake reported it (drift).
    assert all(h.features == readies[0].ready.features for h in registry.heartbeats)
    assert [f.name for f in registry.heartbeats[0].features] == [
        "paged-attn", "prefix-caching", "cpu-kernels", "quant-kernels", "cuda-graphs"
    ]  # fmt: skip
    assert "admitted by router" in worker.stdout()
    assert "Traceback" not in worker.stderr()


def test_the_routers_shutdown_rpc_stops_it_with_0(model_dir, tmp_path):
    registry = RecordingRegistry()
    with (
        serving(registry) as router,
        running(
            worker_argv("--model", str(model_dir), "--router", router, "--paged-attn", "on"), log_dir=tmp_path
        ) as worker,
    ):
        eventually(lambda: len(registry.handshakes) == 2, START_TIMEOUT_S, "the ready handshake")
        address = registry.handshakes[1].address
        assert registry.handshakes[1].ready.kind == cache_pb2.CACHE_KIND_PAGED
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stub.Shutdown(worker_pb2.ShutdownRequest(reason="the cluster failed to start"), timeout=10)
        assert wait_for_exit(worker, 30) == 0, worker.output()
    assert "shutdown requested" in log_events(worker.stderr())


def test_the_plan_is_announced_before_loading_then_ready(model_dir, tmp_path):
    registry = RecordingRegistry(heartbeat_replies=(worker_pb2.HeartbeatReply(known=True, shutdown=True),))
    with serving(registry) as router:
        args = ["--model", str(model_dir), "--router", router, "--paged-attn", "on", "--worker-id", "w-on"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            assert wait_for_exit(worker, START_TIMEOUT_S) == 0, worker.output()
    assert [h.WhichOneof("outcome") for h in registry.handshakes] == ["loading", "ready"]
    announced, ready = registry.handshakes
    assert announced.loading.planned_kind == cache_pb2.CACHE_KIND_PAGED
    assert announced.loading.planned_backend == cache_pb2.PAGED_BACKEND_TORCH
    assert list(announced.loading.fallbacks) == []
    assert announced.loading.verdict_seconds > 0
    assert announced.worker_id == ready.worker_id == "w-on"
    assert announced.address == ready.address and announced.address.startswith("127.0.0.1:")
    assert announced.model_name == model_dir.name
    assert announced.capabilities.device_kind == "cpu"
    assert announced.spec.cache.mode == cache_pb2.PAGED_ATTENTION_MODE_ON
    assert ready.ready.kind == cache_pb2.CACHE_KIND_PAGED
    events = log_events(worker.stderr())
    assert events.index("plan announced") < events.index("model_loaded")


def test_a_refused_plan_exits_78_before_loading(model_dir, tmp_path):
    reason = "the cluster policy is --paged-attn on and it plans an EAGER KV cache under --paged-attn auto"
    registry = RecordingRegistry(plan_admission=worker_pb2.Admission(admitted=False, reason=reason))
    with serving(registry) as router:
        args = ["--model", str(model_dir), "--router", router, "--paged-attn", "auto", "--worker-id", "w-a"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            assert wait_for_exit(worker, START_TIMEOUT_S) == 78, worker.output()
    [handshake] = registry.handshakes
    assert handshake.loading.planned_kind == cache_pb2.CACHE_KIND_EAGER  # auto on CPU
    assert [(f.component, f.reason) for f in handshake.loading.fallbacks] == [
        ("device", "eager is the CPU default (use --paged-attn on for the torch paged backend)")
    ]
    [line] = human_lines(worker.stderr())
    assert line == f"worker w-a: router {router} refused its plan before loading: {reason}"
    events = log_events(worker.stderr())
    assert "plan refused" in events
    assert "model_loaded" not in events  # refused before a weight was read
    assert "Traceback" not in worker.stderr()


def test_a_shutdown_while_it_is_loading_stops_it_with_0(model_dir, tmp_path):
    """The router stops a worker that has announced its plan and is not ready yet (another failed)."""
    registry = RecordingRegistry(plan_delay_s=2.0)  # the worker is still in its startup meanwhile
    with serving(registry) as router:
        args = ["--model", str(model_dir), "--router", router, "--paged-attn", "on"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            eventually(lambda: registry.handshakes, START_TIMEOUT_S, "the plan")
            with grpc.insecure_channel(registry.handshakes[0].address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                stub.Shutdown(worker_pb2.ShutdownRequest(reason="the cluster failed to start"), timeout=10)
            assert wait_for_exit(worker, 10) == 0, worker.output()
    events = log_events(worker.stderr())
    assert "startup interrupted" in events
    assert "model_loaded" not in events
    assert [h.WhichOneof("outcome") for h in registry.handshakes] == ["loading"]


@pytest.mark.parametrize(
    ("case", "code", "message"),
    [
        ("refused", 78, "refused it: policy off admits only EAGER workers"),
        ("no-token", 1, "refused the handshake: missing or wrong auth token"),
        # A worker never loads its weights before the router acknowledged its plan.
        (
            "no-router",
            1,
            "did not answer the handshake within --router-timeout 1s",
        ),
    ],
)
def test_a_router_that_will_not_have_it_ends_it(model_dir, tmp_path, case, code, message):
    registry = RecordingRegistry(
        admission=worker_pb2.Admission(admitted=False, reason="policy off admits only EAGER workers"),
        token="s3cret" if case == "no-token" else "",
    )
    with serving(registry) as router:
        target = f"127.0.0.1:{free_port()}" if case == "no-router" else router
        args = ["--model", str(model_dir), "--router", target, "--router-timeout", "1", "--paged-attn", "on"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            assert wait_for_exit(worker, START_TIMEOUT_S) == code, worker.output()
    [line] = human_lines(worker.stderr())
    assert message in line
    assert "Traceback" not in worker.stderr()
    if case == "no-router":
        assert "it did not load its weights" in line
        assert "model_loaded" not in log_events(worker.stderr())


def test_sigint_stops_a_serving_worker_with_0(model_dir, tmp_path):
    with running(worker_argv("--model", str(model_dir)), log_dir=tmp_path) as worker:
        wait_for_line(worker, r"^worker \S+ serving \S+ on ", START_TIMEOUT_S)
        assert stop(worker, sig=signal.SIGINT) == 0, worker.output()
    assert "stopping" in log_events(worker.stderr())


def test_a_port_in_use_or_an_unreadable_token_file_ends_it_with_one_clear_line(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = worker_argv("--model", str(model_dir), "--listen", f"127.0.0.1:{port}")
        with running(argv, log_dir=tmp_path, name="in-use") as worker:
            assert wait_for_exit(worker, START_TIMEOUT_S) == 1, worker.output()
    [line] = human_lines(worker.stderr())
    assert f"--listen 127.0.0.1:{port}: cannot bind" in line

    argv = worker_argv("--model", str(model_dir), "--auth-token-file", str(tmp_path / "absent"))
    with running(argv, log_dir=tmp_path, name="no-token") as worker:
        assert wait_for_exit(worker, START_TIMEOUT_S) == 78, worker.output()
    [line] = human_lines(worker.stderr())
    assert f"--auth-token-file {tmp_path / 'absent'}: cannot read it" in line


def test_heartbeats_keep_going_while_the_router_is_unreachable_and_say_so_once():
    """In process (worker/registration.py): nothing listens at the router's address."""
    router = f"127.0.0.1:{free_port()}"

    async def beat_for_a_while() -> None:
        link = RouterLink(router, worker_id="w", auth_token=None, timeout_s=0.2)

        async def reregister() -> None:
            raise AssertionError("no router answered, so nothing asked to register again")

        task = asyncio.create_task(link.heartbeats(0.05, WorkerLoad, reregister))
        await asyncio.sleep(1.0)
        assert not task.done()  # still beating: the router may come back
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()

    with structlog.testing.capture_logs() as logs:
        asyncio.run(asyncio.wait_for(beat_for_a_while(), 30))
    warnings = [e for e in logs if e["event"] == "router unreachable; still serving"]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["down_s"] >= 0.2


def test_a_shutdown_while_it_reads_its_weights_exits_0_not_an_abort(tmp_path):
    """Stopped while the load runs in its thread (inside torch): the exit code is the requested 0, not the
    SIGABRT (134) that interpreter finalization gives with torch's C++ still running. The bundled model
    takes long enough to read (~1 s or more) for the Shutdown to land mid-load."""
    registry = RecordingRegistry()  # answers the plan at once: pending
    with serving(registry) as router:
        args = ["--router", router, "--paged-attn", "on", "--worker-id", "w-big"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            eventually(
                lambda: "plan announced" in log_events(worker.stderr()), START_TIMEOUT_S, "the load to start"
            )
            with grpc.insecure_channel(registry.handshakes[0].address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                stub.Shutdown(worker_pb2.ShutdownRequest(reason="the cluster failed to start"), timeout=10)
            assert wait_for_exit(worker, 20) == 0, worker.output()
    assert "model_loaded" not in log_events(worker.stderr())  # it really was stopped mid-load


class IdTakenRegistry(RecordingRegistry):
    """A router where a live worker already holds this worker's id."""

    def Register(self, request, context):
        with self._lock:
            self.handshakes.append(request)
        context.abort(
            grpc.StatusCode.ALREADY_EXISTS,
            f'worker id "{request.worker_id}" is held by a live worker at 127.0.0.1:9 (admitted); give this '
            "worker another --worker-id, or stop that one first",
        )


def test_a_worker_whose_id_is_held_by_a_live_worker_exits_1_before_loading(model_dir, tmp_path):
    registry = IdTakenRegistry()
    with serving(registry) as router:
        args = ["--model", str(model_dir), "--router", router, "--worker-id", "w-dup", "--paged-attn", "on"]
        with running(worker_argv(*args), log_dir=tmp_path) as worker:
            assert wait_for_exit(worker, START_TIMEOUT_S) == 1, worker.output()
    [line] = human_lines(worker.stderr())
    assert 'ALREADY_EXISTS: worker id "w-dup" is held by a live worker at 127.0.0.1:9' in line
    assert "model_loaded" not in log_events(worker.stderr())
    assert [h.WhichOneof("outcome") for h in registry.handshakes] == ["loading"]
