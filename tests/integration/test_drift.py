"""Drift while serving (issue 21, item 6) with a real router and a real worker process on loopback.

No feature of this build degrades on its own once a worker is ready (docs/contract.md "Drift while serving"
says why), and the product has no hook to make one. So the degradation comes from a real worker built
differently: `worker --plan-only --json` with no C compiler and `--paged-attn off` reports prefix-caching off
(prefix-cache-needs-paged) and cpu-kernels off (c-kernels-build), and a Registry proxy between the serving
worker and the router splices those states into the serving worker's heartbeats, as a worker that lost
them would send. Everything else is the real path: the router judges each beat against its policies,
logs, counts, shows the reason, and under `on` sets `drain` in the reply, which reaches the real worker.

    --policy prefix-caching=auto (the default)   prefix-caching lost: logged, counted, shown; it keeps serving
    --policy cpu-kernels=on                      cpu-kernels lost: drained; its in-flight stream finishes;
                                                 it deregisters and exits 0
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from kvpact.client import Client
from kvpact.router import status_cli
from kvpact.v1 import cache_pb2, router_pb2, worker_pb2_grpc
from tests.factories.eventually import eventually
from tests.factories.processes import free_port, module_argv, running, wait_for_exit, wait_for_health
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import (
    MAX_MODEL_LEN,
    START_S,
    log_events,
    router_address,
    router_argv,
    worker_args,
)

MODES = {
    "auto": cache_pb2.FEATURE_MODE_AUTO,
    "on": cache_pb2.FEATURE_MODE_ON,
    "off": cache_pb2.FEATURE_MODE_OFF,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=int(MAX_MODEL_LEN))


class SplicingRegistry(worker_pb2_grpc.RegistryServicer):
    """Forwards every Registry call to the router unchanged, except that a heartbeat's feature states named
    in `splice` are replaced by those (set by the test, read by the gRPC threads)."""

    def __init__(self, router: str) -> None:
        self._channel = grpc.insecure_channel(router)
        self._router = worker_pb2_grpc.RegistryStub(self._channel)
        self.splice: dict[str, cache_pb2.FeatureState] = {}
        self.lock = threading.Lock()

    def _forward(self, method: str, request: object, context: grpc.ServicerContext) -> object:
        try:
            return getattr(self._router, method)(request, timeout=10)
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())

    def Register(self, request, context):  # noqa: ANN001, ANN201, N802 - the servicer's signature
        return self._forward("Register", request, context)

    def Heartbeat(self, request, context):  # noqa: ANN001, ANN201, N802
        with self.lock:
            for i, f in enumerate(request.features):
                if f.name in self.splice:
                    request.features[i].CopyFrom(self.splice[f.name])
        return self._forward("Heartbeat", request, context)

    def Deregister(self, request, context):  # noqa: ANN001, ANN201, N802
        return self._forward("Deregister", request, context)


@contextmanager
def splicing_proxy(router: str) -> Iterator[tuple[str, SplicingRegistry]]:
    servicer = SplicingRegistry(router)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)
        servicer._channel.close()


def planned_states(plan_json: str) -> dict[str, cache_pb2.FeatureState]:
    """`worker --plan-only --json`'s features as the wire's FeatureState."""
    states = {}
    for f in json.loads(plan_json)["features"]:
        reason = f["reason"] or {}
        states[f["name"]] = cache_pb2.FeatureState(
            name=f["name"],
            requested=MODES[f["requested"]],
            realized=f["planned"] == "on",
            reason_code=reason.get("code", ""),
            message=reason.get("message", ""),
            component=reason.get("component", ""),
        )
    return states


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def worker_status(client: Client, worker_id: str) -> router_pb2.WorkerStatus | None:
    return next((w for w in client.cluster_status().workers if w.worker_id == worker_id), None)


@pytest.mark.slow  # a loaded worker (~40 s); tests/router/test_drift.py covers the router in-process
def test_drift_is_reported_under_auto_and_drains_the_worker_under_on(model, tmp_path):
    # The other build's states: planned by a real worker with no C compiler and --paged-attn off.
    plan = subprocess.Popen(
        module_argv("kvpact.worker", "--plan-only", "--json", "--model", str(model), "--paged-attn", "off"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "CC": str(tmp_path / "no-cc"), "KVPACT_CACHE_DIR": str(tmp_path)},
    )
    metrics_port = free_port()
    argv = router_argv("--policy", "cpu-kernels=on", "--heartbeat-interval", "0.3", "--metrics-port",
                       str(metrics_port))  # fmt: skip
    try:
        with running(argv, name="router", log_dir=tmp_path) as router:
            address = router_address(router)
            with splicing_proxy(address) as (proxy, splicer):
                w_argv = module_argv("kvpact.worker", *worker_args(model, proxy, "w-1", "--paged-attn", "on",
                                     "--drain-timeout", "30", "--log-format", "json"))  # fmt: skip
                with running(w_argv, name="w-1", log_dir=tmp_path) as worker:
                    wait_for_health(address, START_S, watch=[router, worker])
                    out, _ = plan.communicate(timeout=START_S)
                    assert plan.returncode == 0, out
                    other = planned_states(out)
                    assert (other["prefix-caching"].reason_code, other["cpu-kernels"].reason_code) == (
                        "prefix-cache-needs-paged", "c-kernels-build"
                    )  # fmt: skip
                    with Client(address, timeout=60) as client:
                        (w,) = client.cluster_status().workers
                        assert [f.realized for f in w.realized.features] == [True, True, True, False]

                        # auto: prefix-caching lost while serving. Reported; the worker keeps serving.
                        with splicer.lock:
                            splicer.splice["prefix-caching"] = other["prefix-caching"]
                        reported = eventually(
                            lambda: log_events(router, "worker_drift"), START_S, "the router's drift event"
                        )
                        want = (
                            "drift: prefix-caching realized off while serving under --policy "
                            "prefix-caching=auto ([cache] prefix-cache-needs-paged: prefix caching needs the "
                            "paged KV cache and this worker plans an eager one (--paged-attn off))"
                        )
                        status = eventually(
                            lambda: (s := worker_status(client, "w-1")) and s.state_reason == want and s,
                            10,
                            "the drift reason in ClusterStatus",
                        )
                        assert status.state == router_pb2.WORKER_STATE_ADMITTED
                        [event] = reported
                        assert (event["worker_id"], event["feature"], event["reason"], event["action"]) == (
                            "w-1", "prefix-caching", "prefix-cache-needs-paged", "report"
                        )  # fmt: skip
                        metrics = scrape(metrics_port)
                        assert (
                            'kvpact_worker_drift_total{feature="prefix-caching",'
                            'reason="prefix-cache-needs-paged"} 1.0' in metrics
                        )
                        assert (
                            'kvpact_worker_feature_realized{feature="prefix-caching",realized="off",'
                            'requested="auto"} 1.0' in metrics
                        )
                        assert (
                            client.complete("still", max_tokens=3, ignore_eos=True).usage.completion_tokens
                            == 3
                        )
                        printed = io.StringIO()
                        assert status_cli.main(["--address", address], out=printed) == 0
                        table = printed.getvalue()
                        print(table)
                        assert "!prefix-caching +cpu-kernels" in table and f"  w-1: {want}" in table
                        assert worker.returncode is None

                        # on: cpu-kernels lost while a stream is in flight. Drained: the stream
                        # finishes, the worker deregisters and exits 0.
                        stream = client.generate("long", max_tokens=200, ignore_eos=True)
                        first = next(stream)
                        with splicer.lock:
                            splicer.splice["cpu-kernels"] = other["cpu-kernels"]
                        rest = list(stream)
                        num_tokens = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
                        assert rest[-1].finish_reason == "length" and num_tokens == 200
                        assert wait_for_exit(worker, START_S) == 0, worker.output()
                        assert worker_status(client, "w-1") is None  # it deregistered
                    for e in log_events(router, "worker_drift"):  # the drift case, as the router logged it
                        print(
                            json.dumps(
                                {k: e[k] for k in ("event", "worker_id", "feature", "reason", "action")}
                            )
                        )
                    drained = [e for e in log_events(router, "worker_drift") if e["feature"] == "cpu-kernels"]
                    assert [(e["reason"], e["action"]) for e in drained] == [("c-kernels-build", "drain")]
                    assert (
                        "the router asked it to drain (drift: cpu-kernels realized off while serving under "
                        "--policy cpu-kernels=on ([build] c-kernels-build: the C kernels cannot be built here"
                    ) in worker.stdout()
                    metrics = scrape(metrics_port)
                    assert (
                        'kvpact_worker_drift_total{feature="cpu-kernels",reason="c-kernels-build"} 1.0'
                        in metrics
                    )
    finally:
        if plan.poll() is None:
            plan.kill()
            plan.wait(10)
