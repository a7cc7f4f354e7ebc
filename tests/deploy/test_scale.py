"""`kvpact-launch scale` without a cluster: the control actor's rules (deploy/control.py, called directly),
which workers leave first (deploy/scaling.py), the command's own usage errors, and the autoscaling policy
(deploy/autoscale.py). The scale itself, through
a real Ray cluster, is in test_launch.py (it shares that module's cluster)."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest

from kvpact.deploy.autoscale import AutoscalePolicy, Autoscaler, Decision, measure
from kvpact.deploy.cluster_file import ClusterFile, RaySection, RouterSection, WorkerGroup, WorkerSlot
from kvpact.deploy.control import GroupBounds, GroupStatus, LauncherControl
from kvpact.deploy.placement import PlacedWorker
from kvpact.deploy.scaling import Scaler, choose_leavers, group_of


def test_scale_refuses_an_unknown_group_and_a_size_outside_the_bounds_by_name():
    control = LauncherControl({"cpu": GroupBounds(1, 1, 3), "gpu": GroupBounds(2, 2, 2)}, timeout_s=300)
    assert control.scale("tpu", 2) == {
        "error": "no worker group 'tpu' in this cluster (its groups: cpu, gpu); pass --group"
    }
    assert control.scale("cpu", 4) == {
        "error": "--replicas 4 is outside group 'cpu''s bounds [1, 3] (workers[].min_replicas and "
        "max_replicas in the cluster file)"
    }
    assert control.scale("cpu", 0)["error"].startswith("--replicas 0 is outside group 'cpu''s bounds")
    assert control.exchange({}) == {"cpu": 1, "gpu": 2}  # refusals change nothing
    assert control.scale("cpu", 3) == {"timeout_s": 300}
    assert control.exchange({}) == {"cpu": 3, "gpu": 2}


def test_a_target_is_reached_with_that_many_admitted_workers_and_none_leaving():
    control = LauncherControl({"cpu": GroupBounds(1, 2, 3)}, timeout_s=60)
    control.scale("cpu", 1)
    control.exchange({"cpu": {"admitted_ids": ["cpu-0"], "leaving_ids": ["cpu-1"], "blocked": ""}})
    assert not GroupStatus(**control.group_status("cpu")).reached(1)  # cpu-1 still drains
    control.exchange({"cpu": {"admitted_ids": ["cpu-0"], "leaving_ids": []}})
    assert GroupStatus(**control.group_status("cpu")).reached(1)


def test_a_target_the_launcher_gives_up_carries_its_reason_until_the_next_scale():
    control = LauncherControl({"cpu": GroupBounds(1, 1, 3)}, timeout_s=60)
    control.scale("cpu", 2)
    control.set_target("cpu", 1, "worker cpu-1 was refused: its startup failed")
    control.exchange({"cpu": {"admitted_ids": ["cpu-0"], "blocked": ""}})  # a later round keeps the reason
    status = GroupStatus(**control.group_status("cpu"))
    assert (status.target, status.gave_up) == (1, "worker cpu-1 was refused: its startup failed")
    assert control.exchange({}) == {"cpu": 1}  # the launcher does not try again by itself
    control.scale("cpu", 2)
    assert GroupStatus(**control.group_status("cpu")).gave_up == ""


def test_the_newest_workers_leave_first():
    group = WorkerGroup("cpu-big", 2, {"CPU": 1}, (), max_replicas=12)
    workers = [PlacedWorker(WorkerSlot(f"cpu-big-{i}", group, 0), actor=None) for i in (0, 10, 2, 1)]
    assert [w.slot.worker_id for w in choose_leavers(workers, 2)] == ["cpu-big-10", "cpu-big-2"]
    assert group_of("cpu-big-10") == "cpu-big"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--group", "cpu"], "the following arguments are required: --replicas"),
        (
            ["--group", "cpu", "--replicas", "2", "--timeout", "0"],
            "--timeout: expected a number of seconds > 0",
        ),
    ],
)
def test_the_command_says_what_is_missing_and_exits_2_before_touching_ray(args: list[str], expected: str):
    argv = [sys.executable, "-m", "kvpact.deploy.launch", "scale", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and expected in done.stderr, done.stderr


# -- autoscaling (deploy/autoscale.py), time passed in -----------------------------------------------


def waiting(*nums: int) -> list[dict[str, int]]:
    return [{"numWaiting": n} for n in nums]


def test_load_is_the_mean_over_the_admitted_workers():
    assert measure("waiting", waiting(3, 0)) == 1.5
    kv = [{"numFreeBlocks": 4, "numTotalBlocks": 16}, {"numFreeBlocks": 16, "numTotalBlocks": 16}]
    assert measure("kv_usage", kv) == 0.375
    assert measure("waiting", []) is None


def test_one_worker_more_only_once_the_load_stayed_above_its_target_for_up_after_s():
    auto = Autoscaler(AutoscalePolicy("waiting", 1.0, up_after_s=10, down_after_s=60), 1, 3)
    assert auto.observe(4.0, 1, now=0) is None
    assert auto.observe(4.0, 1, now=9.9) is None
    assert auto.observe(4.0, 1, now=10) == Decision(2, "waiting 4.00 above its target 1 for 10 s")
    assert auto.observe(4.0, 2, now=15) is None  # a decision restarts the clock
    assert auto.observe(0.5, 2, now=16) is None  # a dip restarts it too
    assert auto.observe(4.0, 2, now=17) is None
    assert auto.observe(4.0, 2, now=27) == Decision(3, "waiting 4.00 above its target 1 for 10 s")
    assert auto.observe(4.0, 3, now=100) is None and auto.observe(4.0, 3, now=200) is None  # at max


def test_one_worker_fewer_once_the_load_stayed_below_its_target_for_down_after_s_never_below_min():
    auto = Autoscaler(AutoscalePolicy("kv_usage", 0.5, up_after_s=10, down_after_s=60), 1, 3)
    assert auto.observe(0.1, 2, now=0) is None
    assert auto.observe(0.1, 2, now=59) is None
    assert auto.observe(0.1, 2, now=60) == Decision(1, "kv_usage 0.10 below its target 0.5 for 60 s")
    assert auto.observe(0.0, 1, now=61) is None and auto.observe(0.0, 1, now=500) is None  # at min
    assert auto.observe(None, 1, now=501) is None  # no admitted worker: nothing to measure


@dataclass
class LaunchHere:
    """The part of a launch scaling reads (deploy/scaling.py's LaunchView), without Ray: no control actor,
    workers whose actors are gone."""

    cluster: ClusterFile
    report: dict = field(default_factory=dict)
    name: str = "kvpact-test"
    group: object = None
    placed: list = field(default_factory=list)
    restarting: dict = field(default_factory=dict)
    stopping: threading.Event = field(default_factory=threading.Event)
    auth_token: str | None = None
    router_address: str = ""
    lines: list = field(default_factory=list)

    def say(self, message: str) -> None:
        self.lines.append(message)

    say_error = say

    def report_status(self) -> dict:
        return self.report

    def start_worker(self, worker: PlacedWorker) -> None:
        raise AssertionError("not started here")


def test_a_refused_joiner_is_released_never_restarted_and_its_group_stays_at_its_size():
    group = WorkerGroup("cpu", 1, {"CPU": 1}, (), max_replicas=3)
    cluster = ClusterFile("c.yaml", RaySection(), RouterSection(), (group,))
    launch = LaunchHere(cluster)
    first = PlacedWorker(WorkerSlot("cpu-0", group, 0), actor=None)
    joiner = PlacedWorker(WorkerSlot("cpu-1", group, 1), actor=None, added=True)
    launch.placed += [first, joiner]
    refusal = "its plan (EAGER) does not meet the cluster policy on"
    launch.report = {
        "workers": [{"workerId": "cpu-1", "state": "WORKER_STATE_REFUSED", "stateReason": refusal}]
    }
    scaler = Scaler(launch)
    scaler.targets["cpu"] = 2
    assert not scaler.on_exit(first, 1, "exited with code 1")  # a starting worker: restarts decide
    assert scaler.on_exit(joiner, 78, "exited with code 78")
    assert launch.placed == [first]
    assert scaler.targets["cpu"] == 1  # no second try in a loop
    assert scaler.free_bundles["cpu"] == [1]  # its bundle is returned for the next worker
    assert launch.lines[-1] == f"scale: group cpu stays at 1 workers: worker cpu-1 was refused: {refusal}"
