"""Client API keys (--api-key-file): every client call must carry `authorization: Bearer <key>` metadata.

Missing or wrong -> UNAUTHENTICATED, before the servicer runs. Open without a key: grpc.health.v1 (probes)
and server reflection (grpcurl's discovery), and the workers' Registry, which the shared token guards
(--auth-token-file). Keys are compared in constant time against every accepted key (shared.auth) and are
never logged; the file is re-read on SIGHUP (router/server.py), calls in flight are not touched.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2

from kvpact.shared.auth import SecretFile
from kvpact.v1 import worker_pb2

log = structlog.get_logger("router.api_keys")

AUTHORIZATION = "authorization"
BEARER = "bearer "
OPEN_SERVICES = (
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
    worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
)
MISSING = (
    "this router requires an API key: send the metadata 'authorization: Bearer <key>' "
    "(kvpact.client: api_key=...; grpcurl: -H 'authorization: Bearer <key>')"
)
WRONG = "the API key is not accepted by this router; ask its operator for a current key"


def service_of(method: str) -> str:
    """'/pkg.Service/Method' -> 'pkg.Service'."""
    return method.lstrip("/").partition("/")[0]


def bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The key in the call's `authorization: Bearer <key>` metadata, None when there is none."""
    for name, value in metadata or ():
        if name.lower() == AUTHORIZATION and isinstance(value, str) and value.lower().startswith(BEARER):
            return value[len(BEARER) :].strip()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: SecretFile) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self.keys.required or service_of(method) in OPEN_SERVICES:
            return handler
        given = bearer(handler_call_details.invocation_metadata)
        if given is not None and self.keys.matches(given):
            return handler
        log.warning("client_unauthenticated", method=method, key_given=given is not None)
        return _refusing(handler, WRONG if given is not None else MISSING)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by an UNAUTHENTICATED abort (same call shape)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=refuse)
    if handler.unary_stream is not None:
        stream = inspect.isasyncgenfunction(handler.unary_stream)
        return handler._replace(unary_stream=refuse_stream if stream else refuse)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=refuse)
    return handler._replace(stream_stream=refuse_stream)
