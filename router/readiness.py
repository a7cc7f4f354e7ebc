"""What the router's grpc.health.v1 says, per service name. Pure: the cluster applies it (router/cluster.py).

    ""  and  "kvpact.v1.Generation"        SERVING while the cluster is SERVING and at least one admitted
                                           worker is live (not DEAD); NOT_SERVING otherwise
    "kvpact.v1.Generation/MODEL"           the same for one model: SERVING while a live admitted worker
                                           serves MODEL (a probe can ask for the model it needs)

A model the router has never admitted a worker for is not a service (Check answers NOT_FOUND).
"""

from __future__ import annotations

from grpc_health.v1 import health

from kvpact.router.cluster_state import ClusterState
from kvpact.router.registry import Registry

GENERATION_SERVICE = "kvpact.v1.Generation"


def model_service(model: str) -> str:
    return f"{GENERATION_SERVICE}/{model}"


def readiness(state: ClusterState, registry: Registry) -> dict[str, bool]:
    """Service name -> SERVING?"""
    models = registry.models()
    serving = state is ClusterState.SERVING
    found = {model_service(model): serving and bool(workers) for model, workers in models.items()}
    anyone = serving and any(found.values())
    return {health.OVERALL_HEALTH: anyone, GENERATION_SERVICE: anyone, **found}
