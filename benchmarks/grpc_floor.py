"""What a gRPC aio process spends per streamed message on this CPU: the floor under the router's relay
(issue 25, item 6), with nothing of kvpact's in the way.

    python -m benchmarks.grpc_floor [--modes write,relay,mux,...] [--streams 256] [--seconds 6] [--rounds 2]
    python -m benchmarks.grpc_floor --modes relay,relay-read,relay-4-channels --rounds 3

Four processes on 127.0.0.1: an upstream server, the measured front server, two client processes
holding `--streams` streams between them, each reading as fast as it can. The front is one of:

    write   yields ready bytes, no upstream: the client-facing write alone
    relay   reads each message from its own upstream stream and yields it: the router's shape (one
            worker stream per request)
    relay-read         `relay` reading with `await call.read()` instead of `async for`
    relay-4-channels   `relay` with its upstream streams spread over 4 channels instead of one
    mux     reads ONE upstream stream whose every message carries a message for each of its client
            streams (what a worker step produces) and hands them out through asyncio queues: the shape
            of a multiplexed worker -> router stream

Messages are raw bytes both ways (no protobuf), so the figure is gRPC's and asyncio's alone. Printed per
mode and round: messages/s the clients received in the window and messages per front CPU-second
(/proc/PID/stat).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import struct
import time
from typing import Any

import grpc

from benchmarks.router_tier import cpu_seconds

CHUNK = b"\x0a\x05hello\x10\x07" + b"x" * 20  # about a one-token GenerateChunk's size
MODES = ("write", "relay", "mux", "relay-read", "relay-4-channels")
START_S = 20.0
OPEN_S = 3.0  # from starting the clients to the window: their spawn, their streams opening, a warm-up


def _raw(b: bytes) -> bytes:
    return b


def _handler(service: str, methods: dict[str, Any]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        service,
        {
            name: grpc.unary_stream_rpc_method_handler(
                fn, request_deserializer=_raw, response_serializer=_raw
            )
            for name, fn in methods.items()
        },
    )


async def _upstream(ready: Any) -> None:
    async def per_stream(request: bytes, context: Any) -> Any:
        while True:
            yield CHUNK

    async def steps(request: bytes, context: Any) -> Any:
        frame = b"".join(struct.pack("<HH", i, len(CHUNK)) + CHUNK for i in range(int(request)))
        while True:
            yield frame

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler("up", {"Stream": per_stream, "Steps": steps}),))
    ready.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


async def _front(mode: str, up_port: int, streams: int, ready: Any) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{up_port}")
    per_stream = channel.unary_stream("/up/Stream", request_serializer=_raw, response_deserializer=None)
    spread = [  # relay-4-channels: distinct channel args, so gRPC does not share one connection
        grpc.aio.insecure_channel(f"127.0.0.1:{up_port}", options=[("kvpact.floor_channel", i)]).unary_stream(
            "/up/Stream", request_serializer=_raw, response_deserializer=None
        )
        for i in range(4)
    ]
    opened = itertools.count()  # relay-4-channels: round robin over `spread`
    steps = channel.unary_stream("/up/Steps", request_serializer=_raw, response_deserializer=None)
    queues: dict[int, asyncio.Queue[bytes]] = {}

    async def fan_out() -> None:  # mux: one upstream message -> one message on each client stream
        async for frame in steps(str(streams).encode()):
            offset = 0
            while offset < len(frame):
                index, size = struct.unpack_from("<HH", frame, offset)
                queue = queues.get(index)
                if queue is not None and queue.qsize() < 64:  # a stream that falls behind skips steps
                    queue.put_nowait(frame[offset + 4 : offset + 4 + size])
                offset += 4 + size

    async def generate(request: bytes, context: Any) -> Any:
        if mode == "write":
            while True:
                yield CHUNK
        elif mode == "relay":
            async for message in per_stream(b""):
                yield message
        elif mode == "relay-read":
            call = per_stream(b"")
            while (message := await call.read()) is not grpc.aio.EOF:
                yield message
        elif mode == "relay-4-channels":
            async for message in spread[next(opened) % 4](b""):
                yield message
        else:
            queue = queues[len(queues)] = asyncio.Queue()
            while True:
                yield await queue.get()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler("front", {"Generate": generate}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fanning = asyncio.get_running_loop().create_task(fan_out()) if mode == "mux" else None
    ready.put(port)
    await server.wait_for_termination()
    if fanning is not None:
        fanning.cancel()


async def _client(port: int, streams: int, window: tuple[float, float], counts: Any) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    generate = channel.unary_stream("/front/Generate", request_serializer=_raw, response_deserializer=None)
    seen = [0]

    async def one() -> None:
        call = generate(b"")
        async for _ in call:
            now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on this host
            if now > window[1]:
                break
            if now >= window[0]:
                seen[0] += 1
        call.cancel()

    await asyncio.gather(*(one() for _ in range(streams)))
    counts.put(seen[0])


def _run(target: Any, *args: Any) -> None:
    asyncio.run(target(*args))


def measure(mode: str, streams: int, seconds: float) -> tuple[float, float]:
    """(messages/s the clients received, messages per front CPU-second) over a window of `seconds`."""
    ctx = multiprocessing.get_context("spawn")  # no gRPC state forked from the caller
    ready, counts = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(_upstream, ready), daemon=True)]
    try:
        procs[0].start()
        up_port = ready.get(timeout=START_S)
        procs.append(ctx.Process(target=_run, args=(_front, mode, up_port, streams, ready), daemon=True))
        procs[1].start()
        front_port, front_pid = ready.get(timeout=START_S), procs[1].pid
        assert front_pid is not None  # started
        start = time.monotonic() + OPEN_S
        window = (start, start + seconds)
        for share in (streams // 2, streams - streams // 2):
            procs.append(
                ctx.Process(target=_run, args=(_client, front_port, share, window, counts), daemon=True)
            )
            procs[-1].start()
        time.sleep(max(0.0, window[0] - time.monotonic()))
        cpu0 = cpu_seconds(front_pid)
        time.sleep(max(0.0, window[1] - time.monotonic()))
        cpu1 = cpu_seconds(front_pid)
        received = sum(counts.get(timeout=START_S + seconds) for _ in range(2))
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=5)
    return received / seconds, received / max(cpu1 - cpu0, 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    print(f"{args.streams} streams, {args.seconds:g} s windows, rounds interleaved\n")
    print("| mode | round | messages/s (wall) | messages per front CPU-s |")
    print("|---|---:|---:|---:|")
    for r in range(args.rounds):
        for mode in modes:
            wall, per_cpu = measure(mode, args.streams, args.seconds)
            print(f"| {mode} | {r + 1} | {wall:,.0f} | {per_cpu:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
