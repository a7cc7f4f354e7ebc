"""deploy/restarts.py: the backoff schedule and the budget over a window, with time passed in; and
deploy/supervision.py's verdict on Ray's errors (death vs slowness), without a cluster."""

from __future__ import annotations

import pytest

from kvpact.deploy.restarts import RestartBudget


def test_each_restart_of_a_window_waits_twice_as_long_up_to_the_cap():
    budget = RestartBudget(max_restarts=10, window_s=600, base_delay_s=1, max_delay_s=8)
    delays = []
    for now in range(0, 60, 10):
        delays.append(budget.delay(now))
        budget.record(now)
    assert delays == [1, 2, 4, 8, 8, 8]


def test_the_budget_counts_only_the_restarts_within_the_window():
    budget = RestartBudget(max_restarts=2, window_s=100)
    assert budget.can_restart(0)
    assert budget.record(0) == 1
    assert budget.record(10) == 2
    assert not budget.can_restart(50)  # two within the last 100 s: a crash loop is not restarted
    assert budget.recent(50) == 2
    assert budget.can_restart(100.5)  # the first one has left the window
    assert budget.delay(100.5) == 2  # one restart still in the window: the second wait
    assert budget.record(100.5) == 2
    assert budget.can_restart(250)  # a long healthy run: the backoff starts over
    assert budget.delay(250) == 1


def test_no_budget_means_no_restart():
    assert not RestartBudget(max_restarts=0).can_restart(0)


def test_only_ray_saying_the_actor_is_gone_is_a_death():
    exceptions = pytest.importorskip("ray.exceptions")
    from kvpact.deploy.supervision import Health, judge_error

    assert judge_error(exceptions.ActorDiedError()) is Health.DEAD
    assert judge_error(exceptions.NodeDiedError("node lost")) is Health.DEAD
    assert judge_error(exceptions.ActorUnavailableError("network", b"\0" * 16)) is Health.SLOW
    assert judge_error(exceptions.GetTimeoutError("slow")) is Health.SLOW
    assert judge_error(exceptions.RayTaskError("poll", "tb", ValueError("v"))) is Health.SLOW
