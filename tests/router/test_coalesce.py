"""Merging a relayed stream (router/coalesce.py): a relay that falls behind gets the ready chunks merged,
every token exactly once and in order, the first token never held back, the end read after every
chunk; a relay that keeps up gets the chunks as they came; and through a real router, a reader that
stalls gets fewer messages than tokens, and does not hold back the other streams on its worker's call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpact.router import coalesce
from kvpact.router.coalesce import merge_chunks, ready_chunks
from kvpact.router.relayed import RelayedChunk
from kvpact.router.service import GenerationService
from kvpact.router.worker_stream import Inbox
from kvpact.shared.limits import MAX_TOKENS_PER_MESSAGE
from kvpact.v1 import generation_pb2, router_pb2_grpc
from tests.router.doubles import WorkerDouble, one_worker_router, run_async

LENGTH = generation_pb2.FINISH_REASON_LENGTH
STALL_S = 0.1  # a relay this slow to take one message has fallen behind a worker that streams at once


def chunk(i: int, *, last: bool = False) -> generation_pb2.GenerateChunk:
    c = generation_pb2.GenerateChunk(request_id="r", text=f"t{i} ", token_ids=[i], logprobs=[-i / 10])
    if last:
        c.finish_reason = LENGTH
        c.usage.prompt_tokens, c.usage.completion_tokens = 3, i + 1
    return c


def fill(inbox: Inbox, chunks, *, end: grpc.StatusCode | None = grpc.StatusCode.OK) -> asyncio.Task[None]:
    """A task that puts `chunks` into `inbox` one per loop turn, as a worker's step events arrive, then
    ends it with `end` (None: no end)."""

    async def run() -> None:
        for c in chunks:
            inbox.put(c.SerializeToString())
            await asyncio.sleep(0)
        if end is not None:
            inbox.finish(end, "" if end is grpc.StatusCode.OK else "it failed")

    return asyncio.get_running_loop().create_task(run())


def stream_of(n: int) -> list[generation_pb2.GenerateChunk]:
    return [chunk(i, last=i == n - 1) for i in range(n)]


def flatten(messages) -> tuple[list[int], list[float], str]:
    tokens = [t for m in messages for t in m.token_ids]
    logprobs = [p for m in messages for p in m.logprobs]
    return tokens, logprobs, "".join(m.text for m in messages)


def assert_whole_stream(messages, n: int) -> None:
    tokens, logprobs, text = flatten(messages)
    assert tokens == list(range(n))
    assert logprobs == pytest.approx([-i / 10 for i in range(n)])
    assert text == "".join(f"t{i} " for i in range(n))
    assert [m.finish_reason for m in messages] == [0] * (len(messages) - 1) + [LENGTH]
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].usage.completion_tokens == n and {m.request_id for m in messages} == {"r"}
    assert {m.worker_id for m in messages} == {"w"}  # filled in: the worker sent none


@run_async
async def test_a_slow_relay_gets_every_token_once_in_order_in_fewer_messages():
    inbox = Inbox()
    producer = fill(inbox, stream_of(300))
    messages = []
    async for message in ready_chunks(inbox, "w"):
        messages.append(message)
        await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)  # stalls, then stays behind
    await producer
    assert_whole_stream(messages, 300)
    assert len(messages) < 300 / 4, len(messages)
    assert len(messages[0].token_ids) == 1  # the first token went out alone, at once
    assert inbox.end == (grpc.StatusCode.OK, "")


@run_async
async def test_the_first_token_is_not_held_back_for_a_second():
    inbox = Inbox()
    stream = ready_chunks(inbox, "w")
    waiting = asyncio.get_running_loop().create_task(anext(stream))
    await asyncio.sleep(0.01)
    inbox.put(chunk(0).SerializeToString())  # and nothing more until the relay has it
    first = await asyncio.wait_for(waiting, 5)
    assert list(first.token_ids) == [0]
    await fill(inbox, [chunk(1, last=True)])
    assert_whole_stream([first, *[m async for m in stream]], 2)


@run_async
async def test_a_relay_that_keeps_up_gets_one_message_per_chunk():
    inbox = Inbox()
    received = asyncio.Event()

    async def lockstep() -> None:
        for i in range(20):
            received.clear()
            inbox.put(chunk(i, last=i == 19).SerializeToString())
            await received.wait()
        inbox.finish(grpc.StatusCode.OK, "")

    producer = asyncio.get_running_loop().create_task(lockstep())
    messages = []
    async for message in ready_chunks(inbox, "w"):
        messages.append(message)
        received.set()
    await producer
    assert [list(m.token_ids) for m in messages] == [[i] for i in range(20)]


@run_async
async def test_the_end_is_read_after_every_chunk_that_came_before_it():
    inbox = Inbox()
    producer = fill(inbox, [chunk(i) for i in range(50)], end=grpc.StatusCode.INTERNAL)
    messages = []
    async for message in ready_chunks(inbox, "w"):
        messages.append(message)
        await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)
    await producer
    assert flatten(messages)[0] == list(range(50)) and len(messages) < 50
    assert inbox.end == (grpc.StatusCode.INTERNAL, "it failed")


@run_async
async def test_a_backlog_goes_out_in_bounded_messages():
    n = 2 * MAX_TOKENS_PER_MESSAGE + 500
    inbox = Inbox()
    for c in stream_of(n):  # all there before the relay looks
        inbox.put(c.SerializeToString())
    inbox.finish(grpc.StatusCode.OK, "")
    messages = [m async for m in ready_chunks(inbox, "w")]
    assert [len(m.token_ids) for m in messages] == [MAX_TOKENS_PER_MESSAGE, MAX_TOKENS_PER_MESSAGE, 500]
    assert_whole_stream(messages, n)


def test_merge_keeps_one_chunk_as_it_is_and_joins_several():
    one = RelayedChunk.of(chunk(7))
    assert merge_chunks([one]) is one
    merged = merge_chunks([RelayedChunk.of(c) for c in (chunk(0), chunk(1), chunk(2, last=True))]).message
    assert list(merged.token_ids) == [0, 1, 2] and merged.text == "t0 t1 t2 "
    assert merged.finish_reason == LENGTH and merged.usage.completion_tokens == 3


def test_merge_carries_top_logprobs_in_order_and_never_joins_two_completions():
    def with_top(i: int, index: int = 0) -> RelayedChunk:
        c = chunk(i)
        c.index = index
        c.top_logprobs.add(token_ids=[i, i + 100], logprobs=[-0.1, -2.0], tokens=[f"t{i}", f"t{i + 100}"])
        c.tokens.append(f"t{i}")
        return RelayedChunk.of(c)

    merged = merge_chunks([with_top(0), with_top(1), with_top(2)]).message
    assert [list(t.token_ids) for t in merged.top_logprobs] == [[0, 100], [1, 101], [2, 102]]
    assert list(merged.tokens) == ["t0", "t1", "t2"] and list(merged.top_logprobs[2].tokens) == ["t2", "t102"]
    assert list(merged.logprobs) == pytest.approx([0, -0.1, -0.2])
    ready = [with_top(0), with_top(1), with_top(2, index=1), with_top(3, index=1), with_top(4)]
    batches = [coalesce.take_batch(ready) for _ in range(3)]
    assert [[c.message.token_ids[0] for c in b] for b in batches] == [[0, 1], [2, 3], [4]]
    assert [merge_chunks(b).message.index for b in batches] == [0, 1, 0] and not ready


@run_async
async def test_a_slow_relay_of_n_completions_never_gets_two_indexes_in_one_message():
    interleaved = []  # two completions (n=2) whose chunks arrive in runs of 3
    for i in range(120):
        c = chunk(i, last=i >= 118)
        c.index = (i // 3) % 2
        interleaved.append(c)
    inbox = Inbox()
    producer = fill(inbox, interleaved)
    messages = []
    async for message in ready_chunks(inbox, "w"):
        messages.append(message)
        await asyncio.sleep(STALL_S if len(messages) == 1 else 0.002)
    await producer
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


@run_async
async def test_a_client_that_stops_reading_does_not_hold_back_the_other_streams_on_its_worker():
    """Both streams go to one worker on one Worker.Stream call: the one whose client stopped reading
    piles up in its own inbox (bounded by its max_tokens), and the other still gets all of its tokens."""
    double = WorkerDouble("a", delay_s=0.001)
    async with one_worker_router(double) as (router, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}", options=SMALL_WINDOW) as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            stuck = stub.Generate(generation_pb2.GenerateRequest(text="stuck", max_tokens=3000), timeout=30)
            assert len((await stuck.read()).token_ids) >= 1  # started; then nobody reads it
            other = stub.Generate(generation_pb2.GenerateRequest(text="other", max_tokens=300), timeout=30)
            tokens = [t async for m in other for t in m.token_ids]
            assert await other.code() is grpc.StatusCode.OK
            assert tokens == WorkerDouble.tokens_for(
                generation_pb2.GenerateRequest(text="other", max_tokens=300)
            )
            assert {r.text for r in double.requests} == {"stuck", "other"}
            stuck.cancel()
        await eventually_cancelled(double, 1)


async def eventually_cancelled(double: WorkerDouble, n: int) -> None:
    for _ in range(200):
        if len(double.cancelled) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the worker saw {len(double.cancelled)} aborts, not {n}")
