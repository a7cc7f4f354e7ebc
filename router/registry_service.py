"""The worker-facing Registry service: Register (handshake -> admission) and Heartbeat.

With --auth-token-file both require the shared secret (compared in constant time, never logged);
a worker without it gets UNAUTHENTICATED and is not admitted.
"""

from __future__ import annotations

import grpc
import structlog

from kvpact.router.cluster import Cluster
from kvpact.router.errors import Unauthenticated
from kvpact.shared.auth import token_matches
from kvpact.v1 import worker_pb2, worker_pb2_grpc

log = structlog.get_logger("router.registry")


class RegistryService(worker_pb2_grpc.RegistryServicer):
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def Register(
        self, request: worker_pb2.Handshake, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Admission:
        self._authenticate(request.auth_token, request.worker_id, "Register")
        return await self.cluster.register(request)

    async def Heartbeat(
        self, request: worker_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HeartbeatReply:
        self._authenticate(request.auth_token, request.worker_id, "Heartbeat")
        return self.cluster.heartbeat(request)

    def _authenticate(self, given: str, worker_id: str, method: str) -> None:
        if token_matches(self.cluster.config.auth_token, given):
            return
        log.warning("worker_unauthenticated", worker_id=worker_id, method=method, token_given=bool(given))
        raise Unauthenticated(
            f'UNAUTHENTICATED: worker "{worker_id}" gave a missing or wrong auth token; start it with '
            f"--auth-token-file naming the router's secret"
        )
