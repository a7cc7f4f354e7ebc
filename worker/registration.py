"""The worker's side of the router's Registry: the handshake (with retries) and the heartbeats.

- `register` sends a Handshake and returns the Admission. A router that is not up yet (UNAVAILABLE)
  is retried with backoff until the link's timeout (--router-timeout), then RouterUnreachableError.
  UNAUTHENTICATED (no or wrong --auth-token-file) raises RouterAuthError at once; any other status
  raises RegistrationError. A failed startup is reported the same way (Handshake.failed).
- `announce` sends the pre-load plan (Handshake.loading) and waits for the router to acknowledge it,
  for up to --router-timeout (a router not up yet is waited for): a worker never loads weights before
  its plan is acknowledged, so one that a failed cluster would have refused never loads them.
  No answer by then raises RouterUnreachableError (the worker exits 1 without loading).
  UNAUTHENTICATED raises RouterAuthError, as for `register`.
- The Admission names the registration (`registration_id`); the link keeps the latest and sends it in
  every heartbeat. ALREADY_EXISTS (a live worker holds this --worker-id) raises RegistrationError at once,
  from `announce` too, so such a worker never loads its weights.
- `heartbeats` calls Registry.Heartbeat every interval with the worker's load and its features'
  realized states (the router judges each beat against its policies: drift, docs/contract.md) until
  the router asks the worker to stop. A reply with `drain` (the router retires this worker: a
  scale-down, or drift under an `on` policy) calls `on_drain(reason)`, and the beats go on (saying
  `draining`) until the worker leaves. A reply `known=false` (the router restarted or forgot us)
  re-registers. A router that cannot be reached is logged (once when the outage passes the timeout)
  and retried: the worker keeps serving, since its router may come back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import structlog

from kvpact.shared.errors import KvpactError
from kvpact.shared.features import FeatureState
from kvpact.shared.handshake import WorkerLoad
from kvpact.shared.handshake_pb import feature_to_pb, load_to_pb
from kvpact.shared.tls import TlsConfig, aio_channel, handshake_failure
from kvpact.v1 import worker_pb2, worker_pb2_grpc

log = structlog.get_logger(__name__)

# Reconnect quickly once the router is up (gRPC's default backoff grows to minutes).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000))
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0
NOTICE_TIMEOUT_S = 1.0  # draining and deregistering: the worker never waits long on the router to stop
PLAINTEXT_HINT = (
    " (a router that serves TLS closes plaintext connections: give this worker --tls-cert, --tls-key and "
    "--tls-ca)"
)
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # not up yet, or slow


class RegistrationError(KvpactError):
    """The router answered the handshake or a heartbeat with an error."""


class RouterAuthError(RegistrationError):
    """The router requires an auth token and this worker has none, or a different one."""


class RouterTlsError(RegistrationError):
    """The TLS handshake with the router failed (certificates, or TLS on one side only)."""


class RouterUnreachableError(RegistrationError):
    """No answer from the router within --router-timeout."""


class RouterLink:
    def __init__(
        self,
        router: str,
        *,
        worker_id: str,
        auth_token: str | None,
        timeout_s: float,
        tls: TlsConfig | None = None,
    ) -> None:
        self.router = router
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._auth_token = auth_token or ""
        self._tls = tls
        self._channel = aio_channel(router, tls, CHANNEL_OPTIONS)
        self.registration_id = ""  # from the latest Admission; heartbeats carry it
        self.draining = False  # heartbeats say so once set (the router routes nothing new here)
        self._stub = worker_pb2_grpc.RegistryStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    def set_token(self, token: str | None) -> None:
        self._auth_token = token or ""

    def _tls_error(self, exc: grpc.aio.AioRpcError) -> RouterTlsError | None:
        reason = handshake_failure(exc.details())
        if reason is None:
            return None
        if self._tls is None:
            hint = (
                "this worker dials in plaintext; give it --tls-cert, --tls-key and --tls-ca like the router's"
            )
        else:
            ca = self._tls.ca_file or "the system's trusted roots"
            hint = (
                f"check that --tls-ca ({ca}) signed the router's certificate, that it names the host in "
                "--router (or set --tls-server-name), and that the router runs with TLS"
            )
        return RouterTlsError(f"TLS handshake with router {self.router} failed: {reason}; {hint}")

    async def register(self, handshake: worker_pb2.Handshake) -> worker_pb2.Admission:
        """Send `handshake` (the token is added here), retrying while the router is unreachable."""
        message = worker_pb2.Handshake()
        message.CopyFrom(handshake)
        message.auth_token = self._auth_token
        deadline = time.monotonic() + self.timeout_s
        backoff = BACKOFF_INITIAL_S
        attempts = 0
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            try:
                admission = await self._stub.Register(message, timeout=max(remaining, 0.01))
                self.registration_id = admission.registration_id
                return admission
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code is grpc.StatusCode.UNAUTHENTICATED:
                    raise RouterAuthError(
                        f"router {self.router} refused the handshake: {exc.details()}"
                    ) from None
                tls_error = self._tls_error(exc)
                if tls_error is not None:
                    raise tls_error from None
                if code not in _RETRYABLE:
                    raise RegistrationError(
                        f"router {self.router} answered the handshake with {code.name}: {exc.details()}"
                    ) from None
                if time.monotonic() + backoff >= deadline:
                    raise RouterUnreachableError(
                        f"router {self.router} did not answer the handshake within --router-timeout "
                        f"{self.timeout_s:g}s ({attempts} attempts; last: {code.name}: {exc.details()})"
                        + (
                            PLAINTEXT_HINT
                            if self._tls is None and "Socket closed" in (exc.details() or "")
                            else ""
                        )
                    ) from None
                if attempts == 1:
                    log.info(
                        "router not reachable yet; retrying", router=self.router, timeout_s=self.timeout_s
                    )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def announce(self, handshake: worker_pb2.Handshake) -> worker_pb2.Admission:
        """Send `handshake` (its `loading` plan) as `register` does, retrying while the router is not up
        for up to --router-timeout: the worker loads nothing before this returns."""
        try:
            return await self.register(handshake)
        except RouterUnreachableError as exc:
            raise RouterUnreachableError(
                f"{exc}; it did not load its weights (it loads only once the router acknowledged its plan)"
            ) from None

    def _beat(self, load: WorkerLoad, features: tuple[FeatureState, ...] = ()) -> worker_pb2.HeartbeatRequest:
        return worker_pb2.HeartbeatRequest(
            worker_id=self.worker_id,
            load=load_to_pb(load),
            auth_token=self._auth_token,
            registration_id=self.registration_id,
            draining=self.draining,
            features=[feature_to_pb(f) for f in features],
        )

    async def start_draining(self, load: WorkerLoad) -> None:
        """Say at once (not at the next beat) that this worker is draining; bounded, best effort."""
        self.draining = True
        try:
            await self._stub.Heartbeat(self._beat(load), timeout=NOTICE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not tell the router this worker is draining", status=exc.code().name)

    async def deregister(self, reason: str) -> None:
        """Leave the router's registry (after draining); bounded, best effort."""
        request = worker_pb2.DeregisterRequest(
            worker_id=self.worker_id,
            registration_id=self.registration_id,
            auth_token=self._auth_token,
            reason=reason,
        )
        try:
            await self._stub.Deregister(request, timeout=NOTICE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not deregister from the router", status=exc.code().name)

    async def heartbeats(
        self,
        interval_s: float,
        load: Callable[[], WorkerLoad],
        reregister: Callable[[], Awaitable[None]],
        on_drain: Callable[[str], None] = lambda reason: None,
        features: Callable[[], tuple[FeatureState, ...]] = tuple,
    ) -> str:
        """Beat until the router asks this worker to stop; return that reason. A reply asking it to drain
        calls `on_drain(reason)` (once: it then beats as draining). Each beat carries `features()`.
        Raises RouterAuthError if the router starts rejecting the token, and whatever `reregister` raises."""
        last_ok = time.monotonic()
        outage_logged = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                beat = self._beat(load(), features())
                reply = await self._stub.Heartbeat(beat, timeout=max(interval_s, 1.0))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                    raise RouterAuthError(
                        f"router {self.router} refused a heartbeat: {exc.details()}"
                    ) from None
                down_s = time.monotonic() - last_ok
                if down_s > self.timeout_s and not outage_logged:
                    outage_logged = True
                    log.warning(
                        "router unreachable; still serving",
                        router=self.router,
                        down_s=round(down_s, 1),
                        status=exc.code().name,
                    )
                continue
            if outage_logged:
                log.info("router reachable again", router=self.router)
            last_ok, outage_logged = time.monotonic(), False
            if reply.shutdown:
                return "the router asked this worker to stop (heartbeat reply)"
            if reply.drain and not self.draining:
                on_drain(reply.drain_reason or "the router asked this worker to drain")
            if reply.router_stopping and not outage_logged:
                log.info("the router is stopping; this worker registers again when a router answers")
            if not reply.known and not self.draining:  # draining, it is leaving: never register again
                log.info("router does not know this worker; registering again", router=self.router)
                await reregister()
