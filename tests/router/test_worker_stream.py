"""The router's one Worker.Stream call per worker (router/worker_stream.py): every request to a worker
goes on it, each gets exactly its own tokens, a client that leaves aborts only its own request, and a
call that ended is replaced by a new one for the next request."""

from __future__ import annotations

import asyncio

import grpc

from kvpact.client import KvpactRpcError
from kvpact.router.connections import CHANNEL_OPTIONS, WORKER_WINDOW_BYTES
from kvpact.shared.limits import GRPC_MESSAGE_OPTIONS, MAX_MESSAGE_BYTES
from kvpact.v1 import generation_pb2
from tests.factories.eventually import eventually_async
from tests.router.doubles import WorkerDouble, one_worker_router, run_async


def expected(text: str, n: int) -> list[int]:
    return WorkerDouble.tokens_for(generation_pb2.GenerateRequest(text=text, max_tokens=n))


@run_async
async def test_concurrent_requests_to_one_worker_share_one_call_and_each_gets_its_own_tokens():
    double = WorkerDouble("a", delay_s=0.001)
    async with one_worker_router(double) as (_, client):
        results = await asyncio.gather(
            *(_tokens(client.generate("x" * i, max_tokens=20 + i)) for i in range(1, 33))
        )
    assert results == [expected("x" * i, 20 + i) for i in range(1, 33)]
    assert double.num_calls == 1 and len(double.requests) == 32


@run_async
async def test_a_client_that_leaves_aborts_its_request_only():
    double = WorkerDouble("a", delay_s=0.005)
    async with one_worker_router(double) as (router, client):
        leaver = client.generate("leaves", max_tokens=1000)
        assert len((await anext(leaver)).token_ids) >= 1
        stayer = asyncio.get_running_loop().create_task(
            asyncio.wait_for(_tokens(client.generate("stays", max_tokens=100)), 30)
        )
        await leaver.aclose()  # the client went away
        await eventually_async(lambda: double.cancelled, what="the worker's request to be aborted")
        assert await stayer == expected("stays", 100)
        assert [r.text for r in double.requests] == ["leaves", "stays"]
        assert double.cancelled == [double.requests[0].request_id]
        assert double.num_calls == 1 and router.cluster.registry.get("a").num_outstanding == 0


@run_async
async def test_a_call_that_ended_is_replaced_by_a_new_one_for_the_next_request():
    double = WorkerDouble("a")
    async with one_worker_router(double) as (router, client):
        assert await _tokens(client.generate("one", max_tokens=5)) == expected("one", 5)
        entry = router.cluster.registry.get("a")
        await router.cluster.channels.stream(entry).close()  # as when the connection drops between requests
        assert await _tokens(client.generate("two", max_tokens=5)) == expected("two", 5)
    assert double.num_calls == 2


@run_async
async def test_requests_on_a_call_that_is_cut_off_end_unavailable_naming_the_worker():
    double = WorkerDouble("a", delay_s=0.01)
    async with one_worker_router(double) as (router, client):
        stream = client.generate("long", max_tokens=1000)
        assert len((await anext(stream)).token_ids) >= 1
        await router.cluster.channels.stream(router.cluster.registry.get("a")).close()
        try:
            async for _ in stream:
                pass
        except KvpactRpcError as exc:
            assert exc.code is grpc.StatusCode.UNAVAILABLE
            assert exc.details.startswith('worker "a": the call to it was cut off (request id ')
        else:
            raise AssertionError("the stream ended without an error")


async def _tokens(chunks) -> list[int]:
    return [t async for c in chunks for t in c.token_ids]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@run_async
async def test_a_request_swollen_by_unknown_fields_is_served_and_fails_no_other_stream_on_the_call():
    """A client's GenerateRequest just under gRPC's message cap, nearly all of it a field the router does
    not know: the router drops what it does not know before it goes on the worker's call (wrapped, it
    would no longer fit one message and would fail every request on the call)."""
    double = WorkerDouble("a", delay_s=0.002)
    async with one_worker_router(double) as (router, client):
        other = asyncio.get_running_loop().create_task(_tokens(client.generate("other", max_tokens=300)))
        while not double.requests:
            await asyncio.sleep(0.01)
        known = generation_pb2.GenerateRequest(text="big", max_tokens=5).SerializeToString()
        pad = b"x" * (MAX_MESSAGE_BYTES - len(known) - 16)
        swollen = known + b"\xba\x3e" + _varint(len(pad)) + pad  # field 999, length-delimited: unknown
        assert len(swollen) <= MAX_MESSAGE_BYTES
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            generate = channel.unary_stream(
                "/kvpact.v1.Generation/Generate",
                request_serializer=None,  # the bytes as they are
                response_deserializer=generation_pb2.GenerateChunk.FromString,
            )
            tokens = [t async for c in generate(swollen, timeout=30) for t in c.token_ids]
        assert tokens == expected("big", 5)
        assert await asyncio.wait_for(other, 30) == expected("other", 300)  # its call was not failed
        assert double.requests[-1].ByteSize() < 100 and double.num_calls == 1


async def _backlog_kib(options: list[tuple[str, int]]) -> int:
    """KiB a server streaming 1 KiB messages as fast as it can gets ahead of a client on a channel with
    `options` that read 3 MiB of them, then stopped reading for half a second."""
    written = 0

    async def flood(request: bytes, context: grpc.aio.ServicerContext):  # noqa: ANN202, ARG001
        nonlocal written
        if request == b"one":
            yield bytes(MAX_MESSAGE_BYTES // 2)  # one message larger than the window
            return
        while True:
            yield bytes(1024)
            written += 1

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Flood": grpc.unary_stream_rpc_method_handler(flood)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            flood_call = channel.unary_stream("/t.T/Flood")
            assert [len(m) async for m in flood_call(b"one")] == [MAX_MESSAGE_BYTES // 2]
            call = flood_call(b"")
            for _ in range(3 * 1024):
                await asyncio.wait_for(call.read(), 10)
            await asyncio.sleep(0.5)
            call.cancel()
            return written - 3 * 1024
    finally:
        await server.stop(None)


@run_async
async def test_a_router_that_stops_reading_holds_its_worker_back_within_the_window():
    """The router's worker channel keeps a fixed flow-control window (router/connections.py), so a router
    that falls behind holds the worker's writes back and the worker merges its ready tokens; gRPC's
    default window, grown by BDP probing while data flows, let megabytes queue unmerged instead."""
    window_kib = WORKER_WINDOW_BYTES // 1024
    assert await _backlog_kib(CHANNEL_OPTIONS) <= 2 * window_kib
    assert await _backlog_kib(GRPC_MESSAGE_OPTIONS) > 8 * window_kib
