"""The event loop the router and the worker run on: `--event-loop uvloop|asyncio`.

uvloop is the default wherever it exists (a dependency of the package there, pyproject.toml's marker
`sys_platform != 'win32'`; on Windows the default is asyncio): since gRPC's I/O moved to its poller
thread (shared/grpc_io.py), every completed gRPC operation wakes the loop from that thread, and uvloop
folds the wake-ups that arrive together into one where asyncio writes its self-pipe for each (the
worker's step thread also wakes its loop once a step, `call_soon_threadsafe`). Measured, interleaved
(docs/performance.md "Event loop and server options"): on the router's relay about 10% more tokens per
router CPU-second at the same added latency; in the worker at one sequence a step, 19% less CPU per
token on its threads besides the step's (`python -m benchmarks.served_ab`). `--event-loop asyncio`
runs the standard library's loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvpact.shared.errors import ConfigError

EVENT_LOOPS = ("asyncio", "uvloop")
DEFAULT_EVENT_LOOP = "asyncio" if sys.platform == "win32" else "uvloop"  # as pyproject installs it
T = TypeVar("T")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for `choice` (None: the standard loop). ConfigError for uvloop where it is missing."""
    if choice == "asyncio":
        return None
    if importlib.util.find_spec("uvloop") is None:
        raise ConfigError(
            "--event-loop uvloop (the default): uvloop is not installed here; install it (pip install "
            "uvloop) or use --event-loop asyncio"
        )
    import uvloop

    return uvloop.new_event_loop


def run_loop(main: Coroutine[Any, Any, T], factory: Callable[[], asyncio.AbstractEventLoop] | None) -> T:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
