"""A staged `--device-map` worker through the real router: its greedy tokens equal a one-device
worker's, and a cuda + cpu map's `on` outcome on a machine without CUDA (the worker's exit code and
message, nothing loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpact.client import Client
from kvpact.v1 import cache_pb2, router_pb2
from tests.factories.processes import module_argv, running, started_worker, wait_for_exit, wait_for_health
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import START_S, log_events, router_address, router_argv

PROMPTS = ("The quick brown fox", "日本語 and emoji 🙂")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))  # 2 layers


def args(model: Path, router: str, name: str, *extra: str) -> list[str]:
    return ["--model", str(model), "--model-name", name, "--router", router, "--worker-id", name,
            "--router-timeout", "30", "--max-model-len", "256", *extra]  # fmt: skip


def test_a_staged_worker_serves_the_same_greedy_tokens_as_a_one_device_worker(model: Path, tmp_path: Path):
    with running(
        router_argv("--paged-attn", "auto", "--expect-workers", "2"), name="router", log_dir=tmp_path
    ) as r:
        address = router_address(r)
        one = args(model, address, "one")
        staged = args(model, address, "staged", "--device-map", "cpu=1,cpu=1")
        with (
            started_worker(one, log_dir=tmp_path, name="one", wait_serving=False, timeout_s=START_S) as a,
            started_worker(
                staged, log_dir=tmp_path, name="staged", wait_serving=False, timeout_s=START_S
            ) as b,
        ):
            wait_for_health(address, START_S, watch=[r, a.handle, b.handle])
            with Client(address, timeout=30) as client:
                by_id = {w.worker_id: w for w in client.cluster_status().workers}
                assert all(w.state == router_pb2.WORKER_STATE_ADMITTED for w in by_id.values())
                assert by_id["staged"].realized.kind == cache_pb2.CACHE_KIND_EAGER
                assert [(p.device, p.num_layers) for p in by_id["staged"].requested.device_map] == [
                    ("cpu", 1),
                    ("cpu", 1),
                ]
                for prompt in PROMPTS:
                    got = {}
                    for name in ("one", "staged"):
                        chunks = list(
                            client.generate(
                                prompt, model=name, max_tokens=24, temperature=0.0, ignore_eos=True
                            )
                        )
                        assert chunks[-1].worker_id == name
                        got[name] = [t for c in chunks for t in c.token_ids]
                    assert len(got["one"]) == 24 and got["staged"] == got["one"], prompt
        stages = [e["stages"] for e in log_events(b.handle, "model_loaded")]
        assert stages == [["layers 0-0 on cpu", "layers 1-1 on cpu"]]


@pytest.mark.slow  # the same verdict in-process: tests/worker/test_stages.py
@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without CUDA")
def test_a_cuda_and_cpu_map_under_on_exits_78_naming_the_mixed_map_before_loading(
    model: Path, tmp_path: Path
):
    argv = ["--model", str(model), "--device-map", "cuda:0=1,cpu=1", "--paged-attn", "on",
            "--log-format", "json", "--listen", "127.0.0.1:0"]  # fmt: skip
    with running(module_argv("kvpact.worker", *argv), name="w-mixed", log_dir=tmp_path) as w:
        assert wait_for_exit(w, START_S) == 78
    assert "device mapping includes CPU and PagedAttention has no CPU KV cache" in w.output()
    assert not log_events(w, "model_loaded")
