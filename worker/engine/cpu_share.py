"""A worker's CPU threads: `--threads N` when given, else its share of the CPUs it may run on.

Workers started by hand on one machine share one affinity mask, so the mask alone does not split the cores
between them: each would take torch's default (every core), and two workers on 2 cores would run 4 OpenMP
threads that spin at every barrier while the other process holds the core (measured: 9x slower than one
thread each). So every worker holds a lease, a file named by its pid in one machine-wide folder that says
whether it is busy (loading, or with requests to step), and a busy worker without `--threads` takes
`len(its CPUs) // busy workers on those CPUs` threads (at least 1): an idle worker leaves its share to the
others. The step thread marks the lease on each busy/idle change, re-reads the others every few seconds,
and applies a changed share with torch.set_num_threads from the step thread itself (OpenMP's thread count
is per calling thread). Under Ray the launcher passes the bundle's num_cpus as `--threads`.

Invariant: a lease is removed when its worker exits; one left by a killed worker names a dead pid (or a
reused pid with another start time) and is ignored, then removed, by the next reader.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REREAD_S = 0.25  # how often a busy step thread looks at the other workers' leases (a read is ~0.1 ms)


def lease_dir() -> Path:
    """One folder for every worker on this machine, whatever each one's TMPDIR: /dev/shm where it exists."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"kvpact-cpu-leases-{os.getuid()}"


def allowed_cpus() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass
class CpuShare:
    """Held for the worker process's life (`with CpuShare.acquire(threads) as share:`)."""

    requested: int | None  # --threads; None = a share of the machine
    cpus: frozenset[int]
    directory: Path
    threads: int = 0  # what was last applied
    busy: bool = True  # a worker starts busy: it is loading
    _lease: Path | None = None
    _next_read: float = field(default=0.0, repr=False)

    @classmethod
    def acquire(cls, requested: int | None, directory: Path | None = None) -> CpuShare:
        share = cls(requested, allowed_cpus(), directory or lease_dir())
        try:
            share.directory.mkdir(parents=True, exist_ok=True)
            share._lease = share.directory / str(os.getpid())
            share._write()
        except OSError:
            share._lease = None  # no writable folder: this worker counts only itself
        return share

    def _write(self) -> None:
        if self._lease is not None:
            cpus = ",".join(map(str, sorted(self.cpus)))
            self._lease.write_text(f"{_start_time(os.getpid())}\n{cpus}\n{int(self.busy)}\n")

    def release(self) -> None:
        if self._lease is not None:
            with contextlib.suppress(OSError):
                self._lease.unlink()
            self._lease = None

    def __enter__(self) -> CpuShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def num_sharing(self) -> int:
        """Busy workers on CPUs that overlap this one's, this one included."""
        count = 1
        try:
            leases = [lease for lease in self.directory.iterdir() if lease != self._lease]
        except OSError:
            return count
        for lease in leases:
            try:
                started, cpus, busy = lease.read_text().splitlines()[:3]
                pid = int(lease.name)
            except (OSError, ValueError):
                continue
            if _start_time(pid) != started:  # its worker is gone
                with contextlib.suppress(OSError):
                    lease.unlink()
                continue
            if busy == "1" and self.cpus & {int(c) for c in cpus.split(",") if c}:
                count += 1
        return count

    def wanted(self) -> int:
        if self.requested is not None:
            return self.requested
        return max(1, len(self.cpus) // self.num_sharing())

    def apply(self, busy: bool = True) -> int:
        """Mark this worker busy or idle and set the calling thread's torch thread count to its share
        (the others' leases are re-read at most every REREAD_S, and at once after a change)."""
        now = time.monotonic()
        if busy != self.busy:
            self.busy = busy
            self._next_read = 0.0
            with contextlib.suppress(OSError):
                self._write()
        if self.threads and (self.requested is not None or now < self._next_read):
            return self.threads
        self._next_read = now + REREAD_S
        wanted = self.wanted()
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            self.threads = wanted
        return wanted
