"""An asyncio loop in a daemon thread, to host async servers (WorkerDouble, an in-process router)
while a synchronous test drives real processes or the blocking client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

T = TypeVar("T")
CALL_TIMEOUT_S = 30.0


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._entered: list[AbstractAsyncContextManager[Any]] = []

    def __enter__(self) -> BackgroundLoop:
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def enter(self, manager: AbstractAsyncContextManager[T]) -> T:
        """Enter an async context manager on the loop; it is exited (in reverse order) on __exit__."""
        value = self.run(manager.__aenter__())
        self._entered.append(manager)
        return value

    def __exit__(self, *exc: object) -> None:
        try:
            while self._entered:
                self.run(self._entered.pop().__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
