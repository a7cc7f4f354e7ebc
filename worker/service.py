"""The worker's gRPC face: the `kvpact.v1.Worker` servicer and the server that carries it.

The servicer is thin: protobuf in and out through worker/generate_pb.py, the work done by the engine, errors
mapped to status codes by shared/rpc_errors.py (this module's `STATUS_FOR_ERROR`). It is added to the server
before the model is loaded and answers UNAVAILABLE until `attach(engine)`. Standard health is readiness:
NOT_SERVING while loading, SERVING once admitted by the router (standalone: once loaded), NOT_SERVING
again when its engine loop stops or while the worker stops (drains).

The router sends its requests on Worker.Stream, many on one call (worker/stream_server.py); Worker.Generate
is the same request alone, for direct callers (grpcurl, benchmarks, tests). A call that ends early
(client cancel, deadline) closes the engine's generator, which aborts the sequence and frees its KV
blocks. The server sets no `grpc.max_concurrent_streams`. With --tls-cert it serves TLS; with --tls-ca
too, only peers holding a certificate that CA signed (the router) get through (shared/tls.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpact.shared.address import join_host_port
from kvpact.shared.errors import BindError, KvpactError, RequestError
from kvpact.shared.handshake_pb import load_to_pb
from kvpact.shared.limits import GRPC_MESSAGE_OPTIONS, check_request_limits, excerpt
from kvpact.shared.rpc_errors import ErrorInterceptor, LogContextInterceptor
from kvpact.shared.tls import TlsConfig, add_port
from kvpact.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from kvpact.worker.engine.request import EngineClosedError, EngineOverloadedError, GenerationError
from kvpact.worker.generate_pb import chunk_to_pb, request_from_pb
from kvpact.worker.stream_server import StreamServer

if TYPE_CHECKING:
    from kvpact.worker.engine.engine import Engine

log = structlog.get_logger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerNotReadyError(KvpactError):
    """The worker is still loading its model (or already stopping)."""


class ModelNotServedError(KvpactError):
    """The request names a model this worker does not serve."""


STATUS_FOR_ERROR: dict[type[BaseException], grpc.StatusCode] = {
    RequestError: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotServedError: grpc.StatusCode.NOT_FOUND,
    WorkerNotReadyError: grpc.StatusCode.UNAVAILABLE,
    EngineClosedError: grpc.StatusCode.UNAVAILABLE,
    EngineOverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    GenerationError: grpc.StatusCode.INTERNAL,
}


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, worker_id: str, request_shutdown: Callable[[str], None], *, log_prompts: bool = False
    ) -> None:
        self.worker_id = worker_id
        self._log_prompts = log_prompts  # --log-prompts: the prompt's text in its request line
        self._request_shutdown = request_shutdown
        self._engine: Engine | None = None
        self._model_name = ""
        self.draining = False  # set on SIGTERM: new requests are refused, in-flight ones finish
        self.errors = ErrorInterceptor(STATUS_FOR_ERROR, "worker")  # also each Stream request's status
        self._streams: set[StreamServer] = set()
        self._closing = False

    def attach(self, engine: Engine, model_name: str) -> None:
        self._engine, self._model_name = engine, model_name

    def _ready(self) -> Engine:
        if self._engine is None:
            raise WorkerNotReadyError(f"worker {self.worker_id} is not serving (still loading, or stopping)")
        return self._engine

    def _accepting(self) -> Engine:
        if self.draining:
            raise WorkerNotReadyError(
                f"worker {self.worker_id} is draining (stopping): it takes no new requests; send to another"
            )
        return self._ready()

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        async with aclosing(self._chunks(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Stream(
        self, requests: AsyncIterator[worker_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StreamReply]:
        """Many Generates on one call (worker/stream_server.py); the router's way to this worker."""
        server = StreamServer(lambda request, _timeout: self._chunks(request), self._stream_status)
        self._streams.add(server)
        if self._closing:
            server.close()
        try:
            with structlog.contextvars.bound_contextvars(worker_id=self.worker_id, rpc="Stream"):
                async with aclosing(server.serve(requests)) as replies:
                    async for reply in replies:
                        yield reply
        finally:
            self._streams.discard(server)

    def _stream_status(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        return self.errors.status_of("Generate", exc)

    def close_streams(self) -> None:
        """The worker stops: every Stream call ends once nothing is in flight on it."""
        self._closing = True
        for server in self._streams:
            server.close()

    async def _chunks(
        self, request: generation_pb2.GenerateRequest
    ) -> AsyncGenerator[generation_pb2.GenerateChunk]:
        """One request's chunks, as Worker.Generate and each request on Worker.Stream send them."""
        check_request_limits(request)  # before anything reads, renders or tokenizes the request
        engine = self._accepting()
        if request.model and request.model != self._model_name:
            raise ModelNotServedError(
                f"model {excerpt(request.model)} is not served here; this worker serves {self._model_name!r}"
            )
        request_id = request.request_id or uuid.uuid4().hex
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            log.debug("request", **_describe_prompt(request, self._log_prompts))
            async with aclosing(engine.generate(request_from_pb(request, request_id))) as outputs:
                async for output in outputs:
                    yield chunk_to_pb(output, self.worker_id)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortReply:
        return worker_pb2.AbortReply(found=self._ready().abort(request.request_id))

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return load_to_pb(self._ready().stats())

    async def Shutdown(
        self, request: worker_pb2.ShutdownRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ShutdownReply:
        log.info("shutdown requested", reason=request.reason)
        self._request_shutdown(request.reason or "the router asked this worker to stop")
        return worker_pb2.ShutdownReply()


def _describe_prompt(request: generation_pb2.GenerateRequest, with_text: bool) -> dict[str, object]:
    """The request's log fields: its prompt's kind and size; its text only under --log-prompts."""
    kind = request.WhichOneof("prompt") or "none"
    fields: dict[str, object] = {"prompt_kind": kind, "max_tokens": request.max_tokens}
    if kind == "text":
        fields["prompt_chars"] = len(request.text)
        if with_text:
            fields["prompt"] = request.text
    elif kind == "chat":
        fields["prompt_messages"] = len(request.chat.messages)
        if with_text:
            fields["prompt"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    elif kind == "token_ids":
        fields["prompt_tokens"] = len(request.token_ids.ids)
        if with_text:
            fields["prompt"] = list(request.token_ids.ids)
    return fields


class WorkerServer:
    """The gRPC server: Worker + grpc.health.v1 + server reflection, on one port."""

    def __init__(self, service: WorkerService, host: str, port: int, tls: TlsConfig | None = None) -> None:
        self.service = service
        self._host = host
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            interceptors=[
                LogContextInterceptor(worker_id=service.worker_id),
                service.errors,
            ],
            options=GRPC_MESSAGE_OPTIONS,  # deliberate, and documented in shared/limits.py
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = (
            WORKER_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self._server)
        address = join_host_port(host, port)
        self.port = add_port(self._server, address, tls, require_client_cert=True)
        if self.port == 0:
            raise BindError("--listen", address)

    @property
    def address(self) -> str:
        """HOST:PORT as bound (the port is the real one when --listen asked for 0)."""
        return join_host_port(self._host, self.port)

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()

    def attach(self, engine: Engine, model_name: str) -> None:
        """Answer Worker calls from now on; health stays as it is (a worker with a router turns SERVING
        only once admitted)."""
        self.service.attach(engine, model_name)

    async def set_ready(self, ready: bool) -> None:
        """Health SERVING (admitted, or standalone and loaded) or NOT_SERVING (its engine stopped)."""
        serving = health_pb2.HealthCheckResponse.SERVING
        await self._set_health(serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_draining(self) -> None:
        """New requests are refused (UNAVAILABLE, so the router sends them elsewhere); health NOT_SERVING."""
        self.service.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING at once, let in-flight calls finish for `grace_s`, then cancel them (a Stream call
        ends as soon as nothing is in flight on it)."""
        self.service.close_streams()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in ("", WORKER_SERVICE):
            await self._health.set(name, status)
