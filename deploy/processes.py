"""Start, watch and stop kvpact processes (a router, workers) on this machine.

Used by `make serve` (deploy/local.py) and by the tests (tests/factories/processes.py). Every wait
is bounded in time; every process is stopped by its own pid (SIGTERM, then SIGKILL after a grace
period). Each process runs in a new session, so a Ctrl-C in the terminal reaches only the parent,
which then stops its children in order. Output goes to files, so a process that dies can be shown
with what it printed, and a chatty one can never block on a full pipe.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.shared.child_process import die_with_parent as die_with_parent_argv

POLL_INTERVAL_S = 0.05


class WaitCancelled(RuntimeError):
    """The caller's `cancel` event was set while we waited (a signal, another process exiting)."""


class ProcessDied(RuntimeError):
    """A process exited while we waited for it to become ready."""

    def __init__(self, handle: ProcessHandle) -> None:
        self.handle = handle
        super().__init__(
            f"{handle.name} (pid {handle.pid}) exited with code {handle.returncode}\n{handle.output()}"
        )


@dataclass(slots=True)
class ProcessHandle:
    """A started process. stdout/stderr are files under `log_dir`."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, or None while it runs (negative: killed by that signal)."""
        return self.popen.poll()

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def output(self, max_chars: int = 20_000) -> str:
        """stdout and stderr, labelled, each cut to its last `max_chars` characters."""
        parts = []
        for label, text in (("stdout", self.stdout()), ("stderr", self.stderr())):
            if text.strip():
                parts.append(f"--- {self.name} {label} ---\n{text[-max_chars:]}")
        return "\n".join(parts) or f"--- {self.name}: no output ---"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Prefer `--listen HOST:0` and reading the bound port back
    where the program supports it; this is for programs that need the number up front."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_process(
    argv: Sequence[str],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: str | Path | None = None,
    cwd: str | Path | None = None,
    die_with_parent: bool = False,
) -> ProcessHandle:
    """Start `argv` in a new session with stdout/stderr written to `<log_dir>/<name>.{stdout,stderr}`.

    `env` is added to (not substituted for) this process's environment. `log_dir` defaults to a new
    temporary directory. `die_with_parent` (Linux, shared/child_process.py): the process gets SIGKILL when
    the thread that started it ends, so a parent that is itself killed (a Ray actor, a launcher stopped
    with SIGKILL) leaves nothing behind; start it from a thread that lives as long as the parent (the main
    thread)."""
    name = name or Path(argv[0]).name
    directory = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvpact-"))
    directory.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = directory / f"{name}.stdout", directory / f"{name}.stderr"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        popen = subprocess.Popen(
            die_with_parent_argv(argv) if die_with_parent else list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
    return ProcessHandle(name, list(argv), popen, stdout_path, stderr_path)


def stop(handle: ProcessHandle, *, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> int:
    """Send `sig` to the process, wait up to `grace_s`, then SIGKILL it. Returns its exit code."""
    if handle.returncode is None:
        _signal(handle, sig)
        try:
            return handle.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal(handle, signal.SIGKILL)
    return handle.popen.wait(timeout=grace_s)


def _signal(handle: ProcessHandle, sig: int) -> None:
    try:
        os.kill(handle.pid, sig)
    except ProcessLookupError:  # exited between the poll and the kill
        pass


def wait_for_exit(handle: ProcessHandle, timeout_s: float) -> int:
    """The exit code, once it exits; TimeoutError (with its output) if it still runs after `timeout_s`."""
    try:
        return handle.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{handle.name} still running after {timeout_s:.0f}s\n{handle.output()}") from None


def wait_for_line(
    handle: ProcessHandle, pattern: str, timeout_s: float, *, stream: str = "stdout"
) -> re.Match[str]:
    """Wait until the process's stdout (or stderr) has a line matching `pattern`; return the match.
    Raises ProcessDied if it exits first, TimeoutError after `timeout_s`."""
    regex = re.compile(pattern, re.MULTILINE)
    read = handle.stdout if stream == "stdout" else handle.stderr
    deadline = time.monotonic() + timeout_s
    while True:
        match = regex.search(read())
        if match:
            return match
        if handle.returncode is not None:
            raise ProcessDied(handle)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{handle.name}: no line matching {pattern!r} after {timeout_s:.0f}s\n{handle.output()}"
            )
        time.sleep(POLL_INTERVAL_S)


def health_status(
    address: str,
    service: str = "",
    timeout_s: float = 5.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """One standard gRPC health check: "SERVING", "NOT_SERVING", ..., or "UNREACHABLE".
    `credentials`: TLS for a router that serves it (None = plaintext). The default timeout is for a check
    that asserts a state: a busy process on a loaded machine can take over a second to answer (a CI run
    read UNREACHABLE from a worker at 1 s); a closed port answers UNREACHABLE at once whatever it is."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return "UNREACHABLE" if exc.code() in _UNREACHABLE else exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def wait_for_health(
    address: str,
    timeout_s: float,
    *,
    service: str = "",
    watch: Sequence[ProcessHandle] = (),
    cancel: threading.Event | None = None,
) -> None:
    """Poll the health service at `address` until it answers SERVING.

    Raises ProcessDied as soon as any process in `watch` exits, WaitCancelled once `cancel` is set,
    TimeoutError (with the last status) after `timeout_s`."""
    cancel = cancel or threading.Event()
    deadline = time.monotonic() + timeout_s
    status = "UNREACHABLE"
    while time.monotonic() < deadline:
        for handle in watch:
            if handle.returncode is not None:
                raise ProcessDied(handle)
        status = health_status(address, service, timeout_s=min(1.0, max(0.05, deadline - time.monotonic())))
        if status == "SERVING":
            return
        if cancel.wait(POLL_INTERVAL_S):
            raise WaitCancelled(f"stopped waiting for {address} to serve")
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s (last health status: {status})")


@contextmanager
def running(
    argv: Sequence[str],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: str | Path | None = None,
    grace_s: float = 10.0,
) -> Iterator[ProcessHandle]:
    """`start_process`, and `stop` it on the way out whatever happens."""
    handle = start_process(argv, name=name, env=env, log_dir=log_dir)
    try:
        yield handle
    finally:
        stop(handle, grace_s=grace_s)
