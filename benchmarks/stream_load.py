"""A load-generating client for the router suite, run as its own process so the client is not what
limits the figures: it keeps `--streams` Generate streams open against one target for `--seconds`
(each slot opens a new stream when its previous one ends) and prints one JSON line of what it saw.

    python -m benchmarks.stream_load --target HOST:PORT --service router|worker --streams 64
        --tokens-per-s 50 --max-tokens 100 --seconds 5 [--warmup 1] [--latency] [--uvloop]

`--service worker` calls kvpact.v1.Worker/Generate on a (synthetic) worker directly, `router` calls
kvpact.v1.Generation/Generate on a router; both take the same GenerateRequest. `http` streams POST
/v1/completions (SSE) from a router's OpenAI-compatible front (`router --http-listen`) with the same
prompt; there a message is one SSE event and its tokens are the synthetic worker's stamps in its text.
Its client is aiohttp: httpx (`--http-client httpx`, kept to compare) spent 8 ms of client CPU per
request at 64 open connections here (its connection pool) against aiohttp's 0.5 ms (and gRPC's 0.4),
and read a fifth of the latency run's tokens late (docs/openai.md, "The HTTP row's p99").
The prompt text `tokens_per_s=R` sets a synthetic worker's rate for the stream
(benchmarks/synthetic_worker.py); `--prompt-text` sends a real prompt instead (a real worker; greedy).
With `--latency`, each token's delivery latency is the receive time minus the send time the synthetic
worker wrote in its text (one monotonic clock on one host). Only what arrives after `--warmup` seconds
counts; with `--requests N`, N requests are sent in all (`--streams` at a time) and everything counts,
until the last one ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

import grpc

from kvpact.shared.limits import GRPC_MESSAGE_OPTIONS
from kvpact.v1 import generation_pb2, router_pb2_grpc, worker_pb2_grpc

CALL_TIMEOUT_S = 300.0
# one SSE response, opened: its lines
OpenStream = Callable[[], AbstractAsyncContextManager[AsyncIterable[bytes]]]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass
class Tally:
    """What one load run counts, only inside its window [counted_from, end]: tokens, messages, streams,
    first-token and (with --latency) per-token delivery latencies. The same for every --service."""

    counted_from: float
    end: float
    latency: bool
    num_tokens: int = 0
    num_messages: int = 0
    num_streams: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    first_token_ms: list[float] = field(default_factory=list)
    by_worker: dict[str, int] = field(default_factory=dict)  # tokens per worker id (gRPC only)

    def message(self, now_s: float, sent: float, first: bool, stamps: list[str], num_tokens: int) -> None:
        """One message inside the window: `first` if it is its stream's first, `stamps` the synthetic
        worker's send times (monotonic ns) of its tokens."""
        self.num_messages += 1
        self.num_tokens += num_tokens
        if first:
            self.first_token_ms.append((now_s - sent) * 1e3)
        if self.latency:
            now_ns = time.monotonic_ns()
            self.latencies_ms.extend((now_ns - int(stamp)) / 1e6 for stamp in stamps)

    def stream_done(self) -> None:
        if time.monotonic() >= self.counted_from:
            self.num_streams += 1

    def summary(self, keep_latencies: bool) -> dict[str, object]:
        seconds = min(time.monotonic(), self.end) - self.counted_from
        return {
            "num_tokens": self.num_tokens,
            "num_messages": self.num_messages,
            "num_streams": self.num_streams,
            "tokens_by_worker": self.by_worker,
            "seconds": seconds,
            "tokens_per_s": self.num_tokens / seconds if seconds > 0 else 0.0,
            "latency_ms": self.latencies_ms if keep_latencies else [],
            "latency_p50_ms": percentile(self.latencies_ms, 50),
            "latency_p99_ms": percentile(self.latencies_ms, 99),
            "first_token_p50_ms": percentile(self.first_token_ms, 50),
            "first_token_p99_ms": percentile(self.first_token_ms, 99),
        }


async def run(args: argparse.Namespace) -> dict[str, object]:
    options: list[tuple[str, str | int]] = [*GRPC_MESSAGE_OPTIONS]
    if "," in args.target:  # several routers: spread the streams over them
        options.append(("grpc.lb_policy_name", "round_robin"))
    target = args.target if "," not in args.target else "ipv4:" + args.target
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        if args.service == "worker":
            call_generate = worker_pb2_grpc.WorkerStub(channel).Generate
        else:
            call_generate = router_pb2_grpc.GenerationStub(channel).Generate
        await channel.channel_ready()
        if "," in args.target:  # round_robin connects to each router; let them all be ready first
            await asyncio.sleep(0.5)
        start = time.monotonic()
        tally = Tally(start + args.warmup, start + args.warmup + args.seconds, args.latency)
        num_requests_left = args.requests
        if args.requests:  # a fixed amount of work, counted whole: until the last request ends
            tally.counted_from, tally.end = start, float("inf")

        async def slot(index: int) -> None:
            nonlocal num_requests_left
            await asyncio.sleep(index * args.stagger / max(args.streams, 1))  # not all in lockstep
            while time.monotonic() < tally.end:
                if args.requests:
                    if num_requests_left <= 0:
                        break
                    num_requests_left -= 1
                request = generation_pb2.GenerateRequest(max_tokens=args.max_tokens, ignore_eos=True)
                if args.prompt_text:
                    request.text = f"{index}. {args.prompt_text}"
                    request.sampling.temperature = 0.0
                else:
                    request.text = f"tokens_per_s={args.tokens_per_s:g}"
                sent = time.monotonic()
                first = True
                call = call_generate(request, timeout=CALL_TIMEOUT_S)
                try:
                    async for chunk in call:
                        now_s = time.monotonic()
                        if now_s < tally.counted_from:
                            first = False
                            continue
                        if now_s > tally.end:
                            break
                        n = len(chunk.token_ids)
                        tally.by_worker[chunk.worker_id] = tally.by_worker.get(chunk.worker_id, 0) + n
                        tally.message(now_s, sent, first, chunk.text.split(";")[:-1], n)
                        first = False
                finally:
                    call.cancel()
                tally.stream_done()

        await asyncio.gather(*(slot(i) for i in range(args.streams)))
    return tally.summary(args.keep_latencies)


async def run_http(args: argparse.Namespace) -> dict[str, object]:
    """The same load as `run`, as SSE streams of POST /v1/completions (synthetic worker only)."""
    # imported before the clock starts (slow on a loaded machine), as `run` starts it once its channel is up
    if args.http_client == "httpx":
        import httpx
    else:
        import aiohttp
    url = f"http://{args.target}/v1/completions"
    start = time.monotonic()
    tally = Tally(start + args.warmup, start + args.warmup + args.seconds, args.latency)
    body = {"prompt": f"tokens_per_s={args.tokens_per_s:g}", "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip

    async def slot(index: int, stream: OpenStream) -> None:
        await asyncio.sleep(index * args.stagger / max(args.streams, 1))
        while time.monotonic() < tally.end:
            sent = time.monotonic()
            first = True
            async with stream() as lines:
                async for line in lines:
                    if not line.startswith(b"data: {"):
                        continue
                    now_s = time.monotonic()
                    if now_s < tally.counted_from:
                        first = False
                        continue
                    if now_s > tally.end:
                        break
                    stamps = json.loads(line[6:])["choices"][0]["text"].split(";")[:-1]
                    tally.message(now_s, sent, first, stamps, len(stamps))
                    first = False
            tally.stream_done()

    if args.http_client == "httpx":
        limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
        async with httpx.AsyncClient(limits=limits, timeout=CALL_TIMEOUT_S) as client:

            @asynccontextmanager
            async def httpx_stream() -> AsyncIterator[AsyncIterable[bytes]]:
                async with client.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:400]!r}")
                    yield (line.encode() async for line in response.aiter_lines())

            await asyncio.gather(*(slot(i, httpx_stream) for i in range(args.streams)))
    else:
        connector = aiohttp.TCPConnector(limit=args.streams + 8)
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            @asynccontextmanager
            async def aiohttp_stream() -> AsyncIterator[AsyncIterable[bytes]]:
                async with session.post(url, json=body) as response:
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:400]!r}")
                    yield response.content  # iterates lines (each SSE `data:` line is one)

            await asyncio.gather(*(slot(i, aiohttp_stream) for i in range(args.streams)))
    return tally.summary(args.keep_latencies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="HOST:PORT, or several comma-separated")
    parser.add_argument("--service", choices=("router", "worker", "http"), default="router")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="per stream; 0 = full speed")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-text", default="", help="the prompt (a real model; greedy, ignore_eos)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--requests", type=int, default=0, help="send N requests in all, then stop (no warmup)"
    )
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--stagger", type=float, default=0.02, help="seconds over which the slots start")
    parser.add_argument("--latency", action="store_true", help="per-token delivery latency")
    parser.add_argument("--keep-latencies", action="store_true", help="print every latency, not only p50/p99")
    parser.add_argument(
        "--http-client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="--service http: the client library (httpx only to compare: it is the slower client, see above)",
    )
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args(argv)
    main_coro = run_http(args) if args.service == "http" else run(args)
    if args.uvloop:
        import uvloop

        result = uvloop.run(main_coro)
    else:
        result = asyncio.run(main_coro)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
