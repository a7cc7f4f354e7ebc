"""A model-free worker for measuring the router: it serves the kvpact Worker gRPC service, streams
tokens at a chosen rate and registers with a router as a real worker does (a ready Handshake through
kvpact.worker.registration.RouterLink, then heartbeats with its load). Benchmarks only, not the product.

    python -m benchmarks.synthetic_worker [--router HOST:PORT] [--listen 127.0.0.1:0]
        [--tokens-per-s 50] [--worker-id synthetic-0] [--model synthetic]

Each Generate streams `max_tokens` tokens (default 16), one GenerateChunk per token as a real worker's
decode steps do, at `--tokens-per-s` per stream (0: as fast as the server writes). A prompt text of the
form `tokens_per_s=R` overrides the rate for that request, so one worker serves paced and full-speed
streams. Tokens are on an absolute schedule (start + i / rate), so a late write does not slow the
stream that follows. Each chunk's text is the worker's send time, `time.monotonic_ns()` followed by
";": a client on the same machine reads it back to get each token's delivery latency (the clock is
shared by every process on a Linux host). The last chunk has finish_reason LENGTH and the usage.

It prints `synthetic worker listening on HOST:PORT` once it serves, and exits on SIGTERM/SIGINT or
when the router asks it to stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator

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
from kvpact.worker.registration import RouterLink

DEFAULT_MAX_TOKENS = 16
NUM_SLOTS = 4096  # what the handshake reports: the router never finds this worker full
MAX_MODEL_LEN = 1 << 20
RATE_PREFIX = "tokens_per_s="


def rate_of(request: generation_pb2.GenerateRequest, default: float) -> float:
    """The request's token rate: its prompt text `tokens_per_s=R`, else `default` (0: full speed)."""
    if request.WhichOneof("prompt") == "text" and request.text.startswith(RATE_PREFIX):
        return float(request.text[len(RATE_PREFIX) :])
    return default


class SyntheticWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, tokens_per_s: float) -> None:
        self.worker_id = worker_id
        self.tokens_per_s = tokens_per_s
        self.num_running = 0
        self.stopped = asyncio.Event()
        self.stop_reason = ""

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        n = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        rate = rate_of(request, self.tokens_per_s)
        rid, wid = request.request_id, self.worker_id
        self.num_running += 1
        try:
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
        finally:
            self.num_running -= 1

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
    worker = SyntheticWorker(args.worker_id, args.tokens_per_s)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *GRPC_MESSAGE_OPTIONS])
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(args.listen)
    if not port:
        print(f"synthetic worker: cannot bind --listen {args.listen}", flush=True)
        return 1
    await server.start()
    address = f"{args.listen.rsplit(':', 1)[0]}:{port}"
    loop = asyncio.get_running_loop()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--router", default="", help="register with this router (default: serve alone)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve on (port 0 = free)")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="per stream; 0 = full speed")
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
