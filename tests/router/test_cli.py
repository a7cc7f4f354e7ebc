"""The `router` process: flags, exit codes, the one failure report, health, metrics. Workers are
real Worker servers on loopback (WorkerDouble) hosted in a background loop."""

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest

from kvpact.client import Client
from kvpact.router.cli import build_parser
from kvpact.shared.features import FeatureMode, FeatureState
from kvpact.v1 import worker_pb2_grpc
from tests.factories.processes import (
    free_port,
    health_status,
    module_argv,
    running,
    stop,
    wait_for_exit,
    wait_for_line,
)
from tests.router.background import BackgroundLoop
from tests.router.doubles import (
    PAGED_ATTN_REALIZED,
    WorkerDouble,
    failed,
    paged_realized,
    ready,
    serving_double,
)

ROUTER_LISTENING = r"^router listening on (\S+)$"
TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"


def router_argv(*args):
    return module_argv("kvpact.router", "--listen", "127.0.0.1:0", "--log-format", "json", *args)


def started(handle, timeout_s=15.0):
    return wait_for_line(handle, ROUTER_LISTENING, timeout_s).group(1)


def test_router_exits_78_within_2s_of_a_worker_that_cannot_honor_on(tmp_path):
    # The third worker never comes: the router waits for it in FAILED no longer than --failed-linger.
    argv = router_argv("--paged-attn", "on", "--expect-workers", "3", "--failed-linger", "0.5")
    with BackgroundLoop() as bg, running(argv, name="router", log_dir=tmp_path) as router:
        address = started(router)
        a = bg.enter(serving_double(WorkerDouble("a")))
        with grpc.insecure_channel(address) as channel:
            registry = worker_pb2_grpc.RegistryStub(channel)
            assert registry.Register(ready("a", a.address), timeout=5).admitted
            sent = time.monotonic()
            admission = registry.Register(failed("b", TRITON_REASON), timeout=5)
        assert not admission.admitted and TRITON_REASON in admission.reason
        assert wait_for_exit(router, 5) == 78
        assert time.monotonic() - sent < 2.0
        assert a.shutdown_reasons, "worker a was not told to shut down"
        stderr = router.stderr()
        assert (
            stderr.count("kvpact router: the cluster FAILED to start (--paged-attn on, --expect-workers 3")
            == 1
        )
        report = stderr[stderr.index("kvpact router: the cluster FAILED") :]
        assert 'worker "a" at ' in report and 'worker "b" at (no address)' in report
        assert f"failed:    (paged-attention-required) [device] {TRITON_REASON}" in report
        assert "exit code 78: the --paged-attn policy cannot be honored by every worker" in report


def test_health_is_not_serving_while_starting_then_serving(tmp_path):
    with (
        BackgroundLoop() as bg,
        running(router_argv("--paged-attn", "on"), name="router", log_dir=tmp_path) as router,
    ):
        address = started(router)
        assert health_status(address) == "NOT_SERVING"
        assert health_status(address, "kvpact.v1.Generation") == "NOT_SERVING"
        a = bg.enter(serving_double(WorkerDouble("a")))
        with grpc.insecure_channel(address) as channel:
            assert worker_pb2_grpc.RegistryStub(channel).Register(ready("a", a.address), timeout=5).admitted
        assert health_status(address) == "SERVING"
        assert health_status(address, "kvpact.v1.Generation") == "SERVING"
        assert stop(router, sig=signal.SIGTERM, grace_s=5) == 0


def test_startup_timeout_exits_1_naming_who_is_missing(tmp_path):
    argv = router_argv("--expect-workers", "2", "--startup-timeout", "1")
    with BackgroundLoop() as bg, running(argv, name="router", log_dir=tmp_path) as router:
        address = started(router)
        a = bg.enter(serving_double(WorkerDouble("a")))
        with grpc.insecure_channel(address) as channel:
            assert worker_pb2_grpc.RegistryStub(channel).Register(ready("a", a.address), timeout=5).admitted
        assert wait_for_exit(router, 10) == 1
        assert '1 of 2 workers admitted: 1 missing (registered: "a")' in router.stderr()
        assert a.shutdown_reasons


def test_metrics_show_each_workers_realized_kind(tmp_path):
    port = free_port()
    with (
        BackgroundLoop() as bg,
        running(router_argv("--metrics-port", str(port)), name="router", log_dir=tmp_path) as router,
    ):
        address = started(router)
        a = bg.enter(serving_double(WorkerDouble("a")))
        with grpc.insecure_channel(address) as channel:
            worker_pb2_grpc.RegistryStub(channel).Register(ready("a", a.address), timeout=5)
        with Client(address, timeout=10) as client:
            assert client.complete("abc", max_tokens=4).token_ids == (3, 4, 5, 6)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert (
        'kvpact_router_worker_realized{backend="torch",model="tiny",realized_kind="paged",worker_id="a"} 1.0'
        in text
    )
    assert 'kvpact_router_workers{realized_kind="paged",state="admitted"} 1.0' in text
    assert 'kvpact_router_cluster_state{state="serving"} 1.0' in text
    assert 'kvpact_router_requests_total{api="grpc",code="OK",model="tiny"} 1.0' in text
    assert 'kvpact_router_tokens_total{api="grpc",model="tiny"} 4.0' in text
    # client-side latency: one first token, three gaps between the four one-token chunks, one request
    assert 'kvpact_router_time_to_first_token_seconds_count{api="grpc",model="tiny"} 1.0' in text
    assert 'kvpact_router_inter_token_latency_seconds_count{api="grpc",model="tiny"} 3.0' in text
    assert 'kvpact_router_request_duration_seconds_count{api="grpc",model="tiny"} 1.0' in text


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_either_event_loop_serves_streams(tmp_path, loop):
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop comes with the dev extra (make venv)")
    with (
        BackgroundLoop() as bg,
        running(router_argv("--event-loop", loop), name="router", log_dir=tmp_path) as router,
    ):
        address = started(router)
        a = bg.enter(serving_double(WorkerDouble("a")))
        with grpc.insecure_channel(address) as channel:
            assert worker_pb2_grpc.RegistryStub(channel).Register(ready("a", a.address), timeout=5).admitted
        with Client(address, timeout=10) as client:
            chunks = list(client.generate("abc", max_tokens=50))
        assert [t for c in chunks for t in c.token_ids] == list(range(3, 53))
        assert stop(router, sig=signal.SIGTERM, grace_s=5) == 0


def test_event_loop_uvloop_where_it_is_missing_is_a_config_error(monkeypatch):
    import importlib.util

    from kvpact.shared.errors import ConfigError
    from kvpact.shared.event_loop import loop_factory

    assert loop_factory("asyncio") is None
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "uvloop" else real_find_spec(name)
    )
    with pytest.raises(ConfigError, match=r"--event-loop uvloop \(the default\): uvloop is not installed"):
        loop_factory("uvloop")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--event-loop", "tokio"], "argument --event-loop: invalid choice: 'tokio'"),
        (["--auth-token-file", "/nonexistent/token"], "--auth-token-file /nonexistent/token: cannot read it"),
        (["--expect-workers", "0"], "argument --expect-workers: expected a whole number > 0"),
        (["--listen", "nowhere"], "expected HOST:PORT"),
        (["--metrics-port", "70000"], "expected a port in [1, 65535], got '70000'"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args, message):
    out = subprocess.run(module_argv("kvpact.router", *args), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert message in out.stderr


@pytest.mark.parametrize("flag", ["--listen", "--metrics-port"])
def test_a_port_in_use_exits_1_with_one_line_naming_the_flag(flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = f"127.0.0.1:{port}" if flag == "--listen" else str(port)
        out = subprocess.run(router_argv(flag, value), capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stderr
    assert f"router: {flag} 127.0.0.1:{port}: cannot bind (the port is in use" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("flag", ["--startup-timeout", "--heartbeat-interval", "--heartbeat-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "soon"])
def test_a_duration_must_be_a_finite_positive_number(flag, value, capsys):
    """nan and inf would make the startup timer or the heartbeat monitor never fire."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([flag, value])
    assert exc.value.code == 2
    assert f"expected a number of seconds > 0, got '{value}'" in capsys.readouterr().err


def test_the_console_script_is_installed():
    script = re.sub(r"python[0-9.]*$", "router", sys.executable)
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--expect-workers" in out.stdout and "78" in out.stdout


def test_a_late_worker_failing_a_feature_policy_is_refused_and_metrics_show_every_feature(tmp_path):
    """`router --policy cuda-graphs=on`: "a" realized graphs and is admitted; "b" (no CUDA) joins after the
    start and is refused alone, the cluster keeps serving; /metrics counts features and fallbacks."""
    port = free_port()
    argv = router_argv("--policy", "cuda-graphs=on", "--metrics-port", str(port))
    graphs = FeatureState("cuda-graphs", FeatureMode.AUTO, True)
    no_cuda = FeatureState(
        "cuda-graphs", FeatureMode.AUTO, False, "no-cuda-device", "no CUDA device", "device"
    )
    with (
        BackgroundLoop() as bg,
        running(argv, name="router", log_dir=tmp_path) as router,
    ):
        address = started(router)
        a = bg.enter(serving_double(WorkerDouble("a")))
        b = bg.enter(serving_double(WorkerDouble("b")))
        with grpc.insecure_channel(address) as channel:
            registry = worker_pb2_grpc.RegistryStub(channel)
            assert registry.Register(
                ready("a", a.address, replace(paged_realized(), features=(PAGED_ATTN_REALIZED, graphs))),
                timeout=5,
            ).admitted
            refused = registry.Register(
                ready("b", b.address, replace(paged_realized(), features=(PAGED_ATTN_REALIZED, no_cuda))),
                timeout=5,
            )
        assert not refused.admitted
        assert refused.reason == (
            "the cluster policy is --policy cuda-graphs=on and it realized cuda-graphs off under "
            "--cuda-graphs auto because [device] no-cuda-device: no CUDA device"
        )
        with Client(address, timeout=10) as client:
            assert client.complete("abc", max_tokens=4).token_ids == (3, 4, 5, 6)  # still serving
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvpact_worker_feature_realized{feature="cuda-graphs",realized="on",requested="auto"} 1.0' in text
    assert 'kvpact_worker_feature_realized{feature="cuda-graphs",realized="off",requested="auto"} 1.0' in text
    assert 'kvpact_worker_fallbacks_total{feature="cuda-graphs",reason="no-cuda-device"} 1.0' in text
    assert "late_worker_refused" in router.stderr()
