"""A model-free worker for measuring the router: it serves the kvpact Worker gRPC service, streams
tokens at a chosen rate and registers with a router as a real worker does (a ready Handshake through
kvpact.worker.registration.RouterLink, then heartbeats with its load). Benchmarks only, not the product.

    python -m benchmarks.synthetic_worker [--router HOST:PORT] [--listen 127.0.0.1:0]
        [--tokens-per-s 50 | --step-ms 10] [--worker-id synthetic-0] [--model synthetic]

Two loads:

Requests come as a real worker's do: from the router on Worker.Stream, many on one call, through the
real kvpact.worker.stream_server (so a write carries every chunk that was ready), or one per
Worker.Generate call (the load clients' direct path).

- per token (the default): each request streams `max_tokens` tokens (default 16), one GenerateChunk
  per token, at `--tokens-per-s` per stream (0: as fast as its writes go, so it never has two tokens
  ready at once: a request's next chunk is made once its last was written, on either call). A prompt
  text of the form `tokens_per_s=R` overrides the rate for that request,
  so one worker serves paced and full-speed streams. Tokens are on an absolute schedule
  (start + i / rate), so a late write does not slow the stream that follows.
- engine steps (`--step-ms MS`): what a real worker's engine does, without the model. A step thread,
  every MS milliseconds, produces one token for every running stream and hands each to its stream's
  event loop as the real step thread does (a LoopHandoff: one wake-up per step); each stream takes them
  through the real engine's kvpact.worker.engine.ready_pieces.ReadyPieces and converts them with the real
  worker's chunk_to_pb. So when a stream's writes fall behind (its worker's event loop is busy, or
  HTTP/2 flow control holds the writes because the reader is slow), the tokens that piled up go out
  as one message, exactly as from a real worker. Each stream then runs at 1000 / MS tokens per second;
  `--tokens-per-s` and the prompt's rate do not apply. A step that overran its time is followed at once
  by the next (a late engine does not catch up by bursting).

Each token's text is its send time (per token: the write; engine steps: the step), `time.monotonic_ns()`
followed by ";": a client on the same machine reads it back to get each token's delivery latency (the
clock is shared by every process on a Linux host). The last chunk has finish_reason LENGTH and the usage.

It prints `synthetic worker listening on HOST:PORT` once it serves, and exits on SIGTERM/SIGINT or
when the router asks it to stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc

from kvpact.shared import handshake_pb, reasons
from kvpact.shared.features import FeatureMode, FeatureState
from kvpact.shared.fingerprint import Fingerprint
from kvpact.shared.handshake import WorkerLoad
from kvpact.shared.intent import CacheDtype, PagedAttentionConfig, PagedAttentionMode, cache_intent
from kvpact.shared.limits import GRPC_MESSAGE_OPTIONS
from kvpact.shared.realized import RealizedCache
from kvpact.shared.reasons import PAGED_ATTN
from kvpact.shared.spec import WorkerSpec
from kvpact.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from kvpact.worker.engine.ready_pieces import LoopHandoff, ReadyPieces
from kvpact.worker.engine.request import FinishReason, GenerationOutput, Usage
from kvpact.worker.generate_pb import chunk_to_pb
from kvpact.worker.registration import RouterLink
from kvpact.worker.stream_server import StreamServer

DEFAULT_MAX_TOKENS = 16
NUM_SLOTS = 4096  # what the handshake reports: the router never finds this worker full
MAX_MODEL_LEN = 1 << 20
RATE_PREFIX = "tokens_per_s="


def rate_of(request: generation_pb2.GenerateRequest, default: float) -> float:
    """The request's token rate: its prompt text `tokens_per_s=R`, else `default` (0: full speed)."""
    if request.WhichOneof("prompt") == "text" and request.text.startswith(RATE_PREFIX):
        return float(request.text[len(RATE_PREFIX) :])
    return default


@dataclass(slots=True)
class _Stepped:
    """A stream of the engine-steps load: its request, how many tokens it has had, and its pieces."""

    request_id: str
    max_tokens: int
    pieces: ReadyPieces
    num_sent: int = 0


class EngineSteps:
    """The engine-steps load's step thread: every `step_s`, one token for every running stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop, step_s: float) -> None:
        self.handoff = LoopHandoff(loop)
        self.step_s = step_s
        self.streams: dict[int, _Stepped] = {}  # id() -> stream; changed under `lock`
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="synthetic-steps", daemon=True)

    def add(self, stream: _Stepped) -> None:
        with self.lock:
            self.streams[id(stream)] = stream

    def remove(self, stream: _Stepped) -> None:
        with self.lock:
            self.streams.pop(id(stream), None)

    def _run(self) -> None:
        next_step = time.monotonic()
        while not self.stopped.is_set():
            next_step = max(next_step + self.step_s, time.monotonic())
            self.stopped.wait(next_step - time.monotonic())
            with self.lock:
                streams = list(self.streams.values())
            stamp = f"{time.monotonic_ns()};"
            for stream in streams:
                if stream.num_sent == stream.max_tokens:
                    continue  # its last token is out; its Generate removes it
                i = stream.num_sent = stream.num_sent + 1
                piece = GenerationOutput(stream.request_id, stamp, [i % 32000], [])
                if i == stream.max_tokens:
                    piece.finish_reason = FinishReason.LENGTH
                    piece.usage = Usage(prompt_tokens=1, completion_tokens=i, cached_prompt_tokens=0)
                if not self.handoff.send(stream.pieces, piece):
                    return  # the event loop closed: the worker is exiting


class SyntheticWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, tokens_per_s: float, steps: EngineSteps | None = None) -> None:
        self.worker_id = worker_id
        self.tokens_per_s = tokens_per_s
        self.steps = steps  # the engine-steps load; None: per token
        self.num_running = 0
        self.stopped = asyncio.Event()
        self.stop_reason = ""

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        async for chunk in self._chunks(request, None):
            yield chunk

    async def Stream(
        self, requests: AsyncIterator[worker_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StreamReply]:
        """The router's way to a worker, served as the real worker serves it (worker/stream_server.py)."""
        async for reply in StreamServer(self._chunks, _internal).serve(requests):
            yield reply

    async def _chunks(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[generation_pb2.GenerateChunk]:
        n = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        self.num_running += 1
        try:
            chunks = self._per_token(request, n) if self.steps is None else self._stepped(request, n)
            async for chunk in chunks:
                yield chunk
        finally:
            self.num_running -= 1

    async def _per_token(
        self, request: generation_pb2.GenerateRequest, n: int
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        rate = rate_of(request, self.tokens_per_s)
        rid, wid = request.request_id, self.worker_id
        start = time.monotonic()
        for i in range(n):
            if rate > 0:
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            chunk = generation_pb2.GenerateChunk(
                request_id=rid, text=f"{time.monotonic_ns()};", token_ids=[i % 32000], worker_id=wid
            )
            if i == n - 1:
                chunk.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 1, n
            yield chunk

    async def _stepped(
        self, request: generation_pb2.GenerateRequest, n: int
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        assert self.steps is not None
        stream = _Stepped(request.request_id, n, ReadyPieces())
        self.steps.add(stream)
        try:
            while True:
                piece = await stream.pieces.next()
                if isinstance(piece, BaseException):
                    raise piece
                yield chunk_to_pb(piece, self.worker_id)
                if piece.usage is not None:
                    return
        finally:
            self.steps.remove(stream)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            num_running=self.num_running,
            num_free_blocks=NUM_SLOTS - min(self.num_running, NUM_SLOTS),
            num_total_blocks=NUM_SLOTS,
        )

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortReply:
        return worker_pb2.AbortReply(found=False)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return handshake_pb.load_to_pb(self.load())

    async def Shutdown(
        self, request: worker_pb2.ShutdownRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ShutdownReply:
        self.stop(request.reason or "the router asked this worker to stop")
        return worker_pb2.ShutdownReply()

    def stop(self, reason: str) -> None:
        if not self.stopped.is_set():
            self.stop_reason = reason
            self.stopped.set()


def _internal(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.INTERNAL, f"the synthetic worker failed: {exc!r}"


def ready_handshake(worker_id: str, address: str, model: str) -> worker_pb2.Handshake:
    """What a CPU worker with an eager cache of NUM_SLOTS sequences would report (`--paged-attn auto`)."""
    spec = WorkerSpec(
        model=model,
        device="cpu",
        cache=cache_intent(PagedAttentionMode.AUTO, PagedAttentionConfig()),
    )
    eager = reasons.EAGER_DEFAULT.found(device="CPU")  # what auto realizes on a CPU, and why
    realized = RealizedCache(
        max_model_len=MAX_MODEL_LEN,
        capacity_tokens=NUM_SLOTS * MAX_MODEL_LEN,
        max_concurrency=NUM_SLOTS,
        num_blocks=NUM_SLOTS,
        memory_bytes=0,
        cache_dtype=CacheDtype.FLOAT32,
        features=(
            FeatureState(PAGED_ATTN, FeatureMode.AUTO, False, eager.code, eager.message, eager.component),
        ),
    )
    return worker_pb2.Handshake(
        worker_id=worker_id,
        address=address,
        model_name=model,
        spec=handshake_pb.spec_to_pb(spec),
        capabilities=worker_pb2.Capabilities(device_kind="cpu"),
        labels={"synthetic": "true"},
        ready=handshake_pb.realized_to_pb(realized),
        # every synthetic worker serves the same "model": one fingerprint (router --uniform admits them all)
        fingerprint=handshake_pb.fingerprint_to_pb(
            Fingerprint(model="sha256:synthetic", tokenizer="sha256:synthetic", max_model_len=MAX_MODEL_LEN)
        ),
    )


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    steps = EngineSteps(loop, args.step_ms / 1000) if args.step_ms > 0 else None
    worker = SyntheticWorker(args.worker_id, args.tokens_per_s, steps)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *GRPC_MESSAGE_OPTIONS])
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(args.listen)
    if not port:
        print(f"synthetic worker: cannot bind --listen {args.listen}", flush=True)
        return 1
    await server.start()
    address = f"{args.listen.rsplit(':', 1)[0]}:{port}"
    if steps is not None:
        steps.thread.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop, sig.name)
    link: RouterLink | None = None
    beats: asyncio.Task[str] | None = None
    try:
        if args.router:
            link = RouterLink(args.router, worker_id=args.worker_id, auth_token=None, timeout_s=30.0)
            handshake = ready_handshake(args.worker_id, address, args.model)
            admission = await link.register(handshake)
            if not admission.admitted:
                print(f"synthetic worker: the router refused it: {admission.reason}", flush=True)
                return 1

            async def reregister() -> None:
                await link.register(handshake)

            interval = admission.heartbeat_interval_ms / 1000 or 2.0
            beats = loop.create_task(link.heartbeats(interval, worker.load, reregister))
            beats.add_done_callback(lambda t: worker.stop("heartbeats ended"))
        print(f"synthetic worker listening on {address}", flush=True)
        await worker.stopped.wait()
        return 0
    finally:
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await beats
        if link is not None:
            await link.close()
        await server.stop(0.2)
        if steps is not None:
            steps.stopped.set()
            steps.thread.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--router", default="", help="register with this router (default: serve alone)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve on (port 0 = free)")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="per stream; 0 = full speed")
    parser.add_argument("--step-ms", type=float, default=0.0, help="engine step length; 0: per token")
    parser.add_argument("--worker-id", default="synthetic-0")
    parser.add_argument("--model", default="synthetic", help="the model name it serves")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args(argv)
    if args.uvloop:
        import uvloop

        return uvloop.run(serve(args))
    return asyncio.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
