"""What goes wrong in a router RPC, and the gRPC status each maps to (applied by
kvpact.shared.rpc_errors.ErrorInterceptor, the layer the worker uses too)."""

from __future__ import annotations

import grpc

from kvpact.shared.rpc_errors import StatusError


class RouterError(StatusError):
    """Raised inside a router servicer; the interceptor aborts the RPC with `code` and the message."""


class NotServing(RouterError):
    code = grpc.StatusCode.UNAVAILABLE  # STARTING, or FAILED and exiting


class NoLiveWorker(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class Overloaded(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED  # every worker of the model is at the router's bound


class UnknownModel(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidRequest(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(RouterError):
    code = grpc.StatusCode.ALREADY_EXISTS  # a live worker already holds this worker id


class Unauthenticated(RouterError):
    code = grpc.StatusCode.UNAUTHENTICATED


class WorkerCallFailed(RouterError):
    """The worker's own status, relayed with the worker named."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code

    @property
    def worker_gone(self) -> bool:
        """The worker could not serve it at all (unreachable, killed, stopping): try another one."""
        return self.code is grpc.StatusCode.UNAVAILABLE

    @property
    def worker_full(self) -> bool:
        """The worker refused it for lack of room (its --max-waiting): another one may have room."""
        return self.code is grpc.StatusCode.RESOURCE_EXHAUSTED
