"""The Ray actor that runs one kvpact worker in its placement-group bundle.

NOTE: the actor starts the `worker` CLI (`python -m kvpact.worker FLAGS`, this interpreter) as its child
and reports on it: the same code, flags, handshake and exit codes as the CLI, and a process the worker owns
(its signal handlers, its os._exit). Invariants:
- GPUs are Ray's: the child's CUDA_VISIBLE_DEVICES is exactly the GPU ids Ray assigned this actor, and ""
  (no GPU at all) for a bundle without GPUs. Ray 2.60 no longer sets it for an actor with num_gpus=0,
  which would otherwise see every GPU of its node. A tensor-parallel worker's bundle holds one GPU per
  rank: the worker keeps the first for rank 0 and gives rank r the r-th (worker/parallel/ranks.py).
- Nothing outlives the actor: the child gets a parent-death signal (SIGKILL) from the actor's main thread.
- Its output is kept in files on this node (`output()` returns their tail, for the launcher's failure
  report) and copied, line by line, to the actor's own stdout/stderr, which Ray streams to the driver
  (the job's logs) prefixed with this actor's repr, `WorkerActor(<worker id>)`.
Does not import ray at import time: the launcher wraps the class with `ray.remote`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from kvpact.deploy.processes import ProcessHandle, start_process, stop

PLAN_TIMEOUT_S = 120.0  # `worker --plan-only` on a busy node: Python, torch's import, the config and headers
OUTPUT_CHARS = 3000  # of a plan's stderr, kept for the verdict table's notes
STOP_GRACE_S = 10.0  # when the caller gives none; the launcher gives the worker's --drain-timeout + margin
FOLLOW_INTERVAL_S = 0.2


def visible_devices(gpu_ids: Sequence[object]) -> str:
    """CUDA_VISIBLE_DEVICES for a worker given `gpu_ids` by Ray: those ids, or "" (no GPU) for none."""
    return ",".join(str(i) for i in gpu_ids)


class WorkerActor:
    """One worker slot. `start` (re)starts the worker process; `poll`, `output` and `stop` follow it;
    `plan` runs its pre-load plan instead (kvpact-launch --plan)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"kvpact-{worker_id}-"))
        self.handle: ProcessHandle | None = None
        self.num_starts = 0

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return f"WorkerActor({self.worker_id})"

    def placement(self) -> dict[str, str]:
        """Where Ray put this actor: node id and IP (as Ray reports it), its GPUs, its log directory."""
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": ",".join(str(i) for i in ray.get_gpu_ids()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
            "log_dir": str(self.log_dir),
            "pid": str(os.getpid()),
        }

    def free_port(self, candidates: list[int]) -> int:
        """The first of `candidates` free on this node's `0.0.0.0` now, or 0 when none is (port_range)."""
        for port in candidates:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("0.0.0.0", port))
                except OSError:
                    continue
                return port
        return 0

    def start(self, argv: list[str], auth_token: str | None = None) -> int:
        """Start `worker ARGV` (its previous process, if any, must have exited); return its pid. With
        `auth_token`, the token is written to a private file on this node and passed as --auth-token-file."""
        import ray

        if self.handle is not None and self.handle.returncode is None:
            raise RuntimeError(f"worker {self.worker_id} is still running (pid {self.handle.pid})")
        argv = list(argv)
        if auth_token is not None:
            argv += ["--auth-token-file", str(self._write_token(auth_token))]
        self.num_starts += 1
        self.handle = start_process(
            [sys.executable, "-m", "kvpact.worker", *argv],
            name=f"{self.worker_id}.{self.num_starts}",
            env={"CUDA_VISIBLE_DEVICES": visible_devices(ray.get_gpu_ids())},
            log_dir=self.log_dir,
            die_with_parent=True,
        )
        for path, stream in ((self.handle.stdout_path, sys.stdout), (self.handle.stderr_path, sys.stderr)):
            threading.Thread(target=_follow, args=(self.handle, path, stream), daemon=True).start()
        return self.handle.pid

    def plan(self, argv: list[str], timeout_s: float = PLAN_TIMEOUT_S) -> dict[str, object]:
        """Run `worker ARGV --plan-only --json` here, with this bundle's GPUs, and wait for it (bounded):
        {"exit_code", "stdout", "stderr"} (exit_code None: it ran past `timeout_s` and was killed). No
        weight is read; the worker process of `start` is not involved."""
        import ray

        command = [sys.executable, "-m", "kvpact.worker", *argv, "--plan-only", "--json"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_devices(ray.get_gpu_ids())}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            return {"exit_code": None, "stdout": "", "stderr": err[-OUTPUT_CHARS:]}
        return {"exit_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-OUTPUT_CHARS:]}

    def poll(self) -> int | None:
        """The worker's exit code, or None while it runs (or before it was started)."""
        return None if self.handle is None else self.handle.returncode

    def output(self, max_chars: int = 4000) -> str:
        return "" if self.handle is None else self.handle.output(max_chars)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the worker (it exits 0 when asked), SIGKILL after `grace_s`; its exit code."""
        if self.handle is None:
            return None
        return stop(self.handle, grace_s=grace_s)

    def _write_token(self, token: str) -> Path:
        path = self.log_dir / "auth-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(token)
        return path


def _follow(handle: ProcessHandle, path: Path, stream: TextIO) -> None:
    """Copy `path`'s complete lines to `stream` as they are written, until the process has exited and
    every line is copied (Ray streams the actor's stdout/stderr to the driver)."""
    with open(path, "rb") as file:
        partial = b""
        while True:
            exited = handle.returncode is not None
            chunk = file.read()
            if chunk:
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    stream.write(line.decode(errors="replace") + "\n")
                stream.flush()
            elif exited:
                if partial:
                    stream.write(partial.decode(errors="replace") + "\n")
                    stream.flush()
                return
            else:
                time.sleep(FOLLOW_INTERVAL_S)
