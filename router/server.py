"""The router process: one grpc.aio server with Generation, Registry, health and reflection.

TLS with --tls-cert/--tls-key (shared/tls.py); API keys with --api-key-file (router/api_keys.py). SIGHUP
re-reads --auth-token-file and --api-key-file; calls in flight go on untouched.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpact.router.api_keys import ApiKeyInterceptor
from kvpact.router.cluster import Cluster
from kvpact.router.config import RouterConfig
from kvpact.router.metrics import RouterMetrics
from kvpact.router.registry_service import RegistryService
from kvpact.router.relayed import relayed_bytes
from kvpact.router.service import GenerationService
from kvpact.shared.address import join_host_port
from kvpact.shared.auth import SecretFile
from kvpact.shared.errors import BindError, ConfigError, RequestError
from kvpact.shared.limits import GRPC_MESSAGE_OPTIONS
from kvpact.shared.rpc_errors import ErrorInterceptor
from kvpact.shared.tls import add_port, describe_tls, plaintext_warning
from kvpact.v1 import generation_pb2, router_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from kvpact.router.http.server import HttpFront

log = structlog.get_logger("router")

STOP_GRACE_S = 0.3  # lets in-flight replies (a refused worker's Admission) go out before exit
SERVICE_NAMES = (
    router_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)
# What is not a RouterError (those carry their own status) but still has a specific status.
STATUS_FOR_ERROR: dict[type[BaseException], grpc.StatusCode] = {
    RequestError: grpc.StatusCode.INVALID_ARGUMENT
}


def add_generation_service(service: GenerationService, server: grpc.aio.Server) -> None:
    """kvpact.v1.Generation, as router_pb2_grpc.add_GenerationServicer_to_server registers it but for
    Generate's response serializer: `relayed_bytes` writes the worker's chunk bytes as they came."""
    request = generation_pb2.GenerateRequest.FromString
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=request, response_serializer=relayed_bytes
        ),
        "Complete": grpc.unary_unary_rpc_method_handler(
            service.Complete,
            request_deserializer=request,
            response_serializer=generation_pb2.CompleteResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=router_pb2.ListModelsRequest.FromString,
            response_serializer=router_pb2.ListModelsResponse.SerializeToString,
        ),
        "ClusterStatus": grpc.unary_unary_rpc_method_handler(
            service.ClusterStatus,
            request_deserializer=router_pb2.ClusterStatusRequest.FromString,
            response_serializer=router_pb2.ClusterStatusResponse.SerializeToString,
        ),
    }
    name = router_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        report_stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,  # liveness: heartbeat ages (tests pass their own)
    ) -> None:
        self.config = config
        self.cluster = Cluster(config, report_stream=report_stream, clock=clock)
        self.metrics = RouterMetrics(self.cluster.registry, self.cluster.startup)
        self.cluster.observe_fallbacks = self.metrics.observe_fallbacks
        self.cluster.observe_drift = self.metrics.observe_drift
        self.tokens = SecretFile("--auth-token-file", config.auth_token_file, config.auth_tokens)
        self.api_keys = SecretFile("--api-key-file", config.api_key_file, config.api_keys)
        # No grpc.max_concurrent_streams: a cap stalls client streams past it (see router/connections.py).
        self._server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(self.api_keys), ErrorInterceptor(STATUS_FOR_ERROR, "router")],
            options=[("grpc.so_reuseport", 0), *GRPC_MESSAGE_OPTIONS],
        )
        self.generation = GenerationService(self.cluster, self.metrics)
        add_generation_service(self.generation, self._server)
        worker_pb2_grpc.add_RegistryServicer_to_server(
            RegistryService(self.cluster, self.tokens), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.cluster.health, self._server)
        reflection.enable_server_reflection(SERVICE_NAMES, self._server)
        self.port = 0
        self.http: HttpFront | None = None
        if config.http_listen is not None:  # fastapi/uvicorn imported only when the front is on
            from kvpact.router.http.server import HttpFront

            http_host, http_port = config.http_listen
            self.http = HttpFront(self.generation, self.api_keys, http_host, http_port, config.tls)

    async def start(self) -> int:
        """Bind (both ports, before anything starts: BindError) and start serving; returns the bound port."""
        host = self.config.host
        # Clients hold no certificate (they bring API keys): workers are checked by dialing them back.
        self.port = add_port(
            self._server, join_host_port(host, self.config.port), self.config.tls, require_client_cert=False
        )
        if not self.port:
            raise BindError("--listen", join_host_port(host, self.config.port))
        if self.config.metrics_port is not None:
            try:
                self.metrics.serve(self.config.metrics_port, self.config.host)
            except OSError as exc:
                raise BindError("--metrics-port", join_host_port(host, self.config.metrics_port)) from exc
        if self.http is not None:
            self.http.bind()  # BindError naming --http-listen, before anything starts
        await self.cluster.start()
        await self._server.start()
        address = join_host_port(host, self.port)
        self.cluster.address = address
        print(f"router listening on {address}", flush=True)  # tests, make serve and deploy read it
        if self.http is not None:
            await self.http.start()  # prints "router http listening on HOST:PORT"
            self.cluster.http_address = self.http.address
        self.cluster.write_report()
        log.info(
            "router_listening",
            address=address,
            metrics_port=self.config.metrics_port,
            tls=describe_tls(self.config.tls),
            api_keys=self.api_keys.required,
        )
        warning = plaintext_warning(self.config.host, self.config.tls)
        if warning:
            log.warning("plaintext_listener", address=address, hint=warning)
        return self.port

    def reload_secrets(self) -> None:
        """SIGHUP: re-read --auth-token-file and --api-key-file (an unreadable one keeps its secrets)."""
        for secrets in (self.tokens, self.api_keys):
            try:
                if secrets.reload():
                    log.info("secrets_reloaded", flag=secrets.flag, num_secrets=len(secrets.values))
            except ConfigError as exc:
                log.error(
                    "secrets_reload_failed", flag=secrets.flag, error=str(exc), kept=len(secrets.values)
                )

    async def wait(self) -> int:
        """Until the cluster fails or a stop is requested; returns the exit code."""
        await self.cluster.finished.wait()
        return self.cluster.exit_code or 0

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self._server.stop(STOP_GRACE_S)
        await self.cluster.close()


async def serve(config: RouterConfig) -> int:
    server = RouterServer(config)
    await server.start()
    # Everything allocated so far (modules, the servers, the registry) lives as long as the process: out of
    # the collector's generations, so a collection walks only what requests allocate.
    gc.freeze()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # drain first (--drain-timeout); a second SIGINT: now
        loop.add_signal_handler(sig, server.cluster.on_stop_signal, sig.name)
    loop.add_signal_handler(signal.SIGHUP, server.reload_secrets)
    try:
        code = await server.wait()
    finally:
        await server.stop()
        # Exiting now: a late SIGTERM (a supervisor's, after its own) must not turn exit 0 into -15.
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("router_exit", exit_code=code)
    return code
