"""`kvpact-launch scale` on a real local Ray cluster (4 CPUs, the dashboard for ray.util.state), a tiny Llama
on CPU: a group grows from 1 to 2 workers while serving (the new one in a placement group of its own) and
shrinks back to 1 with streams in flight on the worker that leaves. The router drains it (the `drain` field
of its heartbeat reply), its streams finish, it exits 0 and is not restarted; its actor and placement group
are released. The command's own refusals (exit 2) and the control actor's rules are checked without a
launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpact.client import Client, render_cluster_status
from kvpact.deploy.control import GroupBounds, GroupStatus, LauncherControl
from kvpact.deploy.processes import wait_for_exit, wait_for_line
from kvpact.v1 import router_pb2
from tests.factories.ray_launch import (
    RAY_AUTH,
    cluster_file,
    launched,
    placement_group_name,
    ray_auth_env,
    short_temp_dir,
    wait_serving,
    worker_group,
)
from tests.factories.tiny_models import make_tiny_llama

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

LAUNCH = [sys.executable, "-m", "kvpact.deploy.launch"]
NUM_LOADERS, STREAM_TOKENS = 4, 200  # one sequence at a time per worker: each has a queue to finish
ADMITTED = router_pb2.WORKER_STATE_ADMITTED


@dataclass(frozen=True)
class RayCluster:
    address: str
    dashboard: str


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    with ray_auth_env():
        context = ray.init(
            num_cpus=4,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=0,
            object_store_memory=100 * 1024 * 1024,
            _temp_dir=short_temp_dir(),
            log_to_driver=False,
        )
        try:
            yield RayCluster(context.address_info["gcs_address"], f"http://{context.dashboard_url}")
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=256)


def scale(ray_cluster: RayCluster, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **RAY_AUTH, "RAY_ADDRESS": ray_cluster.address}
    argv = [*LAUNCH, "scale", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)


def live(cluster: RayCluster, prefix: str) -> tuple[list[str], list[str]]:
    """Actors not DEAD (their class and name) and this launch's placement groups not REMOVED."""
    from ray.util import state

    actors = state.list_actors(address=cluster.dashboard, filters=[("state", "!=", "DEAD")])
    groups = state.list_placement_groups(address=cluster.dashboard)
    return (
        sorted(f"{a.class_name}:{a.name}" for a in actors),
        sorted(g.name for g in groups if g.name.startswith(prefix) and g.state != "REMOVED"),
    )


def eventually_live(cluster: RayCluster, prefix: str, expected: tuple[list[str], list[str]]) -> None:
    deadline = time.monotonic() + 30
    while (seen := live(cluster, prefix)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert seen == expected


@dataclass
class Stream:
    worker_id: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""


def _load(router: str, streams: list[Stream], stop: threading.Event) -> None:
    """Streams one after another until `stop`: a steady load."""
    with Client(router, timeout=120) as kvpact:
        while not stop.is_set():
            stream = Stream()
            streams.append(stream)
            try:
                for chunk in kvpact.generate("hi", max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True):
                    stream.worker_id = stream.worker_id or chunk.worker_id
                    stream.num_tokens += len(chunk.token_ids)
                    stream.finish_reason = chunk.finish_reason or stream.finish_reason
            except Exception as exc:  # the assertion shows it
                stream.error = f"{type(exc).__name__}: {exc}"


def test_scale_up_to_2_then_down_to_1_drains_the_leaver_with_its_streams_and_leaves_nothing(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    group = {
        **worker_group(model, "cpu", 1, max_num_seqs=1, drain_timeout=30),
        "min_replicas": 1,
        "max_replicas": 2,
    }
    config = cluster_file(tmp_path, workers=[group], router_flags={"heartbeat-interval": 0.3})
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        name = placement_group_name(launch)
        router = wait_serving(launch)

        up = scale(ray_cluster, "--group", "cpu", "--replicas", "2", "--timeout", "150")
        assert up.returncode == 0, up.stdout + up.stderr + launch.output()[-3000:]
        assert "kvpact-launch scale: group cpu: 2 admitted workers (cpu-0, cpu-1)" in up.stdout
        with Client(router, timeout=30) as kvpact:
            status = kvpact.cluster_status()
        print(render_cluster_status(status))
        by_id = {w.worker_id: w for w in status.workers}
        assert {i: w.state for i, w in by_id.items()} == {"cpu-0": ADMITTED, "cpu-1": ADMITTED}
        assert by_id["cpu-1"].labels["ray.bundle"] == "0"  # the only bundle of its own placement group
        wait_for_line(launch, r"scale: adding worker cpu-1 in a placement group of its own", 5)
        assert live(ray_cluster, name)[1] == sorted([name, f"{name}-cpu-1"])

        streams: list[Stream] = []
        stop_load = threading.Event()
        loaders = [
            threading.Thread(target=_load, args=(router, streams, stop_load)) for _ in range(NUM_LOADERS)
        ]
        for thread in loaders:
            thread.start()
        with Client(router, timeout=30) as kvpact:  # both workers busy before the scale-down
            deadline = time.monotonic() + 30
            while not all(w.num_outstanding for w in kvpact.cluster_status().workers):
                assert time.monotonic() < deadline, [s.error for s in streams]
                time.sleep(0.02)
            down = subprocess.Popen(
                [*LAUNCH, "scale", "--group", "cpu", "--replicas", "1", "--timeout", "150"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **RAY_AUTH, "RAY_ADDRESS": ray_cluster.address},
            )
            leaving = None
            deadline = time.monotonic() + 60
            while leaving is None or leaving.state != router_pb2.WORKER_STATE_DRAINING:
                assert time.monotonic() < deadline and down.poll() is None, launch.output()[-3000:]
                leaving = next(w for w in kvpact.cluster_status().workers if w.worker_id == "cpu-1")
                time.sleep(0.02)
            in_flight_at_drain = leaving.num_outstanding
        output, _ = down.communicate(timeout=150)
        stop_load.set()
        for thread in loaders:
            thread.join(120)
        assert down.returncode == 0, output + launch.output()[-3000:]
        assert "kvpact-launch scale: group cpu: 1 admitted workers (cpu-0)" in output
        assert in_flight_at_drain > 0, "cpu-1 had no stream in flight when the router drained it"
        assert {s.worker_id for s in streams} == {"cpu-0", "cpu-1"}
        assert [(s.error, s.finish_reason, s.num_tokens) for s in streams] == [
            ("", "length", STREAM_TOKENS)
        ] * len(streams)  # no request lost, the leaver's included
        print(f"scale-down under load: {len(streams)} streams OK, {in_flight_at_drain} on cpu-1 at its drain")
        with Client(router, timeout=30) as kvpact:
            status = kvpact.cluster_status()
        print(render_cluster_status(status))
        assert [(w.worker_id, w.state) for w in status.workers] == [("cpu-0", ADMITTED)]
        wait_for_line(launch, r"scale: worker cpu-1 left \(exited with code 0\); its actor killed, its "
                      r"placement group removed", 30)  # fmt: skip
        assert "restarting it" not in launch.stdout()
        assert "the router asked it to drain (kvpact-launch scale-down)" in launch.output()
        eventually_live(ray_cluster, name, (["LauncherControl:kvpact-launcher", "WorkerActor:"], [name]))

        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()[-3000:]
    eventually_live(ray_cluster, name, ([], []))


def test_the_command_refuses_an_unknown_group_and_a_size_outside_the_bounds(ray_cluster: RayCluster):
    """Exit 2 comes from the launcher's control actor; with no launcher running, exit 1 says so."""
    control = LauncherControl({"cpu": GroupBounds(1, 1, 3)}, timeout_s=300)
    assert control.scale("gpu", 2) == {
        "error": "no worker group 'gpu' in this cluster (its groups: cpu); pass --group"
    }
    assert control.scale("cpu", 4) == {
        "error": "--replicas 4 is outside group 'cpu''s bounds [1, 3] (workers[].min_replicas and "
        "max_replicas in the cluster file)"
    }
    assert control.scale("cpu", 3) == {"timeout_s": 300}
    assert control.exchange({"cpu": {"admitted_ids": ["cpu-0"], "blocked": "worker cpu-1 is starting"}}) == {
        "cpu": 3
    }
    control.set_target("cpu", 1, "worker cpu-1 was refused: its startup failed")
    status = GroupStatus(**control.group_status("cpu"))
    assert (status.target, status.gave_up, status.reached(1)) == (
        1,
        "worker cpu-1 was refused: its startup failed",
        True,
    )

    nobody = scale(ray_cluster, "--group", "cpu", "--replicas", "2", timeout_s=60)
    assert nobody.returncode == 1
    assert "no kvpact launcher runs on the Ray cluster" in nobody.stderr
    usage = scale(ray_cluster, "--group", "cpu", timeout_s=60)
    assert usage.returncode == 2 and "--replicas" in usage.stderr
