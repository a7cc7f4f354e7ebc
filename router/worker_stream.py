"""Worker.Stream, the router's half: every request to one worker on one long-lived call (issue 25, item 6).

Reading a gRPC message costs the router more than writing one, and one message per token per stream was
most of what a relayed token cost (docs/performance.md, "Router"). So the router keeps one Worker.Stream
call per worker connection and sends every request to that worker on it; the worker answers with one
message per engine step carrying the chunks of all its streams (worker/stream_server.py). One task reads
that call (`_read`) and hands each event to its request's `Inbox`; the request's relay
(router/service.py `_forward`) takes from its inbox whatever is ready.

What a per-request call gave, and where it is now:
- cancel: a relay that ends before its request did (client cancel, deadline, a failed write) sends an
  abort with the request's tag; the worker cancels the request, which frees its blocks;
- deadline: the client's remaining deadline travels in the start and the worker ends the request with
  DEADLINE_EXCEEDED when it passes, as a timed-out call did (the gRPC front's handler is also cancelled
  by gRPC at the client's deadline, which aborts the request, should the worker not answer);
- size: a start that would not fit one message is refused on its own (INVALID_ARGUMENT) rather than
  fail the call and every request on it (the router drops a request's unknown fields first);
- status: each request ends with the status Worker.Generate would have had (code and detail), mapped for
  the client as before (router/service.py `_worker_error`);
- a worker that is gone: when the call fails (the worker was killed, its connection dropped, the channel
  was closed), every request on it ends with that call's status (UNAVAILABLE for a dead worker), so the
  retry of a request that had produced nothing works as before; the next request opens a new call;
- flow control: the reader never waits for a relay, so a client that stops reading cannot stall the
  other streams on the call; what its stream piles up in its inbox is bounded by the request's own
  output (max_tokens, at most the worker's max model len).

Tags are the call's own (1, 2, 3, ...), so two clients' request ids never collide here; the worker still
refuses a request id it already has in flight, as before.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from kvpact.shared.limits import MAX_MESSAGE_BYTES
from kvpact.v1 import generation_pb2, worker_pb2

STREAM_METHOD = "/kvpact.v1.Worker/Stream"
CUT_OFF = "the call to it was cut off"  # the router ended the call (closed the channel, stopping)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Inbox:
    """One request's chunks (the worker's bytes) as they arrive, then its end (code, details)."""

    __slots__ = ("call_ended", "chunks", "end", "_loop", "_waiter")

    def __init__(self) -> None:
        # Kept, not looked up per wait: on Python 3.11 get_running_loop() is a getpid() system call,
        # 5% of the router's CPU when it was called once per relayed message.
        self._loop = asyncio.get_running_loop()
        self.chunks: list[bytes] = []
        self.end: tuple[grpc.StatusCode, str] | None = None
        self.call_ended = False  # the end is the whole call's (it failed or was cut off), not the request's
        self._waiter: asyncio.Future[None] | None = None

    def put(self, data: bytes) -> None:
        self.chunks.append(data)
        self._wake()

    def finish(self, code: grpc.StatusCode, details: str, *, call_ended: bool = False) -> None:
        if self.end is None:
            self.end = (code, details)
            self.call_ended = call_ended
            self._wake()

    def take(self) -> list[bytes]:
        chunks, self.chunks = self.chunks, []
        return chunks

    async def wait(self) -> None:
        """Until a chunk or the end arrives (returns at once if one is there)."""
        if self.chunks or self.end is not None:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class WorkerStream:
    """One Worker.Stream call on a channel; `start` a request on it, `abort` one that is not over."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        method = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=worker_pb2.StreamRequest.SerializeToString,
            response_deserializer=worker_pb2.StreamReply.FromString,
            _registered_method=True,
        )
        self._outgoing: asyncio.Queue[worker_pb2.StreamRequest] = asyncio.Queue()
        self._inboxes: dict[int, Inbox] = {}
        self._tags = itertools.count(1)
        self.ended: tuple[grpc.StatusCode, str] | None = None  # the call is over; open a new one
        self._call = method()
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    def start(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> tuple[int, Inbox]:
        """Send `request` (its deadline `timeout` seconds from now, None: none); its tag and inbox."""
        inbox = Inbox()
        if self.ended is not None:
            inbox.finish(*self.ended, call_ended=True)
            return 0, inbox
        # A deadline already passed still travels as one (0 would mean none).
        timeout_s = 0.0 if timeout is None else max(timeout, 1e-6)
        message = worker_pb2.StreamRequest(
            start=worker_pb2.StreamStart(tag=next(self._tags), request=request, timeout_s=timeout_s)
        )
        if message.ByteSize() > MAX_MESSAGE_BYTES:  # it would fail the whole call, every request on it
            details = (
                f"the request is {request.ByteSize()} bytes, over the {MAX_MESSAGE_BYTES} a message may be"
            )
            inbox.finish(grpc.StatusCode.INVALID_ARGUMENT, details)
            return 0, inbox
        self._inboxes[message.start.tag] = inbox
        self._outgoing.put_nowait(message)
        return message.start.tag, inbox

    def abort(self, tag: int) -> None:
        """The request under `tag` is no longer wanted: the worker stops it (nothing if it ended)."""
        if self._inboxes.pop(tag, None) is not None and self.ended is None:
            self._outgoing.put_nowait(worker_pb2.StreamRequest(abort=tag))

    async def close(self) -> None:
        """Cancel the call (every request still on it ends UNAVAILABLE) and wait for its tasks."""
        self._call.cancel()
        self._writer.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)

    async def _write(self) -> None:
        """Sends the starts and aborts in order, one write at a time (gRPC's rule), until the call ends."""
        while True:
            message = await self._outgoing.get()
            try:
                await self._call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the call ended: the reader has its status and ends every request with it

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the call"
        try:
            async for reply in self._call:
                inboxes = self._inboxes
                for event in reply.events:
                    inbox = inboxes.get(event.tag)
                    if inbox is None:  # aborted meanwhile
                        continue
                    if event.HasField("end"):
                        del inboxes[event.tag]
                        inbox.finish(_CODES.get(event.end.code, grpc.StatusCode.UNKNOWN), event.end.details)
                    else:
                        inbox.put(event.chunk)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code is grpc.StatusCode.CANCELLED:  # the router cancelled it (channel closed, router stops)
                code, details = grpc.StatusCode.UNAVAILABLE, CUT_OFF
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.UNAVAILABLE, CUT_OFF
            raise
        finally:
            self.ended = (code, details)
            self._writer.cancel()
            inboxes, self._inboxes = self._inboxes, {}
            for inbox in inboxes.values():
                inbox.finish(code, details, call_ended=True)
