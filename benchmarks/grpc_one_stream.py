"""What one gRPC stream costs per message on this host, at full speed and paced like a decode: the
serving hop's cost at one sequence a step (issue 25, item 1's `--max-num-seqs 1` row), with nothing of
kvpact's in the way.

    python -m benchmarks.grpc_one_stream [--gaps 0,2,10,40] [--transports tcp,unix] [--seconds 3]
                                         [--rounds 2]

A server process yields one small message after another on a single server-streaming call, sleeping
`gap` ms before each (0: none), to a client process that reads them as they come. Both run as the
router and the worker do: gRPC's I/O on grpc.aio's poller thread (shared/grpc_io.py) and uvloop. The
call goes over loopback TCP (`tcp`) or a Unix socket (`unix`, in a temporary directory). Printed per
transport, gap and round: each side's CPU per message (µs: each process's own CPU clock, all its threads,
over the call) and the wall per message. Both sides are spawned processes, so the caller's own gRPC
(already loaded, perhaps with other settings) plays no part. Messages are raw bytes (no protobuf).

What it showed (docs/performance.md, "What one message costs", session 32): a paced message costs each
side several times what a streamed one does (every message wakes the poller thread and the loop from
sleep), more the longer the gap; a Unix socket saves a tenth to a fifth of a paced message and nothing
at full speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import grpc

from benchmarks.grpc_floor import CHUNK
from kvpact.shared.event_loop import loop_factory, run_loop
from kvpact.shared.grpc_io import set_grpc_io

FULL_SPEED_MESSAGES = 20_000
TRANSPORTS = ("tcp", "unix")
START_S = 20.0


async def _serve(address: str, gap_s: float, count: int, ready: Any) -> None:
    async def stream(request: bytes, context: Any) -> Any:
        started = time.process_time()
        for _ in range(count):
            if gap_s:
                await asyncio.sleep(gap_s)
            yield CHUNK
        ready.put(time.process_time() - started)  # once the last message was written

    stream_handler = grpc.unary_stream_rpc_method_handler(stream)  # raw bytes both ways
    handler = grpc.method_handlers_generic_handler("one", {"Stream": stream_handler})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(address)
    await server.start()
    ready.put(port)
    await server.wait_for_termination()


def _server_process(address: str, gap_s: float, count: int, ready: Any) -> None:
    run_loop(_serve(address, gap_s, count, ready), loop_factory("uvloop"))


async def _read(target: str, results: Any) -> None:
    """Puts (messages, this process's CPU s, wall s) for one call on a connected channel."""
    async with grpc.aio.insecure_channel(target) as channel:
        stream = channel.unary_stream("/one/Stream")  # raw bytes both ways
        await channel.channel_ready()
        cpu, started = time.process_time(), time.perf_counter()
        received = 0
        async for _ in stream(b""):
            received += 1
        results.put((received, time.process_time() - cpu, time.perf_counter() - started))


def _client_process(target: str, results: Any) -> None:
    run_loop(_read(target, results), loop_factory("uvloop"))


def _get(queue: Any, timeout_s: float, what: str) -> Any:
    try:
        return queue.get(timeout=timeout_s)
    except Empty:
        raise RuntimeError(f"{what} within {timeout_s:g} s (its traceback, if any, is above)") from None


@contextlib.contextmanager
def _grpc_io_environment() -> Iterator[None]:
    """os.environ with the router's and the worker's gRPC I/O setting while processes are spawned (they
    inherit it, and read it when gRPC loads in them); as it was afterwards."""
    before = os.environ.get("GRPC_EXPERIMENTS")
    set_grpc_io(os.environ)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GRPC_EXPERIMENTS", None)
        else:
            os.environ["GRPC_EXPERIMENTS"] = before


def measure(transport: str, gap_ms: float, seconds: float) -> dict[str, float]:
    """One call of `seconds` (paced) or FULL_SPEED_MESSAGES messages (gap 0): µs per message."""
    count = int(seconds * 1000 / gap_ms) if gap_ms else FULL_SPEED_MESSAGES
    ctx = multiprocessing.get_context("spawn")  # fresh processes: gRPC loads in each with the setting
    ready, results = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="kvpact-one-stream-") as tmp, _grpc_io_environment():
        address = f"unix:{Path(tmp) / 'one.sock'}" if transport == "unix" else "127.0.0.1:0"
        server = ctx.Process(target=_server_process, args=(address, gap_ms / 1000, count, ready), daemon=True)
        started = []
        try:
            server.start()
            started.append(server)
            port = _get(ready, START_S, "the server did not start")
            target = address if transport == "unix" else f"127.0.0.1:{port}"
            client = ctx.Process(target=_client_process, args=(target, results), daemon=True)
            client.start()
            started.append(client)
            received, client_s, wall = _get(results, START_S + seconds * 2 + 60, "the client did not finish")
            server_s = _get(ready, START_S, "the server did not report its CPU")
        finally:
            for p in started:
                p.kill()
                p.join(timeout=5)
    if received != count:
        raise RuntimeError(f"the call delivered {received} of its {count} messages")
    per = 1e6 / count
    return {"client": client_s * per, "server": server_s * per, "wall": wall * per}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gaps", default="0,2,10,40", help="ms the server sleeps before each message")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--seconds", type=float, default=3.0, help="a paced call's length")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    transports = args.transports.split(",")
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"--transports: unknown {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
    try:
        gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        parser.error(f"--gaps: {args.gaps!r} is not a list of milliseconds (e.g. 0,10)")
    if any(gap < 0 or gap > args.seconds * 1000 for gap in gaps):
        parser.error(f"--gaps: each gap must be 0 to --seconds ({args.seconds:g} s) in ms, got {args.gaps}")
    print("CPU and wall per message, µs\n")
    print("| transport | gap ms | round | client CPU | server CPU | wall |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for transport in transports:
            for gap in gaps:
                got = measure(transport, gap, args.seconds)
                print(
                    f"| {transport} | {gap:g} | {r + 1} | {got['client']:.1f} | {got['server']:.1f} | "
                    f"{got['wall']:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
