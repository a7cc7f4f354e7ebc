"""Two server interceptors for the worker's kvpact services (health and reflection pass untouched).

- `LogContextInterceptor` binds the worker id and the RPC name into every log line of the call.
- `ErrorInterceptor` turns our exceptions into specific gRPC status codes with their message
  (never a stack trace to the client). An exception the table does not name is logged with its
  traceback and answered INTERNAL; the server keeps serving everyone else.

Both wrap unary-unary and unary-stream handlers written as coroutines / async generators. Streams are
wrapped with `aclosing`, so when a call ends early (client cancel, deadline) closing the outermost
generator closes the handler's, which closes the engine's (and the engine frees the sequence).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

KVPACT_METHOD_PREFIX = "/kvpact.v1."

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Stream = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any]]


class _WrappingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(KVPACT_METHOD_PREFIX):
            return handler
        name = method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self.wrap_unary(name, handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self.wrap_stream(name, handler.unary_stream))
        return handler

    def wrap_unary(self, name: str, behavior: Unary) -> Unary:
        raise NotImplementedError

    def wrap_stream(self, name: str, behavior: Stream) -> Stream:
        raise NotImplementedError


class LogContextInterceptor(_WrappingInterceptor):
    def __init__(self, worker_id: str) -> None:
        self._worker_id = worker_id

    def wrap_unary(self, name: str, behavior: Unary) -> Unary:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with structlog.contextvars.bound_contextvars(worker_id=self._worker_id, rpc=name):
                return await behavior(request, context)

        return unary

    def wrap_stream(self, name: str, behavior: Stream) -> Stream:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any]:
            with structlog.contextvars.bound_contextvars(worker_id=self._worker_id, rpc=name):
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

        return stream


class ErrorInterceptor(_WrappingInterceptor):
    """`statuses` maps exception classes to status codes; the most derived class listed wins."""

    def __init__(self, statuses: Mapping[type[BaseException], grpc.StatusCode]) -> None:
        self._statuses = dict(statuses)

    def status_for(self, exc: BaseException) -> grpc.StatusCode | None:
        for cls in type(exc).__mro__:
            if cls in self._statuses:
                return self._statuses[cls]
        return None

    async def _abort(self, name: str, exc: Exception, context: grpc.aio.ServicerContext) -> None:
        code = self.status_for(exc)
        if code is None:
            log.exception("unexpected error", error_type=type(exc).__name__)
            code, message = (
                grpc.StatusCode.INTERNAL,
                f"internal error in {name}: {type(exc).__name__} (see the worker's log)",
            )
        else:
            message = str(exc)
            log.info("request failed", status=code.name, error=message)
        await context.abort(code, message)

    def wrap_unary(self, name: str, behavior: Unary) -> Unary:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._abort(name, exc, context)

        return unary

    def wrap_stream(self, name: str, behavior: Stream) -> Stream:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any]:
            try:
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._abort(name, exc, context)

        return stream
