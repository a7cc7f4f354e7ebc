"""Rank 0's side of a tensor-parallel worker: spawn ranks 1..N-1, join them in one gloo group, lead
their steps, and never leave one running alone.

NOTE: every collective (a step's message and the forward's all-reduces, or an idle keepalive) runs
under `lock`, so the ranks see them in the same order. A rank that exits while the worker runs takes
the worker down at once (exit 1, naming the rank), after stopping the others. A follower dies with
rank 0's process (the kernel's parent-death signal, and its own watch of its parent). Outside Ray only:
the worker spawns the ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from kvpact.shared.child_process import parent_death_signal
from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.parallel import step_message
from kvpact.worker.parallel.step_message import KEEPALIVE, StepMessage

log = structlog.get_logger(__name__)

# Joining, the wait while every rank loads its weights, and any one collective (a rank alive but stuck).
# A rank that exits is seen at once by its watcher, whatever this says.
GROUP_TIMEOUT = timedelta(minutes=30)
KEEPALIVE_S = 10.0


class RankGroup:
    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lock = threading.Lock()
        self.closing = False
        self.last = time.monotonic()

    @classmethod
    def start(cls, world: int, follower_args: list[str], threads: int | None = None) -> RankGroup:
        """Spawn ranks 1..world-1 (`python -m kvpact.worker.parallel.follower ... follower_args`), each with
        `threads` // world torch threads (None: the CPUs this process may use), and join them; raises
        RuntimeError when they do not join."""
        address = f"127.0.0.1:{_free_port()}"
        threads = max(1, (threads or len(os.sched_getaffinity(0))) // world)
        group = cls(world)
        for rank in range(1, world):
            argv = [sys.executable, "-m", "kvpact.worker.parallel.follower", "--rank", str(rank),
                    "--world", str(world), "--address", address, "--parent", str(os.getpid()),
                    "--threads", str(threads), *follower_args]  # fmt: skip
            group._spawn(rank, argv)
        pids = [p.pid for p in group.procs]
        log.info("tensor-parallel ranks started", world=world, pids=pids, address=address)
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://{address}", rank=0, world_size=world, timeout=GROUP_TIMEOUT
            )
        except Exception as e:
            group.close()
            raise RuntimeError(f"--tensor-parallel-size {world}: the ranks did not join ({e})") from e
        atexit.register(group.close)
        return group

    def ready(self) -> None:
        """Wait until every rank has built its shard and cache (a rank that failed: RuntimeError), then
        keep the idle ranks' receives alive."""
        try:
            with self.lock:
                dist.barrier()
        except Exception as e:
            self.close()
            raise RuntimeError(
                f"--tensor-parallel-size {self.world}: a rank failed while loading ({e})"
            ) from e
        # Only now: a keepalive sent while a rank still loads would meet its barrier, not a receive.
        threading.Thread(target=self._keepalive, daemon=True, name="rank-keepalive").start()

    @staticmethod
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    @contextlib.contextmanager
    def lead(self, input_ids: list[int], chunks: list[ScheduledChunk], num_decodes: int) -> Iterator[None]:
        """Hold the group for one step: tell the ranks what to run; inside, the forward (its all-reduces)."""
        spans = [(c.seq.slot or 0, c.start, c.num_tokens) for c in chunks]
        with self.lock:
            step_message.send(StepMessage(input_ids, spans, num_decodes))
            yield
            self.last = time.monotonic()

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(Exception):
            if self.lock.acquire(timeout=5):
                step_message.send(None)
        _stop(self.procs)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _keepalive(self) -> None:
        while not self.closing:
            time.sleep(KEEPALIVE_S / 2)
            if time.monotonic() - self.last > KEEPALIVE_S and self.lock.acquire(timeout=1):
                try:
                    if not self.closing:
                        step_message.send(KEEPALIVE)
                        self.last = time.monotonic()
                except Exception:  # a rank is gone: its watcher stops the worker
                    return
                finally:
                    self.lock.release()

    def _spawn(self, rank: int, argv: list[str]) -> None:
        """Start rank `rank` from a thread that lives as long as the rank does: PR_SET_PDEATHSIG follows
        the spawning thread, so the kernel SIGKILLs the rank only when this process dies."""
        started = threading.Event()
        watcher = threading.Thread(
            target=self._watch, args=(rank, argv, started), daemon=True, name=f"rank-{rank}"
        )
        watcher.start()
        started.wait()

    def _watch(self, rank: int, argv: list[str], started: threading.Event) -> None:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=parent_death_signal())
        self.procs.append(proc)
        started.set()
        code = proc.wait()
        if self.closing:
            return
        self.closing = True
        print(
            f"worker: tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; the worker stops "
            f"with it (a worker never runs without all of its ranks)",
            file=sys.stderr,
            flush=True,
        )
        _stop(self.procs)
        os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
