"""Coalescing a relayed stream (router/coalesce.py): a client that falls behind gets the ready chunks
merged, every token exactly once and in order, the first token never held back, the final status
unchanged; a client that keeps up gets the chunks as they came; and through a real router, a reader
that stalls gets fewer messages than tokens."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpact.router import coalesce
from kvpact.router.coalesce import (
    BEHIND_AFTER_S,
    MAX_READY,
    MAX_TOKENS_PER_MESSAGE,
    coalesced,
    merge_chunks,
)
from kvpact.router.errors import WorkerCallFailed
from kvpact.router.service import GenerationService
from kvpact.v1 import generation_pb2, router_pb2_grpc
from tests.factories.eventually import eventually_async
from tests.router.doubles import WorkerDouble, one_worker_router, run_async

LENGTH = generation_pb2.FINISH_REASON_LENGTH
STALL_S = 2 * BEHIND_AFTER_S  # a client this slow to take one message has fallen behind


def chunk(i: int, *, last: bool = False) -> generation_pb2.GenerateChunk:
    c = generation_pb2.GenerateChunk(request_id="r", text=f"t{i} ", token_ids=[i], logprobs=[-i / 10])
    if last:
        c.finish_reason = LENGTH
        c.usage.prompt_tokens, c.usage.completion_tokens = 3, i + 1
    return c


async def fast_source(n: int):
    for i in range(n):
        yield chunk(i, last=i == n - 1)
        await asyncio.sleep(0)  # ready at once, one after another


def flatten(messages: list[generation_pb2.GenerateChunk]) -> tuple[list[int], list[float], str]:
    tokens = [t for m in messages for t in m.token_ids]
    logprobs = [p for m in messages for p in m.logprobs]
    return tokens, logprobs, "".join(m.text for m in messages)


def assert_whole_stream(messages: list[generation_pb2.GenerateChunk], n: int) -> None:
    tokens, logprobs, text = flatten(messages)
    assert tokens == list(range(n))
    assert logprobs == pytest.approx([-i / 10 for i in range(n)])
    assert text == "".join(f"t{i} " for i in range(n))
    assert [m.finish_reason for m in messages] == [0] * (len(messages) - 1) + [LENGTH]
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].usage.completion_tokens == n and {m.request_id for m in messages} == {"r"}


@run_async
async def test_a_slow_consumer_gets_every_token_once_in_order_in_fewer_messages():
    messages = []
    async for message in coalesced(fast_source(300)):
        messages.append(message)
        await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)  # stalls, then stays behind
    assert_whole_stream(messages, 300)
    assert len(messages) < 300 / 4, len(messages)
    assert len(messages[0].token_ids) == 1  # the first token went out alone, at once


@run_async
async def test_the_first_token_is_not_held_back_for_a_second():
    first_seen = asyncio.Event()

    async def source():
        yield chunk(0)
        await first_seen.wait()  # a coalescer that waited for more would never see another chunk
        yield chunk(1, last=True)

    stream = coalesced(source())
    first = await asyncio.wait_for(anext(stream), 5)
    assert list(first.token_ids) == [0]
    first_seen.set()
    assert_whole_stream([first, *[m async for m in stream]], 2)


@run_async
async def test_a_consumer_that_keeps_up_gets_one_message_per_chunk():
    received = asyncio.Event()

    async def lockstep():
        for i in range(20):
            received.clear()
            yield chunk(i, last=i == 19)
            await received.wait()

    messages = []
    async for message in coalesced(lockstep()):
        messages.append(message)
        received.set()
    assert [list(m.token_ids) for m in messages] == [[i] for i in range(20)]


@run_async
async def test_the_sources_error_comes_after_every_chunk_read_before_it():
    async def failing():
        for i in range(50):
            yield chunk(i)
            await asyncio.sleep(0)
        raise WorkerCallFailed(grpc.StatusCode.INTERNAL, 'worker "a" could not serve request r')

    messages = []
    with pytest.raises(WorkerCallFailed) as err:
        async for message in coalesced(failing()):
            messages.append(message)
            await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)
    assert err.value.code is grpc.StatusCode.INTERNAL
    assert flatten(messages)[0] == list(range(50)) and len(messages) < 50


@run_async
async def test_closing_the_stream_ends_the_source_before_close_returns():
    ended = []

    async def endless():
        try:
            i = 0
            while True:
                yield chunk(i)
                i += 1
                await asyncio.sleep(0.001)
        finally:
            ended.append(True)

    stream = coalesced(endless())  # the client keeps up: no reader task
    await anext(stream)
    await stream.aclose()
    assert ended == [True]

    ended.clear()
    stream = coalesced(endless())
    await anext(stream)
    await asyncio.sleep(STALL_S)  # behind: the reader task reads ahead
    await anext(stream)
    await asyncio.sleep(0.02)
    await stream.aclose()
    assert ended == [True]


@run_async
async def test_a_backlog_goes_out_in_bounded_messages_and_a_stuck_client_pushes_back():
    produced = []

    async def counted(n: int):
        for i in range(n):
            produced.append(i)
            yield chunk(i, last=i == n - 1)
            await asyncio.sleep(0)

    n = MAX_READY + 500
    stream = coalesced(counted(n))
    assert list((await anext(stream)).token_ids) == [0]
    assert len(produced) == 1  # keeping up, the relay reads only what it writes
    await asyncio.sleep(STALL_S)
    second = await anext(stream)  # behind from here: the reader reads ahead while nobody takes
    await eventually_async(lambda: len(produced) >= MAX_READY, what="the reader to fill its read-ahead")
    await asyncio.sleep(0.05)
    assert len(produced) <= MAX_READY + len(second.token_ids) + 1  # it stopped: the worker's stream waits
    rest = [m async for m in stream]
    assert max(len(m.token_ids) for m in rest) == MAX_TOKENS_PER_MESSAGE
    assert_whole_stream([chunk(0), second, *rest], n)


def test_merge_keeps_one_chunk_as_it_is_and_joins_several():
    one = chunk(7)
    assert merge_chunks([one]) is one
    merged = merge_chunks([chunk(0), chunk(1), chunk(2, last=True)])
    assert list(merged.token_ids) == [0, 1, 2] and merged.text == "t0 t1 t2 "
    assert merged.finish_reason == LENGTH and merged.usage.completion_tokens == 3


def test_merge_carries_top_logprobs_in_order_and_never_joins_two_completions():
    def with_top(i: int, index: int = 0) -> generation_pb2.GenerateChunk:
        c = chunk(i)
        c.index = index
        c.top_logprobs.add(token_ids=[i, i + 100], logprobs=[-0.1, -2.0])
        return c

    merged = merge_chunks([with_top(0), with_top(1), with_top(2)])
    assert [list(t.token_ids) for t in merged.top_logprobs] == [[0, 100], [1, 101], [2, 102]]
    assert list(merged.logprobs) == pytest.approx([0, -0.1, -0.2])
    ready = [with_top(0), with_top(1), with_top(2, index=1), with_top(3, index=1), with_top(4)]
    batches = [coalesce.take_batch(ready) for _ in range(3)]
    assert [[c.token_ids[0] for c in b] for b in batches] == [[0, 1], [2, 3], [4]]
    assert [merge_chunks(b).index for b in batches] == [0, 1, 0] and not ready


@run_async
async def test_a_slow_consumer_of_n_completions_never_gets_two_indexes_in_one_message():
    async def interleaved(n: int):  # two completions (n=2) whose chunks arrive in runs of 3
        for i in range(n):
            c = chunk(i, last=i >= n - 2)
            c.index = (i // 3) % 2
            yield c
            await asyncio.sleep(0)

    messages = []
    async for message in coalesced(interleaved(120)):
        messages.append(message)
        await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)
    assert len(messages) < 120  # it did merge
    for message in messages:  # never across completions: every token of a message has its index
        assert {(t // 3) % 2 for t in message.token_ids} == {message.index}
    assert sorted(t for m in messages for t in m.token_ids) == list(range(120))
    for index in (0, 1):
        tokens = [t for m in messages if m.index == index for t in m.token_ids]
        assert tokens == sorted(tokens)  # each completion in order


def test_the_message_caps_leave_room_under_the_grpc_limit():
    from kvpact.shared.limits import MAX_MESSAGE_BYTES

    assert coalesce.MAX_TEXT_PER_MESSAGE * 4 + MAX_TOKENS_PER_MESSAGE * 10 < MAX_MESSAGE_BYTES


SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@run_async
async def test_through_the_router_a_stalling_reader_gets_every_token_once_in_order():
    """A real router relaying a worker that streams 3,000 tokens as fast as it can to a client that
    stalls now and then (a small HTTP/2 window, so the router's writes wait for it): the same tokens,
    text, finish and status as the worker sent."""
    n = 3000
    double = WorkerDouble("a")
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}", options=SMALL_WINDOW) as channel:
            call = router_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(text="hello", max_tokens=n), timeout=30
            )
            messages = []
            async for message in call:
                messages.append(message)
                if len(messages) % 500 == 1:
                    await asyncio.sleep(STALL_S)
            assert await call.code() is grpc.StatusCode.OK
    expected = WorkerDouble.tokens_for(generation_pb2.GenerateRequest(text="hello", max_tokens=n))
    assert [t for m in messages for t in m.token_ids] == expected
    assert "".join(m.text for m in messages) == "".join(f"t{t} " for t in expected)
    assert messages[-1].finish_reason == LENGTH and messages[-1].usage.completion_tokens == n
    assert len(messages) <= n


class _NoDeadline:
    """The little of a grpc.aio ServicerContext that the relay reads."""

    def time_remaining(self):
        return None


@run_async
async def test_the_routers_relay_merges_what_a_slow_client_leaves_waiting():
    """The router's Generate handler, relaying a real worker over gRPC, to a consumer that falls behind:
    every token once and in order, in far fewer messages; the worker call over when it ends."""
    n = 600
    double = WorkerDouble("a")
    async with one_worker_router(double) as (router, _):
        handler = GenerationService(router.cluster).Generate
        relay = handler(generation_pb2.GenerateRequest(text="hello", max_tokens=n), _NoDeadline())
        messages = []
        async for message in relay:
            messages.append(message)
            await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)
        assert router.cluster.registry.get("a").num_outstanding == 0
    expected = WorkerDouble.tokens_for(generation_pb2.GenerateRequest(text="hello", max_tokens=n))
    assert [t for m in messages for t in m.token_ids] == expected
    assert messages[-1].finish_reason == LENGTH and messages[-1].usage.completion_tokens == n
    assert len(messages) < n / 4, len(messages)
