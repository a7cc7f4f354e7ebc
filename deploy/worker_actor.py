"""The Ray actor that runs one kvpact worker in its placement-group bundle.

The actor does not run the worker in its own process: it starts the `worker` CLI itself
(`python -m kvpact.worker FLAGS`, this interpreter) as its child, and reports on it. Why a child:

- It is the same code as the CLI, byte for byte: flags parsed by the same parser, the same startup
  sequence (kvpact.worker.process), the same handshake, reasons and exit codes. An exit code is what the
  launcher needs to tell "stopped on request" (0) from "cannot honor the policy" (78) from "broken" (1).
- The worker owns its process: it installs SIGINT/SIGTERM handlers on its event loop (only possible in a
  main thread; actor methods may run elsewhere), runs the model in daemon threads, and may end with
  os._exit (a worker stopped mid-load). Inside an actor each of these would break or kill the actor.
- The GPUs stay Ray's: the child inherits the actor's environment, where Ray set CUDA_VISIBLE_DEVICES to
  the GPUs of this bundle; nothing else picks devices.
- Nothing outlives the actor: the child is started with a parent-death signal (prctl PR_SET_PDEATHSIG,
  SIGKILL), so when Ray kills the actor (teardown, the launcher's death: actors are never detached, so
  they share the driver's fate) the worker dies with it. The actor's methods run one at a time (default
  concurrency), in the thread that started the child, which lives as long as the actor.

Output goes to files in a directory on the actor's node (named by `placement()`); `output()` returns their
tail. This module does not import ray at import time: the launcher wraps the class with `ray.remote`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from kvpact.deploy.processes import ProcessHandle, start_process, stop

STOP_GRACE_S = 10.0


class WorkerActor:
    """One worker slot. `start` (re)starts the worker process; `poll`, `output` and `stop` follow it."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"kvpact-{worker_id}-"))
        self.handle: ProcessHandle | None = None
        self.num_starts = 0

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

    def start(self, argv: list[str], auth_token: str | None = None) -> int:
        """Start `worker ARGV` (its previous process, if any, must have exited); return its pid. With
        `auth_token`, the token is written to a private file on this node and passed as --auth-token-file."""
        if self.handle is not None and self.handle.returncode is None:
            raise RuntimeError(f"worker {self.worker_id} is still running (pid {self.handle.pid})")
        argv = list(argv)
        if auth_token is not None:
            argv += ["--auth-token-file", str(self._write_token(auth_token))]
        self.num_starts += 1
        self.handle = start_process(
            [sys.executable, "-m", "kvpact.worker", *argv],
            name=f"{self.worker_id}.{self.num_starts}",
            log_dir=self.log_dir,
            die_with_parent=True,
        )
        return self.handle.pid

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
