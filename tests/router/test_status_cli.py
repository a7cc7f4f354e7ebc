"""`router status`: the table from a running router, JSON, --watch, and exit codes scripts can use."""

import json
import signal

import grpc

from kvpact.v1 import worker_pb2_grpc
from tests.factories.processes import free_port, module_argv, running, stop, wait_for_exit, wait_for_line
from tests.router.background import BackgroundLoop
from tests.router.doubles import WorkerDouble, ready, serving_double
from tests.router.test_cli import router_argv, started


def status(address: str, *args: str, tmp_path, name: str = "status"):
    """Run `router status` to its end; returns (exit code, stdout, stderr)."""
    argv = module_argv("kvpact.router", "status", "--address", address, *args)
    with running(argv, name=name, log_dir=tmp_path) as handle:
        code = wait_for_exit(handle, 30)
        return code, handle.stdout(), handle.stderr()


def test_exit_1_while_starting_then_0_with_the_table_once_serving(tmp_path):
    with BackgroundLoop() as bg, running(router_argv(), name="router", log_dir=tmp_path) as router:
        address = started(router)
        code, out, _ = status(address, tmp_path=tmp_path, name="starting")
        assert code == 1
        assert out.startswith("cluster STARTING  policy --paged-attn auto  workers 0/1 admitted")

        a = bg.enter(serving_double(WorkerDouble("a")))
        with grpc.insecure_channel(address) as channel:
            assert worker_pb2_grpc.RegistryStub(channel).Register(ready("a", a.address), timeout=5).admitted
        code, out, err = status(address, tmp_path=tmp_path, name="serving")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == "cluster SERVING  policy --paged-attn auto  workers 1/1 admitted"
        assert lines[1].split() == [
            "WORKER", "STATE", "MODEL", "ADDRESS", "DEVICE", "ASKED", "REALIZED", "CAPACITY", "FEATURES",
            "LOAD", "HEARTBEAT"
        ]  # fmt: skip
        assert lines[2].split()[:7] == ["a", "ADMITTED", "tiny", a.address, "cpu", "on", "PAGED"]

        code, out, _ = status(address, "--json", tmp_path=tmp_path, name="json")
        assert code == 0
        parsed = json.loads(out)
        assert parsed["state"] == "CLUSTER_STATE_SERVING"
        assert [w["worker_id"] for w in parsed["workers"]] == ["a"]
        assert parsed["workers"][0]["realized"]["kind"] == "CACHE_KIND_PAGED"

        argv = module_argv("kvpact.router", "status", "--address", address, "--watch", "0.2")
        with running(argv, name="watch", log_dir=tmp_path) as watch:
            wait_for_line(watch, r"^cluster SERVING", 10)
            wait_for_line(watch, r"^cluster SERVING.*\n(?:.*\n)*cluster SERVING", 10)
            assert stop(watch, sig=signal.SIGINT, grace_s=5) == 0
        assert stop(router, sig=signal.SIGTERM, grace_s=5) == 0


def test_no_router_there_exits_69_saying_where_it_looked(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    code, out, err = status(address, "--timeout", "2", tmp_path=tmp_path)
    assert code == 69
    assert out == ""
    assert f"router status: no answer from the router at {address} (UNAVAILABLE" in err
    assert "Traceback" not in err


def test_bad_flags_exit_2():
    import subprocess

    out = subprocess.run(
        module_argv("kvpact.router", "status", "--watch", "0"), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    assert "expected a number of seconds > 0, got '0'" in out.stderr


def test_a_router_that_wants_an_api_key_gets_it_from_api_key_file(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("k-123\n")
    argv = router_argv("--api-key-file", str(keys))
    with running(argv, name="router", log_dir=tmp_path) as router:
        address = started(router)
        code, out, err = status(address, tmp_path=tmp_path, name="no-key")
        assert code == 77 and out == ""
        assert f"router status: the router at {address} refused the call (UNAUTHENTICATED" in err
        assert "--api-key-file" in err
        code, out, _ = status(address, "--api-key-file", str(keys), tmp_path=tmp_path, name="key")
        assert code == 1  # answered: still STARTING (no worker)
        assert out.startswith("cluster STARTING")
