"""Rank 0's side of a tensor-parallel worker: spawn ranks 1..N-1, join them in one gloo group, lead
their steps, and never leave one running alone.

NOTE: every collective (a step's message and the forward's all-reduces, or an idle keepalive) runs
under `lock`, so the ranks see them in the same order. A rank that exits while the worker runs takes
the worker down at once (exit 1, naming the rank), after stopping the others; each follower exits
when rank 0's process is gone (it watches its parent). Outside Ray only: the worker spawns the ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.parallel import step_message
from kvpact.worker.parallel.step_message import KEEPALIVE, StepMessage

log = structlog.get_logger(__name__)

# Joining, the wait while every rank loads its weights, and any one collective (a rank alive but stuck).
# A rank that exits is seen at once by its watcher, whatever this says.
GROUP_TIMEOUT = timedelta(minutes=30)
KEEPALIVE_S = 10.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankGroup:
    def __init__(self, world: int, procs: list[subprocess.Popen[bytes]]) -> None:
        self.world, self.procs = world, procs
        self.lock = threading.Lock()
        self.closing = False
        self.last = time.monotonic()
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"rank-{rank}").start()

    @classmethod
    def start(cls, world: int, follower_args: list[str]) -> RankGroup:
        """Spawn ranks 1..world-1 (`python -m kvpact.worker.parallel.follower ... follower_args`) and join
        them; raises RuntimeError naming the rank that did not join."""
        address = f"127.0.0.1:{free_port()}"
        threads = max(1, (os.cpu_count() or 1) // world)
        procs = []
        for rank in range(1, world):
            argv = [sys.executable, "-m", "kvpact.worker.parallel.follower", "--rank", str(rank),
                    "--world", str(world), "--address", address, "--parent", str(os.getpid()),
                    "--threads", str(threads), *follower_args]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        log.info("tensor-parallel ranks started", world=world, pids=[p.pid for p in procs], address=address)
        group = cls(world, procs)  # watching the ranks from here on: one that exits stops the worker
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://{address}", rank=0, world_size=world, timeout=GROUP_TIMEOUT
            )
        except Exception as e:
            group.close()
            raise RuntimeError(f"--tensor-parallel-size {world}: the ranks did not join ({e})") from e
        atexit.register(group.close)
        threading.Thread(target=group._keepalive, daemon=True, name="rank-keepalive").start()
        return group

    def ready(self) -> None:
        """Wait until every rank has built its shard and cache (a rank that failed: RuntimeError)."""
        try:
            with self.lock:
                dist.barrier()
        except Exception as e:
            self.close()
            raise RuntimeError(
                f"--tensor-parallel-size {self.world}: a rank failed while loading ({e})"
            ) from e

    @staticmethod
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    @contextlib.contextmanager
    def lead(self, input_ids: list[int], chunks: list[ScheduledChunk], num_decodes: int) -> Iterator[None]:
        """Hold the group for one step: tell the ranks what to run; inside, the forward (its all-reduces)."""
        message = StepMessage(
            input_ids, [(c.seq.slot or 0, c.start, c.num_tokens) for c in chunks], num_decodes
        )
        with self.lock:
            step_message.send(message)
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

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
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
