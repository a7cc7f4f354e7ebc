"""Which worker serves a request. Pure.

A request names its model (or, when one model is served, gets it). Among that model's serving workers
the router's balance picks one (router/balancing/, `router --balance`; least-load by default).
`route` offers the balance only that model's serving workers that have room (fewer than
--max-in-flight-per-worker requests forwarded by this router right now, and not already tried for this
request), refusing with RESOURCE_EXHAUSTED naming the bound when none has: every balance benefits.
"""

from __future__ import annotations

from collections.abc import Collection

from kvpact.router.balancing.balance import Balance
from kvpact.router.balancing.least_load import LeastLoad
from kvpact.router.errors import InvalidRequest, NoLiveWorker, Overloaded, UnknownModel
from kvpact.router.registry import Registry, WorkerEntry
from kvpact.shared.limits import excerpt
from kvpact.v1 import generation_pb2


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


def with_room(workers: list[WorkerEntry], max_in_flight: int) -> list[WorkerEntry]:
    return [w for w in workers if w.num_outstanding < max_in_flight]


def route(
    registry: Registry,
    requested_model: str,
    balance: Balance | None = None,
    request: generation_pb2.GenerateRequest | None = None,
    *,
    max_in_flight: int | None = None,
    exclude: Collection[str] = (),
) -> WorkerEntry:
    """The worker `balance` (least-load when None) picks for `request` among the model's serving workers
    that have room (see the module doc); `exclude`: ids already tried for this request. NoLiveWorker when
    every serving worker was tried; Overloaded when none of the rest has room."""
    model, workers = resolve_model(registry, requested_model)
    workers = [w for w in workers if w.worker_id not in exclude]
    if not workers:
        raise NoLiveWorker(f"no other live worker serves model {excerpt(model)}")
    if max_in_flight is not None:
        workers = with_room(workers, max_in_flight)
        if not workers:
            raise Overloaded(
                f"every live worker of model {excerpt(model)} already has {max_in_flight} requests in "
                f"flight from this router (--max-in-flight-per-worker {max_in_flight}); retry later, or "
                "add workers"
            )
    return (balance or LeastLoad()).choose(workers, request or generation_pb2.GenerateRequest())
