"""`router --report-file`: the JSON the router keeps about itself (router/report_file.py) through a start,
SERVING, a failure, and a drain that repeated SIGTERMs do not cut short."""

import json
import signal
import threading

import grpc

from kvpact.client import Client
from kvpact.v1 import worker_pb2_grpc
from tests.factories.eventually import eventually
from tests.factories.processes import module_argv, running, wait_for_exit
from tests.router.background import BackgroundLoop
from tests.router.doubles import WorkerDouble, failed, ready, serving_double

TRITON_REASON = "the Triton paged backend needs a CUDA device and this worker runs on cpu"


def report(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def router_argv(path, *args):
    return module_argv(
        "kvpact.router", "--listen", "127.0.0.1:0", "--log-format", "json", "--report-file", str(path), *args
    )


def test_the_report_follows_the_router_from_listening_to_serving_to_stopping(tmp_path):
    path = tmp_path / "report.json"
    argv = router_argv(path, "--expect-workers", "1", "--drain-timeout", "30")
    with BackgroundLoop() as bg, running(argv, name="router", log_dir=tmp_path) as router:
        eventually(lambda: report(path).get("address"), 15, "the router's address in its report")
        first = report(path)
        assert first["state"] == "starting" and first["exit_code"] is None
        address = first["address"]
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")  # the bound port
        a = bg.enter(serving_double(WorkerDouble("a", delay_s=0.1)))
        with grpc.insecure_channel(address) as channel:
            assert worker_pb2_grpc.RegistryStub(channel).Register(ready("a", a.address), timeout=5).admitted
        eventually(lambda: report(path).get("state") == "serving", 5, "serving in the report")
        [worker] = report(path)["cluster_status"]["workers"]
        assert worker["workerId"] == "a" and worker["state"] == "WORKER_STATE_ADMITTED"
        # A 3 s stream in flight, then SIGTERM twice (`ray job stop` signals the router, then kvpact-launch
        # does, in order): one drain, and the stream finishes.
        chunks = []
        with Client(address, timeout=30) as client:
            stream = threading.Thread(target=lambda: chunks.extend(client.generate("hi", max_tokens=30)))
            stream.start()
            eventually(lambda: chunks, 5, "the stream's first token")
            router.popen.send_signal(signal.SIGTERM)
            eventually(lambda: report(path).get("state") == "stopping", 5, "stopping in the report")
            router.popen.send_signal(signal.SIGTERM)
            stream.join(15)
        # every token once, in order, however the router merged them for a client that fell behind (chunk
        # boundaries are not part of the contract); the double's tokens for "hi" are 2, 3, ...
        assert [t for c in chunks for t in c.token_ids] == list(range(2, 32))
        assert chunks[-1].finish_reason == "length"
        assert wait_for_exit(router, 15) == 0
    assert "router_already_draining" in router.stderr()


def test_a_failed_start_leaves_its_cause_exit_code_and_report(tmp_path):
    path = tmp_path / "report.json"
    argv = router_argv(path, "--paged-attn", "on", "--expect-workers", "1", "--failed-linger", "0.5")
    with running(argv, name="router", log_dir=tmp_path) as router:
        eventually(lambda: report(path).get("address"), 15, "the router's address in its report")
        with grpc.insecure_channel(report(path)["address"]) as channel:
            worker_pb2_grpc.RegistryStub(channel).Register(failed("b", TRITON_REASON), timeout=5)
        assert wait_for_exit(router, 10) == 78
    final = report(path)
    assert final["state"] == "failed" and final["exit_code"] == 78
    assert final["cause"].startswith('worker "b" was refused while the cluster was starting')
    assert final["report"].startswith("kvpact router: the cluster FAILED to start (--paged-attn on")
    assert final["report"] in router.stderr()  # the same report it printed
