"""ClusterStatus at the edge: registry entries and the startup state -> protobuf (the one place)."""

from __future__ import annotations

from collections.abc import Mapping

from kvpact.router.cluster_state import ClusterState
from kvpact.router.registry import WorkerEntry, WorkerState
from kvpact.shared import handshake_pb
from kvpact.shared.features import FeatureMode
from kvpact.v1 import router_pb2

_CLUSTER_STATE_TO_PB = {
    ClusterState.STARTING: router_pb2.CLUSTER_STATE_STARTING,
    ClusterState.SERVING: router_pb2.CLUSTER_STATE_SERVING,
    ClusterState.FAILED: router_pb2.CLUSTER_STATE_FAILED,
}
_WORKER_STATE_TO_PB = {
    WorkerState.ADMITTED: router_pb2.WORKER_STATE_ADMITTED,
    WorkerState.REFUSED: router_pb2.WORKER_STATE_REFUSED,
    WorkerState.FAILED: router_pb2.WORKER_STATE_FAILED,
    WorkerState.DEAD: router_pb2.WORKER_STATE_DEAD,
    WorkerState.LOADING: router_pb2.WORKER_STATE_LOADING,
    WorkerState.DRAINING: router_pb2.WORKER_STATE_DRAINING,
}


def worker_status_to_pb(entry: WorkerEntry, now: float) -> router_pb2.WorkerStatus:
    msg = router_pb2.WorkerStatus(
        worker_id=entry.worker_id,
        address=entry.address,
        model_name=entry.model_name,
        requested=handshake_pb.spec_to_pb(entry.spec),
        capabilities=entry.capabilities,
        state=_WORKER_STATE_TO_PB[entry.state],
        state_reason=entry.state_reason,
        # A DEAD worker's last reported load is not its load now: left unset (the state says why).
        load=handshake_pb.load_to_pb(entry.load) if entry.state is not WorkerState.DEAD else None,
        seconds_since_heartbeat=max(0.0, now - entry.last_heartbeat),
        num_outstanding=entry.num_outstanding,
        metrics_address=entry.metrics_address,
        labels=entry.labels,
    )
    if entry.realized is not None:
        msg.realized.CopyFrom(handshake_pb.realized_to_pb(entry.realized))
    if entry.failure is not None:
        msg.failure.CopyFrom(handshake_pb.failure_to_pb(entry.failure))
    if entry.plan is not None:
        msg.planned.CopyFrom(handshake_pb.plan_to_pb(entry.plan))
    if entry.fingerprint is not None:
        msg.fingerprint.CopyFrom(handshake_pb.fingerprint_to_pb(entry.fingerprint))
    return msg


def cluster_status_to_pb(
    state: ClusterState,
    policy: FeatureMode,
    num_expected: int,
    workers: list[WorkerEntry],
    now: float,
    failure_report: str = "",
    serving: bool = False,
    policies: Mapping[str, FeatureMode] | None = None,
) -> router_pb2.ClusterStatusResponse:
    """`policy`: paged-attn's; `policies`: every other feature's (None: all auto)."""
    return router_pb2.ClusterStatusResponse(
        health="SERVING" if serving else "NOT_SERVING",
        state=_CLUSTER_STATE_TO_PB[state],
        policy=handshake_pb.mode_to_pb(policy),
        policies={
            name: handshake_pb.feature_mode_to_pb(mode)
            for name, mode in {"paged-attn": policy, **(policies or {})}.items()
        },
        expected_workers=num_expected,
        workers=[worker_status_to_pb(w, now) for w in workers],
        failure_report=failure_report,
    )
