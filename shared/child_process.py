"""Children that never outlive their parent: the one preexec_fn the launcher and a worker's ranks use."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn: the kernel SIGKILLs the child when the thread that spawned it dies (None off Linux).
    libc is loaded here, before the fork, so the child makes only the one system call."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def set_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the call: the signal will never come
            os.kill(os.getpid(), signal.SIGKILL)

    return set_signal
