"""The router's byte relay (router/relayed.py): a streamed Generate carries the worker's chunks as the
worker encoded them (with the router's worker id where the worker sent none), the same tokens, text,
finish and usage as the parsed relay gave, and the same final status and error text when the worker
fails, before its first chunk or after some."""

from __future__ import annotations

import grpc
import pytest

from kvpact.router.coalesce import ready_chunks
from kvpact.router.relayed import RelayedChunk, relayed_bytes
from kvpact.router.worker_stream import Inbox
from kvpact.v1 import generation_pb2, router_pb2
from tests.router.doubles import WorkerDouble, one_worker_router, run_async, status_error

GenerateChunk = generation_pb2.GenerateChunk
LENGTH = generation_pb2.FINISH_REASON_LENGTH


def raw_generate(channel: grpc.aio.Channel, service: str) -> grpc.aio.UnaryStreamMultiCallable:
    """`service`'s Generate with no response deserializer: each message as the bytes that came."""
    return channel.unary_stream(
        f"/kvpact.v1.{service}/Generate",
        request_serializer=generation_pb2.GenerateRequest.SerializeToString,
        response_deserializer=None,
    )


def as_the_parsed_relay_sent_it(data: bytes, worker_id: str) -> GenerateChunk:
    """What the router sent before the byte relay: the chunk parsed, its worker id filled, re-encoded."""
    chunk = GenerateChunk.FromString(data)
    if not chunk.worker_id:
        chunk.worker_id = worker_id
    return GenerateChunk.FromString(chunk.SerializeToString())


class FailsAfter(WorkerDouble):
    """Streams `num_chunks` tokens, then ends the call with `code` and a detail naming an address."""

    def __init__(self, worker_id: str, num_chunks: int, code: grpc.StatusCode) -> None:
        super().__init__(worker_id)
        self.num_chunks, self.code = num_chunks, code

    async def chunks(self, request, timeout):
        for token in self.tokens_for(request)[: self.num_chunks]:
            yield GenerateChunk(request_id=request.request_id, text=f"t{token} ", token_ids=[token])
        raise status_error(self.code, "no room left at 10.1.2.3:7000")


@run_async
async def test_a_streamed_generate_is_the_workers_bytes_with_the_routers_worker_id():
    double = WorkerDouble("a")
    request = generation_pb2.GenerateRequest(request_id="rid-1", text="hello", max_tokens=40)
    request.sampling.top_logprobs = 2
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(double.address) as direct:
            sent = [data async for data in raw_generate(direct, "Worker")(request, timeout=30)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            call = raw_generate(channel, "Generation")(request, timeout=30)
            relayed = [data async for data in call]
            assert await call.code() is grpc.StatusCode.OK
    expected = [as_the_parsed_relay_sent_it(data, "a") for data in sent]
    got = [GenerateChunk.FromString(data) for data in relayed]
    tokens = WorkerDouble.tokens_for(request)
    assert [t for c in got for t in c.token_ids] == [t for c in expected for t in c.token_ids] == tokens
    assert "".join(c.text for c in got) == "".join(f"t{t} " for t in tokens)
    assert [list(t.token_ids) for c in got for t in c.top_logprobs] == [[t, t + 1] for t in tokens]
    assert {c.worker_id for c in got} == {"a"} and {c.request_id for c in got} == {"rid-1"}
    assert got[-1].finish_reason == LENGTH and got[-1].usage.completion_tokens == len(tokens)
    assert len(got[0].token_ids) == 1  # the first token alone
    if len(relayed) == len(sent):  # nothing merged (a client that keeps up): message for message
        assert got == expected
        # The worker's own bytes, never re-encoded: the router only appended its worker id.
        worker_id_field = GenerateChunk(worker_id="a").SerializeToString()
        assert relayed == [data + worker_id_field for data in sent]


@run_async
async def test_a_worker_that_sets_its_worker_id_is_relayed_byte_for_byte():
    double = WorkerDouble("a")

    async def with_id(request, timeout):
        for token in double.tokens_for(request):
            yield GenerateChunk(request_id=request.request_id, token_ids=[token], worker_id="a")

    double.chunks = with_id
    request = generation_pb2.GenerateRequest(request_id="rid-2", text="hi", max_tokens=5)
    async with one_worker_router(double) as (router, client):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            relayed = [data async for data in raw_generate(channel, "Generation")(request, timeout=30)]
        completed = await client.complete("hi", max_tokens=5)
    expected = [
        GenerateChunk(request_id="rid-2", token_ids=[t], worker_id="a") for t in double.tokens_for(request)
    ]
    if len(relayed) == len(expected):
        assert relayed == [c.SerializeToString() for c in expected]
    assert [t for d in relayed for t in GenerateChunk.FromString(d).token_ids] == double.tokens_for(request)
    assert list(completed.token_ids) == double.tokens_for(request) and completed.worker_id == "a"


@pytest.mark.parametrize(
    ("code", "relayed_detail"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 'worker "a": no room left at <address> (request id rid-3)'),
        (
            grpc.StatusCode.INTERNAL,
            'worker "a" could not serve request rid-3 (INTERNAL); the router\'s log has the cause under that '
            "request id",
        ),
    ],
    ids=["request-code", "cluster-code"],
)
@run_async
async def test_a_worker_failing_mid_stream_ends_the_relay_with_its_status_after_every_token(
    code, relayed_detail
):
    double = FailsAfter("a", num_chunks=3, code=code)
    request = generation_pb2.GenerateRequest(request_id="rid-3", text="hello", max_tokens=10)
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            call = raw_generate(channel, "Generation")(request, timeout=30)
            relayed = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for data in call:
                    relayed.append(data)
    assert [t for d in relayed for t in GenerateChunk.FromString(d).token_ids] == double.tokens_for(request)[
        :3
    ]
    assert err.value.code() is code
    assert err.value.details() == relayed_detail


@run_async
async def test_a_refusal_before_the_first_chunk_keeps_its_code_and_redacted_detail():
    double = WorkerDouble("a")
    double.refuse = (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens too large for 127.0.0.1:9999")
    request = generation_pb2.GenerateRequest(request_id="rid-4", text="hello", max_tokens=10)
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [d async for d in raw_generate(channel, "Generation")(request, timeout=30)]
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == 'worker "a": max_tokens too large for <address> (request id rid-4)'


@run_async
async def test_every_generation_method_is_served():
    """The router registers Generation itself (for Generate's byte serializer): none is left out."""
    double = WorkerDouble("a")
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            service = router_pb2.DESCRIPTOR.services_by_name["Generation"]
            for method in service.methods:
                request = {
                    "Generate": generation_pb2.GenerateRequest(text="x", max_tokens=1),
                    "Complete": generation_pb2.GenerateRequest(text="x", max_tokens=1),
                    "ListModels": router_pb2.ListModelsRequest(),
                    "ClusterStatus": router_pb2.ClusterStatusRequest(),
                }[method.name]
                path = f"/{service.full_name}/{method.name}"
                if method.server_streaming:
                    call = channel.unary_stream(path, request_serializer=type(request).SerializeToString)
                    assert [m async for m in call(request, timeout=10)]
                else:
                    call = channel.unary_unary(path, request_serializer=type(request).SerializeToString)
                    assert await call(request, timeout=10) is not None


@run_async
async def test_a_relayed_chunk_reads_as_its_message_and_serializes_to_its_bytes():
    data = GenerateChunk(request_id="r", token_ids=[5, 6], text="ab").SerializeToString()
    inbox = Inbox()  # the relay's own path: the worker's bytes into an inbox, out as a RelayedChunk
    inbox.put(data)
    inbox.finish(grpc.StatusCode.OK, "")
    [chunk] = [c async for c in ready_chunks(inbox, "w")]
    assert isinstance(chunk, RelayedChunk)
    assert list(chunk.token_ids) == [5, 6] and chunk.text == "ab" and chunk.worker_id == "w"
    assert GenerateChunk.FromString(relayed_bytes(chunk)) == chunk.message
    with pytest.raises(AttributeError):
        chunk.no_such_field  # noqa: B018
