"""Rank 0's side of a tensor-parallel worker: spawn ranks 1..N-1, join them in one gloo group, gather
their own pre-load verdicts, tell them what to build, lead their steps, and never leave one running alone.

NOTE: startup is four collectives in this order (follower.py mirrors them): the spec (`verdicts`), every
rank's verdict, the build (`build`), every rank's build outcome (`ready`). After that every collective
(a step's message and the forward's all-reduces, or an idle keepalive) runs under `lock`, so the ranks
see them in the same order. A rank that fails or exits while starting makes rank 0's startup fail naming
it (the worker reports it to the router); one that exits while the worker serves takes the worker down
at once (exit 1, naming the rank), after stopping the others. A follower dies with rank 0's process (the
kernel's parent-death signal, and its own watch of its parent). The worker spawns its ranks itself, also
under Ray (in its actor's bundle): with CUDA_VISIBLE_DEVICES listing one GPU per rank, rank r sees only
the r-th.
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
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    TCPStore,  # the public name (torch.distributed) is not exported to typing
)

from kvpact.shared.child_process import die_with_parent
from kvpact.shared.errors import ModelLoadError
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.loader.header import ModelHeader
from kvpact.worker.parallel import step_message
from kvpact.worker.parallel.rank_verdict import RankBuild, RankProblem, RankVerdict
from kvpact.worker.parallel.step_message import KEEPALIVE, StepMessage

log = structlog.get_logger(__name__)

# Joining, the wait while every rank loads its weights, and any one collective (a rank alive but stuck).
# A rank that exits is seen at once by its watcher, whatever this says.
GROUP_TIMEOUT = timedelta(minutes=30)
KEEPALIVE_S = 10.0
T = TypeVar("T")


class RankGroup:
    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lock = threading.Lock()
        self.closing = False
        self.serving = False  # every rank built and ready: from now on a rank's exit stops the worker
        self.exits: dict[int, tuple[int, int]] = {}  # rank -> (pid, exit code), seen while starting
        self.tails: dict[int, deque[str]] = {}  # rank -> its last stderr lines
        self.devices: list[str] = []  # each rank's device, once `verdicts` ran
        self.at_broadcast = True  # the other ranks wait for rank 0's broadcast (a stop can be sent)
        self.last = time.monotonic()

    @classmethod
    def start(cls, world: int, threads: int | None = None, visible: str | None = None) -> RankGroup:
        """Spawn ranks 1..world-1 (`python -m kvpact.worker.startup.follower`), each with `threads` // world
        torch threads (None: the CPUs this process may use), and join them; raises ModelLoadError naming a
        rank that exits first. `visible`: the worker's CUDA_VISIBLE_DEVICES as it started (claim_gpus)."""
        # The store is bound here on port 0 and handed to init_process_group: a port picked free and bound
        # later could be taken meanwhile by another process (rank 0's join then fails, the ranks with it).
        store = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        address = f"127.0.0.1:{store.port}"
        threads = max(1, (threads or len(os.sched_getaffinity(0))) // world)
        group = cls(world)
        for rank in range(1, world):
            argv = [sys.executable, "-m", "kvpact.worker.startup.follower", "--rank", str(rank),
                    "--world", str(world), "--address", address, "--parent", str(os.getpid()),
                    "--threads", str(threads)]  # fmt: skip
            group._spawn(rank, argv, rank_visible_devices(visible, world, rank))
        pids = [p.pid for p in group.procs]
        log.info("tensor-parallel ranks started", world=world, pids=pids, address=address)
        atexit.register(group.close)
        group._startup(lambda: group._join(store))
        return group

    def _join(self, store: TCPStore) -> None:
        """init_process_group in a thread, so a rank that exits before it joins fails the start at once."""
        outcome: list[BaseException | None] = []

        def join() -> None:
            try:
                dist.init_process_group(
                    "gloo",
                    store=store,
                    rank=0,
                    world_size=self.world,
                    timeout=GROUP_TIMEOUT,
                )
                outcome.append(None)
            except BaseException as e:  # handed to the waiting thread
                outcome.append(e)

        threading.Thread(target=join, daemon=True, name="rank-join").start()
        while not outcome:
            if self.exits:
                raise RuntimeError("a rank exited before it joined")
            time.sleep(0.05)
        if outcome[0] is not None:
            raise outcome[0]

    def verdicts(self, spec: WorkerSpec, devices: list[str], header: ModelHeader) -> list[RankVerdict]:
        """Every other rank's own pre-load plan of `spec` on `devices[rank]` (rank order, rank 0 left out).
        `header`: the model's header as rank 0 read it (loader/header.py), so no rank reads it again."""
        self.devices = devices
        sent = (spec, devices, header)
        gathered = self._startup(lambda: (step_message.broadcast(sent), step_message.gather(None)))
        return [v for v in gathered[1] or [] if isinstance(v, RankVerdict)]

    def build(self, orders: RankBuild) -> None:
        """Tell every rank what to build (rank 0 decided it from all verdicts)."""
        self.at_broadcast = False
        self._startup(lambda: step_message.broadcast(orders))

    def ready(self) -> None:
        """Wait until every rank has built its shard and cache (a rank that failed: its error, naming it),
        then keep the idle ranks' receives alive."""
        outcomes = self._startup(lambda: step_message.gather(None))
        for rank, problem in enumerate(outcomes or []):
            if isinstance(problem, RankProblem):
                self.close()
                raise problem.error(rank, self._device(rank))
        self.serving = self.at_broadcast = True
        if self.exits:  # a rank exited right after it reported ready
            rank, (pid, code) = next(iter(self.exits.items()))
            self._stop_worker(rank, pid, code)
        # Only now: a keepalive sent while a rank still loads would meet its gather, not a receive.
        threading.Thread(target=self._keepalive, daemon=True, name="rank-keepalive").start()

    def _startup(self, collective: Callable[[], T]) -> T:
        """One startup collective; a rank gone meanwhile: ModelLoadError naming it (and its last words)."""
        try:
            with self.lock:
                return collective()
        except Exception as e:
            deadline = time.monotonic() + 3  # let the watchers see the exit that broke it
            while not self.exits and time.monotonic() < deadline:
                time.sleep(0.05)
            self.close()
            rank, (pid, code) = next(iter(self.exits.items()), (0, (0, 0)))
            if not rank:
                raise ModelLoadError(
                    f"--tensor-parallel-size {self.world}: the ranks stopped answering ({e})"
                ) from e
            said = " | ".join(self.tails.get(rank, ())) or "(nothing on stderr)"
            where = f"{self.devices[rank]}, pid {pid}" if rank < len(self.devices) else f"pid {pid}"
            error = ModelLoadError(
                f"rank {rank} ({where}) exited with code {code} while the worker started; its last words: "
                f"{said}"
            )
            error.rank = rank
            raise error from e

    def _device(self, rank: int) -> str:
        return self.devices[rank] if rank < len(self.devices) else "?"

    @staticmethod
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    @contextlib.contextmanager
    def lead(
        self,
        input_ids: list[int],
        chunks: list[ScheduledChunk],
        num_decodes: int,
        *,
        paged: bool = False,
        block_copies: list[tuple[int, int]] | None = None,
    ) -> Iterator[None]:
        """Hold the group for one step: tell the ranks what to run (`paged`: with rank 0's block tables and
        the step's block copies); inside, the forward (its all-reduces)."""
        spans = [(c.seq.slot or 0, c.start, c.num_tokens) for c in chunks]
        tables = [list(c.seq.block_table.block_ids) for c in chunks] if paged else None
        with self.lock:
            step_message.send(StepMessage(input_ids, spans, num_decodes, tables, block_copies or None))
            yield
            self.last = time.monotonic()

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(Exception):
            if self.at_broadcast and self.lock.acquire(timeout=5):  # else they are building: SIGTERM
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

    def _spawn(self, rank: int, argv: list[str], visible: str | None) -> None:
        """Start rank `rank` from a thread that lives as long as the rank does: PR_SET_PDEATHSIG follows
        the spawning thread, so the kernel SIGKILLs the rank only when this process dies."""
        started = threading.Event()
        env = dict(os.environ) if visible is None else {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
        watcher = threading.Thread(
            target=self._watch, args=(rank, argv, env, started), daemon=True, name=f"rank-{rank}"
        )
        watcher.start()
        started.wait()

    def _watch(self, rank: int, argv: list[str], env: dict[str, str], started: threading.Event) -> None:
        proc = subprocess.Popen(
            die_with_parent(argv), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        self.procs.append(proc)
        tail = self.tails[rank] = deque(maxlen=3)
        started.set()
        assert proc.stderr is not None
        for raw in proc.stderr:  # the rank's stderr, passed on, its last lines kept for a failure report
            text = raw.decode(errors="replace")
            with contextlib.suppress(Exception):  # a closed or replaced stderr never stops the watch
                sys.stderr.write(text)
                sys.stderr.flush()
            if line := text.strip():
                tail.append(line[-300:])
        code = proc.wait()
        if self.closing:
            return
        if not self.serving:  # starting: the collective under way fails and names this rank
            self.exits[rank] = (proc.pid, code)
            return
        self._stop_worker(rank, proc.pid, code)

    def _stop_worker(self, rank: int, pid: int, code: int) -> None:
        if self.closing:
            return
        self.closing = True
        print(
            f"worker: tensor-parallel rank {rank} (pid {pid}) exited with code {code}; the worker stops "
            f"with it (a worker never runs without all of its ranks)",
            file=sys.stderr,
            flush=True,
        )
        _stop(self.procs)
        os._exit(1)


def rank_visible_devices(visible: str | None, world: int, rank: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for rank `rank`: the rank-th id when the worker was given one GPU per rank (a
    Ray bundle of `world` GPUs), so each rank sees exactly its own; otherwise the worker's, unchanged."""
    ids = [i for i in (visible or "").split(",") if i.strip()]
    return ids[rank] if len(ids) == world else visible


def claim_gpus(world: int) -> str | None:
    """At the worker's start, before CUDA is touched: its CUDA_VISIBLE_DEVICES (for RankGroup.start), and,
    when it lists one GPU per rank (a Ray bundle of `world` GPUs), this process keeps only rank 0's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    own = rank_visible_devices(visible, world, 0) if world > 1 else visible
    if own is not None and own != visible:
        os.environ["CUDA_VISIBLE_DEVICES"] = own
    return visible


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
