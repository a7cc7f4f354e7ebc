"""Process helpers for tests that start real routers and workers on loopback.

The general pieces (start, stop by pid, bounded waits, health polling) live in deploy/processes.py,
which `make serve` uses too; this module re-exports them and adds what tests want: argv builders that
run the code under test with this interpreter, and context managers that always clean up.

    with started_worker(["--model", str(model_dir)], log_dir=tmp_path) as worker:
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))

Every wait is bounded; every process is stopped by its pid (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvpact.deploy.processes import (
    ProcessDied,
    ProcessHandle,
    free_port,
    health_status,
    running,
    start_process,
    stop,
    wait_for_exit,
    wait_for_health,
    wait_for_line,
)

__all__ = [
    "ProcessDied",
    "ProcessHandle",
    "RunningWorker",
    "free_port",
    "health_status",
    "module_argv",
    "running",
    "start_process",
    "started_worker",
    "stop",
    "wait_for_exit",
    "wait_for_health",
    "wait_for_line",
    "worker_argv",
]

T = TypeVar("T")

# What a worker prints on stdout once its gRPC server is bound (before the model is loaded).
WORKER_LISTENING = r"^worker \S+ listening on (\S+)$"
# Cold start of a worker: torch import, a tiny model, the cache. Generous for a loaded 2-core CI box.
WORKER_START_TIMEOUT_S = 60.0


def alive(pid: int) -> bool:
    """The process `pid` exists and has not exited (a zombie, exited but not yet reaped, is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def module_argv(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter (no console script needed)."""
    return [sys.executable, "-m", module, *args]


def worker_argv(*args: str) -> list[str]:
    """A `worker` command line; defaults that keep tests quiet and local are added unless given."""
    argv = list(args)
    if "--log-format" not in argv:
        argv += ["--log-format", "json"]
    if "--listen" not in argv:
        argv += ["--listen", "127.0.0.1:0"]
    return module_argv("kvpact.worker", *argv)


@dataclass(slots=True)
class RunningWorker:
    handle: ProcessHandle
    address: str  # HOST:PORT its Worker service listens on


@contextmanager
def started_worker(
    args: Sequence[str],
    *,
    log_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "worker",
    wait_serving: bool = True,
    timeout_s: float = WORKER_START_TIMEOUT_S,
) -> Iterator[RunningWorker]:
    """Start a worker, read its address from stdout and (by default) wait until its health is
    SERVING. Stopped by pid on the way out."""
    with running(worker_argv(*args), name=name, env=env, log_dir=log_dir) as handle:
        address = wait_for_line(handle, WORKER_LISTENING, timeout_s).group(1)
        if wait_serving:
            wait_for_health(address, timeout_s, watch=[handle])
        yield RunningWorker(handle, address)
