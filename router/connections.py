"""One router->worker channel per worker, and on it one Worker.Stream call that carries every request to
that worker (router/worker_stream.py).
With --tls-cert it is TLS (mutual with --tls-ca: shared/tls.py).

Nothing here caps concurrent streams (`grpc.max_concurrent_streams`): a cap below what a worker can
run stalls the streams past it. Backpressure is the worker's scheduler's job, not the channel's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.router.registry import WorkerEntry, WorkerState
from kvpact.router.worker_stream import WorkerStream
from kvpact.shared.limits import GRPC_MESSAGE_OPTIONS
from kvpact.shared.tls import TlsConfig, aio_channel
from kvpact.v1 import worker_pb2, worker_pb2_grpc

# A worker merges a stream's tokens that are ready while its last write is unfinished (ReadyPieces,
# worker/engine/ready_pieces.py): that is how a router that falls behind gets fewer, larger messages. What
# holds the worker's write back is this channel's HTTP/2 flow-control window, and gRPC's default BDP
# probing grows it to megabytes once data flows, so a router falling behind never held a worker back:
# the backlog queued in the router's receive buffers as one message a step, unmerged. A fixed window of
# WORKER_WINDOW_BYTES holds the worker back within a few engine steps of what the router has read (a
# step's message for 256 streams is about 10 KB). Every request to the worker rides that one call, and
# the router's reader never waits for a slow client (router/worker_stream.py), so the window only fills
# when the router's own loop cannot keep up, never because of one request. One call's throughput is
# bounded by the window per round trip (32 KB in a 1 ms round trip: about 800,000 tokens/s of plain
# chunks); a message larger than the window still passes, gRPC granting a pending read what its
# message needs.
WORKER_WINDOW_BYTES = 32 * 1024
CHANNEL_OPTIONS = [  # and the message limits of the router's and the workers' servers (shared/limits.py)
    *GRPC_MESSAGE_OPTIONS,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", WORKER_WINDOW_BYTES),
]


@dataclass(slots=True)
class _Open:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    stream: WorkerStream | None = None  # the call every request goes on (router/worker_stream.py)


NOT_TOLD = "could not be told"  # a shutdown_workers result: the call failed
# ... because the worker did not answer in time (its loop busy, say): the router asks it again while it
# lingers; any other failure (a closed port: the process is gone) is not asked again
NOT_ANSWERED = f"{NOT_TOLD} (DEADLINE_EXCEEDED"


class WorkerChannels:
    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._tls = tls
        self._open: dict[str, _Open] = {}

    def stub(self, entry: WorkerEntry) -> worker_pb2_grpc.WorkerStub:
        """The stub for `entry`'s current address (re-registered elsewhere -> a new channel)."""
        return self._channel(entry).stub

    def stream(self, entry: WorkerEntry) -> WorkerStream:
        """The Worker.Stream call to `entry` that requests go on: the open one, or a new one when there is
        none or it ended (the worker restarted, its connection dropped)."""
        opened = self._channel(entry)
        if opened.stream is None or opened.stream.ended is not None:
            opened.stream = WorkerStream(opened.channel)
        return opened.stream

    def _channel(self, entry: WorkerEntry) -> _Open:
        current = self._open.get(entry.worker_id)
        if current is not None and current.address == entry.address:
            return current
        if current is not None:  # its calls end with it (a stream's requests: UNAVAILABLE, cut off)
            asyncio.get_running_loop().create_task(current.channel.close(grace=None))
        channel = aio_channel(entry.address, self._tls, CHANNEL_OPTIONS)
        opened = _Open(entry.address, channel, worker_pb2_grpc.WorkerStub(channel))
        self._open[entry.worker_id] = opened
        return opened

    async def answers(self, address: str, timeout_s: float) -> bool:
        """Whether a process answers gRPC at `address` within `timeout_s` (any reply to a health check,
        even UNIMPLEMENTED, is an answer; no connection or no reply in time is not). Over TLS when the
        router's calls to workers are."""
        async with aio_channel(address, self._tls, CHANNEL_OPTIONS) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return True

    async def shutdown_workers(
        self, entries: list[WorkerEntry], reason: str, timeout_s: float
    ) -> dict[str, str]:
        """Ask every worker with an address to stop, in parallel, within `timeout_s`.
        Returns worker id -> "sent" or why it could not be told."""

        async def one(entry: WorkerEntry) -> str:
            if not entry.address:
                return "not asked (it reported no address)"
            if entry.state is WorkerState.REFUSED:  # a Shutdown could reach it before its refusal (exit 78)
                return "not asked (its refusal tells it to stop)"
            try:
                await self.stub(entry).Shutdown(worker_pb2.ShutdownRequest(reason=reason), timeout=timeout_s)
                return "sent"
            except grpc.aio.AioRpcError as exc:
                if entry.state is WorkerState.FAILED:
                    return "already gone (its startup failed; it exits on its own)"
                first = (exc.details() or "").split(";")[0]
                told = f"{NOT_TOLD} ({exc.code().name}: {first})"
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    return f"{told}; asked again while the router lingers"
                return told

        results = await asyncio.gather(*(one(e) for e in entries))
        return {e.worker_id: r for e, r in zip(entries, results, strict=True)}

    async def close_all(self) -> None:
        opened = list(self._open.values())
        self._open.clear()
        await asyncio.gather(*(o.stream.close() for o in opened if o.stream is not None))
        channels = [o.channel for o in opened]
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)
