"""Children that never outlive their parent: the launcher's router, a Ray actor's worker, a worker's ranks.

`die_with_parent(argv)` returns the argv to start instead: this module run as a trampoline, which asks
the kernel to SIGKILL it when the thread that started it ends (PR_SET_PDEATHSIG, kept across exec),
checks that parent is still there, and execs `argv` in its own process (same pid).

NOTE: the signal is set by the child after it starts, never by a preexec_fn. A preexec_fn makes
subprocess fork() a parent that serves gRPC (a worker with tensor-parallel ranks, a Ray actor), and gRPC's
fork handlers then run in the child: CI saw a rank abort there (SIGABRT, "epoll_wait error: Bad file
descriptor") before it ever ran. Without one, subprocess uses vfork, which runs no fork handlers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` started so that the kernel SIGKILLs it when the thread that starts it ends (Linux; `argv`
    unchanged elsewhere). Start it from a thread that lives as long as the parent should."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", "kvpact.shared.child_process", str(os.getpid()), "--", *argv]


def _trampoline(args: list[str]) -> None:
    parent, separator, *argv = args
    if separator != "--" or not argv:
        sys.exit("usage: python -m kvpact.shared.child_process PARENT_PID -- ARGV...")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):  # the parent died before the call: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    _trampoline(sys.argv[1:])
