"""The worker-facing Registry service: Register (handshake -> admission), Heartbeat, Deregister, and
Drain (kvpact-launch retiring a worker when it scales down).

With --auth-token-file all of them require the shared secret (compared in constant time, never logged);
a worker without it gets UNAUTHENTICATED and is not admitted. With TLS, a worker that announces an
address is dialed back there over (mutual) TLS first (router/tls_probe.py): a certificate the router's
--tls-ca did not sign gets UNAUTHENTICATED too, and the router logs why.
"""

from __future__ import annotations

import grpc
import structlog

from kvpact.router.cluster import Cluster
from kvpact.router.errors import Unauthenticated
from kvpact.router.tls_probe import tls_refusal
from kvpact.shared.auth import SecretFile
from kvpact.v1 import worker_pb2, worker_pb2_grpc

log = structlog.get_logger("router.registry")


class RegistryService(worker_pb2_grpc.RegistryServicer):
    def __init__(self, cluster: Cluster, tokens: SecretFile | None = None) -> None:
        self.cluster = cluster
        self.tokens = tokens or SecretFile("--auth-token-file", None, cluster.config.auth_tokens)

    async def Register(
        self, request: worker_pb2.Handshake, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Admission:
        self._authenticate(request.auth_token, request.worker_id, "Register")
        await self._check_tls(request)
        return await self.cluster.register(request)

    async def Heartbeat(
        self, request: worker_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HeartbeatReply:
        self._authenticate(request.auth_token, request.worker_id, "Heartbeat")
        return await self.cluster.heartbeat(request)

    async def Deregister(
        self, request: worker_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DeregisterReply:
        self._authenticate(request.auth_token, request.worker_id, "Deregister")
        return await self.cluster.deregister(request)

    async def Drain(
        self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DrainReply:
        self._authenticate(request.auth_token, request.worker_id, "Drain")
        return await self.cluster.drain(request)

    def _authenticate(self, given: str, worker_id: str, method: str) -> None:
        if self.tokens.matches(given):
            return
        log.warning("worker_unauthenticated", worker_id=worker_id, method=method, token_given=bool(given))
        raise Unauthenticated(
            f'UNAUTHENTICATED: worker "{worker_id}" gave a missing or wrong auth token; start it with '
            f"--auth-token-file naming the router's secret"
        )

    async def _check_tls(self, request: worker_pb2.Handshake) -> None:
        tls = self.cluster.config.tls
        if tls is None or not request.address or request.WhichOneof("outcome") == "failed":
            return
        reason = await tls_refusal(request.address, tls)
        if reason is None:
            return
        ca = tls.ca_file or "the system's trusted roots"
        log.error(
            "worker_tls_refused", worker_id=request.worker_id, address=request.address, ca=ca, reason=reason
        )
        raise Unauthenticated(
            f'worker "{request.worker_id}": the router dialed it back over TLS and the handshake failed '
            f"({reason}); its --tls-cert must be signed by the router's --tls-ca ({ca}) and name the "
            "host it advertises (or set --tls-server-name on both)"
        )
