"""What goes wrong in a router RPC, and the gRPC status each maps to (applied by router.interceptor)."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Raised inside a servicer; the interceptor aborts the RPC with `code` and the message."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self.details = details


class NotServing(RouterError):
    code = grpc.StatusCode.UNAVAILABLE  # STARTING, or FAILED and exiting


class NoLiveWorker(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class UnknownModel(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidRequest(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(RouterError):
    code = grpc.StatusCode.UNAUTHENTICATED


class WorkerCallFailed(RouterError):
    """The worker's own status, relayed with the worker named."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
