"""Real gRPC servers and handshakes for router tests that do not need a real model.

`WorkerDouble` is a real Worker service on loopback (grpc.aio): its "model" emits token
`(prompt length + i) % 1000` as text "t<id> ", one chunk per token, optionally slowly, and it records
what it was asked (requests, cancellations, shutdowns) so tests can assert on the router's behaviour.
Handshakes are built from the shared dataclasses through shared/handshake_pb.py, as a worker builds them.
"""

from __future__ import annotations

import asyncio
import functools
import io
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import grpc

from kvpact.client import AsyncClient
from kvpact.router.config import RouterConfig
from kvpact.router.server import RouterServer
from kvpact.shared import handshake_pb
from kvpact.shared.features import FeatureMode, FeatureState, off_by_request
from kvpact.shared.fingerprint import Fingerprint
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode
from kvpact.shared.intent import (
    CacheDtype,
    Fallback,
    PagedAttentionConfig,
    PagedAttentionMode,
    PagedBackend,
    cache_intent,
)
from kvpact.shared.realized import RealizedCache
from kvpact.shared.rpc_errors import StatusError
from kvpact.shared.spec import WorkerSpec
from kvpact.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from kvpact.worker.stream_server import StreamServer

ASYNC_TEST_TIMEOUT_S = 60.0


def run_async(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop, bounded in time (pytest fixtures still inject)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), ASYNC_TEST_TIMEOUT_S))

    return wrapper


class WorkerDouble(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, *, num_blocks: int = 64, delay_s: float = 0.0) -> None:
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.delay_s = delay_s
        self.active: set[str] = set()
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.shutdown_reasons: list[str] = []
        self.shutdown_delays: list[float] = []  # seconds each next Shutdown takes to answer (then none)
        self.timeouts: list[float | None] = []
        self.num_calls = 0  # Worker.Stream calls opened to it
        self.address = ""
        self.refuse: tuple[grpc.StatusCode, str] | None = None  # end every request with this status

    @staticmethod
    def tokens_for(request: generation_pb2.GenerateRequest) -> list[int]:
        base = len(request.text) if request.WhichOneof("prompt") == "text" else len(request.token_ids.ids)
        n = request.max_tokens if request.HasField("max_tokens") else 8
        return [(base + i) % 1000 for i in range(n)]

    async def Stream(
        self, requests: AsyncIterator[worker_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StreamReply]:
        """The router's way to a worker, as the real worker serves it (worker/stream_server.py)."""
        self.num_calls += 1
        async for reply in StreamServer(self.chunks, _status_of).serve(requests):
            yield reply

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """One request alone, for tests that call the worker directly."""
        try:
            async for chunk in self.chunks(request, context.time_remaining()):
                yield chunk
        except StatusError as exc:
            await context.abort(exc.code, exc.details)

    async def chunks(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        rid = request.request_id
        self.requests.append(request)
        if self.refuse is not None:
            raise status_error(*self.refuse)
        self.timeouts.append(timeout)
        self.active.add(rid)
        tokens = self.tokens_for(request)
        finished = False
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(
                    self.delay_s
                )  # 0: the next token is ready at once, as after an engine step
                chunk = generation_pb2.GenerateChunk(request_id=rid, text=f"t{token} ", token_ids=[token])
                if request.sampling.top_logprobs:  # the token, then its successors, at -0.5, -1.5, ...
                    ids = [token + k for k in range(request.sampling.top_logprobs)]
                    chunk.top_logprobs.add(token_ids=ids, logprobs=[-0.5 - k for k in range(len(ids))])
                if i == len(tokens) - 1:
                    chunk.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                    chunk.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=3, completion_tokens=len(tokens)))
                    finished = True
                yield chunk
        finally:  # closed before its last chunk (cancelled, or aclose()d while its caller waited): aborted
            self.active.discard(rid)
            if not finished:
                self.cancelled.append(rid)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            num_running=len(self.active),
            num_free_blocks=self.num_blocks - len(self.active),
            num_total_blocks=self.num_blocks,
        )

    async def Shutdown(
        self, request: worker_pb2.ShutdownRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ShutdownReply:
        self.shutdown_reasons.append(request.reason)
        if self.shutdown_delays:
            await asyncio.sleep(self.shutdown_delays.pop(0))
        return worker_pb2.ShutdownReply()


def status_error(code: grpc.StatusCode, details: str) -> StatusError:
    """What a double raises to end a request with `code` and `details`."""
    error = StatusError(details)
    error.code = code
    return error


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, StatusError):
        return exc.code, exc.details
    return grpc.StatusCode.INTERNAL, f"the double failed: {exc!r}"


@asynccontextmanager
async def serving_double(double: WorkerDouble) -> AsyncIterator[WorkerDouble]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(double, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    double.address = f"127.0.0.1:{port}"
    try:
        yield double
    finally:
        await server.stop(None)


class ManualClock:
    """A monotonic clock that moves only when told: `advance(seconds)`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@asynccontextmanager
async def running_router(clock: ManualClock | None = None, **overrides: Any) -> AsyncIterator[RouterServer]:
    """An in-process router on a free loopback port; its failure report goes to `kvpact.router.report`.
    With `clock`, heartbeat ages (liveness) follow it instead of time.monotonic."""
    config = replace(RouterConfig(host="127.0.0.1", port=0), **overrides)
    report = io.StringIO()
    router = RouterServer(config, report_stream=report, clock=clock or time.monotonic)
    router.report = report  # type: ignore[attr-defined]
    await router.start()
    try:
        yield router
    finally:
        await router.stop()


PAGED_ATTN_REALIZED = FeatureState("paged-attn", FeatureMode.AUTO, True)


def paged_attn_off(fallback: Fallback | None = None) -> FeatureState:
    """paged-attn realized off: fell back under auto with `fallback`, or (none) off by request."""
    if fallback is None:
        return off_by_request("paged-attn")
    return FeatureState(
        "paged-attn", FeatureMode.AUTO, False, fallback.code, fallback.reason, fallback.component
    )


def paged_realized(
    *, num_blocks: int = 64, block_size: int = 16, backend: PagedBackend = PagedBackend.TORCH
) -> RealizedCache:
    return RealizedCache(
        max_model_len=256,
        capacity_tokens=num_blocks * block_size,
        max_concurrency=num_blocks * block_size // 256,
        num_blocks=num_blocks,
        memory_bytes=1 << 20,
        cache_dtype=CacheDtype.FLOAT32,
        backend=backend,
        block_size=block_size,
        features=(PAGED_ATTN_REALIZED, FeatureState("prefix-caching", FeatureMode.AUTO, True)),
    )


EAGER_CPU_REASON = "eager is the CPU default (use --paged-attn on for the torch paged backend)"


def eager_realized(fallback: Fallback | None = None, *, num_slots: int = 4) -> RealizedCache:
    return RealizedCache(
        max_model_len=256,
        capacity_tokens=num_slots * 256,
        max_concurrency=num_slots,
        num_blocks=num_slots,
        memory_bytes=1 << 20,
        cache_dtype=CacheDtype.FLOAT32,
        features=(paged_attn_off(fallback),),
    )


def spec(
    mode: str = "on", *, backend: PagedBackend = PagedBackend.AUTO, model: str = "/models/tiny"
) -> WorkerSpec:
    return WorkerSpec(
        model=model,
        device="cpu",
        cache=cache_intent(PagedAttentionMode(mode), PagedAttentionConfig(backend=backend)),
    )


TINY_FINGERPRINT = Fingerprint(
    model="sha256:" + "1" * 64, tokenizer="sha256:" + "2" * 64, chat_template="sha256:" + "3" * 64,
    max_model_len=256, block_size=16,
)  # fmt: skip


def handshake(
    worker_id: str,
    address: str,
    worker_spec: WorkerSpec,
    *,
    model: str = "tiny",
    token: str = "",
    fingerprint: Fingerprint | None = TINY_FINGERPRINT,
    **outcome: Any,
) -> worker_pb2.Handshake:
    """The parts every test handshake shares; `outcome` is ready=, loading= or failed=. `fingerprint`
    None: a worker that reports none (an older one, or one that failed before its plan)."""
    message = worker_pb2.Handshake(
        worker_id=worker_id,
        address=address,
        model_name=model,
        spec=handshake_pb.spec_to_pb(worker_spec),
        capabilities=worker_pb2.Capabilities(device_kind="cpu", torch_version="2.13.0"),
        auth_token=token,
        **outcome,
    )
    if fingerprint is not None:
        message.fingerprint.CopyFrom(handshake_pb.fingerprint_to_pb(fingerprint))
    return message


def ready(
    worker_id: str,
    address: str,
    realized: RealizedCache | None = None,
    *,
    mode: str = "on",
    model: str = "tiny",
    token: str = "",
    fingerprint: Fingerprint | None = TINY_FINGERPRINT,
) -> worker_pb2.Handshake:
    return handshake(
        worker_id, address, spec(mode), model=model, token=token, fingerprint=fingerprint,
        ready=handshake_pb.realized_to_pb(realized or paged_realized()),
    )  # fmt: skip


def loading(
    worker_id: str,
    address: str,
    plan: LoadingPlan | None = None,
    *,
    mode: str = "on",
    model: str = "tiny",
    fingerprint: Fingerprint | None = TINY_FINGERPRINT,
) -> worker_pb2.Handshake:
    """A worker announcing its pre-load plan (default: PAGED, torch backend) before it loads weights."""
    plan = plan or LoadingPlan((PAGED_ATTN_REALIZED,), PagedBackend.TORCH, verdict_seconds=0.2)
    return handshake(
        worker_id, address, spec(mode), model=model, fingerprint=fingerprint,
        loading=handshake_pb.plan_to_pb(plan),
    )  # fmt: skip


def failed(
    worker_id: str,
    reason: str,
    *,
    address: str = "",
    mode: str = "on",
    backend: PagedBackend = PagedBackend.TRITON,
    component: str = "device",
    code: StartupFailureCode = StartupFailureCode.PAGED_ATTENTION_REQUIRED,
) -> worker_pb2.Handshake:
    failure = handshake_pb.failure_to_pb(StartupFailure(code, reason, component))
    return handshake(worker_id, address, spec(mode, backend=backend), fingerprint=None, failed=failure)


@asynccontextmanager
async def registry_stub(router: RouterServer) -> AsyncIterator[worker_pb2_grpc.RegistryStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        yield worker_pb2_grpc.RegistryStub(channel)


@asynccontextmanager
async def one_worker_router(
    double: WorkerDouble, *, client_timeout: float | None = None, **overrides: Any
) -> AsyncIterator[tuple[RouterServer, AsyncClient]]:
    """A router (`overrides` as for running_router) that has admitted `double` with the default `ready`
    handshake, and a client of it."""
    async with (
        running_router(**overrides) as router,
        serving_double(double),
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=client_timeout) as client,
    ):
        admission = await registry.Register(ready(double.worker_id, double.address))
        assert admission.admitted, admission.reason
        yield router, client
