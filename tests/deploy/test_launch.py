"""`kvpact-launch` on a real local Ray cluster (one per module: 4 CPUs and 2 fake GPUs, with the dashboard
so `ray.util.state` answers), a tiny Llama on CPU. Torch sees no CUDA behind the fake GPUs, so a worker
asked for `--pa-backend triton` cannot honor `on`, exactly as on a GPU node without a usable device.

The launcher runs as its own process (joining through $RAY_ADDRESS) and is stopped by pid.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from kvpact.client import Client, KvpactRpcError, render_cluster_status
from kvpact.deploy.processes import free_port, health_status, wait_for_exit, wait_for_line
from kvpact.v1 import cache_pb2, router_pb2
from tests.factories.certs import CertificateAuthority
from tests.factories.eventually import eventually
from tests.factories.processes import alive
from tests.factories.ray_launch import (
    RAY_AUTH,
    cluster_file,
    launched,
    placement_group_name,
    ray_auth_env,
    start_local_ray,
    wait_serving,
    worker_group,
)
from tests.factories.tiny_models import make_tiny_llama

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"


@dataclass(frozen=True)
class RayCluster:
    address: str  # the GCS address, for RAY_ADDRESS
    dashboard: str  # http://HOST:PORT, for ray.util.state


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    with ray_auth_env():
        context = start_local_ray(
            num_cpus=4,
            num_gpus=2,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=0,
            object_store_memory=100 * 1024 * 1024,
            log_to_driver=False,
        )
        try:
            yield RayCluster(context.address_info["gcs_address"], f"http://{context.dashboard_url}")
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=256)


def assert_nothing_left(cluster: RayCluster, group_name: str) -> None:
    """No live actor in the cluster and no placement group of this launch that is not REMOVED."""
    from ray.util import state

    deadline = time.monotonic() + 30
    while True:
        alive = state.list_actors(address=cluster.dashboard, filters=[("state", "!=", "DEAD")])
        groups = [
            g
            for g in state.list_placement_groups(
                address=cluster.dashboard, filters=[("name", "=", group_name)]
            )
            if g.state != "REMOVED"
        ]
        if not alive and not groups or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == [], f"actors left alive: {alive}"
    assert groups == [], f"placement groups left: {groups}"


def test_two_cpu_workers_serve_through_ray_then_sigterm_releases_everything(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    token = tmp_path / "token"  # the router requires it: each worker must have been handed it to register
    token.write_text("s3cret\n")
    low = free_port()  # the workers' ports come from the group's port_range (firewalled nodes)
    group = {**worker_group(model, "cpu", 2), "port_range": [low, low + 20]}
    config = cluster_file(
        tmp_path, workers=[group], auth_token_file=token, router_flags={"http-listen": "127.0.0.1:0"}
    )
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        group_name = placement_group_name(launch)
        address = wait_serving(launch)
        # the router's OpenAI API, reported by the launcher next to the gRPC address
        http = re.search(r"^OpenAI API: (http://\S+)/v1$", launch.stdout(), re.MULTILINE)
        assert http is not None, launch.stdout()[-2000:]
        assert httpx.get(f"{http.group(1)}/health", timeout=10).json()["status"] == "SERVING"
        with Client(address, timeout=30) as client:
            text = "".join(chunk.text for chunk in client.generate("hello", max_tokens=8, temperature=0))
            status = client.cluster_status()
        assert text
        assert status.state == router_pb2.CLUSTER_STATE_SERVING
        workers = {w.worker_id: w for w in status.workers}
        assert sorted(workers) == ["cpu-0", "cpu-1"]
        node_id = ray.get_runtime_context().get_node_id()
        for index, worker_id in enumerate(["cpu-0", "cpu-1"]):
            w = workers[worker_id]
            assert w.state == router_pb2.WORKER_STATE_ADMITTED
            assert w.realized.kind == cache_pb2.CACHE_KIND_PAGED
            assert w.realized.backend == cache_pb2.PAGED_BACKEND_TORCH
            assert dict(w.labels) == {
                "ray.node": node_id[:12],
                "ray.node_ip": ray.util.get_node_ip_address(),
                "ray.bundle": str(index),
            }
            assert w.address.startswith(ray.util.get_node_ip_address() + ":")
            assert low <= int(w.address.rpartition(":")[2]) <= low + 20, w.address
            # A scraper finds each worker's /metrics in ClusterStatus.
            assert w.metrics_address.startswith(ray.util.get_node_ip_address() + ":"), w.metrics_address
        # The table the launcher printed shows where each worker runs.
        table = launch.stdout()
        assert "LABELS" in table and f"ray.bundle=1 ray.node={node_id[:12]}" in table
        worker_addresses = [w.address for w in status.workers]

        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()
    out = launch.stdout()
    assert "teardown: placement group removed" in out
    assert out.rstrip().endswith("kvpact-launch: stopped"), out[-2000:]
    assert_nothing_left(ray_cluster, group_name)
    for worker_address in [address, *worker_addresses]:
        assert health_status(worker_address) == "UNREACHABLE"


@pytest.mark.slow  # TLS and keys are judged by tests/integration/test_security.py without Ray
def test_router_tls_and_api_keys_in_the_cluster_file_reach_router_and_workers(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    """Mutual TLS between router and worker, TLS + an API key for clients, all from the cluster file; the
    launcher itself reaches its router the same way (it prints the cluster table once SERVING)."""
    files = CertificateAuthority.create("test CA").issue("kvpact", tmp_path / "pki")
    tls = {"tls-cert": str(files.cert), "tls-key": str(files.key), "tls-ca": str(files.ca)}
    tls["tls-server-name"] = "localhost"  # one certificate for every node: workers advertise the node IP
    keys = tmp_path / "api-keys"
    keys.write_text("k-launch\n")
    config = cluster_file(
        tmp_path,
        workers=[worker_group(model, "tls", 1, **{k.replace("-", "_"): v for k, v in tls.items()})],
        router_flags={**tls, "api-key-file": str(keys)},
    )
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        address = wait_serving(launch)
        # The table, from the router's report file: the launcher needs neither its TLS nor a key for it.
        assert "ADMITTED" in launch.stdout(), launch.output()
        with Client(address, timeout=30, ca_file=str(files.ca), server_name="localhost") as client:
            with pytest.raises(KvpactRpcError) as refused:
                client.cluster_status()
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        secured = Client(
            address, timeout=30, ca_file=str(files.ca), server_name="localhost", api_key="k-launch"
        )
        with secured as client:
            assert "".join(c.text for c in client.generate("hello", max_tokens=4, temperature=0))
        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()


@pytest.mark.slow  # the Ray job test gives the same 78 report by default (test_job_submission.py)
def test_on_with_a_worker_that_cannot_honor_it_fails_78_naming_it(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    workers = [
        worker_group(model, "torch", 1),
        worker_group(model, "triton", 1, resources={"num_gpus": 1, "num_cpus": 1}, pa_backend="triton"),
    ]
    config = cluster_file(tmp_path, workers=workers)
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        group_name = placement_group_name(launch)
        code = wait_for_exit(launch, 180)
    err = launch.stderr()
    assert code == 78, launch.output()
    last = err.rstrip().splitlines()[-1]
    assert last.startswith('kvpact-launch: FAILED (exit code 78): worker "triton-0" was refused'), err[-3000:]
    assert TRITON_REASON in last
    # The router's report precedes the verdict: each worker, where Ray placed it, and the shutdown sent.
    assert 'worker "triton-0" at ' in err and "ray.bundle=1" in err
    # Then the failed worker's own last lines, fetched through its actor (its node's files may be gone).
    header = re.search(r"^worker triton-0 in bundle 1 on node \S+ \(\S+\): its last output lines$", err, re.M)
    assert header is not None, err[-3000:]
    assert TRITON_REASON in err[header.end() : err.rindex("kvpact-launch: FAILED")]
    out = launch.stdout()  # teardown's lines, printed (and flushed) before the verdict
    assert "teardown: placement group removed" in out
    # Every worker's output reached the launcher's own (the job's logs), prefixed with its worker id.
    everything = launch.output()
    assert "(WorkerActor(torch-0) pid=" in everything and "(WorkerActor(triton-0) pid=" in everything
    # torch-0 did not keep loading: told to stop by the router (0), refused when it announced its plan to
    # the failed cluster (78), or stopped by the teardown (0).
    assert re.search(
        r"kvpact-launch: teardown: workers stopped \(exit codes\): torch-0 (0|78), triton-0 78$", out, re.M
    )
    if 'worker "torch-0" at ' in err:  # it announced its plan in time: the router told it to stop
        torch_block = err[err.index('worker "torch-0" at ') :].split("\n\n")[0]
        assert "shutdown:  sent" in torch_block, torch_block
    assert_nothing_left(ray_cluster, group_name)


def test_a_placement_group_that_cannot_be_granted_exits_1_naming_the_resources(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    workers = [worker_group(model, "big", 1, resources={"num_gpus": 3, "num_cpus": 1})]
    config = cluster_file(tmp_path, workers=workers, placement_timeout_s=3)
    started = time.monotonic()
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        group_name = placement_group_name(launch)
        code = wait_for_exit(launch, 60)
    assert code == 1, launch.output()
    last = launch.stderr().rstrip().splitlines()[-1]
    assert last.startswith(
        "kvpact-launch: FAILED (exit code 1): placement: 1 bundles big x1 {CPU: 1, GPU: 3}"
    )
    assert "ray.placement_timeout_s 3 s" in last and "GPU: 2" in last  # what the cluster has
    assert time.monotonic() - started < 45  # the timeout, plus starting Python and joining Ray
    assert_nothing_left(ray_cluster, group_name)


@pytest.mark.slow  # ~50 s: a second cold start of a worker; the default suite keeps the issue's cases
def test_a_worker_that_dies_after_serving_is_restarted_in_its_bundle_and_admitted_again(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    group = {**worker_group(model, "cpu", 1), "max_restarts": 1}
    config = cluster_file(tmp_path, workers=[group])
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        address = wait_serving(launch)
        pid = int(wait_for_line(launch, r"kvpact-launch: worker cpu-0 \(pid (\d+)\) started", 5).group(1))
        with Client(address, timeout=30) as client:
            before = client.cluster_status().workers[0].address
        os.kill(pid, signal.SIGKILL)  # the worker process this test's launcher started, by its pid
        wait_for_line(
            launch,
            r"cpu-0 .* exited with code -9; restarting it in its bundle in 1 s "
            r"\(restart 1 of 1 within 600 s\)",
            30,
        )
        # Its own last lines came first, fetched through its actor (its node's files may be elsewhere).
        crash = launch.output().split("exited with code -9; worker cpu-0 in ", 1)[1]
        assert "its last output lines" in crash and "worker cpu-0 serving" in crash, crash[:3000]
        wait_for_line(launch, rf"kvpact-launch: worker cpu-0 \(pid (?!{pid}\))\d+\) started in bundle 0", 30)

        def admitted_again() -> bool:
            with Client(address, timeout=10) as client:
                [w] = client.cluster_status().workers
            return w.state == router_pb2.WORKER_STATE_ADMITTED and w.address != before

        eventually(admitted_again, 120, "cpu-0 admitted again at a new address", interval=0.5)
        with Client(address, timeout=30) as client:
            assert "".join(c.text for c in client.generate("hello", max_tokens=4, temperature=0))
        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()


def test_a_killed_actor_is_restarted_after_its_backoff_and_a_sigterm_meanwhile_still_stops_at_once(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    """The actor itself dies (its process killed): Ray reports it dead, the launcher schedules a restart
    after its backoff, beside supervision; a SIGTERM during the backoff ends the launch in order, and the
    restart never happens."""
    from ray.util import state

    group = {**worker_group(model, "cpu", 1), "max_restarts": 2}
    config = cluster_file(tmp_path, workers=[group])
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        group_name = placement_group_name(launch)
        wait_serving(launch)
        [actor] = state.list_actors(
            address=ray_cluster.dashboard,
            filters=[("class_name", "=", "WorkerActor"), ("state", "=", "ALIVE")],
        )
        os.kill(actor.pid, signal.SIGKILL)  # the actor this test's launcher started, by its pid
        wait_for_line(
            launch,
            r"kvpact-launch: worker cpu-0 in bundle 0 on node \S+ \(\S+\) its Ray actor is dead \(.+\); "
            r"restarting it in its bundle in 1 s \(restart 1 of 2 within 600 s\)$",
            60,
        )
        launch.popen.send_signal(signal.SIGTERM)  # answered now, not after the restart
        assert wait_for_exit(launch, 60) == 0, launch.output()
    out = launch.stdout()
    assert out.rstrip().endswith("kvpact-launch: stopped"), out[-2000:]
    assert len(re.findall(r"kvpact-launch: worker cpu-0 \(pid \d+\) started", out, re.M)) == 1, out[-3000:]
    assert_nothing_left(ray_cluster, group_name)


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel ranks the worker `worker_pid` spawned (its children running the follower)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == worker_pid and b"kvpact.worker.startup.follower" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_tensor_parallel_worker_runs_its_ranks_in_its_bundle_and_a_killed_rank_restarts_it_whole(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    """TP=2 on CPU in one bundle of half a CPU (it fits a 2-CPU local Ray): placed, served, shown per
    rank; a killed rank takes its worker down (exit 1 naming the rank), the router marks it DEAD, the
    launcher restarts the whole worker within its budget, and no process of the old worker is left."""
    group = {
        **worker_group(model, "tp", 1, resources={"num_cpus": 0.5}, tensor_parallel_size=2),
        "max_restarts": 1,
    }
    config = cluster_file(tmp_path, workers=[group], router_flags={"heartbeat-timeout": 3})
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        address = wait_serving(launch)
        out = launch.stdout()
        assert "placing 1 workers: tp x1 {CPU: 0.5} tp 2, strategy PACK" in out, out[-3000:]
        line = r"kvpact-launch: worker tp-0 \(pid (\d+)\) started in bundle 0 .*; it starts its 1 other "
        started = wait_for_line(launch, line + "tensor-parallel ranks in this bundle$", 5)
        pid = int(started.group(1))
        [rank1] = rank_pids(pid)
        with Client(address, timeout=30) as client:
            assert "".join(c.text for c in client.generate("hello", max_tokens=8, temperature=0))
            status = client.cluster_status()
        [w] = status.workers
        assert (w.state, w.realized.kind) == (router_pb2.WORKER_STATE_ADMITTED, cache_pb2.CACHE_KIND_PAGED)
        assert (w.realized.tensor_parallel_size, list(w.realized.rank_devices)) == (2, ["cpu", "cpu"])
        assert dict(w.labels)["ray.bundle"] == "0"
        row = render_cluster_status(status).splitlines()[2]
        assert " tp2 cpu,cpu " in row and " tp 2" in row, row
        print(render_cluster_status(status))

        os.kill(rank1, signal.SIGKILL)  # rank 1 of the worker this test's launcher started, by its pid
        wait_for_line(
            launch,
            r"tp-0 .* exited with code 1; restarting it in its bundle in 1 s \(restart 1 of 1 within 600 s\)",
            30,
        )
        said = f"tensor-parallel rank 1 (pid {rank1}) exited with code -9; the worker stops"
        eventually(lambda: said in launch.output(), 30, "the worker's line naming its rank (via Ray's logs)")

        # DEAD after --heartbeat-timeout 3 s without heartbeats, unless the restarted worker (1 s after the
        # exit, a new port) registers first and replaces the entry: both show the router stopped routing
        # to the killed one. `seen` says which states it went through if neither comes.
        seen: list[str] = []

        def dead_or_replaced() -> bool:
            with Client(address, timeout=10) as client:
                now = client.cluster_status().workers[0]
            seen.append(f"{router_pb2.WorkerState.Name(now.state)} at {now.address}: {now.state_reason}")
            return now.state == router_pb2.WORKER_STATE_DEAD or now.address != w.address

        try:
            eventually(dead_or_replaced, 30, "tp-0 marked DEAD by the router or replaced", interval=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}; states seen: {sorted(set(seen))}") from None
        again = wait_for_line(launch, rf"kvpact-launch: worker tp-0 \(pid (?!{pid}\))(\d+)\) started", 30)
        assert not alive(pid) and not alive(rank1), "a process of the killed worker is left"
        eventually(lambda: len(rank_pids(int(again.group(1)))) == 1, 60, "the new worker's rank 1")
        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()


# -- kvpact-launch scale -------------------------------------------------------------------------------

SCALE = [sys.executable, "-m", "kvpact.deploy.launch", "scale"]
# One sequence at a time per worker: each has a queue of 4 to finish, so the leaver is empty at its drain
# only if every loader thread stalls for 5 streams' time (with 4 and then 6 loaders, stalled CI runs saw
# it with none in flight when it was drained).
NUM_LOADERS, STREAM_TOKENS = 10, 200
ADMITTED = router_pb2.WORKER_STATE_ADMITTED


def scale_env(ray_cluster: RayCluster) -> dict[str, str]:
    return {**os.environ, **RAY_AUTH, "RAY_ADDRESS": ray_cluster.address}


def scale(ray_cluster: RayCluster, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """`kvpact-launch scale ARGS` as its own process, joining the cluster through $RAY_ADDRESS."""
    env = scale_env(ray_cluster)
    return subprocess.run([*SCALE, *args], capture_output=True, text=True, env=env, timeout=timeout_s)


def live(cluster: RayCluster, prefix: str) -> tuple[list[str], list[str]]:
    """Actors not DEAD (CLASS:NAME) and the placement groups named PREFIX... not REMOVED."""
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
                [*SCALE, "--group", "cpu", "--replicas", "1", "--timeout", "150"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=scale_env(ray_cluster),
            )
            # The router's count when it drained cpu-1, as the launcher says it: a ClusterStatus polled
            # after that can come too late (the drain took 0.26 s here; a stalled CI run saw 0).
            drained = r"scale: worker cpu-1 .* leaves: the router drains it \((\d+) streams in flight"
            in_flight_at_drain = int(wait_for_line(launch, drained, 60).group(1))
        output, _ = down.communicate(timeout=150)
        stop_load.set()
        for thread in loaders:
            thread.join(120)
        assert down.returncode == 0, output + launch.output()[-3000:]
        assert "kvpact-launch scale: group cpu: 1 admitted workers (cpu-0)" in output
        assert [(s.error, s.finish_reason, s.num_tokens) for s in streams] == [
            ("", "length", STREAM_TOKENS)
        ] * len(streams)  # no request lost, the leaver's included
        assert {s.worker_id for s in streams} == {"cpu-0", "cpu-1"}
        assert in_flight_at_drain > 0, (
            f"cpu-1 had no stream in flight when the router drained it; {len(streams)} streams by worker: "
            f"{collections.Counter(s.worker_id for s in streams)}\n" + launch.output()[-3000:]
        )
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
    print(up.stdout + output)
    print("\n".join(line for line in launch.stdout().splitlines() if line.startswith("kvpact-launch: ")))
    eventually_live(ray_cluster, name, ([], []))


@pytest.mark.slow  # ~45 s: a second worker's cold start, then its drain
def test_autoscaling_adds_a_worker_under_a_burst_and_removes_it_when_idle(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    """A CPU group of fractional CPUs (0.5, so it grows on a small Ray) autoscaled on `waiting`: a burst on
    its one worker (one sequence at a time, the rest queued) adds a second; idle again, one leaves (drained,
    exit 0). Every decision is one launcher line and is recorded by the control actor."""
    autoscale = {"metric": "waiting", "target": 0.5, "up_after_s": 2, "down_after_s": 4}
    group = {
        **worker_group(model, "cpu", 1, resources={"num_cpus": 0.5}, max_num_seqs=1),
        "max_replicas": 2,
        "autoscale": autoscale,
    }
    config = cluster_file(tmp_path, workers=[group], router_flags={"heartbeat-interval": 0.3})
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        router = wait_serving(launch)
        streams: list[Stream] = []
        stop_load = threading.Event()
        loaders = [threading.Thread(target=_load, args=(router, streams, stop_load)) for _ in range(6)]
        for thread in loaders:
            thread.start()
        wait_for_line(launch, r"kvpact-launch: autoscale: group cpu from 1 to 2 workers: waiting \S+ above "
                      r"its target 0.5 for 2 s$", 60)  # fmt: skip
        with Client(router, timeout=30) as kvpact:
            deadline = time.monotonic() + 120
            while [w.state for w in kvpact.cluster_status().workers] != [ADMITTED, ADMITTED]:
                assert time.monotonic() < deadline, launch.output()[-3000:]
                time.sleep(0.2)
        while not any(s.worker_id == "cpu-1" for s in streams):  # the burst reaches the new worker
            assert time.monotonic() < deadline, launch.output()[-3000:]
            time.sleep(0.05)
        stop_load.set()
        for thread in loaders:
            thread.join(120)
        wait_for_line(launch, r"kvpact-launch: autoscale: group cpu from 2 to 1 workers: waiting 0.00 below "
                      r"its target 0.5 for 4 s$", 60)  # fmt: skip
        wait_for_line(launch, r"scale: worker cpu-1 left \(exited with code 0\)", 60)
        control = ray.get_actor("kvpact-launcher", namespace="kvpact")
        decisions = ray.get(control.decisions.remote(), timeout=30)
        assert [(d["cause"], d["from"], d["to"]) for d in decisions] == [
            ("autoscale", 1, 2),
            ("autoscale", 2, 1),
        ]
        assert [(s.error, s.finish_reason) for s in streams] == [("", "length")] * len(streams)
        assert {s.worker_id for s in streams} == {"cpu-0", "cpu-1"}
        print("\n".join(line for line in launch.stdout().splitlines() if "scale" in line))
        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()[-3000:]


@pytest.mark.slow  # ~30 s: three runs of the command against one launch
def test_scale_refuses_by_name_and_says_what_blocks_a_placement(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    """With no launcher, exit 1 saying so; an unknown group or a size outside the bounds, exit 2; a worker
    whose placement group cannot be granted (3 CPUs each on a 4-CPU cluster), exit 1 naming it; the launcher
    then gives up after ray.placement_timeout_s, and the cluster serves on at its size."""
    nobody = scale(ray_cluster, "--group", "big", "--replicas", "2")
    assert nobody.returncode == 1 and "no kvpact launcher runs on the Ray cluster" in nobody.stderr
    group = {**worker_group(model, "big", 1, resources={"num_cpus": 3}), "max_replicas": 3}
    config = cluster_file(tmp_path, workers=[group], placement_timeout_s=15)
    with launched(config, ray_cluster.address, log_dir=tmp_path) as launch:
        name = placement_group_name(launch)
        router = wait_serving(launch)
        unknown = scale(ray_cluster, "--group", "small", "--replicas", "2")
        assert unknown.returncode == 2, unknown.stderr
        assert "no worker group 'small' in this cluster (its groups: big); pass --group" in unknown.stderr
        outside = scale(ray_cluster, "--group", "big", "--replicas", "4")
        assert outside.returncode == 2, outside.stderr
        assert "--replicas 4 is outside group 'big''s bounds [1, 3]" in outside.stderr
        pending = scale(ray_cluster, "--group", "big", "--replicas", "2", "--timeout", "5")
        assert pending.returncode == 1, pending.stderr
        assert re.search(
            r"group big: FAILED: 1 of 2 workers admitted after 5 s \(big-0\); blocked by: worker big-1: its "
            r"placement group \{CPU: 3\} is pending \(\d+ s of ray.placement_timeout_s 15; free now: ",
            pending.stderr,
        ), pending.stderr
        wait_for_line(launch, r"scale: group big stays at 1 workers: worker big-1: its placement group "
                      r"\{CPU: 3\} was not granted within ray.placement_timeout_s 15 s", 60,
                      stream="stderr")  # fmt: skip
        eventually_live(ray_cluster, name, (["LauncherControl:kvpact-launcher", "WorkerActor:"], [name]))
        with Client(router, timeout=30) as kvpact:
            assert [w.state for w in kvpact.cluster_status().workers] == [ADMITTED]
        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()[-3000:]
    eventually_live(ray_cluster, name, ([], []))


def test_plan_judges_each_worker_on_its_node_and_says_78_then_1_without_resources(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
):
    """`kvpact-launch --plan`: each worker's `--plan-only` runs in its bundle (the model's weight data is
    garbage: only headers are read), judged as the router would: cpu-0 meets --paged-attn on; long-0 plans
    another max-model-len under router --uniform model,max-model-len; triton-0 cannot honor on; tp-0's two
    ranks are each shown with their own plan. Then a file whose bundles the cluster cannot grant exits 1
    after ray.placement_timeout_s, as a launch does."""
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    for f in model.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            (header_len,) = struct.unpack("<Q", data[:8])
            data = data[: 8 + header_len] + b"\xff" * (len(data) - 8 - header_len)
        (garbage / f.name).write_bytes(data)
    workers = [
        worker_group(garbage, "cpu", 1),
        worker_group(garbage, "long", 1, max_model_len=128),
        worker_group(garbage, "triton", 1, resources={"num_gpus": 1, "num_cpus": 1}, pa_backend="triton"),
        worker_group(garbage, "tp", 1, tensor_parallel_size=2, model_name="tiny-tp"),  # each rank planned
    ]
    config = cluster_file(tmp_path, workers=workers, router_flags={"uniform": "model,max-model-len"})
    with launched(config, ray_cluster.address, log_dir=tmp_path, args=("--plan",)) as launch:
        group_name = placement_group_name(launch)
        code = wait_for_exit(launch, 240)
    out, err = launch.stdout(), launch.stderr()
    assert code == 78, launch.output()
    rows = [" ".join(line.split()) for line in out.splitlines()]
    assert "cpu-0 paged-attn on on" in rows, out
    assert any(r.startswith("triton-0 paged-attn on off [device]") and "Triton" in r for r in rows), out
    assert any(r.startswith("cpu-0 tiny yes model sha256:") and r.endswith("max-model-len 256") for r in rows)
    assert any(r.startswith("long-0 tiny no model sha256:") and r.endswith("max-model-len 128") for r in rows)
    assert any(r.startswith("cpu-0 ok bundle 0 on node") for r in rows), out
    assert any(r.startswith("triton-0 refused it was started with --paged-attn on") for r in rows), out
    for rank in (0, 1):  # the TP worker's ranks, each with its own plan
        assert (
            f"tp-0 {rank} cpu ok +paged-attn +prefix-caching +cpu-kernels !quant-kernels !cuda-graphs" in rows
        ), out
    assert any(r.startswith("tp-0 ok bundle 3 on node") for r in rows), out
    assert (
        err.rstrip()
        .splitlines()[-1]
        .startswith("kvpact-launch: plan: REFUSED (exit code 78): worker long-0: it is not interchangeable")
    ), err
    assert "max-model-len 128 here, 256 on worker 'cpu-0'" in err
    assert "SERVING" not in out and "router started" not in out  # no router, no worker served
    assert_nothing_left(ray_cluster, group_name)

    big = [worker_group(model, "big", 1, resources={"num_gpus": 3, "num_cpus": 1})]
    unplaceable = cluster_file(tmp_path, workers=big, placement_timeout_s=3, name="big.yaml")
    with launched(unplaceable, ray_cluster.address, log_dir=tmp_path, name="big", args=("--plan",)) as launch:
        code = wait_for_exit(launch, 90)
    assert code == 1, launch.output()
    assert (
        launch.stderr()
        .rstrip()
        .splitlines()[-1]
        .startswith("kvpact-launch: plan: FAILED (exit code 1): placement: 1 bundles big x1 {CPU: 1, GPU: 3}")
    )
