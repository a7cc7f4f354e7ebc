"""The router's state and the actions on it: register a worker, take a heartbeat, fail the startup.

The servicers (router/service.py, router/registry_service.py) are thin adapters over this object;
policy lives in admission.py and cluster_state.py, I/O to the workers in connections.py.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TextIO

import structlog
from grpc_health.v1 import health, health_pb2

from kvpact.router.admission import admit, admit_plan, admit_uniform
from kvpact.router.cluster_state import ClusterState, Startup
from kvpact.router.config import RouterConfig
from kvpact.router.connections import NOT_ANSWERED, WorkerChannels
from kvpact.router.drift import Drift
from kvpact.router.drift import judge as judge_drift
from kvpact.router.errors import AlreadyExists, InvalidRequest
from kvpact.router.readiness import readiness
from kvpact.router.registry import Registry, WorkerEntry, WorkerState
from kvpact.router.report import FailedStartup, render_failure_report
from kvpact.router.report_file import write_report
from kvpact.router.status import cluster_status_to_pb
from kvpact.shared import handshake_pb
from kvpact.shared.describe import describe_intent, describe_plan, describe_realized
from kvpact.shared.errors import ConfigError
from kvpact.shared.features import FeatureMode, FeatureState, describe_features, updated_states
from kvpact.shared.handshake import WorkerLoad
from kvpact.v1 import router_pb2, worker_pb2

DRAIN_EXPIRED_GRACE_S = 1.0  # after --drain-timeout: for the streams still relaying to end with their status
log = structlog.get_logger("router")

HOLDER_PROBE_TIMEOUT_S = 1.0  # a worker id's holder that does not answer within this has gone
# lingering in FAILED: how often a worker that did not answer its Shutdown is asked again
SHUTDOWN_RETRY_S = 0.5
# A holder of the id in one of these states may still be running; REFUSED and FAILED ones exit.
_MAY_BE_RUNNING = (WorkerState.LOADING, WorkerState.ADMITTED, WorkerState.DEAD)


class Cluster:
    def __init__(
        self,
        config: RouterConfig,
        report_stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = Registry()
        self.startup = Startup(num_expected=config.num_expected_workers)
        self.channels = WorkerChannels(config.tls)
        self.health = health.aio.HealthServicer()
        self.clock = clock
        self.failure_report = ""
        self.stopping = False  # SIGTERM: draining the in-flight calls before exit
        # Streams being relayed now, every worker's, registered or not: what a drain waits for. Not the
        # entries' num_outstanding: a worker deregisters once its engine is done, while the router may
        # still be relaying its last chunks (router/service.py counts both).
        self.num_relaying = 0
        self.drain_expired = False  # --drain-timeout ran out: streams still relaying end with a named status
        self.told_after_failure: set[str] = set()  # workers refused while lingering in FAILED
        self.exit_code: int | None = None
        # each registration's feature states, for kvpact_worker_fallbacks_total (router/server.py sets it)
        self.observe_fallbacks: Callable[[tuple[FeatureState, ...]], None] = lambda features: None
        # each drift a heartbeat shows, for kvpact_worker_drift_total (router/server.py sets it)
        self.observe_drift: Callable[[Drift], None] = lambda drift: None
        self.address = ""  # HOST:PORT once bound (router/server.py), for --report-file
        self.http_address = ""  # the --http-listen front's HOST:PORT once bound, for --report-file
        self.finished = asyncio.Event()  # set with exit_code when the router should exit
        self._report_stream = report_stream
        self._tasks: list[asyncio.Task[None]] = []
        self._health_now: dict[str, bool] = {}  # what health says, per service (router/readiness.py)

    @property
    def state(self) -> ClusterState:
        return self.startup.state

    @property
    def serving_health(self) -> bool:
        """What grpc.health says for the router as a whole (router/readiness.py)."""
        return self._health_now.get(health.OVERALL_HEALTH, False)

    async def start(self) -> None:
        """Health NOT_SERVING until SERVING; start the startup timer and the heartbeat monitor."""
        await self.refresh_health()
        self._tasks = [
            asyncio.create_task(self._startup_timer(), name="startup-timer"),
            asyncio.create_task(self._watch_heartbeats(), name="heartbeat-monitor"),
        ]
        log.info(
            "cluster_starting",
            policy=self.config.policy.value,
            policies={k: v.value for k, v in self.config.feature_policies().items()},
            expect_workers=self.config.num_expected_workers,
            startup_timeout_s=self.config.startup_timeout_s,
        )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channels.close_all()

    def status(self) -> router_pb2.ClusterStatusResponse:
        return cluster_status_to_pb(
            self.state,
            self.config.policy,
            self.startup.num_expected,
            self.registry.entries(),
            self.clock(),
            self.failure_report,
            self.serving_health,
            self.config.feature_policies(),
        )

    def write_report(self, exit_code: int | None = None) -> None:
        """--report-file, if set: the state now (router/report_file.py). An unwritable file is logged."""
        if not self.config.report_file:
            return
        state = "stopping" if self.stopping else self.state.value
        try:
            write_report(
                self.config.report_file,
                address=self.address,
                http_address=self.http_address,
                state=state,
                status=self.status(),
                exit_code=exit_code,
                cause=self.startup.cause,
                report=self.failure_report,
            )
        except OSError as exc:
            log.error("report_file_not_written", path=self.config.report_file, error=str(exc))

    def request_exit(self, exit_code: int) -> None:
        if self.exit_code is None:
            self.exit_code = exit_code
        self.finished.set()

    # -- Registry (worker-facing) ---------------------------------------------------------------------

    async def register(self, handshake: worker_pb2.Handshake) -> worker_pb2.Admission:
        entry = self._entry_from_handshake(handshake)
        prior = self.registry.get(entry.worker_id)
        if prior is not None and prior.address != entry.address and prior.state in _MAY_BE_RUNNING:
            if await self.channels.answers(prior.address, HOLDER_PROBE_TIMEOUT_S):
                log.warning(
                    "worker_id_taken", worker_id=entry.worker_id, holder=prior.address, refused=entry.address
                )
                raise AlreadyExists(
                    f'worker id "{entry.worker_id}" is held by a live worker at {prior.address} '
                    f"({prior.state.value}); give this worker another --worker-id, or stop that one first"
                )
            log.info("worker_id_reclaimed", worker_id=entry.worker_id, gone=prior.address, new=entry.address)
        entry.registration_id = uuid.uuid4().hex
        if entry.plan is None and prior is not None and prior.state is WorkerState.LOADING:
            entry.plan = prior.plan  # its ready (or failed) registration keeps what it had announced
        policy = self.config.policy
        if self.state is ClusterState.FAILED:
            entry.state, entry.state_reason = WorkerState.REFUSED, self.startup.describe()
            self.told_after_failure.add(entry.worker_id)
            log.info("worker_told_cluster_failed", worker_id=entry.worker_id, planned=entry.plan is not None)
            return self._admission(False, entry.state_reason)
        policies = self.config.feature_policies()
        if entry.plan is not None and entry.realized is None and entry.failure is None:
            decision = admit_plan(policy, entry.spec.cache, entry.plan, policies)
        else:
            outcome = entry.realized if entry.realized is not None else entry.failure
            assert outcome is not None
            decision = admit(policy, entry.spec.cache, outcome, policies)
        if decision.admitted or decision.pending:  # interchangeable with its model name's other workers?
            peers = self.registry.peers(entry)
            decision = admit_uniform(entry.fingerprint, peers, self.config.uniform) or decision
        if entry.realized is not None:
            self._note_fallbacks(entry)
        if decision.admitted:
            entry.state = WorkerState.ADMITTED
        elif decision.pending:
            entry.state = WorkerState.LOADING
        else:
            entry.state = WorkerState.FAILED if entry.failure is not None else WorkerState.REFUSED
        entry.state_reason = decision.reason
        self.registry.add(entry)
        await self.refresh_health()
        if decision.pending:  # not admitted yet: the startup state machine hears of it once it is ready
            log.info(
                "worker_loading",
                worker_id=entry.worker_id,
                address=entry.address,
                model=entry.model_name,
                asked=describe_intent(entry.spec.cache),
                planned=describe_plan(entry.plan) if entry.plan else None,
                verdict_seconds=entry.plan.verdict_seconds if entry.plan else None,
                reason=decision.reason,
                cluster_state=self.state.value,
            )
            return self._admission(
                False, decision.reason, pending=True, registration_id=entry.registration_id
            )
        before = self.state
        after = self.startup.on_decision(entry.worker_id, decision)
        emit = log.info if decision.admitted else log.error
        emit(
            "worker_admitted" if decision.admitted else "worker_refused",
            worker_id=entry.worker_id,
            address=entry.address,
            model=entry.model_name,
            asked=describe_intent(entry.spec.cache),
            realized=describe_realized(entry.realized) if entry.realized else None,
            planned=describe_plan(entry.plan) if entry.plan else None,
            features=describe_features(entry.realized.features) if entry.realized else None,
            reason=decision.reason,
            feature=decision.feature or None,
            cluster_state=after.value,
            admitted=f"{self.startup.num_admitted}/{self.startup.num_expected}",
        )
        await self.refresh_health()
        if before is ClusterState.STARTING and after is ClusterState.SERVING:
            await self._now_serving()
        elif before is ClusterState.STARTING and after is ClusterState.FAILED:
            self._tasks.append(asyncio.create_task(self._fail(), name="fail-startup"))
        elif before is ClusterState.SERVING and not decision.admitted:
            log.warning("late_worker_refused", worker_id=entry.worker_id, detail="the cluster keeps serving")
        if before is ClusterState.SERVING:
            self.write_report()  # a joiner while serving: kvpact-launch counts a group's admitted workers
        return self._admission(decision.admitted, decision.reason, registration_id=entry.registration_id)

    def _note_fallbacks(self, entry: WorkerEntry) -> None:
        """A ready registration's features: each fallback logged once here (the worker logged it too) and
        counted in kvpact_worker_fallbacks_total."""
        assert entry.realized is not None
        features = entry.realized.features
        self.observe_fallbacks(features)
        for f in features:
            if f.fell_back:
                log.info(
                    "worker_feature_fallback",
                    worker_id=entry.worker_id,
                    feature=f.name,
                    requested=f.requested.value,
                    reason=f.code,
                    component=f.component,
                    message=f.message,
                )

    async def heartbeat(self, request: worker_pb2.HeartbeatRequest) -> worker_pb2.HeartbeatReply:
        known = self.registry.get(request.worker_id)
        was_dead = known is not None and known.state is WorkerState.DEAD
        was_draining = known is not None and known.state is WorkerState.DRAINING
        load_before = known.load if known is not None else WorkerLoad()
        entry = self.registry.heartbeat(
            request.worker_id,
            handshake_pb.load_from_pb(request.load),
            self.clock(),
            request.registration_id,
            draining=request.draining,
        )
        if entry is None:
            return worker_pb2.HeartbeatReply(known=False, router_stopping=self.stopping)
        serving = entry.state in (WorkerState.ADMITTED, WorkerState.DRAINING)
        if serving and entry.realized is not None and self._judge_drift(entry, request, load_before):
            self.write_report()
        if entry.state is WorkerState.DRAINING and not was_draining:
            log.info("worker_draining", worker_id=entry.worker_id, num_outstanding=entry.num_outstanding)
            await self.refresh_health()
            self.write_report()
        if was_dead:
            log.info("worker_revived", worker_id=entry.worker_id)
            await self.refresh_health()
            self.write_report()
        stop = entry.state in (WorkerState.REFUSED, WorkerState.FAILED) or self.state is ClusterState.FAILED
        return worker_pb2.HeartbeatReply(
            known=True,
            shutdown=stop,
            router_stopping=self.stopping,
            drain=bool(entry.drain_reason),
            drain_reason=entry.drain_reason,
        )

    def _judge_drift(
        self, entry: WorkerEntry, request: worker_pb2.HeartbeatRequest, load_before: WorkerLoad
    ) -> bool:
        """Judge one beat's feature states and counters against the policies (router/drift.py): each
        drift is logged once, counted in kvpact_worker_drift_total and shown as the state reason; one
        that violates an `on` (or `off`) policy drains the worker. The states it reports become its
        realized ones (ClusterStatus, kvpact_worker_feature_realized). True if it drifted."""
        assert entry.realized is not None
        now = tuple(handshake_pb.feature_from_pb(f) for f in request.features)
        drifts = judge_drift(
            self.config.all_policies(), entry.realized.features, now or entry.realized.features,
            load_before, entry.load,
        )  # fmt: skip
        if now:
            entry.realized = replace(entry.realized, features=updated_states(entry.realized.features, now))
        for d in drifts:
            drain = d.violates and not entry.drain_reason
            log.warning(
                "worker_drift",
                worker_id=entry.worker_id,
                feature=d.feature,
                reason=d.reason,
                message=d.message,
                policy=self.config.all_policies().get(d.feature, FeatureMode.AUTO).value,
                action="drain" if drain else "report",
            )
            self.observe_drift(d)
            entry.state_reason = f"drift: {d.message}"
            if drain:
                self.registry.drain(entry.worker_id, f"drift: {d.message}")
        return bool(drifts)

    async def drain(self, request: worker_pb2.DrainRequest) -> worker_pb2.DrainReply:
        """Registry.Drain (kvpact-launch scaling down): nothing new is routed to the worker from now on; its
        next heartbeat reply tells it to drain, and it leaves once its in-flight streams are done."""
        entry = self.registry.drain(request.worker_id, request.reason)
        if entry is None:
            return worker_pb2.DrainReply(known=False)
        # as the drain found them: its streams go on finishing while the health and report are updated
        reply = worker_pb2.DrainReply(
            known=True, state=entry.state.value, num_outstanding=entry.num_outstanding
        )
        log.info(
            "worker_drain_requested",
            worker_id=entry.worker_id,
            reason=entry.drain_reason,
            state=reply.state,
            num_outstanding=reply.num_outstanding,
        )
        await self.refresh_health()
        self.write_report()
        return reply

    async def deregister(self, request: worker_pb2.DeregisterRequest) -> worker_pb2.DeregisterReply:
        entry = self.registry.remove(request.worker_id, request.registration_id)
        if entry is not None:
            log.info("worker_left", worker_id=entry.worker_id, address=entry.address, reason=request.reason)
            await self.refresh_health()
            self.write_report()
        return worker_pb2.DeregisterReply(known=entry is not None)

    def on_stop_signal(self, name: str = "SIGTERM") -> None:
        """SIGTERM (again and again: `ray job stop` signals the router and kvpact-launch, which then stops
        it in order) drains; a SIGINT while draining (a second Ctrl-C) stops now."""
        if self.stopping and name == "SIGTERM":
            log.info("router_already_draining", signal=name)
            return
        self._tasks.append(asyncio.get_running_loop().create_task(self.drain_and_exit(0), name="drain"))

    async def drain_and_exit(self, exit_code: int = 0) -> None:
        """SIGTERM: health NOT_SERVING and new calls refused at once (UNAVAILABLE), heartbeats answered
        with `router_stopping`; the in-flight calls finish for up to --drain-timeout; then exit."""
        if self.stopping:  # a second signal: now
            self.request_exit(exit_code)
            return
        self.stopping = True
        await self.refresh_health()
        self.write_report()
        started = self.clock()
        log.info("router_draining", in_flight=self.num_relaying, timeout_s=self.config.drain_timeout_s)
        while self.num_relaying and self.clock() - started < self.config.drain_timeout_s:
            await asyncio.sleep(0.05)
        left = self.num_relaying
        if left:  # each stream still relaying ends at its next chunk, saying why (router/service.py)
            self.drain_expired = True
            ends = self.clock() + DRAIN_EXPIRED_GRACE_S
            while self.num_relaying and self.clock() < ends:
                await asyncio.sleep(0.05)
        log.info("router_drained", seconds=round(self.clock() - started, 2), unfinished=left)
        self.request_exit(exit_code)

    def _admission(
        self, admitted: bool, reason: str, *, pending: bool = False, registration_id: str = ""
    ) -> worker_pb2.Admission:
        return worker_pb2.Admission(
            admitted=admitted,
            pending=pending,
            registration_id=registration_id,
            reason=reason,
            cluster_policy=handshake_pb.mode_to_pb(self.config.policy),
            heartbeat_interval_ms=int(self.config.heartbeat_interval_s * 1000),
        )

    def _entry_from_handshake(self, hs: worker_pb2.Handshake) -> WorkerEntry:
        if not hs.worker_id:
            raise InvalidRequest("Handshake.worker_id is empty; every worker needs a --worker-id")
        outcome = hs.WhichOneof("outcome")
        if outcome is None:
            raise InvalidRequest(
                f'worker "{hs.worker_id}": Handshake has no outcome: '
                "neither `ready` nor `failed` nor `loading`"
            )
        if outcome == "ready" and not hs.address:
            raise InvalidRequest(
                f'worker "{hs.worker_id}": a ready Handshake needs the Worker service address'
            )
        try:
            realized = handshake_pb.realized_from_pb(hs.ready) if outcome == "ready" else None
        except KeyError as exc:
            raise InvalidRequest(f'worker "{hs.worker_id}": its RealizedCache has no kind/scheduler') from exc
        try:
            plan = handshake_pb.plan_from_pb(hs.loading) if outcome == "loading" else None
        except KeyError as exc:
            raise InvalidRequest(f'worker "{hs.worker_id}": its LoadingPlan has no planned kind') from exc
        try:
            spec = handshake_pb.spec_from_pb(hs.spec)
        except (KeyError, ValueError, ConfigError) as exc:  # an unknown enum, or --pa-* values out of range
            raise InvalidRequest(f'worker "{hs.worker_id}": its WorkerSpec is malformed: {exc}') from exc
        return WorkerEntry(
            worker_id=hs.worker_id,
            address=hs.address,
            model_name=hs.model_name,
            spec=spec,
            capabilities=hs.capabilities,
            realized=realized,
            failure=handshake_pb.failure_from_pb(hs.failed) if outcome == "failed" else None,
            plan=plan,
            metrics_address=hs.metrics_address,
            labels=dict(hs.labels),
            fingerprint=handshake_pb.fingerprint_from_pb(hs.fingerprint)
            if hs.HasField("fingerprint")
            else None,
            state=WorkerState.REFUSED,
            state_reason="",
            last_heartbeat=self.clock(),
            # Until its first heartbeat (one interval away) a worker that just registered counts as idle.
            load=WorkerLoad(num_free_blocks=realized.num_blocks, num_total_blocks=realized.num_blocks)
            if realized is not None
            else WorkerLoad(),
        )

    async def call_failed(self, entry: WorkerEntry, reason: str) -> None:
        """A relayed call found `entry` gone: route nothing more to it until it beats again."""
        if self.registry.mark_unreachable(entry, reason):
            log.warning("worker_dead", worker_id=entry.worker_id, reason=reason)
            await self.refresh_health()

    # -- Startup transitions --------------------------------------------------------------------------

    async def refresh_health(self) -> None:
        """Bring grpc.health.v1 in line with the cluster (router/readiness.py); only changes are set.
        A stopping router (SIGTERM) is NOT_SERVING everywhere."""
        for service, ready in readiness(self.state, self.registry).items():
            ready = ready and not self.stopping
            if self._health_now.get(service) is not ready:
                self._health_now[service] = ready
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ready
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                await self.health.set(service, status)

    async def _now_serving(self) -> None:
        admitted = [e for e in self.registry.entries() if e.serving]
        log.info(
            "cluster_serving",
            policy=self.config.policy.value,
            workers=[
                {
                    "worker_id": e.worker_id,
                    "model": e.model_name,
                    "realized": describe_realized(e.realized) if e.realized else None,
                }
                for e in admitted
            ],
        )
        self.write_report()

    async def _fail(self, linger: bool = True) -> None:
        """Tell every registered worker to stop (bounded), those still LOADING included, print the one
        report, linger for the workers not heard from yet (not after a startup timeout), and exit."""
        await self.refresh_health()
        workers = self.registry.entries()
        reason = f"the cluster failed to start: {self.startup.cause}"
        shutdown = await self.channels.shutdown_workers(workers, reason, self.config.shutdown_timeout_s)
        self.failure_report = render_failure_report(
            FailedStartup(
                policy=self.config.policy,
                num_expected=self.startup.num_expected,
                cause=self.startup.cause,
                exit_code=self.startup.exit_code,
                workers=workers,
                shutdown=shutdown,
                policies=self.config.feature_policies(),
                feature=self.startup.feature,
                uniform=self.config.uniform,
            )
        )
        stream = self._report_stream or sys.stderr
        stream.write(self.failure_report + "\n")
        stream.flush()
        self.write_report(self.startup.exit_code)
        log.error(
            "cluster_failed", exit_code=self.startup.exit_code, worker_ids=[w.worker_id for w in workers]
        )
        if linger:
            untold = [w for w in workers if shutdown[w.worker_id].startswith(NOT_ANSWERED)]
            told = {w.worker_id for w in workers} - {w.worker_id for w in untold}
            await self._linger(told, untold, reason)
        self.request_exit(self.startup.exit_code)

    async def _linger(self, told: set[str], untold: list[WorkerEntry], reason: str) -> None:
        """Stay reachable in FAILED until every expected worker was told (registered before the failure,
        or refused since), or --failed-linger passed: a worker that announces its plan meanwhile is
        refused before it loads its weights, and exits too. A registered worker that did not answer its
        Shutdown in time (`untold`: its loop busy loading, say) is asked again every SHUTDOWN_RETRY_S
        until it answers or registers again (and is refused)."""
        started = self.clock()
        next_try = started + SHUTDOWN_RETRY_S
        while len(told | self.told_after_failure) < self.startup.num_expected:
            untold = [w for w in untold if w.worker_id not in self.told_after_failure]
            if untold and self.clock() >= next_try:
                answers = await self.channels.shutdown_workers(untold, reason, self.config.shutdown_timeout_s)
                for worker_id, answer in answers.items():
                    if not answer.startswith(NOT_ANSWERED):
                        told.add(worker_id)
                        log.info(
                            "worker_told_cluster_failed", worker_id=worker_id, shutdown=answer, retried=True
                        )
                untold = [w for w in untold if w.worker_id not in told]
                next_try = self.clock() + SHUTDOWN_RETRY_S
            if self.clock() - started >= self.config.failed_linger_s:
                log.warning(
                    "cluster_failed_linger_over",
                    told=sorted(told | self.told_after_failure),
                    expected=self.startup.num_expected,
                    seconds=self.config.failed_linger_s,
                )
                return
            await asyncio.sleep(0.05)

    async def _startup_timer(self) -> None:
        await asyncio.sleep(self.config.startup_timeout_s)
        entries = self.registry.entries()
        registered = [e.worker_id for e in entries]
        loading = [e.worker_id for e in entries if e.state is WorkerState.LOADING]
        if self.state is ClusterState.STARTING:
            self.startup.on_timeout(self.config.startup_timeout_s, registered, loading)
            await self._fail(linger=False)  # the missing workers are not coming: no point waiting for them

    async def _watch_heartbeats(self) -> None:
        period = min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s) / 2
        while True:
            await asyncio.sleep(period)
            dead = self.registry.mark_dead(self.clock(), self.config.heartbeat_timeout_s)
            for entry in dead:
                log.warning("worker_dead", worker_id=entry.worker_id, reason=entry.state_reason)
            await self.refresh_health()  # a worker died or came back
            if dead or self.state is ClusterState.SERVING:  # serving: the loads, for autoscaling
                self.write_report()
