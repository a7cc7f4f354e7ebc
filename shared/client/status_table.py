"""ClusterStatus as a readable table (re-exported by kvpact.client; `make serve` prints it).

One row per worker (state, model, address, its device (a tensor-parallel worker: `tpN` and each rank's),
what it was asked, what it realized, capacity, each feature's realized state, load, heartbeat age, and
its labels when any worker has some, e.g. its Ray node and bundle), then every fallback reason, failure
and refusal. The cells are kvpact.shared.describe's (the renderer the router and worker use), over the
messages as kvpact.shared.handshake_pb converts them.
"""

from __future__ import annotations

from typing import Any

from kvpact.shared import handshake_pb
from kvpact.shared.describe import describe_asked, describe_compact, describe_labels
from kvpact.shared.features import FeatureState, describe_features
from kvpact.v1 import cache_pb2, router_pb2, worker_pb2


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    name: str = enum_type.Name(value)
    return name.removeprefix(prefix)


def _realized_cells(w: router_pb2.WorkerStatus) -> tuple[str, str]:
    if not w.HasField("realized") or w.realized.kind == cache_pb2.CACHE_KIND_UNSPECIFIED:
        return "-", "-"
    try:
        return describe_compact(handshake_pb.realized_from_pb(w.realized))
    except (KeyError, ValueError):  # a field this client does not know: show the table anyway
        return "?", f"{w.realized.capacity_tokens} tok"


def _asked_cell(w: router_pb2.WorkerStatus) -> str:
    """The cache intent, then a worker bigger than one device: `tp N` ranks, `map DEVICE=N,...` stages."""
    try:
        asked = describe_asked(handshake_pb.intent_from_pb(w.requested.cache))
    except (KeyError, ValueError):
        asked = "?"
    if w.requested.tensor_parallel_size > 1:
        asked += f" tp {w.requested.tensor_parallel_size}"
    if len(w.requested.device_map) > 1:
        asked += " map " + ",".join(f"{p.device}={p.num_layers}" for p in w.requested.device_map)
    return asked


def _device_cell(w: router_pb2.WorkerStatus) -> str:
    """Where it runs: its rank's device, or `tp N` and each rank's device (what it built); before it built,
    the kind of device it probed."""
    devices = list(w.realized.rank_devices) if w.HasField("realized") else []
    if len(devices) > 1:
        return f"tp{len(devices)} " + ",".join(devices)
    if devices:
        return devices[0]
    return w.capabilities.device_kind or "-"


def worker_features(w: router_pb2.WorkerStatus) -> tuple[FeatureState, ...]:
    """What it built of each feature, else what it planned (a LOADING worker), else nothing."""
    msgs = w.realized.features if w.HasField("realized") else w.planned.features
    return tuple(handshake_pb.feature_from_pb(f) for f in msgs)


def render_cluster_status(status: router_pb2.ClusterStatusResponse) -> str:
    """ClusterStatus as a readable table: one row per worker, then its fallback reasons and failures."""
    state = _enum_name(router_pb2.ClusterState, status.state, "CLUSTER_STATE_")
    policy = cache_pb2.PagedAttentionMode.Name(status.policy).removeprefix("PAGED_ATTENTION_MODE_").lower()
    others = " ".join(
        f"--policy {name}={handshake_pb.feature_mode_from_pb(mode).value}"
        for name, mode in sorted(status.policies.items())
        if name != "paged-attn" and handshake_pb.feature_mode_from_pb(mode).value != "auto"
    )
    num_admitted = sum(1 for w in status.workers if w.state == router_pb2.WORKER_STATE_ADMITTED)
    # While starting, "1/2" is the wait; once serving, workers join, scale and die, so the start's
    # --expect-workers is only a reference, not a denominator.
    if num_admitted == status.expected_workers or state == "STARTING":
        workers = f"workers {num_admitted}/{status.expected_workers} admitted"
    else:
        workers = f"workers {num_admitted} admitted ({status.expected_workers} expected at start)"
    head = f"cluster {state}  policy --paged-attn {policy}{'  ' + others if others else ''}  {workers}"
    columns: tuple[str, ...] = (
        "WORKER", "STATE", "MODEL", "ADDRESS", "DEVICE", "ASKED", "REALIZED", "CAPACITY", "FEATURES",
        "LOAD", "HEARTBEAT",
    )  # fmt: skip
    with_labels = any(w.labels for w in status.workers)
    if with_labels:
        columns += ("LABELS",)
    rows: list[tuple[str, ...]] = []
    notes = []
    for w in status.workers:
        kind, capacity = _realized_cells(w)
        features = worker_features(w)
        load = (
            f"{w.load.num_running} run {w.load.num_waiting} wait "
            f"{w.load.num_free_blocks}/{w.load.num_total_blocks} free {w.num_outstanding} out"
        )
        rows.append(
            (
                w.worker_id,
                _enum_name(router_pb2.WorkerState, w.state, "WORKER_STATE_"),
                w.model_name,
                w.address,
                _device_cell(w),
                _asked_cell(w),
                kind,
                capacity,
                describe_features(features) or "-",
                load,
                f"{w.seconds_since_heartbeat:.1f}s ago",
            )
            + ((describe_labels(w.labels),) if with_labels else ())
        )
        for f in w.realized.fallbacks:
            notes.append(f"  {w.worker_id}: fallback [{f.component}] {f.reason}")
        for s in features:
            if s.fell_back and s.name != "paged-attn":  # paged-attn's are the fallback lines above
                notes.append(f"  {w.worker_id}: {s.name} off [{s.component}] {s.code}: {s.message}")
        if w.HasField("failure"):
            code = _enum_name(worker_pb2.StartupFailureCode, w.failure.code, "STARTUP_FAILURE_CODE_")
            notes.append(f"  {w.worker_id}: failed ({code}) [{w.failure.component}] {w.failure.reason}")
        drifted = w.state_reason.startswith("drift:")  # router/drift.py: reported while it serves
        if w.state != router_pb2.WORKER_STATE_ADMITTED or not w.HasField("realized") or drifted:
            notes.append(f"  {w.worker_id}: {w.state_reason}")
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = [head, "  ".join(c.ljust(n) for c, n in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(v).ljust(n) for v, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    if notes:
        lines += ["", "reasons:", *notes]
    if status.failure_report:
        lines += ["", status.failure_report]
    return "\n".join(lines)
