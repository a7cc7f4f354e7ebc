"""ClusterStatus as a readable table (re-exported by kvpact.client; `make serve` prints it).

One row per worker (state, model, address, what it was asked, what it realized, capacity, load,
heartbeat age), then every fallback reason, failure and refusal. Depends only on the generated messages.
"""

from __future__ import annotations

from typing import Any

from kvpact.v1 import cache_pb2, router_pb2, worker_pb2


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    name: str = enum_type.Name(value)
    return name.removeprefix(prefix)


def _describe_asked(spec: worker_pb2.WorkerSpec) -> str:
    mode = cache_pb2.PagedAttentionMode.Name(spec.cache.mode).removeprefix("PAGED_ATTENTION_MODE_").lower()
    mode = "auto" if mode == "unspecified" else mode
    backend = spec.cache.paged.backend if spec.cache.HasField("paged") else 0
    if backend in (cache_pb2.PAGED_BACKEND_TRITON, cache_pb2.PAGED_BACKEND_TORCH):
        mode += f" ({_enum_name(cache_pb2.PagedBackend, backend, 'PAGED_BACKEND_').lower()})"
    return mode


def _describe_realized(realized: cache_pb2.RealizedCache) -> tuple[str, str]:
    if realized.kind == cache_pb2.CACHE_KIND_PAGED:
        backend = _enum_name(cache_pb2.PagedBackend, realized.backend, "PAGED_BACKEND_").lower()
        kind = f"PAGED {backend} {realized.num_blocks}x{realized.block_size}"
    elif realized.kind == cache_pb2.CACHE_KIND_EAGER:
        kind = f"EAGER {realized.num_blocks} slots"
    else:
        return "-", "-"
    return kind, f"{realized.capacity_tokens} tok"


def render_cluster_status(status: router_pb2.ClusterStatusResponse) -> str:
    """ClusterStatus as a readable table: one row per worker, then its fallback reasons and failures."""
    state = _enum_name(router_pb2.ClusterState, status.state, "CLUSTER_STATE_")
    policy = cache_pb2.PagedAttentionMode.Name(status.policy).removeprefix("PAGED_ATTENTION_MODE_").lower()
    num_admitted = sum(1 for w in status.workers if w.state == router_pb2.WORKER_STATE_ADMITTED)
    head = (
        f"cluster {state}  policy --paged-attn {policy}  "
        f"workers {num_admitted}/{status.expected_workers} admitted"
    )
    columns = ("WORKER", "STATE", "MODEL", "ADDRESS", "ASKED", "REALIZED", "CAPACITY", "LOAD", "HEARTBEAT")
    rows, notes = [], []
    for w in status.workers:
        kind, capacity = _describe_realized(w.realized) if w.HasField("realized") else ("-", "-")
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
                _describe_asked(w.requested),
                kind,
                capacity,
                load,
                f"{w.seconds_since_heartbeat:.1f}s ago",
            )
        )
        for f in w.realized.fallbacks:
            notes.append(f"  {w.worker_id}: fallback [{f.component}] {f.reason}")
        if w.HasField("failure"):
            code = _enum_name(worker_pb2.StartupFailureCode, w.failure.code, "STARTUP_FAILURE_CODE_")
            notes.append(f"  {w.worker_id}: failed ({code}) [{w.failure.component}] {w.failure.reason}")
        if w.state != router_pb2.WORKER_STATE_ADMITTED or not w.HasField("realized"):
            notes.append(f"  {w.worker_id}: {w.state_reason}")
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = [head, "  ".join(c.ljust(n) for c, n in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(v).ljust(n) for v, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    if notes:
        lines += ["", "reasons:", *notes]
    if status.failure_report:
        lines += ["", status.failure_report]
    return "\n".join(lines)
