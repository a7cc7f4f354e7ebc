"""The one way a test waits for a state it does not control (another process, a thread, the event loop):
poll `condition` until it returns something truthy, and return that; after `timeout` seconds fail with
an AssertionError that names `what` and the last value seen. Never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout: float = 5.0, what: str = "", interval: float = 0.02) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what or condition} (last: {value!r})"
            )
        time.sleep(interval)


async def eventually_async(
    condition: Callable[[], T | Awaitable[T]], timeout: float = 5.0, what: str = "", interval: float = 0.02
) -> T:
    """`eventually` for a test running on an event loop: it yields to the loop between polls.
    `condition` may be a coroutine function (e.g. one that asks a server)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what or condition} (last: {value!r})"
            )
        await asyncio.sleep(interval)


def _timed_out(timeout: float, what: str, value: object) -> str:
    return f"timed out after {timeout:g}s waiting for {what} (last: {value!r})"
