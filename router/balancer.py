"""Which worker serves a request. Pure.

A request names its model (or, when one model is served, gets it). Among that model's serving workers
the balancer picks the least outstanding work (requests the router is forwarding to it right now, an
exact and fresh count), tie-broken by more free KV blocks/slots from its last heartbeat, then by id
so the choice is deterministic.
"""

from __future__ import annotations

from kvpact.router.errors import InvalidRequest, NoLiveWorker, UnknownModel
from kvpact.router.registry import Registry, WorkerEntry
from kvpact.shared.limits import excerpt


def choose(candidates: list[WorkerEntry]) -> WorkerEntry | None:
    if not candidates:
        return None
    return min(candidates, key=lambda e: (e.num_outstanding, -e.load.num_free_blocks, e.worker_id))


def resolve_model(registry: Registry, requested: str) -> tuple[str, list[WorkerEntry]]:
    """The model a request goes to and its serving workers, or the error that explains why none."""
    models = registry.models()
    served = ", ".join(sorted(models)) or "none"
    if not requested:
        if len(models) > 1:
            raise InvalidRequest(
                f"this cluster serves several models ({served}); name one in the request's model"
            )
        if not models:
            raise NoLiveWorker("no worker is serving any model")
        requested = next(iter(models))
    if requested not in models:
        raise UnknownModel(f"model {excerpt(requested)} is not served here; served models: {served}")
    workers = models[requested]
    if not workers:
        raise NoLiveWorker(
            f"no live worker serves model {excerpt(requested)} (its workers missed their heartbeats)"
        )
    return requested, workers


def route(registry: Registry, requested_model: str) -> WorkerEntry:
    _, workers = resolve_model(registry, requested_model)
    chosen = choose(workers)
    assert chosen is not None
    return chosen
