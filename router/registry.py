"""Every worker that registered: what it was asked, what it built, its state, load and liveness.

No I/O here: the Registry servicer and the heartbeat monitor update it; routing (router/balancing/) and
the status page read it. Times are `time.monotonic()` seconds passed in by the caller.

States (DRAINING: the worker said it is stopping, or the router asked it to (`drain_reason`, sent in
every heartbeat reply until it leaves); it gets no new requests, its in-flight ones finish, then it
deregisters and its entry is removed; silent, it becomes DEAD like any other):
LOADING (announced a pre-load plan that meets the policy; not admitted, gets no requests, sends
no heartbeats yet, so it is never marked DEAD; its `ready` registration replaces it) -> ADMITTED (serving)
<-> DEAD (missed heartbeats for --heartbeat-timeout; a later heartbeat
revives it); REFUSED (did not meet the policy) and FAILED (reported a startup failure) are final for
that registration.

One worker id, one worker: each registration gets a `registration_id` (sent back in the Admission) and
a heartbeat counts only for the registration it names, so a worker whose id was taken over cannot keep
the new holder's entry alive (or its own dead address admitted). Whether a second worker may take an
id is decided by the cluster (router/cluster.py): only once the holder no longer answers; a worker
that registers again from the same address replaces its own entry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpact.shared.features import FeatureState
from kvpact.shared.fingerprint import Fingerprint
from kvpact.shared.handshake import LoadingPlan, StartupFailure, WorkerLoad
from kvpact.shared.realized import RealizedCache
from kvpact.shared.spec import WorkerSpec
from kvpact.v1 import worker_pb2


class WorkerState(enum.Enum):
    LOADING = "loading"
    ADMITTED = "admitted"
    REFUSED = "refused"
    FAILED = "failed"
    DEAD = "dead"
    DRAINING = "draining"


@dataclass(slots=True)
class WorkerEntry:
    worker_id: str
    address: str
    model_name: str
    spec: WorkerSpec
    # Relayed as-is to ClusterStatus and the report; the router never decides on it.
    capabilities: worker_pb2.Capabilities
    realized: RealizedCache | None  # what it built; its `features` as its latest heartbeat says (drift)
    failure: StartupFailure | None
    state: WorkerState
    state_reason: str
    last_heartbeat: float
    load: WorkerLoad = field(default_factory=WorkerLoad)
    num_outstanding: int = 0  # requests the router is forwarding to it right now
    plan: LoadingPlan | None = None  # the pre-load plan it announced (Handshake.loading)
    metrics_address: str = ""  # where its Prometheus /metrics is served (Handshake.metrics_address)
    registration_id: str = ""  # names this registration; its heartbeats must carry it
    labels: dict[str, str] = field(default_factory=dict)  # Handshake.labels: where it runs, relayed as-is
    drain_reason: str = ""  # set: the router asked it to drain (HeartbeatReply.drain), and why
    fingerprint: Fingerprint | None = None  # Handshake.fingerprint (router --uniform); None: not reported

    @property
    def serving(self) -> bool:
        return self.state is WorkerState.ADMITTED

    @property
    def features(self) -> tuple[FeatureState, ...]:
        """What it built of each feature, else what it planned, else nothing (it failed first)."""
        if self.realized is not None:
            return self.realized.features
        return self.plan.features if self.plan is not None else ()


class Registry:
    def __init__(self) -> None:
        self._entries: dict[str, WorkerEntry] = {}

    def add(self, entry: WorkerEntry) -> WorkerEntry | None:
        """Add or replace (same worker id). Returns the replaced entry, if any."""
        old = self._entries.pop(entry.worker_id, None)
        self._entries[entry.worker_id] = entry
        return old

    def remove(self, worker_id: str, registration_id: str) -> WorkerEntry | None:
        """Forget a registration (the worker deregistered). None if it is not the current one."""
        entry = self._entries.get(worker_id)
        if entry is None or entry.registration_id != registration_id:
            return None
        return self._entries.pop(worker_id)

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._entries.get(worker_id)

    def peers(self, entry: WorkerEntry) -> list[tuple[str, Fingerprint]]:
        """(worker id, fingerprint) of the other workers serving or loading `entry`'s model name, in
        registration order: those a joiner must be interchangeable with (router --uniform)."""
        live = (WorkerState.LOADING, WorkerState.ADMITTED, WorkerState.DEAD, WorkerState.DRAINING)
        return [
            (e.worker_id, e.fingerprint)
            for e in self._entries.values()
            if e.worker_id != entry.worker_id
            and e.model_name == entry.model_name
            and e.state in live
            and e.fingerprint is not None
        ]

    def entries(self) -> list[WorkerEntry]:
        """In registration order (a copy: safe to read from another thread, e.g. a metrics scrape)."""
        return list(self._entries.values())

    def heartbeat(
        self, worker_id: str, load: WorkerLoad, now: float, registration_id: str = "", draining: bool = False
    ) -> WorkerEntry | None:
        """Record a heartbeat; revives a DEAD worker. None when the worker is unknown, or known under
        another registration (it must register again)."""
        entry = self._entries.get(worker_id)
        if entry is None or entry.registration_id != registration_id:
            return None
        entry.load = load
        entry.last_heartbeat = now
        if (draining or entry.drain_reason) and entry.state in (WorkerState.ADMITTED, WorkerState.DEAD):
            entry.state = WorkerState.DRAINING
            why = entry.drain_reason or "it finishes its in-flight requests, then leaves"
            entry.state_reason = f"draining: {why}"
        elif entry.state is WorkerState.DEAD:
            entry.state = WorkerState.ADMITTED
            entry.state_reason = "heartbeats resumed"
        return entry

    def drain(self, worker_id: str, reason: str) -> WorkerEntry | None:
        """The router asks this worker to drain: DRAINING at once (nothing new is routed to it) if it
        serves; its heartbeat replies say `drain` until it deregisters. None when it is not registered."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        entry.drain_reason = reason or "the router asked it to drain"
        if entry.state in (WorkerState.ADMITTED, WorkerState.DEAD):
            entry.state = WorkerState.DRAINING
            entry.state_reason = f"draining: {entry.drain_reason}"
        return entry

    def mark_unreachable(self, entry: WorkerEntry, reason: str) -> bool:
        """A call to an ADMITTED worker failed as if it were gone: DEAD at once (not after missed
        heartbeats), so nothing more is routed to it; a heartbeat from it revives it. True if marked."""
        if self._entries.get(entry.worker_id) is not entry or entry.state is not WorkerState.ADMITTED:
            return False
        entry.state = WorkerState.DEAD
        entry.state_reason = reason
        return True

    def mark_dead(self, now: float, timeout_s: float) -> list[WorkerEntry]:
        """Mark ADMITTED workers silent for longer than `timeout_s` as DEAD; returns the newly dead."""
        dead = []
        for entry in self._entries.values():
            silent = now - entry.last_heartbeat
            if entry.state in (WorkerState.ADMITTED, WorkerState.DRAINING) and silent > timeout_s:
                entry.state = WorkerState.DEAD
                entry.state_reason = f"no heartbeat for {silent:.1f} s (--heartbeat-timeout {timeout_s:g})"
                dead.append(entry)
        return dead

    def serving(self, model: str) -> list[WorkerEntry]:
        return [e for e in self._entries.values() if e.serving and e.model_name == model]

    def models(self) -> dict[str, list[WorkerEntry]]:
        """Models of workers that were admitted (serving or DEAD) -> their serving workers."""
        found: dict[str, list[WorkerEntry]] = {}
        for entry in self._entries.values():
            if entry.state in (WorkerState.ADMITTED, WorkerState.DEAD, WorkerState.DRAINING):
                found.setdefault(entry.model_name, [])
                if entry.serving:
                    found[entry.model_name].append(entry)
        return found
