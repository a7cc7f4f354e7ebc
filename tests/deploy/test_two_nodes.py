"""Two Ray nodes on this machine (`ray.cluster_utils.Cluster`, one fake GPU each): under STRICT_SPREAD the
launcher puts one worker on each node; each registers its own address and says which node it runs on."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpact.client import Client
from kvpact.deploy.processes import wait_for_exit
from kvpact.v1 import cache_pb2, router_pb2
from tests.factories.ray_launch import (
    cluster_file,
    launched,
    private_ray_temp_dir,
    ray_auth_env,
    wait_serving,
    worker_group,
)
from tests.factories.tiny_models import make_tiny_llama

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[str, set[str]]]:
    """The cluster's address and its two node ids."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": 80 * 1024 * 1024}
    with ray_auth_env(), private_ray_temp_dir() as temp_dir:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**node, "include_dashboard": False, "temp_dir": temp_dir},
        )
        try:
            cluster.add_node(**node)
            cluster.wait_for_nodes()
            yield cluster.address, {n.node_id for n in cluster.list_all_nodes()}
        finally:
            cluster.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=256)


def test_strict_spread_puts_the_workers_on_different_nodes(
    two_nodes: tuple[str, set[str]], model: Path, tmp_path: Path
):
    address, node_ids = two_nodes
    assert len(node_ids) == 2
    gpu = {"num_gpus": 1, "num_cpus": 1}
    config = cluster_file(
        tmp_path, workers=[worker_group(model, "gpu", 2, resources=gpu)], strategy="STRICT_SPREAD"
    )
    with launched(config, address, log_dir=tmp_path) as launch:
        router = wait_serving(launch)
        with Client(router, timeout=30) as client:
            status = client.cluster_status()
        launch.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(launch, 60) == 0, launch.output()
    workers = list(status.workers)
    assert [w.state for w in workers] == [router_pb2.WORKER_STATE_ADMITTED] * 2
    assert all(w.realized.kind == cache_pb2.CACHE_KIND_PAGED for w in workers)  # on CPU behind a fake GPU
    placed_on = {w.labels["ray.node"] for w in workers}
    assert placed_on == {node_id[:12] for node_id in node_ids}  # one worker on each node
    assert len({w.address for w in workers}) == 2
