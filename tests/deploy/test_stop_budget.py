"""The ordered stop's graces, checked without Ray: every grace is longer than the drain it waits for,
and a Ray job whose stop wait is shorter than the stop is warned at start."""

from __future__ import annotations

import pytest

from kvpact.deploy import placement
from kvpact.deploy.cluster_file import ClusterFileError, WorkerSlot, parse_cluster_file
from kvpact.deploy.placement import PlacedWorker
from kvpact.deploy.stop import stop_budget_s, stop_wait_warning

JOB = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}


def cluster(worker_drain: float = 20, router_drain: float = 25):
    return parse_cluster_file(
        {
            "router": {"flags": {"drain-timeout": router_drain}},
            "workers": [{"name": "cpu", "replicas": 1, "flags": {"drain-timeout": worker_drain}}],
        },
        "c.yaml",
    )


def test_a_worker_is_killed_only_after_its_whole_drain():
    c = cluster(worker_drain=20)
    worker = PlacedWorker(WorkerSlot("cpu-0", c.workers[0], 0), actor=None)
    assert c.workers[0].drain_timeout_s == 20
    assert placement.stop_grace_s(worker) == 20 + placement.STOP_MARGIN_S
    assert stop_budget_s(c) == 25 + placement.STOP_MARGIN_S + 20 + 2 * placement.STOP_MARGIN_S


def test_a_router_drain_shorter_than_a_workers_is_refused():
    with pytest.raises(ClusterFileError) as error:
        cluster(worker_drain=40, router_drain=30)
    assert str(error.value).startswith(
        "c.yaml: workers[0].flags.drain-timeout: expected at most the router's --drain-timeout (30 s)"
    )


def test_a_ray_job_with_a_short_stop_wait_is_warned():
    c = cluster()
    need = stop_budget_s(c)
    assert stop_wait_warning(c, {}) == ""  # not a Ray job: nobody SIGKILLs us on a timer
    warning = stop_wait_warning(c, JOB)  # Ray's default, 3 s
    assert warning.startswith("RAY_JOB_STOP_WAIT_TIME_S is 3 s: `ray job stop` would SIGKILL this launcher")
    assert f"set RAY_JOB_STOP_WAIT_TIME_S={need:g} or more" in warning
    assert stop_wait_warning(c, {**JOB, "RAY_JOB_STOP_WAIT_TIME_S": str(int(need))}) == ""
