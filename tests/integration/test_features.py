"""The contract matrix for the features beside paged-attn, through real `router` and `worker` processes
on loopback with a tiny generated Llama on CPU (docs/contract.md):

    worker --FEATURE on that cannot be honored here      exit 78 naming the reason, no weight read
    router --policy cuda-graphs=on at start (CPU)        the cluster fails 78; one report, each worker
    router --policy prefix-caching=on after start        a joining eager worker is refused before it
                                                         loads; the cluster keeps serving; /metrics
                                                         and ClusterStatus show each feature (slow)

Every process is stopped by pid; every wait is bounded.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kvpact.client import Client, render_cluster_status
from kvpact.v1 import cache_pb2
from tests.factories.processes import (
    ProcessHandle,
    free_port,
    module_argv,
    running,
    wait_for_exit,
    wait_for_health,
)
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import MAX_MODEL_LEN, START_S, router_address, router_argv, worker_args


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=int(MAX_MODEL_LEN))


def loaded_weights(handle: ProcessHandle) -> bool:
    """Whether the worker's JSON log has its `model_loaded` event (the loader's, after reading weights)."""
    for line in handle.stderr().splitlines() + handle.stdout().splitlines():
        if line.startswith("{") and json.loads(line).get("event") == "model_loaded":
            return True
    return False


def standalone(model: Path, *args: str) -> list[str]:
    return module_argv("kvpact.worker", "--model", str(model), "--max-model-len", MAX_MODEL_LEN,
                       "--log-format", "json", *args)  # fmt: skip


def test_a_worker_that_cannot_honor_its_own_feature_on_exits_78_before_reading_a_weight(model, tmp_path):
    """Three workers at once (one torch import's wall time): each `on` that this CPU cannot honor."""
    cases = {
        "graphs": (standalone(model, "--cuda-graphs", "on"), {},
                   "CUDA graphs were explicitly requested (--cuda-graphs on), but no CUDA device: CUDA "
                   "graphs need one and this worker runs on cpu. [device]"),
        "prefix": (standalone(model, "--prefix-caching", "on"), {},
                   "Prefix caching was explicitly requested (--prefix-caching on), but prefix caching needs "
                   "the paged KV cache and this worker plans an eager one (eager is the CPU default"),
        "kernels": (standalone(model, "--cpu-kernels", "on"),
                    {"CC": str(tmp_path / "no-such-cc"), "KVPACT_CACHE_DIR": str(tmp_path / "cache")},
                    "The C CPU kernels were explicitly requested (--cpu-kernels on), but the C kernels "
                    "cannot be built here: could not build cpu_paged.c"),
    }  # fmt: skip
    with (
        running(cases["graphs"][0], name="graphs", log_dir=tmp_path) as graphs,
        running(cases["prefix"][0], name="prefix", log_dir=tmp_path) as prefix,
        running(cases["kernels"][0], name="kernels", env=cases["kernels"][1], log_dir=tmp_path) as kernels,
    ):
        for handle in (graphs, prefix, kernels):
            assert wait_for_exit(handle, START_S) == 78, handle.output()
            assert cases[handle.name][2] in handle.stderr(), handle.output()
            assert not loaded_weights(handle), handle.output()


def test_an_unmet_cluster_policy_fails_the_start_with_one_report_naming_each_worker(model, tmp_path):
    """`router --policy cuda-graphs=on` on CPU: every worker plans cuda-graphs off, so the cluster fails 78
    before any weight is read, and the report names each worker, the feature and the reason."""
    argv = router_argv("--policy", "cuda-graphs=on", "--expect-workers", "2", "--failed-linger", "5")
    with running(argv, name="router", log_dir=tmp_path) as router:
        address = router_address(router)
        with (
            running(module_argv("kvpact.worker", *worker_args(model, address, "w-a"), "--log-format", "json"),
                    name="w-a", log_dir=tmp_path) as a,
            running(module_argv("kvpact.worker", *worker_args(model, address, "w-b"), "--log-format", "json"),
                    name="w-b", log_dir=tmp_path) as b,
        ):  # fmt: skip
            assert wait_for_exit(router, START_S) == 78, router.output()
            codes = {h.name: wait_for_exit(h, START_S) for h in (a, b)}
    assert codes == {"w-a": 78, "w-b": 78}, (a.output(), b.output())
    assert not loaded_weights(a) and not loaded_weights(b)
    report = router.stderr()
    assert (
        "the cluster FAILED to start (--paged-attn auto, --policy cuda-graphs=on, --expect-workers 2"
        in report
    )
    assert (
        "the cluster policy is --policy cuda-graphs=on and it plans cuda-graphs off under --cuda-graphs auto "
        "because [device] no-cuda-device: no CUDA device: CUDA graphs need one and this worker runs on cpu"
    ) in report
    assert (
        "exit code 78: the cuda-graphs policy (--policy cuda-graphs, or a worker's --cuda-graphs on)"
        in report
    )
    # The report names every worker registered when the cluster failed (one that announces its plan after
    # it is refused by the lingering router, and exits 78 too, as asserted above).
    named = [w for w in ("w-a", "w-b") if f'worker "{w}" at ' in report]
    assert named and report.count(
        "  feature:   cuda-graphs off [device] no-cuda-device: no CUDA device"
    ) == len(named)


@pytest.mark.slow  # a loaded worker (~25 s); tests/router/test_cli.py covers the same with a worker double
def test_after_start_a_worker_that_fails_a_feature_policy_is_refused_and_the_cluster_serves(model, tmp_path):
    """`router --policy prefix-caching=on`: a paged worker is admitted; a joining auto worker plans the eager
    cache (the CPU default), so no prefix cache: refused before it loads, while the cluster keeps serving.
    ClusterStatus, `router status`'s table and /metrics show each feature."""
    port = free_port()
    argv = router_argv("--policy", "prefix-caching=on", "--metrics-port", str(port))
    with running(argv, name="router", log_dir=tmp_path) as router:
        address = router_address(router)
        a_argv = module_argv("kvpact.worker", *worker_args(model, address, "w-a", "--paged-attn", "on"))
        with running(a_argv, name="w-a", log_dir=tmp_path) as a:
            wait_for_health(address, START_S, watch=[router, a])
            b_argv = module_argv("kvpact.worker", *worker_args(model, address, "w-b"), "--log-format", "json")
            with running(b_argv, name="w-b", log_dir=tmp_path) as b:
                assert wait_for_exit(b, START_S) == 78, b.output()
            assert not loaded_weights(b), b.output()
            assert "refused its plan before loading" in b.stderr()
            assert (
                "the cluster policy is --policy prefix-caching=on and it plans prefix-caching off"
                in b.stderr()
            )
            with Client(address, timeout=30) as client:
                assert client.complete("hello", max_tokens=2).token_ids  # still serving
                status = client.cluster_status()
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    (served,) = [w for w in status.workers if w.worker_id == "w-a"]
    features = {f.name: f for f in served.realized.features}
    assert [f.name for f in served.realized.features] == ["paged-attn", "prefix-caching", "cpu-kernels",
                                                           "cuda-graphs"]  # fmt: skip
    assert features["paged-attn"].realized and features["prefix-caching"].realized
    assert features["cpu-kernels"].realized
    graphs = features["cuda-graphs"]
    assert (graphs.realized, graphs.requested, graphs.reason_code) == (
        False, cache_pb2.FEATURE_MODE_AUTO, "no-cuda-device"
    )  # fmt: skip
    assert dict(status.policies)["prefix-caching"] == cache_pb2.FEATURE_MODE_ON
    table = render_cluster_status(status)
    assert "FEATURES" in table and "+paged-attn +prefix-caching +cpu-kernels !cuda-graphs" in table
    assert (
        'kvpact_worker_feature_realized{feature="prefix-caching",realized="on",requested="auto"} 1.0'
        in metrics
    )
    assert 'kvpact_worker_feature_realized{feature="cuda-graphs",realized="off",requested="auto"}' in metrics
    assert 'kvpact_worker_fallbacks_total{feature="cuda-graphs",reason="no-cuda-device"} 1.0' in metrics
