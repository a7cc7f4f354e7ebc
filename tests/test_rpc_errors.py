"""The one exceptions -> gRPC status layer both servers use (kvpact.shared.rpc_errors)."""

import asyncio

import grpc
import pytest

from kvpact.router.errors import NoLiveWorker, WorkerCallFailed
from kvpact.shared.errors import RequestError
from kvpact.shared.rpc_errors import ErrorInterceptor


class Aborted(Exception):
    pass


class Context:
    """What the interceptor uses of a grpc.aio.ServicerContext: abort(code, message)."""

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


def outcome(exc: Exception, stream: bool = False) -> tuple[grpc.StatusCode, str]:
    interceptor = ErrorInterceptor({RequestError: grpc.StatusCode.INVALID_ARGUMENT}, "router")

    async def unary(request, context):
        raise exc

    async def streamed(request, context):
        yield 1
        raise exc

    async def call() -> None:
        if stream:
            async for _ in interceptor.wrap_stream("Generate", streamed)(None, Context()):
                pass
        else:
            await interceptor.wrap_unary("Complete", unary)(None, Context())

    with pytest.raises(Aborted) as aborted:
        asyncio.run(call())
    return aborted.value.args


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_each_error_gets_its_status_and_message(stream):
    assert outcome(NoLiveWorker("no worker is live"), stream) == (
        grpc.StatusCode.UNAVAILABLE,
        "no worker is live",
    )
    relayed = WorkerCallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "worker a: too long")
    assert outcome(relayed, stream) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "worker a: too long")
    assert outcome(RequestError("max_tokens must be > 0"), stream) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be > 0",
    )


def test_an_unexpected_error_is_internal_without_its_stack():
    code, message = outcome(ZeroDivisionError("division by zero"))
    assert code is grpc.StatusCode.INTERNAL
    assert message == "internal error in Complete: ZeroDivisionError (see the router's log)"
