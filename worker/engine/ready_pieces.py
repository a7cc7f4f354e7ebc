"""One request's stream of pieces from the step thread to its caller, merged when the caller fell behind.

The step thread hands each piece to the caller's event loop through that loop's `LoopHandoff`, which
puts it in the request's `ReadyPieces`; the caller takes them with `next()`. A caller that keeps up
gets each piece as it came. A caller whose writes fell behind finds several queued and gets them as
one (`merge_pieces`): fewer messages, never a wait, so the first token always goes alone. Pieces of
different completions (`index`) are never merged, nor is anything merged past a completion's last
piece or an error, nor beyond MAX_TOKENS_PER_MESSAGE (shared/limits.py): every piece arrives once, in
order, and an error comes after every piece queued before it.

The engine (worker/engine/engine.py) streams through this, and so does the router suite's synthetic
worker (benchmarks/synthetic_worker.py), so the load it offers the router merges as a real worker's does.
"""

from __future__ import annotations

import asyncio
import threading

from kvpact.shared.limits import MAX_TOKENS_PER_MESSAGE
from kvpact.worker.engine.request import GenerationOutput, merge_pieces

Item = GenerationOutput | BaseException


class ReadyPieces:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._held: Item | None = None  # taken from the queue, not yet merged: the next one to go

    def num_queued(self) -> int:
        """How many pieces (or the ending exception) are queued and not yet taken. (Not __len__: an
        empty ReadyPieces must stay truthy where callers test `if pieces`.)"""
        return self._queue.qsize() + (self._held is not None)

    def put(self, item: Item) -> None:
        """On the caller's event loop: queue a piece, or the exception that ends the request."""
        self._queue.put_nowait(item)

    async def next(self) -> Item:
        """The next piece, with the ones queued behind it merged in; or the exception (not raised)."""
        item = self._held if self._held is not None else await self._queue.get()
        self._held = None
        if isinstance(item, BaseException):
            return item
        queue = self._queue
        while (
            item.finish_reason is None and len(item.token_ids) < MAX_TOKENS_PER_MESSAGE and not queue.empty()
        ):
            then = queue.get_nowait()
            if isinstance(then, BaseException) or then.index != item.index:
                self._held = then
                break
            item = merge_pieces(item, then)
        return item


class LoopHandoff:
    """Pieces from the step thread to one event loop's ReadyPieces, a batch per wake-up: the first piece
    of a batch schedules the loop's `_deliver` (call_soon_threadsafe: a system call that wakes the loop),
    and every piece sent before the loop runs it joins that batch. One wake-up per step for all its
    streams, not one per piece: 32 sends a step at 32 streams cost the served worker's step thread 0.25 s
    of a 20 s mixed run (31 us a token against 10 in-process, docs/performance.md "Served against
    in-process"). Pieces are put in the order they were sent, so each request's stay in order, as long as
    a request sends through one handoff."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._batch: list[tuple[ReadyPieces, Item]] = []

    def send(self, pieces: ReadyPieces, item: Item) -> bool:
        """From any thread. False when the loop is closed: nobody will take the item (its caller is
        gone), and the batch it would have joined is dropped with it."""
        with self._lock:
            self._batch.append((pieces, item))
            if len(self._batch) > 1:
                return True  # the batch's first send scheduled its delivery
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._batch.clear()
            return False
        return True

    def _deliver(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for pieces, item in batch:
            pieces.put(item)
