"""Before a TLS router admits a worker, it dials the worker's address back over (mutual) TLS.

The router's port cannot require client certificates (clients bring API keys, not certificates), so a
worker's certificate is checked from the other side: the router connects to the address the worker
announced, verifying the worker's certificate against --tls-ca and presenting its own. Any answer, even
UNIMPLEMENTED or UNAVAILABLE from the servicer, proves the handshake; a failed handshake refuses the worker,
logged here with the TLS reason. A worker that cannot be reached at all is not refused here: that is the
heartbeat's business, as without TLS.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.shared.tls import TlsConfig, aio_channel, handshake_failure

PROBE_TIMEOUT_S = 3.0


async def tls_refusal(address: str, tls: TlsConfig, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the TLS handshake with the worker at `address` failed, or None when it succeeded (or when the
    worker could not be reached for another reason)."""
    async with aio_channel(address, tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return handshake_failure(exc.details())
    return None
