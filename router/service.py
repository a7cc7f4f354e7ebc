"""The client-facing Generation service: a thin relay to the chosen worker.

Generate sends the request to one worker, on the router's one Worker.Stream call to that worker
(router/worker_stream.py), and relays its chunks, merging the ones that are ready together when the
client's side falls behind (router/coalesce.py); Complete does the same and aggregates. The client's
remaining deadline travels with the request (the worker ends it DEADLINE_EXCEEDED when it passes), and a
client that cancels aborts the request on the worker (which frees its cache). The relay is closed with
`aclosing`, so the request ends when the client's call does, not whenever the garbage collector
finalizes an abandoned generator.

The relay is a byte relay (router/relayed.py): the worker's chunks arrive as bytes, are parsed once
(token counts for the metrics, what merging and Complete read), and Generate writes the worker's bytes
to the client as they came, never re-encoded (its serializer is `relayed_bytes`, router/server.py);
only a merged chunk is encoded, once.

A worker's error reaches the client naming the worker id only: its address, and whatever transport detail
the call failed with, go to the router's log with the request id the client can quote (`_worker_error`).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc
import structlog

from kvpact.router.balancing import make_balance, resolve_model, route
from kvpact.router.cluster import Cluster
from kvpact.router.cluster_state import ClusterState
from kvpact.router.coalesce import ready_chunks
from kvpact.router.errors import NoLiveWorker, NotServing, Overloaded, WorkerCallFailed
from kvpact.router.metrics import RouterMetrics
from kvpact.router.registry import WorkerEntry
from kvpact.router.relayed import RelayedChunk
from kvpact.router.worker_stream import CUT_OFF
from kvpact.shared.errors import RequestError
from kvpact.shared.limits import check_request_limits
from kvpact.v1 import generation_pb2, router_pb2, router_pb2_grpc

log = structlog.get_logger("router.generation")

# A worker's own verdicts on the request: relayed to the client (addresses redacted). Any other status
# (UNAVAILABLE, INTERNAL, UNKNOWN, ...) is about the cluster, not the request: the client gets a summary.
REQUEST_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)
_ADDRESS = re.compile(r"(?:ipv[46]:)?(?:\[[0-9a-fA-F:.]+\]|\d{1,3}(?:\.\d{1,3}){3}|[\w.-]+\.[A-Za-z]\w*):\d+")
MAX_RETRIES_GONE = 1  # a request whose worker was gone before it produced anything is retried once


class GenerationService(router_pb2_grpc.GenerationServicer):
    def __init__(self, cluster: Cluster, metrics: RouterMetrics | None = None) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.balance = make_balance(cluster.config.balance)

    async def Generate(  # type: ignore[override]  # RelayedChunks: the server writes their bytes
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[RelayedChunk]:
        async with aclosing(self.relay(request, context.time_remaining())) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Complete(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CompleteResponse:
        if request.n > 1:  # CompleteResponse holds one completion
            raise RequestError(
                f"Complete returns one completion but n is {request.n}; call Generate for n > 1 (each chunk "
                "carries its completion's index)"
            )
        response = generation_pb2.CompleteResponse()
        async with aclosing(self.relay(request, context.time_remaining())) as chunks:
            async for relayed in chunks:
                chunk = relayed.message
                response.text += chunk.text
                response.token_ids.extend(chunk.token_ids)
                response.logprobs.extend(chunk.logprobs)
                response.top_logprobs.extend(chunk.top_logprobs)
                response.tokens.extend(chunk.tokens)
                if chunk.HasField("prompt"):
                    response.prompt.CopyFrom(chunk.prompt)
                response.worker_id = chunk.worker_id
                if chunk.finish_reason:
                    response.finish_reason = chunk.finish_reason
                if chunk.HasField("usage"):
                    response.usage.CopyFrom(chunk.usage)
        response.request_id = request.request_id
        return response

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        self._check_serving()
        models = []
        for name, workers in sorted(self.cluster.registry.models().items()):
            lens = [w.realized.max_model_len for w in workers if w.realized is not None]
            models.append(
                router_pb2.ModelInfo(name=name, max_model_len=min(lens, default=0), num_workers=len(workers))
            )
        return router_pb2.ListModelsResponse(models=models)

    async def ClusterStatus(
        self, request: router_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ClusterStatusResponse:
        return self.cluster.status()

    def _check_serving(self) -> None:
        if self.cluster.state is not ClusterState.SERVING:
            raise NotServing(self.cluster.startup.describe())
        if self.cluster.stopping:
            raise NotServing("the router is stopping; send new requests to another router")

    def check_serving(self) -> None:
        """NotServing (UNAVAILABLE) unless the cluster is SERVING and the router is not stopping."""
        self._check_serving()

    def _prepare(self, request: generation_pb2.GenerateRequest) -> None:
        self._check_serving()
        check_request_limits(request)  # before the request is routed, logged or echoed
        request.DiscardUnknownFields()  # nothing the worker would read; they could only make it too big
        if not request.model:
            request.model, _ = resolve_model(self.cluster.registry, "")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex

    def _route(self, request: generation_pb2.GenerateRequest, tried: set[str]) -> WorkerEntry:
        limit = self.cluster.config.max_in_flight_per_worker
        return route(
            self.cluster.registry, request.model, self.balance, request, max_in_flight=limit, exclude=tried
        )

    async def relay(
        self, request: generation_pb2.GenerateRequest, timeout: float | None, api: str = "grpc"
    ) -> AsyncGenerator[RelayedChunk, None]:
        """The request's chunks (the worker's bytes and their parse), from the worker that serves it;
        `timeout`: what is left of the client's deadline (None: none); `api`: the front it came in on
        ("grpc", "http"), a metrics label and a log field. Both fronts call this (router/http/).

        Forward to a worker with room and relay its chunks. A worker that fails the call before it
        produced anything is not the client's problem: when it is gone (UNAVAILABLE: killed, unreachable,
        stopping) the request is retried once on another worker (and the gone one marked DEAD); when it
        is full (RESOURCE_EXHAUSTED) the next worker with room is tried. Once a chunk went out, a failure
        ends the stream with the worker's status (never a retry: no duplicate tokens)."""
        self._prepare(request)
        self.cluster.num_relaying += 1  # in flight from here to its end, retries included: the drain's count
        try:
            async with aclosing(self._retried(request, timeout, api)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.cluster.num_relaying -= 1

    async def _retried(
        self, request: generation_pb2.GenerateRequest, timeout: float | None, api: str
    ) -> AsyncGenerator[RelayedChunk, None]:
        """`relay`'s worker calls: the first worker routed to, then the retries (see `relay`)."""
        tried: set[str] = set()
        num_retries = 0
        entry = self._route(request, tried)
        while True:
            tried.add(entry.worker_id)
            produced = False
            bound = structlog.contextvars.bound_contextvars(
                request_id=request.request_id, worker_id=entry.worker_id, api=api
            )
            try:
                with bound:
                    async with aclosing(self._forward(entry, request, timeout, api)) as chunks:
                        async for chunk in chunks:
                            produced = True
                            yield chunk
                return
            except WorkerCallFailed as failure:
                if failure.worker_gone:
                    await self.cluster.call_failed(entry, f"a call to it failed: {failure.details}")
                retry = not produced and (
                    (failure.worker_gone and num_retries < MAX_RETRIES_GONE) or failure.worker_full
                )
                if not retry:
                    raise
                num_retries += failure.worker_gone
                failed_worker = entry.worker_id
                try:
                    entry = self._route(request, tried)
                except (NoLiveWorker, Overloaded):
                    raise failure from None
                log.info(
                    "request_retried",
                    request_id=request.request_id,
                    failed_worker=failed_worker,
                    code=failure.code.name,
                    next_worker=entry.worker_id,
                )

    async def _forward(
        self, entry: WorkerEntry, request: generation_pb2.GenerateRequest, timeout: float | None, api: str
    ) -> AsyncGenerator[RelayedChunk, None]:
        """The request's chunks from `entry`, on the router's one Worker.Stream call to it
        (router/worker_stream.py). Each time the relay is free it takes every chunk that arrived and
        yields them merged, within one message's limits (router/coalesce.py): one at a time while its
        client keeps up, several once its writes fell behind; a chunk is never held back for company."""
        stream = self.cluster.channels.stream(entry)
        code = grpc.StatusCode.OK
        num_tokens = 0
        entry.num_outstanding += 1
        started = last = time.monotonic()
        timings = self.metrics.stream(request.model, api) if self.metrics is not None else None
        tag, inbox = stream.start(request, timeout)
        chunks = ready_chunks(inbox, entry.worker_id)
        try:
            async for chunk in chunks:
                num_chunk_tokens = len(chunk.message.token_ids)
                if num_chunk_tokens and timings is not None:
                    now = time.monotonic()
                    timings.chunk(now - last, num_chunk_tokens, num_tokens == 0)
                    last = now
                num_tokens += num_chunk_tokens
                if self.cluster.drain_expired:
                    code = grpc.StatusCode.UNAVAILABLE
                    timeout_s = self.cluster.config.drain_timeout_s
                    raise NotServing(
                        f"the router is stopping and its --drain-timeout {timeout_s:g} s ran out before this "
                        f"stream finished ({num_tokens - num_chunk_tokens} tokens sent); send the rest to "
                        "another router, or give the router a longer --drain-timeout"
                    )
                yield chunk
            assert inbox.end is not None  # ready_chunks ends at the end
            code, details = inbox.end
            if code is not grpc.StatusCode.OK:
                raise _worker_error(entry, request.request_id, code, details, inbox.call_ended)
        except (NotServing, WorkerCallFailed):  # the router's drain ran out (above); the worker failed it
            raise
        except BaseException:  # the client cancelled (or its deadline passed): stop the worker's work too
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            await chunks.aclose()
            entry.num_outstanding -= 1
            if inbox.end is None:
                stream.abort(tag)
            log.debug(
                "request_done",
                request_id=request.request_id,
                worker_id=entry.worker_id,
                api=api,
                code=code.name,
                num_tokens=num_tokens,
            )
            if self.metrics is not None:
                self.metrics.observe_request(request.model, code.name, num_tokens, api)
                self.metrics.observe_duration(request.model, time.monotonic() - started, api)


def _worker_error(
    entry: WorkerEntry, request_id: str, code: grpc.StatusCode, details: str, call_ended: bool
) -> WorkerCallFailed:
    """What the client hears when the worker failed the request (`call_ended`: its whole Worker.Stream
    call failed, not this request alone): the worker id, never its address; the whole detail is logged
    with the request id."""
    log.warning(
        "worker_call_failed",
        request_id=request_id,
        worker_id=entry.worker_id,
        address=entry.address,
        code=code.name,
        details=details,
        call_ended=call_ended,
    )
    if call_ended and details == CUT_OFF:
        return WorkerCallFailed(
            code, f'worker "{entry.worker_id}": {CUT_OFF} (request id {request_id}); retry'
        )
    if code in REQUEST_CODES and not call_ended:
        relayed = redact_addresses(details, entry.address)
        return WorkerCallFailed(code, f'worker "{entry.worker_id}": {relayed} (request id {request_id})')
    return WorkerCallFailed(
        code,
        f'worker "{entry.worker_id}" could not serve request {request_id} ({code.name}); the router\'s log '
        "has the cause under that request id",
    )


def redact_addresses(text: str, address: str) -> str:
    """`text` without `address` and anything shaped like HOST:PORT."""
    if address:
        text = text.replace(address, "<worker>")
    return _ADDRESS.sub("<address>", text)
