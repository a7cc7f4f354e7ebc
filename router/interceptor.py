"""Errors -> gRPC status, in one place, for every servicer of the router.

A `RouterError` aborts with its own code and message; `shared.errors.RequestError` with
INVALID_ARGUMENT; anything else is logged with its stack and answered INTERNAL without the stack.
Streams are wrapped with `aclosing`: closing the wrapper (a call that ended early) closes the handler.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
import structlog

from kvpact.router.errors import RouterError
from kvpact.shared.errors import RequestError

log = structlog.get_logger("router.rpc")


def _status_of(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RouterError):
        return exc.code, exc.details
    if isinstance(exc, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("rpc_internal_error", method=method)
    return grpc.StatusCode.INTERNAL, f"internal error in {method} (the router logged it)"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            behavior = handler.unary_stream
            # An async generator yields its messages; a coroutine (e.g. health Watch) writes them itself.
            wrap = _wrap_stream if inspect.isasyncgenfunction(behavior) else _wrap_unary
            return handler._replace(unary_stream=wrap(behavior, method))
        return handler


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await context.abort(*_status_of(exc, method))

    return wrapped


def _wrap_stream(
    behavior: Callable[..., AsyncGenerator[Any, None]], method: str
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async with aclosing(behavior(request, context)) as items:
                async for item in items:
                    yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await context.abort(*_status_of(exc, method))

    return wrapped
