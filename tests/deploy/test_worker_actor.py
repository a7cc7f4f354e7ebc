"""WorkerActor and supervision on a real local Ray (one per module: 2 CPUs, 1 fake GPU): the environment
the worker process really gets, and a slow actor told apart from a dead one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpact.deploy.processes import free_port
from kvpact.deploy.supervision import Health, Poller, observe
from kvpact.deploy.worker_actor import WorkerActor, visible_devices
from tests.factories.ray_launch import ray_auth_env, start_local_ray
from tests.factories.tiny_models import make_tiny_llama

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with ray_auth_env():
        start_local_ray(
            num_cpus=2,
            num_gpus=1,
            include_dashboard=False,
            object_store_memory=80 * 1024 * 1024,
            log_to_driver=False,
        )
        try:
            yield
        finally:
            ray.shutdown()


def test_visible_devices_are_the_assigned_ids_or_none():
    assert visible_devices([]) == ""
    assert visible_devices([0, 3]) == "0,3"


def _environ(pid: int, marker: str) -> dict[str, str]:
    """The environment `pid` was exec'd with, once it has been: between fork and exec the child still
    shows its parent's (the actor's, which lacks what Ray set at run time), so wait (up to 30 s) until
    its command line holds `marker`, an argument of the worker's own."""
    deadline = time.monotonic() + 30
    while marker not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
        assert time.monotonic() < deadline, f"process {pid} did not exec the worker within 30 s"
        time.sleep(0.05)
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/PID/environ (Linux)")
def test_the_worker_process_sees_exactly_the_gpus_of_its_bundle(local_ray: None, tmp_path: Path):
    """A worker with no GPU gets CUDA_VISIBLE_DEVICES="" (Ray 2.60 leaves it unset for num_gpus=0, so it
    would see every GPU of the node); one with a GPU gets the id Ray assigned."""
    model = make_tiny_llama(tmp_path / "tiny")
    # A router nobody listens on: the worker keeps trying to announce its plan (up to --router-timeout),
    # so its process lives long enough to be read.
    argv = ["--model", str(model), "--device", "cpu", "--router", f"127.0.0.1:{free_port()}"]
    argv += ["--router-timeout", "60", "--listen", "127.0.0.1:0"]
    seen = {}
    for num_gpus in (0, 1):
        actor = ray.remote(WorkerActor).options(num_cpus=0, num_gpus=num_gpus).remote(f"w{num_gpus}")
        try:
            assigned = ray.get(actor.placement.remote(), timeout=120)["gpu_ids"]
            pid = ray.get(actor.start.remote([*argv, "--worker-id", f"w{num_gpus}"]), timeout=60)
            environ = _environ(pid, f"--worker-id\0w{num_gpus}")  # its arguments, NUL-separated
            seen[num_gpus] = (assigned, environ.get("CUDA_VISIBLE_DEVICES"))
            assert ray.get(actor.poll.remote(), timeout=30) is None  # still running when read
            ray.get(actor.stop.remote(5), timeout=30)
        finally:
            ray.kill(actor, no_restart=True)
    assert seen[0] == ("", "")  # set, and empty: no GPU at all
    assert seen[1][0] != "" and seen[1][1] == seen[1][0]  # exactly what Ray assigned


@ray.remote(num_cpus=0)
class Slow:
    """Answers `poll` only after `seconds` (a node that is busy, not gone)."""

    def ready(self) -> bool:
        return True

    def poll(self, seconds: float = 5.0) -> int | None:
        time.sleep(seconds)
        return None


def test_a_slow_actor_is_not_taken_for_a_dead_one(local_ray: None):
    slow = Slow.remote()
    running = ray.remote(WorkerActor).options(num_cpus=0).remote("idle")
    ray.get([slow.ready.remote(), running.placement.remote()], timeout=120)  # both up and answering
    seen = observe({"slow": slow, "idle": running}, timeout_s=1.0)
    assert seen["slow"].health is Health.SLOW, seen
    assert seen["slow"].detail == "no answer within 1 s"
    assert seen["idle"].health is Health.RUNNING  # asked at the same time, answered at once
    # Round after round, the unanswered call is waited on again, not sent again.
    poller = Poller()
    assert poller.observe({"slow": slow}, timeout_s=0.5)["slow"].health is Health.SLOW
    [(_, first)] = poller.pending.values()
    assert poller.observe({"slow": slow}, timeout_s=0.5)["slow"].health is Health.SLOW
    assert poller.pending["slow"][1] == first
    assert poller.observe({"slow": slow}, timeout_s=10)["slow"].health is Health.RUNNING  # it answered
    assert poller.pending == {}
    ray.kill(slow, no_restart=True)
    deadline = time.monotonic() + 30
    while (health := poller.observe({"slow": slow}, timeout_s=5.0)["slow"].health) is not Health.DEAD:
        assert health is Health.SLOW and time.monotonic() < deadline, health
    ray.kill(running, no_restart=True)
