"""`kvpact-launch` submitted as a Ray job, end to end, to a head started here with `ray start --head
--block` (its own temp dir, ports and process group, token authentication on, 1 fake GPU). The head is
stopped by signalling its process group at the end: never `ray stop`, which ends every Ray on the machine.

The failing cluster file ends the job FAILED with driver_exit_code 78 and the worker's name and reason in
the job's message (Ray keeps the tail of the driver's output there); the CPU one serves until the job is
stopped, then leaves nothing behind.
"""

from __future__ import annotations

import ast
import os
import re
import secrets
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
from kvpact.deploy.processes import free_port, health_status
from kvpact.v1 import router_pb2
from tests.factories.ray_launch import cluster_file, short_temp_dir, tried_twice, worker_group
from tests.factories.tiny_models import make_tiny_llama

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"
LAUNCH = str(Path(sys.executable).parent / "kvpact-launch")  # the console script of this environment
HEAD_START_S = 90.0
JOB_END_S = 180.0
STOP_WAIT_S = 60
DRAIN_S = 15  # the workers' and the router's --drain-timeout: the stop takes at most 15 + 10 + 20 s
NUM_STREAMS, STREAM_TOKENS = 8, 200


@dataclass(frozen=True)
class Head:
    dashboard: str  # http://127.0.0.1:PORT: jobs and ray.util.state
    auth: dict[str, str]  # RAY_AUTH_MODE / RAY_AUTH_TOKEN for clients of this head

    def jobs(self):
        """A job client that presents the token itself (Ray reads its auth mode once per process, and this
        process may already have joined a cluster without one)."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(
            self.dashboard, headers={"Authorization": f"Bearer {self.auth['RAY_AUTH_TOKEN']}"}
        )

    def submit(self, client, entrypoint: str) -> str:  # noqa: ANN001 - a JobSubmissionClient
        """submit_job, retried while the head's job agent is still starting: the dashboard answers
        list_jobs before its agent registers, and a submit then gets 500 "No available agent"."""
        deadline = time.monotonic() + HEAD_START_S
        while True:
            try:
                return str(client.submit_job(entrypoint=entrypoint))
            except RuntimeError as e:
                if "No available agent" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def live(self) -> tuple[list[str], list[str]]:
        """Live WorkerActors and placement groups not REMOVED, asked with ray.util.state in a process of
        its own, with this head's token in its environment."""
        script = (
            "import sys; from ray.util import state; a = sys.argv[1]; "
            "print([x.actor_id for x in state.list_actors(address=a) "
            "if x.state != 'DEAD' and x.class_name == 'WorkerActor']); "
            "print([g.placement_group_id for g in state.list_placement_groups(address=a) "
            "if g.state != 'REMOVED'])"
        )
        result = subprocess.run(
            [sys.executable, "-c", script, self.dashboard],
            env={**os.environ, **self.auth},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        actors, groups = result.stdout.strip().splitlines()[-2:]
        return ast.literal_eval(actors), ast.literal_eval(groups)


def _head_argv(temp_dir: str) -> list[str]:
    argv = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir,
        "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
        "--num-cpus", "4", "--num-gpus", "1", "--object-store-memory", str(100 * 1024 * 1024),
    ]  # fmt: skip
    for flag in (
        "port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port",
    ):  # fmt: skip
        argv += [f"--{flag}", str(free_port())]
    low = free_port()
    return [*argv, "--min-worker-port", str(low), "--max-worker-port", str(low + 40)]


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    # A stopped job's driver gets SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (default 3 s): long
    # enough for the launcher's ordered stop (kvpact-launch warns when it is not; docs/ray.md).
    env = {**os.environ, **auth, "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S)}
    env.pop("RAY_ADDRESS", None)
    # `ray start` exits when its GCS or raylet miss Ray's hard-coded 30 s: one more try
    process, head = tried_twice(lambda: _start_head(env, auth), "the ray head")
    try:
        yield head
    finally:
        _stop_group(process)


def _start_head(env: dict[str, str], auth: dict[str, str]) -> tuple[subprocess.Popen[bytes], Head] | str:
    """A `ray start --head --block` and its Head once its job API answers; its log's tail (the process
    group stopped) when it exits first. Raises when it neither answers nor exits in HEAD_START_S."""
    temp_dir = short_temp_dir("kvh-")
    argv = _head_argv(temp_dir)
    dashboard = f"http://127.0.0.1:{argv[argv.index('--dashboard-port') + 1]}"
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    head = Head(dashboard, auth)
    deadline = time.monotonic() + HEAD_START_S
    while True:
        try:
            head.jobs().list_jobs()
            return process, head
        except Exception:
            if process.poll() is not None:
                _stop_group(process)
                return log_path.read_text()[-3000:]
            if time.monotonic() > deadline:
                _stop_group(process)
                raise AssertionError(f"ray head did not come up: {log_path.read_text()[-3000:]}") from None
            time.sleep(0.5)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group (raylet, GCS, dashboard stop with it), SIGKILL what is left after
    5 s (`ray start --block` itself waits out its children's exits far longer than that)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=15)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=256)


def wait_job(client, job_id: str, timeout_s: float = JOB_END_S):
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        assert time.monotonic() < deadline, f"job {job_id} still {status} after {timeout_s:g} s"
        time.sleep(0.5)


def assert_nothing_left(head: Head) -> None:
    deadline = time.monotonic() + 30
    while True:
        actors, groups = head.live()
        if not actors and not groups or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert actors == [] and groups == [], (actors, groups)


def test_a_job_whose_cluster_cannot_honor_on_fails_78_with_the_worker_and_reason(
    head: Head, model: Path, tmp_path: Path
):
    from ray.job_submission import JobStatus

    workers = [
        worker_group(model, "torch", 1),
        worker_group(model, "triton", 1, resources={"num_gpus": 1, "num_cpus": 1}, pa_backend="triton"),
    ]
    config = cluster_file(tmp_path, workers=workers, listen=f"127.0.0.1:{free_port()}")
    client = head.jobs()
    job_id = head.submit(client, f"{LAUNCH} --config {config}")
    assert wait_job(client, job_id) == JobStatus.FAILED, client.get_job_logs(job_id)[-3000:]
    info = client.get_job_info(job_id)
    assert info.driver_exit_code == 78
    assert info.message.rstrip().endswith(
        'kvpact-launch: FAILED (exit code 78): worker "triton-0" was refused while the cluster was starting: '
        f"its startup failed (paged-attention-required) [device]: {TRITON_REASON}"
    ), info.message[-3000:]
    assert_nothing_left(head)


@dataclass
class Stream:
    """One client stream, read to its end in a thread of its own."""

    num_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    ended_at: float = 0.0


def _read(router: str, stream: Stream, first_token: threading.Event) -> None:
    try:
        with Client(router, timeout=120) as kvpact:
            for chunk in kvpact.generate("hi", max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True):
                stream.num_tokens += len(chunk.token_ids)
                first_token.set()
                stream.finish_reason = chunk.finish_reason or stream.finish_reason
    except Exception as exc:  # the assertion below shows it
        stream.error = f"{type(exc).__name__}: {exc}"
    stream.ended_at = time.monotonic()


def test_ray_job_stop_with_streams_in_flight_finishes_every_stream_then_leaves_nothing(
    head: Head, model: Path, tmp_path: Path
):
    """`ray job stop` signals the launcher and the router at once: the router refuses new work and
    finishes every stream it took, even one it took an instant before the stop; then the workers stop;
    the job ends STOPPED."""
    from ray.job_submission import JobStatus

    router = f"127.0.0.1:{free_port()}"
    group = worker_group(model, "cpu", 2, drain_timeout=DRAIN_S, max_num_seqs=2)  # streams queue: long
    config = cluster_file(tmp_path, workers=[group], listen=router, router_flags={"drain-timeout": DRAIN_S})
    client = head.jobs()
    job_id = head.submit(client, f"{LAUNCH} --config {config}")
    deadline = time.monotonic() + JOB_END_S
    while health_status(router) != "SERVING":
        assert not client.get_job_status(job_id).is_terminal(), client.get_job_logs(job_id)[-3000:]
        assert time.monotonic() < deadline, client.get_job_logs(job_id)[-3000:]
        time.sleep(0.5)
    with Client(router, timeout=30) as kvpact:
        status = kvpact.cluster_status()
    assert [w.state for w in status.workers] == [router_pb2.WORKER_STATE_ADMITTED] * 2
    print(render_cluster_status(status))

    # Stop once every stream has reached the router: it is on a worker or already ended (a fast machine
    # runs a stream in under a second). A stream still connecting when the stop comes is new work, which
    # the router refuses: not what this test is about. With 2 sequences a worker, most streams are still
    # in flight (queued behind the first ones) when the stop comes; on a loaded machine a late stream can
    # let the others finish first, so a round with none left in flight is run again (at most 3 rounds).
    for _ in range(3):
        streams = [Stream() for _ in range(NUM_STREAMS)]
        first_token = threading.Event()
        threads = [threading.Thread(target=_read, args=(router, s, first_token)) for s in streams]
        for thread in threads:
            thread.start()
        assert first_token.wait(60), [s.error for s in streams]
        with Client(router, timeout=30) as kvpact:
            for _ in range(200):
                ended = sum(1 for s in streams if s.ended_at)  # before the count: no stream is counted twice
                if ended + sum(w.num_outstanding for w in kvpact.cluster_status().workers) >= NUM_STREAMS:
                    break
                time.sleep(0.02)
        in_flight = sum(not s.ended_at for s in streams)
        if in_flight:
            break
        for thread in threads:
            thread.join(30)
        assert [(s.error, s.num_tokens) for s in streams] == [("", STREAM_TOKENS)] * NUM_STREAMS
    client.stop_job(job_id)
    assert in_flight, "in 3 rounds every stream ended before the stop came: nothing was in flight to finish"
    print(f"{in_flight} of {NUM_STREAMS} streams in flight at the stop")
    for thread in threads:
        thread.join(STOP_WAIT_S + 30)
    assert [(s.error, s.finish_reason, s.num_tokens) for s in streams] == [
        ("", "length", STREAM_TOKENS)
    ] * NUM_STREAMS
    assert wait_job(client, job_id, STOP_WAIT_S + 30) == JobStatus.STOPPED
    logs = client.get_job_logs(job_id)
    print("\n".join(line for line in logs.splitlines() if line.startswith("kvpact-launch: "))[-3000:])
    # The router stops first, exit 0. The teardown tells it to, unless it has already drained and left on
    # the job's own SIGTERM (Ray signals the entrypoint's process group; with every stream done that can
    # come first, and then "router told to stop" is not printed: seen in CI).
    teardown = [line for line in logs.splitlines() if line.startswith("kvpact-launch: teardown: ")]
    router_stopped = "kvpact-launch: teardown: router stopped (exit code 0)"
    assert router_stopped in teardown, logs[-3000:]
    assert re.search(r"workers stopped \(exit codes\): cpu-0 0, cpu-1 0$", logs, re.M), logs[-3000:]
    assert teardown.index(router_stopped) < next(
        i for i, line in enumerate(teardown) if "workers stopped" in line
    )
    assert "(WorkerActor(cpu-0) pid=" in logs  # the workers' own lines are in the job's logs
    assert_nothing_left(head)
    assert health_status(router) == "UNREACHABLE"
    for worker in status.workers:
        assert health_status(worker.address) == "UNREACHABLE"


@pytest.mark.slow  # ~90 s: a second worker's cold start, a job per scale
def test_kvpact_launch_scale_runs_as_a_ray_job_up_and_down(head: Head, model: Path, tmp_path: Path):
    """`ray job submit -- kvpact-launch scale ...`: the command, as a job of its own on the head, finds the
    launcher's control actor and exits 0 once the group has its new size; the launch then stops cleanly."""
    from ray.job_submission import JobStatus

    router = f"127.0.0.1:{free_port()}"
    group = {**worker_group(model, "cpu", 1, resources={"num_cpus": 0.5}), "max_replicas": 2}
    config = cluster_file(tmp_path, workers=[group], listen=router, router_flags={"heartbeat-interval": 0.3})
    client = head.jobs()
    launch_id = head.submit(client, f"{LAUNCH} --config {config}")
    deadline = time.monotonic() + JOB_END_S
    while health_status(router) != "SERVING":
        assert not client.get_job_status(launch_id).is_terminal(), client.get_job_logs(launch_id)[-3000:]
        assert time.monotonic() < deadline, client.get_job_logs(launch_id)[-3000:]
        time.sleep(0.5)
    for num, admitted in ((2, "cpu-0, cpu-1"), (1, "cpu-0")):
        scale_id = head.submit(client, f"{LAUNCH} scale --group cpu --replicas {num} --timeout 150")
        assert wait_job(client, scale_id) == JobStatus.SUCCEEDED, client.get_job_logs(scale_id)[-3000:]
        assert f"group cpu: {num} admitted workers ({admitted})" in client.get_job_logs(scale_id)
        with Client(router, timeout=30) as kvpact:
            status = kvpact.cluster_status()
        print(render_cluster_status(status))
        assert [w.state for w in status.workers] == [router_pb2.WORKER_STATE_ADMITTED] * num
    client.stop_job(launch_id)
    assert wait_job(client, launch_id, STOP_WAIT_S + 30) == JobStatus.STOPPED
    assert "scale: worker cpu-1 left (exited with code 0)" in client.get_job_logs(launch_id)
    assert_nothing_left(head)
