"""Which worker serves a request. Pure.

A request names its model (or, when one model is served, gets it). Among that model's serving workers
the router's balancing policy picks one (router/balancing/, `router --balance`; least-load by default).
"""

from __future__ import annotations

from kvpact.router.balancing import BalancePolicy, LeastLoad
from kvpact.router.errors import InvalidRequest, NoLiveWorker, UnknownModel
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


def route(
    registry: Registry,
    requested_model: str,
    policy: BalancePolicy | None = None,
    request: generation_pb2.GenerateRequest | None = None,
) -> WorkerEntry:
    """The worker `policy` (least-load when None) picks for `request` among the model's serving workers."""
    _, workers = resolve_model(registry, requested_model)
    return (policy or LeastLoad()).choose(workers, request or generation_pb2.GenerateRequest())
