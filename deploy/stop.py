"""How long the ordered stop takes, and whether Ray gives it that long. Pure.

NOTE: the stop (deploy/launch.py's teardown) tells the router and waits for it to exit (its streams
done, up to its --drain-timeout plus STOP_MARGIN_S), then every worker, each of which drains up to its
--drain-timeout and is SIGKILLed only STOP_MARGIN_S after that. `ray job stop` SIGKILLs the launcher
RAY_JOB_STOP_WAIT_TIME_S after its SIGTERM (3 s unless the head's environment says otherwise), so that
must be at least `stop_budget_s`.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpact.deploy.cluster_file import ClusterFile
from kvpact.deploy.placement import STOP_MARGIN_S

RAY_JOB_STOP_WAIT_DEFAULT_S = 3  # Ray's, when RAY_JOB_STOP_WAIT_TIME_S is not set


def stop_budget_s(cluster: ClusterFile) -> float:
    """The longest an ordered stop takes: the router's drain (plus its margin), then the longest worker
    drain (plus its margin), then the release."""
    worker_drain = max(g.drain_timeout_s for g in cluster.workers) + STOP_MARGIN_S
    return cluster.router.drain_timeout_s + STOP_MARGIN_S + worker_drain + STOP_MARGIN_S


def stop_wait_warning(cluster: ClusterFile, environ: Mapping[str, str]) -> str:
    """As a Ray job: a warning when Ray would SIGKILL this launcher before its stop can finish (the job
    supervisor waits RAY_JOB_STOP_WAIT_TIME_S after its SIGTERM); "" otherwise."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in environ:  # set by Ray's job supervisor for its driver
        return ""
    raw = environ.get("RAY_JOB_STOP_WAIT_TIME_S", str(RAY_JOB_STOP_WAIT_DEFAULT_S))
    need = stop_budget_s(cluster)
    try:
        wait = float(raw)
    except ValueError:
        wait = RAY_JOB_STOP_WAIT_DEFAULT_S
    if wait >= need:
        return ""
    return (
        f"RAY_JOB_STOP_WAIT_TIME_S is {raw} s: `ray job stop` would SIGKILL this launcher before its workers "
        f"finish draining (the stop takes up to {need:g} s); set RAY_JOB_STOP_WAIT_TIME_S={need:g} or more "
        "in the Ray head's environment (docs/ray.md)"
    )
