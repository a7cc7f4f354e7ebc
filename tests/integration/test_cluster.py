"""Real `router` and `worker` processes over loopback with a tiny generated Llama on CPU.

One `--paged-attn on` cluster of two workers is shared by the tests that only read from it (module
fixture); the failure cases start their own. Every process is stopped by pid; every wait is bounded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpact.client import Client, KvpactRpcError, build_request, render_cluster_status
from kvpact.v1 import cache_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from tests.factories.eventually import eventually
from tests.factories.processes import (
    ProcessHandle,
    health_status,
    module_argv,
    running,
    started_worker,
    wait_for_exit,
    wait_for_health,
    wait_for_line,
)
from tests.factories.tiny_models import make_tiny_llama

ROUTER_LISTENING = r"^router listening on (\S+)$"
TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"
EAGER_CPU_REASON = "eager is the CPU default"
START_S = 90.0  # a cold worker on a loaded 2-core box: torch import, the tiny model, the cache
MAX_MODEL_LEN = "2048"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=int(MAX_MODEL_LEN))


def router_argv(*args: str) -> list[str]:
    return module_argv(
        "kvpact.router", "--listen", "127.0.0.1:0", "--log-format", "json", "--startup-timeout", "120", *args
    )


def worker_args(model: Path, router: str, worker_id: str, *args: str) -> list[str]:
    return ["--model", str(model), "--model-name", "tiny", "--router", router, "--worker-id", worker_id,
            "--router-timeout", "30", "--max-model-len", MAX_MODEL_LEN, *args]  # fmt: skip


def router_address(handle: ProcessHandle) -> str:
    return wait_for_line(handle, ROUTER_LISTENING, 15).group(1)


def log_events(handle: ProcessHandle, event: str) -> list[dict]:
    found = []
    for line in handle.stderr().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def wait_all_blocks_free(worker_address: str, timeout_s: float = 10.0) -> worker_pb2.WorkerLoad:
    with grpc.insecure_channel(worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)

        def all_free() -> worker_pb2.WorkerLoad | None:
            load = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            idle = load.num_running == 0 and load.num_waiting == 0
            return load if idle and load.num_free_blocks == load.num_total_blocks else None

        return eventually(all_free, timeout_s, f"worker {worker_address} to free every KV block")


class OnCluster:
    def __init__(
        self, router: ProcessHandle, address: str, workers: dict[str, str], model: Path, log_dir: Path
    ):
        self.router, self.address, self.workers, self.model, self.log_dir = (
            router,
            address,
            workers,
            model,
            log_dir,
        )


@pytest.fixture(scope="module")
def on_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnCluster]:
    """`router --paged-attn on --expect-workers 2` and two `--paged-attn on` workers (torch backend, CPU):
    w-a on the default event loop (uvloop), w-b on `--event-loop asyncio`."""
    log_dir = tmp_path_factory.mktemp("on-cluster")
    with running(
        router_argv("--paged-attn", "on", "--expect-workers", "2"), name="router", log_dir=log_dir
    ) as r:
        address = router_address(r)
        assert health_status(address) == "NOT_SERVING"
        assert health_status(address, "kvpact.v1.Generation") == "NOT_SERVING"
        a_args = worker_args(model, address, "w-a", "--paged-attn", "on")
        b_args = worker_args(
            model, address, "w-b", "--paged-attn", "on", "--pa-backend", "torch", "--event-loop", "asyncio"
        )
        with (
            started_worker(a_args, log_dir=log_dir, name="w-a", wait_serving=False, timeout_s=START_S) as a,
            started_worker(b_args, log_dir=log_dir, name="w-b", wait_serving=False, timeout_s=START_S) as b,
        ):
            wait_for_health(address, START_S, watch=[r, a.handle, b.handle])
            yield OnCluster(r, address, {"w-a": a.address, "w-b": b.address}, model, log_dir)


def test_on_cluster_serves_paged_workers_and_relays_the_workers_exact_tokens(on_cluster: OnCluster):
    assert health_status(on_cluster.address) == "SERVING"
    assert health_status(on_cluster.address, "kvpact.v1.Generation") == "SERVING"
    with Client(on_cluster.address, timeout=30) as client:
        status = client.cluster_status()
        print(render_cluster_status(status))
        assert (
            status.state == router_pb2.CLUSTER_STATE_SERVING
            and status.policy == cache_pb2.PAGED_ATTENTION_MODE_ON
        )
        assert sorted(w.worker_id for w in status.workers) == ["w-a", "w-b"]
        for w in status.workers:
            assert w.state == router_pb2.WORKER_STATE_ADMITTED
            assert (
                w.realized.kind == cache_pb2.CACHE_KIND_PAGED
                and w.realized.backend == cache_pb2.PAGED_BACKEND_TORCH
            )
            assert w.realized.capacity_tokens > 0 and w.realized.num_blocks > 0 and not w.realized.fallbacks
            assert (
                w.requested.cache.mode == cache_pb2.PAGED_ATTENTION_MODE_ON
                and w.capabilities.device_kind == "cpu"
            )
            assert w.address == on_cluster.workers[w.worker_id]

        chunks = list(client.generate("The quick brown fox", max_tokens=24, temperature=0.0, ignore_eos=True))
        routed = [t for c in chunks for t in c.token_ids]
        assert (
            len(routed) == 24
            and chunks[-1].finish_reason == "length"
            and chunks[-1].usage.completion_tokens == 24
        )
        direct_request = build_request("The quick brown fox", model="tiny", max_tokens=24, temperature=0.0,
                                       ignore_eos=True)  # fmt: skip
        for worker_address in on_cluster.workers.values():  # either event loop: the same tokens and text
            with grpc.insecure_channel(worker_address) as channel:
                direct = list(worker_pb2_grpc.WorkerStub(channel).Generate(direct_request, timeout=30))
            assert routed == [t for c in direct for t in c.token_ids]
            assert "".join(c.text for c in chunks) == "".join(c.text for c in direct)
        completion = client.complete("The quick brown fox", max_tokens=24, temperature=0.0, ignore_eos=True)
        assert list(completion.token_ids) == routed


def test_reflection_lists_the_services(on_cluster: OnCluster):
    with grpc.insecure_channel(on_cluster.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"kvpact.v1.Generation", "kvpact.v1.Registry", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names  # fmt: skip


def test_client_cancellation_mid_stream_frees_the_workers_blocks(on_cluster: OnCluster):
    with Client(on_cluster.address, timeout=60) as client:
        stream = client.generate("Once upon a time", max_tokens=1800, temperature=0.0, ignore_eos=True)
        first = next(stream)
        assert first.finish_reason is None
        with grpc.insecure_channel(on_cluster.workers[first.worker_id]) as channel:
            busy = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
        assert busy.num_running == 1 and busy.num_free_blocks < busy.num_total_blocks
        stream.close()  # cancels the client's call; the router cancels the worker's
    loads = {w: wait_all_blocks_free(addr) for w, addr in on_cluster.workers.items()}
    assert all(load.num_total_blocks > 0 for load in loads.values())


def test_a_deadline_shorter_than_the_generation_is_deadline_exceeded_and_frees_the_blocks(
    on_cluster: OnCluster,
):
    with Client(on_cluster.address) as client, pytest.raises(KvpactRpcError) as err:
        client.complete("Once upon a time", max_tokens=1800, temperature=0.0, ignore_eos=True, timeout=0.3)
    assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    for address in on_cluster.workers.values():
        wait_all_blocks_free(address)


def test_a_late_worker_that_misses_the_policy_is_refused_alone(on_cluster: OnCluster, tmp_path: Path):
    args = worker_args(on_cluster.model, on_cluster.address, "w-late", "--paged-attn", "auto")
    with running(
        module_argv("kvpact.worker", *args, "--log-format", "json"), name="w-late", log_dir=tmp_path
    ) as late:
        assert wait_for_exit(late, START_S) == 78
    assert not log_events(late, "model_loaded")  # its plan was refused: no weight was read
    with Client(on_cluster.address, timeout=30) as client:
        status = client.cluster_status()
        by_id = {w.worker_id: w for w in status.workers}
        refused = by_id["w-late"]
        assert refused.state == router_pb2.WORKER_STATE_REFUSED
        assert refused.planned.planned_kind == cache_pb2.CACHE_KIND_EAGER  # auto on CPU plans EAGER
        assert "cluster policy is --paged-attn on" in refused.state_reason
        assert EAGER_CPU_REASON in refused.state_reason
        assert status.state == router_pb2.CLUSTER_STATE_SERVING
        assert client.complete("still serving", max_tokens=4, temperature=0.0).usage.completion_tokens == 4
    assert on_cluster.router.returncode is None


def test_a_worker_that_cannot_honor_on_fails_the_whole_cluster(model: Path, tmp_path: Path):
    with running(
        router_argv("--paged-attn", "on", "--expect-workers", "2"), name="router", log_dir=tmp_path
    ) as r:
        address = router_address(r)
        a_args = worker_args(model, address, "w-good", "--paged-attn", "on")
        with started_worker(
            a_args, log_dir=tmp_path, name="w-good", wait_serving=False, timeout_s=START_S
        ) as a:
            admitted_or_gone = lambda: log_events(r, "worker_admitted") or a.handle.returncode is not None  # noqa: E731
            eventually(admitted_or_gone, START_S, "w-good to be admitted")
            assert a.handle.returncode is None, a.handle.output()
            b_args = worker_args(model, address, "w-triton", "--paged-attn", "on", "--pa-backend", "triton")
            with running(module_argv("kvpact.worker", *b_args, "--log-format", "json"), name="w-triton",
                         log_dir=tmp_path) as b:  # fmt: skip
                assert wait_for_exit(r, START_S) == 78
                exited_at = time.time()
                assert wait_for_exit(b, 30) == 78
            assert wait_for_exit(a.handle, 10) == 0  # told to shut down by the router
    refused = log_events(r, "worker_refused")
    assert [e["worker_id"] for e in refused] == ["w-triton"]
    reported_at = datetime.fromisoformat(refused[0]["timestamp"].replace("Z", "+00:00")).timestamp()
    assert exited_at - reported_at < 2.0
    stderr = r.stderr()
    report = stderr[stderr.index("kvpact router: the cluster FAILED to start") :]
    print(report)
    assert stderr.count("kvpact router: the cluster FAILED to start") == 1
    assert 'worker "w-triton"' in report and TRITON_REASON in report
    assert "asked:     --paged-attn on --pa-backend triton" in report
    assert 'worker "w-good"' in report and "realized:  PAGED (torch backend)" in report
    assert "exit code 78" in report


def test_auto_cluster_admits_eager_workers_with_their_reasons_and_off_without(model: Path, tmp_path: Path):
    with running(
        router_argv("--paged-attn", "auto", "--expect-workers", "2"), name="router", log_dir=tmp_path
    ) as r:
        address = router_address(r)
        auto_args = worker_args(model, address, "w-auto", "--paged-attn", "auto")
        off_args = worker_args(model, address, "w-off", "--paged-attn", "off")
        with (
            started_worker(
                auto_args, log_dir=tmp_path, name="w-auto", wait_serving=False, timeout_s=START_S
            ) as a,
            started_worker(
                off_args, log_dir=tmp_path, name="w-off", wait_serving=False, timeout_s=START_S
            ) as o,
        ):
            wait_for_health(address, START_S, watch=[r, a.handle, o.handle])
            with Client(address, timeout=30) as client:
                status = client.cluster_status()
                by_id = {w.worker_id: w for w in status.workers}
                assert by_id["w-auto"].realized.kind == cache_pb2.CACHE_KIND_EAGER
                assert any(EAGER_CPU_REASON in f.reason for f in by_id["w-auto"].realized.fallbacks)
                assert by_id["w-off"].realized.kind == cache_pb2.CACHE_KIND_EAGER
                assert list(by_id["w-off"].realized.fallbacks) == []
                assert all(w.state == router_pb2.WORKER_STATE_ADMITTED for w in status.workers)
                assert client.complete("hi", max_tokens=3, temperature=0.0).usage.completion_tokens == 3


def test_on_cluster_refuses_a_worker_started_auto_before_it_loads(model: Path, tmp_path: Path):
    """auto on CPU plans EAGER: the router refuses the plan, so the worker never reads a weight."""
    with running(router_argv("--paged-attn", "on"), name="router", log_dir=tmp_path) as r:
        address = router_address(r)
        args = worker_args(model, address, "w-auto", "--paged-attn", "auto")
        with running(
            module_argv("kvpact.worker", *args, "--log-format", "json"), name="w-auto", log_dir=tmp_path
        ) as w:
            assert wait_for_exit(w, START_S) == 78
            assert wait_for_exit(r, 10) == 78
        assert EAGER_CPU_REASON in w.output()
        assert "refused its plan before loading" in w.output()
        assert not log_events(w, "model_loaded")
        assert log_events(w, "plan refused")
    report = r.stderr()
    assert 'worker "w-auto"' in report and "under --paged-attn auto because [" in report
    assert EAGER_CPU_REASON in report
    assert "plans an EAGER KV cache" in report
    assert "planned:   EAGER; fell back because [device]" in report


def test_a_worker_without_the_auth_token_is_not_admitted(model: Path, tmp_path: Path):
    token = tmp_path / "token"
    token.write_text("s3cret-value\n")
    argv = router_argv("--auth-token-file", str(token))
    with running(argv, name="router", log_dir=tmp_path) as r:
        address = router_address(r)
        args = worker_args(model, address, "w-anon", "--router-timeout", "10")
        with running(
            module_argv("kvpact.worker", *args, "--log-format", "json"), name="w-anon", log_dir=tmp_path
        ) as w:
            assert wait_for_exit(w, START_S) != 0
            assert "UNAUTHENTICATED" in w.output()
        assert health_status(address) == "NOT_SERVING"
        with Client(address, timeout=10) as client:
            assert list(client.cluster_status().workers) == []
        assert "s3cret-value" not in r.output()


def test_a_worker_killed_mid_stream_ends_the_stream_with_unavailable_and_is_marked_dead(
    model: Path, tmp_path: Path
):
    """kill -9 of the serving worker: the client's stream ends promptly with UNAVAILABLE naming the
    worker (no hang), the router keeps running, and after --heartbeat-timeout the worker is DEAD."""
    argv = router_argv("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1")
    with running(argv, name="router", log_dir=tmp_path) as r:
        address = router_address(r)
        args = worker_args(model, address, "w-doomed", "--paged-attn", "on")
        with started_worker(
            args, log_dir=tmp_path, name="w-doomed", wait_serving=False, timeout_s=START_S
        ) as w:
            wait_for_health(address, START_S, watch=[r, w.handle])
            with Client(address, timeout=60) as client:
                stream = client.generate("Once upon", max_tokens=1800, temperature=0.0, ignore_eos=True)
                assert next(stream).finish_reason is None
                w.handle.popen.kill()
                started = time.monotonic()
                with pytest.raises(KvpactRpcError) as err:
                    for _ in stream:
                        pass
                assert time.monotonic() - started < 10
                assert err.value.code is grpc.StatusCode.UNAVAILABLE
                assert 'worker "w-doomed"' in err.value.details
                dead = lambda: client.cluster_status().workers[0].state == router_pb2.WORKER_STATE_DEAD  # noqa: E731
                eventually(dead, 15, "the killed worker to be marked DEAD")
                with pytest.raises(KvpactRpcError) as err:
                    client.complete("hi", max_tokens=2)
                assert err.value.code is grpc.StatusCode.UNAVAILABLE and "no live worker" in err.value.details
        assert r.returncode is None  # the router is still up
