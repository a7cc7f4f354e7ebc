"""The router's event loop: `--event-loop asyncio|uvloop`.

asyncio (the standard library's loop) is the default. uvloop was measured against it on the relay
(benchmarks/suites/router.py, docs/performance.md "Router") and did not relay more tokens per CPU
second on this project's hardware, so it is not a dependency; `--event-loop uvloop` runs on it where it
is installed (pip install uvloop), for an operator who measures a gain on theirs.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvpact.shared.errors import ConfigError

EVENT_LOOPS = ("asyncio", "uvloop")
DEFAULT_EVENT_LOOP = "asyncio"
T = TypeVar("T")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for `choice` (None: the standard loop). ConfigError for uvloop where it is missing."""
    if choice == "asyncio":
        return None
    if importlib.util.find_spec("uvloop") is None:
        raise ConfigError(
            "--event-loop uvloop: uvloop is not installed here; install it (pip install uvloop) or use "
            "--event-loop asyncio"
        )
    import uvloop

    return uvloop.new_event_loop


def run_loop(main: Coroutine[Any, Any, T], factory: Callable[[], asyncio.AbstractEventLoop] | None) -> T:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
