"""Exceptions -> gRPC status, for every kvpact servicer (the router's and the worker's), in one place.

- `StatusError` carries its own status code (the router's errors; a worker's status relayed as is).
- `ErrorInterceptor(statuses, process)` aborts a call that raised with a specific status and the
  exception's message: its own code for a `StatusError`, else the code `statuses` maps its class to
  (the most derived class listed wins). Anything else is logged with its traceback and answered
  INTERNAL "internal error in <Method>: <ExceptionType> (see the <process>'s log)", never a stack trace;
  the server keeps serving everyone else.
- `LogContextInterceptor(**fields)` binds `fields` and the RPC's name into every log line of the call.

Only `/kvpact.v1.` methods are wrapped (standard health and reflection pass untouched), unary-unary
and unary-stream. Streams are wrapped with `aclosing`, so when a call ends early (client cancel,
deadline) closing the outermost generator closes the handler's, which closes what it relays (the
engine's, which frees the sequence; the router's relay, which aborts the request on the worker).
Worker.Stream (stream-stream) is not wrapped: worker/stream_server.py ends each request on it with
`status_of`.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

import grpc
import structlog

log = structlog.get_logger("kvpact.rpc")

KVPACT_METHOD_PREFIX = "/kvpact.v1."

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Stream = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any]]


class StatusError(Exception):
    """Raised inside a servicer: the call is aborted with `code` and the message (`details`)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self.details = details


class _WrappingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(KVPACT_METHOD_PREFIX):
            return handler
        name = method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self.wrap_unary(name, handler.unary_unary))
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return handler._replace(unary_stream=self.wrap_stream(name, handler.unary_stream))
        return handler

    def wrap_unary(self, name: str, behavior: Unary) -> Unary:
        raise NotImplementedError

    def wrap_stream(self, name: str, behavior: Stream) -> Stream:
        raise NotImplementedError


class LogContextInterceptor(_WrappingInterceptor):
    def __init__(self, **fields: str) -> None:
        self._fields = fields

    def wrap_unary(self, name: str, behavior: Unary) -> Unary:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with structlog.contextvars.bound_contextvars(**self._fields, rpc=name):
                return await behavior(request, context)

        return unary

    def wrap_stream(self, name: str, behavior: Stream) -> Stream:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any]:
            with structlog.contextvars.bound_contextvars(**self._fields, rpc=name):
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

        return stream


class ErrorInterceptor(_WrappingInterceptor):
    """`statuses` maps exception classes to status codes; `process` ("router", "worker") names whose
    log holds the traceback of an unexpected error."""

    def __init__(self, statuses: Mapping[type[BaseException], grpc.StatusCode], process: str) -> None:
        self._statuses = dict(statuses)
        self._process = process

    def status_for(self, exc: BaseException) -> grpc.StatusCode | None:
        if isinstance(exc, StatusError):
            return exc.code
        for cls in type(exc).__mro__:
            if cls in self._statuses:
                return self._statuses[cls]
        return None

    def status_of(self, name: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status a call of `name` that raised `exc` ends with, logged (see the module docstring).
        Also what a request on Worker.Stream ends with (worker/stream_server.py)."""
        code = self.status_for(exc)
        if code is None:
            log.error("unexpected error", rpc=name, error_type=type(exc).__name__, exc_info=exc)
            code = grpc.StatusCode.INTERNAL
            return code, f"internal error in {name}: {type(exc).__name__} (see the {self._process}'s log)"
        message = str(exc)
        log.info("request failed", rpc=name, status=code.name, error=message)
        return code, message

    async def _abort(self, name: str, exc: Exception, context: grpc.aio.ServicerContext) -> None:
        await context.abort(*self.status_of(name, exc))

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
