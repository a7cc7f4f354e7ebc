"""The worker's metrics as recorded from a real engine's requests (worker/metrics.py)."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpact.shared.errors import RequestError
from kvpact.shared.intent import PagedAttentionMode
from kvpact.v1 import generation_pb2, worker_pb2_grpc
from kvpact.worker.metrics import WorkerMetrics
from tests.factories.processes import running, started_worker, wait_for_exit, wait_for_line, worker_argv
from tests.worker.conftest import greedy
from tests.worker.test_process import RecordingRegistry, serving


def samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def test_values_follow_the_requests_an_engine_runs(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, "on", block_size=4, context_tokens=256)
    metrics = WorkerMetrics("w1", PagedAttentionMode.ON)
    before = samples(metrics)
    assert value(before, "kvpact_worker_state", state="loading") == 1.0
    assert ("kvpact_worker_requests_running", ()) not in before  # no engine yet
    metrics.attach(engine, "tiny")
    metrics.set_state("serving")

    prefix = tuple(range(10, 26))  # 16 tokens = 4 full blocks, cached after the first request
    engine.run([greedy("a", (*prefix, 1, 2), max_tokens=5)], timeout=60)
    engine.run([greedy("b", (*prefix, 3, 4), max_tokens=7)], timeout=60)
    with pytest.raises(RequestError):
        engine.run([greedy("c", tuple(range(300)), max_tokens=5)], timeout=60)

    found = samples(metrics)
    assert value(found, "kvpact_worker_state", state="serving") == 1.0
    assert value(found, "kvpact_worker_info", worker_id="w1", model="tiny") == 1.0
    contract = {"requested": "on", "realized_kind": "paged", "backend": "torch"}
    assert value(found, "kvpact_worker_paged_attention", **contract) == 1.0
    assert value(found, "kvpact_worker_requests_total", outcome="length") == 2.0
    assert value(found, "kvpact_worker_requests_total", outcome="rejected") == 1.0
    assert value(found, "kvpact_worker_requests_total", outcome="error") == 0.0
    assert value(found, "kvpact_worker_prompt_tokens_total") == 36.0
    assert value(found, "kvpact_worker_generation_tokens_total") == 12.0
    assert value(found, "kvpact_worker_prefix_cache_queries_total") == 36.0
    assert value(found, "kvpact_worker_prefix_cache_hits_total") == 16.0  # b reused a's 4 blocks
    assert value(found, "kvpact_worker_time_to_first_token_seconds_count") == 2.0
    assert value(found, "kvpact_worker_inter_token_latency_seconds_count") == 4.0 + 6.0
    assert value(found, "kvpact_worker_request_duration_seconds_count") == 2.0
    assert value(found, "kvpact_worker_request_queue_seconds_count") == 2.0
    assert value(found, "kvpact_worker_time_to_first_token_seconds_sum") > 0.0
    assert value(found, "kvpact_worker_requests_running") == 0.0
    assert value(found, "kvpact_worker_requests_waiting") == 0.0
    total = value(found, "kvpact_worker_kv_total_blocks")
    assert total == 64.0
    # finished sequences keep their blocks only as cached (free, evictable) blocks
    assert value(found, "kvpact_worker_kv_free_blocks") == total
    assert value(found, "kvpact_worker_kv_usage_ratio") == 0.0
    assert value(found, "kvpact_worker_preemptions_total") == 0.0


def test_fallbacks_are_counted_by_component(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, "auto")  # auto on CPU: eager, one fallback from the device check
    metrics = WorkerMetrics("w2", PagedAttentionMode.AUTO)
    metrics.attach(engine, "tiny")
    found = samples(metrics)
    assert value(found, "kvpact_worker_paged_attention_fallbacks_total", component="device") == 1.0
    contract = {"requested": "auto", "realized_kind": "eager", "backend": ""}
    assert value(found, "kvpact_worker_paged_attention", **contract) == 1.0
    assert ("kvpact_worker_prefix_cache_queries_total", ()) in found
    engine.run([greedy("a", (5, 6, 7), max_tokens=3)], timeout=60)
    found = samples(metrics)
    assert value(found, "kvpact_worker_prefix_cache_queries_total") == 0.0  # no prefix cache when eager
    assert value(found, "kvpact_worker_requests_total", outcome="length") == 1.0


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_running_worker_serves_metrics_that_move_as_requests_run(tiny_llama, tmp_path):
    registry = RecordingRegistry()
    with serving(registry) as router:
        args = ["--model", str(tiny_llama), "--paged-attn", "on", "--metrics-port", "0", "--router", router]
        with started_worker([*args, "--worker-id", "w-m"], log_dir=tmp_path) as worker:
            url = wait_for_line(worker.handle, r"^worker w-m metrics on (http://\S+/metrics)$", 10).group(1)
            before = scrape(url)
            assert value(before, "kvpact_worker_state", state="serving") == 1.0
            contract = {"requested": "on", "realized_kind": "paged", "backend": "torch"}
            assert value(before, "kvpact_worker_paged_attention", **contract) == 1.0
            assert value(before, "kvpact_worker_requests_total", outcome="length") == 0.0
            with grpc.insecure_channel(worker.address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                request = generation_pb2.GenerateRequest(
                    token_ids={"ids": [5, 6, 7]}, max_tokens=6, ignore_eos=True
                )
                chunks = list(stub.Generate(request, timeout=30))
            assert sum(len(c.token_ids) for c in chunks) == 6
            after = scrape(url)
    assert value(after, "kvpact_worker_requests_total", outcome="length") == 1.0
    assert value(after, "kvpact_worker_generation_tokens_total") == 6.0
    assert value(after, "kvpact_worker_prompt_tokens_total") == 3.0
    assert value(after, "kvpact_worker_time_to_first_token_seconds_count") == 1.0
    assert value(after, "kvpact_worker_inter_token_latency_seconds_count") == 5.0
    # the router learns where to scrape it
    assert registry.handshakes[-1].metrics_address == url.removeprefix("http://").removesuffix("/metrics")


def test_a_metrics_port_in_use_exits_1_naming_the_flag(tiny_llama, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = worker_argv("--model", str(tiny_llama), "--metrics-port", str(port), "--worker-id", "w-busy")
        with running(argv, log_dir=tmp_path) as worker:
            assert wait_for_exit(worker, 60) == 1
    assert (
        f"worker w-busy: --metrics-port 127.0.0.1:{port}: cannot bind (the port is in use" in worker.stderr()
    )
    assert "Traceback" not in worker.stderr()
