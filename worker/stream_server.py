"""Worker.Stream, the worker's half: many requests on one router->worker call (issue 25, item 6).

The router opens one Stream call per worker and keeps it (router/worker_stream.py holds its half). On it
the router starts requests, each under a tag of its choosing, and aborts the ones whose client left; the
worker answers with StreamReplies, each carrying every event that was ready when it wrote: a request's
chunks (its GenerateChunk's bytes, relayed to the client as they are) and, last, its end (the status
Worker.Generate would have ended with). One engine step's chunks for all its streams go out as one
message, so the router reads one message per step instead of one per stream per step: what one gRPC
message costs to read is most of what a relayed token costs the router (docs/performance.md, "Router").

Each request runs as the same async generator Worker.Generate runs (`generate`), in a task of its own;
what it yields and how it ends are queued as events, in order. The writer takes everything queued each
time it is free, so a writer held back by HTTP/2 flow control sends more per message, never less, and
never waits for company. A request takes its next chunk from its generator only once the reply that
took its last one was written, as on its own call: while the writer is held back, the engine merges what
piles up for that request into one piece (worker/engine/ready_pieces.py), so a slow router reads fewer,
larger chunks. (A backlog over MAX_REPLY_BYTES goes out in several replies; the first one's write lets
every waiting request go on, which only loosens that hold, never the order.)

A request's task is cancelled by its abort, by its timeout (ending DEADLINE_EXCEEDED), or when the call
ends (the router went away): the generator is closed, which aborts the engine's sequence and frees its
blocks, as a cancelled Worker.Generate does.

The call ends when the router closes its side and nothing is in flight, or once `close()` was called
(the worker stops) and nothing is in flight; events already queued are sent first. After `close()` a new
request ends at once UNAVAILABLE, as a stopping server refuses a new call, so the router retries it on
another worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import grpc

from kvpact.v1 import generation_pb2, worker_pb2

# A request's chunks: the GenerateRequest and its timeout (None: none) in, the chunks out, in order.
Generate = Callable[
    [generation_pb2.GenerateRequest, float | None], AsyncGenerator[generation_pb2.GenerateChunk]
]
# The status a request that raised ends with (the worker's ErrorInterceptor.status_of, for Stream).
StatusOf = Callable[[BaseException], tuple[grpc.StatusCode, str]]

MAX_REPLY_BYTES = 1 << 20  # events beyond this go in the next reply (far below the gRPC message cap)
STOPPING = "the worker is stopping: it takes no new requests; send this one to another worker"


class StreamServer:
    """One Worker.Stream call: `serve(requests)` is the handler's reply stream. Made on the event loop
    that serves the call."""

    def __init__(self, generate: Generate, status_of: StatusOf) -> None:
        self._generate = generate
        self._status_of = status_of
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._events: list[worker_pb2.StreamEvent] = []
        self._size = 0  # bytes of the chunks in _events
        self._wake = asyncio.Event()
        # The requests whose chunks are queued now, each waiting on a future of its own until the reply
        # that takes them is written. Futures of the loop kept here: not an asyncio.Event, whose wait
        # looks the loop up, a getpid() system call on Python 3.11 (6% of a worker's loop thread at 256
        # streams, docs/performance.md "A system call per relayed message"); not one shared future behind
        # asyncio.shield (so that an abort cancels its own request's wait only), which costs 2.5 us more
        # per wait (an extra future and loop hop: 3.7-3.9 against 1.2 us, 256 waiters, one-off probe).
        self._loop = asyncio.get_running_loop()
        self._waiting: list[asyncio.Future[None]] = []
        self._reading = True  # the router's side is open
        self._closing = False

    def close(self) -> None:
        """End the call once nothing is in flight on it (the worker is stopping)."""
        self._closing = True
        self._wake.set()

    async def serve(
        self, requests: AsyncIterator[worker_pb2.StreamRequest]
    ) -> AsyncGenerator[worker_pb2.StreamReply]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                if self._events:
                    reply, waiting = self._take()
                    yield reply
                    for written in waiting:
                        if not written.done():  # else its request was aborted meanwhile
                            written.set_result(None)
                elif self._tasks or (self._reading and not self._closing):
                    self._wake.clear()
                    await self._wake.wait()
                else:
                    break
            if reader.done():
                reader.result()  # the router's side failed: raise it here
        finally:
            reader.cancel()
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[worker_pb2.StreamRequest]) -> None:
        try:
            async for message in requests:
                if message.HasField("start"):
                    self._start(message.start)
                elif (task := self._tasks.get(message.abort)) is not None:
                    task.cancel()
        finally:
            self._reading = False
            self._wake.set()

    def _start(self, start: worker_pb2.StreamStart) -> None:
        tag = start.tag
        if self._closing:  # as a stopping server refuses a new call: the router sends it elsewhere
            self._end(tag, grpc.StatusCode.UNAVAILABLE, STOPPING)
            return
        if tag in self._tasks:
            details = (
                f"tag {tag} is already in flight on this call (a router fault); the new request is refused"
            )
            self._end(tag, grpc.StatusCode.ALREADY_EXISTS, details)
            return
        timeout = start.timeout_s if start.timeout_s > 0 else None
        task = asyncio.get_running_loop().create_task(self._run(tag, start.request, timeout))
        self._tasks[tag] = task
        task.add_done_callback(lambda done: self._forget(tag, done))

    def _forget(self, tag: int, task: asyncio.Task[None]) -> None:
        """`task` is over (ended, aborted, or cancelled before it ran): it is no longer in flight."""
        if self._tasks.get(tag) is task:
            del self._tasks[tag]
            self._wake.set()

    async def _run(self, tag: int, request: generation_pb2.GenerateRequest, timeout: float | None) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            async with asyncio.timeout(timeout), aclosing(self._generate(request, timeout)) as chunks:
                async for chunk in chunks:
                    data = chunk.SerializeToString()
                    self._events.append(worker_pb2.StreamEvent(tag=tag, chunk=data))
                    self._size += len(data)
                    self._wake.set()
                    if not chunk.HasField("usage"):  # not its last: take the next once this one is written
                        written = self._loop.create_future()
                        self._waiting.append(written)
                        await written
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # aborted, or the call is ending: nobody waits
                raise
            code, details = self._status_of(exc)  # raised inside the request's work: it still ends
        except Exception as exc:  # noqa: BLE001 - the request's own status, as Worker.Generate's would be
            code, details = self._status_of(exc)
        self._end(tag, code, details)

    def _end(self, tag: int, code: grpc.StatusCode, details: str) -> None:
        end = worker_pb2.StreamEnd(code=code.value[0], details=details)
        self._events.append(worker_pb2.StreamEvent(tag=tag, end=end))
        self._wake.set()

    def _take(self) -> tuple[worker_pb2.StreamReply, list[asyncio.Future[None]]]:
        """The queued events, up to MAX_REPLY_BYTES of chunks (at least one event), and the waits to end
        once they are written (every request waiting now: the first reply of a backlog lets them all go)."""
        events, waiting = self._events, self._waiting
        self._waiting = []
        if self._size <= MAX_REPLY_BYTES:
            self._events, self._size = [], 0
            return worker_pb2.StreamReply(events=events), waiting
        size = end = 0
        while end < len(events) and (end == 0 or size + len(events[end].chunk) <= MAX_REPLY_BYTES):
            size += len(events[end].chunk)
            end += 1
        self._events, self._size = events[end:], self._size - size
        return worker_pb2.StreamReply(events=events[:end]), waiting
