"""shared/child_process.die_with_parent: the child runs as asked, dies with its parent, and starts safely
from a process whose other threads are inside gRPC (a worker leading tensor-parallel ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvpact.shared.child_process import die_with_parent
from tests.factories.eventually import eventually
from tests.factories.processes import alive


def test_the_child_keeps_its_pid_output_and_exit_code():
    code = "import os, sys; print(os.getpid(), sys.argv[1:]); sys.exit(3)"
    child = subprocess.Popen(
        die_with_parent([sys.executable, "-c", code, "a b", "c"]), stdout=subprocess.PIPE
    )
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 3
    pid, args = out.decode().split(" ", 1)
    assert (int(pid), args.strip()) == (child.pid, "['a b', 'c']")  # exec'd in the process Popen started


def test_a_child_is_killed_when_its_parent_is_killed():
    parent_code = (
        "import subprocess, sys, time\n"
        "from kvpact.shared.child_process import die_with_parent\n"
        "child = subprocess.Popen(die_with_parent(['sleep', '60']))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        # the trampoline has exec'd sleep once it shows as sleep: the signal is set by then
        eventually(
            lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"), 10, "sleep exec'd"
        )
        parent.kill()
        parent.wait(10)
        eventually(lambda: not alive(child), 10, f"child {child} gone after its parent's SIGKILL")
    finally:
        parent.kill()
        parent.wait(10)
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


# Run in a process of its own: this suite switches gRPC's fork handlers off (tests/conftest.py), and the
# trampoline has to hold with them on (an operator's GRPC_ENABLE_FORK_SUPPORT, a process that imported
# grpc before kvpact.deploy).
_STARTS_BESIDE_GRPC = """
import subprocess, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvpact.shared.child_process import die_with_parent

server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stop = threading.Event()

def call_until_stopped():
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

callers = [threading.Thread(target=call_until_stopped, daemon=True) for _ in range(4)]
for caller in callers:
    caller.start()
failed = 0
for _ in range(80):
    done = subprocess.run(die_with_parent(["true"]), capture_output=True, timeout=30)
    if done.returncode != 0:
        failed += 1
        print(done.returncode, done.stderr.decode(errors="replace")[-300:], flush=True)
stop.set()
for caller in callers:
    caller.join(15)
server.stop(0)
print(f"failed {failed} of 80", flush=True)
"""


def test_children_start_while_other_threads_call_into_grpc_with_its_fork_handlers_on():
    """With a preexec_fn (a fork, and gRPC's fork handlers run in the child) 0-4 of 40 starts aborted
    (SIGABRT, 'epoll_wait error: Bad file descriptor', grpc/grpc#43055), as a CI worker's tensor-parallel
    rank once did; the trampoline starts without them."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    done = subprocess.run(
        [sys.executable, "-c", _STARTS_BESIDE_GRPC], capture_output=True, env=env, timeout=240
    )
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert out.strip().endswith("failed 0 of 80"), out[-2000:]
