"""Worker.Stream's worker half (worker/stream_server.py), driven as gRPC drives it: a stream of
StreamRequests in, StreamReplies out. The chunks that are ready together go out in one reply; each
request's events keep their order and end with its status; an abort, a timeout or the end of the call
stops a request's generator (which is what frees its blocks in the engine); close() ends the call once
nothing is in flight, after sending what was queued."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvpact.shared.rpc_errors import StatusError
from kvpact.v1 import generation_pb2, worker_pb2
from kvpact.worker import stream_server
from kvpact.worker.stream_server import StreamServer
from tests.router.doubles import run_async, status_error

OK = grpc.StatusCode.OK


def start(tag: int, text: str, max_tokens: int, timeout_s: float = 0.0) -> worker_pb2.StreamRequest:
    request = generation_pb2.GenerateRequest(request_id=f"r{tag}", text=text, max_tokens=max_tokens)
    return worker_pb2.StreamRequest(
        start=worker_pb2.StreamStart(tag=tag, request=request, timeout_s=timeout_s)
    )


class Engine:
    """Steps like an engine: each `step()` gives every running request its next token at once."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Queue[int]] = {}
        self.closed: list[str] = []  # requests whose generator was closed before their last token
        self.timeouts: dict[str, float | None] = {}

    async def generate(self, request: generation_pb2.GenerateRequest, timeout: float | None):
        rid, queue = request.request_id, asyncio.Queue()
        if request.text == "refuse":
            raise status_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        self.running[rid], self.timeouts[rid] = queue, timeout
        done = False
        try:
            for i in range(request.max_tokens):
                token = await queue.get()
                if token < 0:
                    raise RuntimeError("the engine broke")
                last = i == request.max_tokens - 1
                chunk = generation_pb2.GenerateChunk(request_id=rid, token_ids=[token])
                if last:
                    chunk.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                yield chunk
            done = True
        finally:
            del self.running[rid]
            if not done:
                self.closed.append(rid)

    def step(self, token: int = 7) -> None:
        for queue in self.running.values():
            queue.put_nowait(token)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, StatusError):
        return exc.code, exc.details
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


class Call:
    """The router's side of one call: send requests, read replies."""

    def __init__(self, server: StreamServer) -> None:
        self.sent: asyncio.Queue[worker_pb2.StreamRequest | None] = asyncio.Queue()
        self.replies: list[worker_pb2.StreamReply] = []
        self.task = asyncio.get_running_loop().create_task(self._run(server))

    async def _requests(self):
        while (message := await self.sent.get()) is not None:
            yield message

    async def _run(self, server: StreamServer) -> None:
        async for reply in server.serve(self._requests()):
            self.replies.append(reply)

    def send(self, *messages: worker_pb2.StreamRequest | None) -> None:
        for message in messages:
            self.sent.put_nowait(message)

    async def finish(self) -> None:
        """The router closes its side; the call ends once nothing is in flight."""
        self.sent.put_nowait(None)
        await asyncio.wait_for(self.task, 5)

    def events(self) -> list[tuple[int, str]]:
        """(tag, "chunk <tokens>" or "end <CODE> <details>") for every event so far, in order."""
        out = []
        for reply in self.replies:
            for event in reply.events:
                if event.HasField("end"):
                    code = next(c for c in grpc.StatusCode if c.value[0] == event.end.code)
                    out.append((event.tag, f"end {code.name} {event.end.details}".strip()))
                else:
                    chunk = generation_pb2.GenerateChunk.FromString(event.chunk)
                    out.append((event.tag, f"chunk {list(chunk.token_ids)}"))
        return out


def held(server: StreamServer) -> tuple[AsyncIterator[worker_pb2.StreamReply], asyncio.Queue]:
    """`server`'s replies read one at a time by the test (a reply not yet read is not yet written), and
    the queue the router's side sends on."""
    sent: asyncio.Queue[worker_pb2.StreamRequest] = asyncio.Queue()

    async def requests():
        while True:
            yield await sent.get()

    return server.serve(requests()), sent


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@run_async
async def test_one_steps_chunks_for_every_request_go_out_in_one_reply_and_each_ends_ok():
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(*(start(tag, "hi", 2) for tag in (1, 2, 3)))
    await settle()
    assert sorted(engine.running) == ["r1", "r2", "r3"]
    engine.step(5)
    await settle()
    assert len(call.replies) == 1 and [e.tag for e in call.replies[0].events] == [1, 2, 3]
    engine.step(6)
    await settle()
    assert sorted(call.events()[3:]) == [
        (1, "chunk [6]"), (1, "end OK"), (2, "chunk [6]"), (2, "end OK"), (3, "chunk [6]"), (3, "end OK")
    ]  # fmt: skip
    assert [e for e in call.events() if e[0] == 2] == [(2, "chunk [5]"), (2, "chunk [6]"), (2, "end OK")]
    await call.finish()  # nothing in flight: the call ends


@run_async
async def test_an_abort_closes_that_requests_generator_only_and_it_sends_no_end():
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(start(1, "hi", 3), start(2, "hi", 3))
    await settle()
    engine.step()
    await settle()
    call.send(worker_pb2.StreamRequest(abort=1), worker_pb2.StreamRequest(abort=99))  # 99: unknown, ignored
    await settle()
    assert engine.closed == ["r1"] and list(engine.running) == ["r2"]
    engine.step()
    engine.step()
    await settle()
    assert [e for e in call.events() if e[0] == 1] == [(1, "chunk [7]")]
    assert [e[1] for e in call.events() if e[0] == 2] == ["chunk [7]", "chunk [7]", "chunk [7]", "end OK"]
    await call.finish()


@run_async
async def test_a_failure_ends_the_request_with_its_status_after_its_chunks_and_the_call_goes_on():
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(start(1, "refuse", 3), start(2, "hi", 3), start(3, "hi", 1))
    await settle()
    engine.step()
    await settle()
    engine.running["r2"].put_nowait(-1)  # r2's next step fails
    await settle()
    assert [e for e in call.events() if e[0] == 1] == [(1, "end RESOURCE_EXHAUSTED no room")]
    assert [e for e in call.events() if e[0] == 2] == [
        (2, "chunk [7]"),
        (2, "end INTERNAL internal error: RuntimeError"),
    ]
    assert [e for e in call.events() if e[0] == 3] == [(3, "chunk [7]"), (3, "end OK")]
    call.send(start(4, "hi", 1))  # the call still takes requests
    await settle()
    engine.step(9)
    await settle()
    assert call.events()[-2:] == [(4, "chunk [9]"), (4, "end OK")]
    await call.finish()


@run_async
async def test_a_timeout_ends_the_request_deadline_exceeded_and_closes_its_generator():
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(start(1, "hi", 3, timeout_s=0.05), start(2, "hi", 1))
    await settle()
    assert engine.timeouts == {"r1": 0.05, "r2": None}  # the deadline reaches the generator too
    await asyncio.sleep(0.1)
    assert engine.closed == ["r1"]
    assert call.events() == [(1, "end DEADLINE_EXCEEDED Deadline Exceeded")]
    engine.step()
    await call.finish()
    assert call.events()[1:] == [(2, "chunk [7]"), (2, "end OK")]


@run_async
async def test_a_tag_in_flight_twice_is_refused_and_the_first_goes_on():
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(start(1, "hi", 1), start(1, "hi", 1))
    await settle()
    assert call.events()[0][0] == 1 and call.events()[0][1].startswith("end ALREADY_EXISTS tag 1 is already")
    engine.step()
    await call.finish()
    assert call.events()[1:] == [(1, "chunk [7]"), (1, "end OK")]


@run_async
async def test_close_ends_the_call_once_nothing_is_in_flight_and_sends_what_was_queued_first():
    engine = Engine()
    server = StreamServer(engine.generate, status_of)
    call = Call(server)
    call.send(start(1, "hi", 2))
    await settle()
    server.close()  # the worker stops (after its drain): the request in flight still finishes
    engine.step()
    await settle()
    assert not call.task.done()
    engine.step()
    await asyncio.wait_for(call.task, 5)  # ended by the worker, the router's side still open
    assert call.events() == [(1, "chunk [7]"), (1, "chunk [7]"), (1, "end OK")]


@run_async
async def test_the_call_ending_early_closes_every_generator_in_flight():
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(start(1, "hi", 5), start(2, "hi", 5))
    await settle()
    call.task.cancel()  # the router went away: gRPC cancels the handler
    await asyncio.gather(call.task, return_exceptions=True)
    assert sorted(engine.closed) == ["r1", "r2"] and not engine.running


@run_async
async def test_a_large_backlog_is_split_over_replies_under_the_cap(monkeypatch):
    monkeypatch.setattr(stream_server, "MAX_REPLY_BYTES", 100)
    engine = Engine()
    call = Call(StreamServer(engine.generate, status_of))
    call.send(*(start(tag, "hi", 1) for tag in range(1, 41)))
    await settle()
    engine.step()
    await call.finish()
    assert len(call.replies) > 1
    for reply in call.replies:
        assert sum(len(e.chunk) for e in reply.events) <= 100
    assert sorted(call.events()) == sorted(
        [(t, "chunk [7]") for t in range(1, 41)] + [(t, "end OK") for t in range(1, 41)]
    )


@run_async
async def test_a_request_takes_its_next_chunk_only_once_its_last_was_written():
    """While the writer is held back (HTTP/2 flow control, a slow router), no request's generator is
    advanced past one unwritten chunk: the engine's queue holds the rest, where it merges them."""
    engine = Engine()
    taken: list[int] = []

    async def counting(request, timeout):
        async for chunk in engine.generate(request, timeout):
            taken.append(chunk.token_ids[0])
            yield chunk

    replies, sent = held(StreamServer(counting, status_of))
    sent.put_nowait(start(1, "hi", 4))
    pending = asyncio.get_running_loop().create_task(anext(replies))
    await settle()
    engine.step(1)
    first = await asyncio.wait_for(pending, 5)  # the writer now holds this reply (not yet written)
    for token in (2, 3, 4):
        engine.step(token)
    await settle()
    assert taken == [1] and engine.running["r1"].qsize() == 3  # held in the engine, not taken
    rest = []
    while not any(e.HasField("end") for r in rest for e in r.events):
        rest.append(await asyncio.wait_for(anext(replies), 5))
    assert taken == [1, 2, 3, 4]
    tokens = [
        generation_pb2.GenerateChunk.FromString(e.chunk).token_ids[0]
        for r in [first, *rest]
        for e in r.events
        if not e.HasField("end")
    ]
    assert tokens == [1, 2, 3, 4]
    await replies.aclose()


@run_async
async def test_an_abort_while_the_reply_is_held_leaves_the_other_requests_waiting_on_it_to_go_on():
    """Both requests wait for the same unwritten reply; aborting one must not end the other's wait."""
    engine = Engine()
    replies, sent = held(StreamServer(engine.generate, status_of))
    sent.put_nowait(start(1, "hi", 3))
    sent.put_nowait(start(2, "hi", 3))
    pending = asyncio.get_running_loop().create_task(anext(replies))
    await settle()
    engine.step()
    first = await asyncio.wait_for(pending, 5)  # held: both requests wait for this reply's write
    assert sorted(e.tag for e in first.events) == [1, 2]
    sent.put_nowait(worker_pb2.StreamRequest(abort=1))
    pending = asyncio.get_running_loop().create_task(anext(replies))  # the write completes
    await settle()
    assert engine.closed == ["r1"] and list(engine.running) == ["r2"]
    engine.step()
    engine.step()
    events = []
    while not any(e.HasField("end") for e in events):
        reply = await asyncio.wait_for(pending, 5)
        events += reply.events
        pending = asyncio.get_running_loop().create_task(anext(replies))
    assert [e.tag for e in events] == [2, 2, 2] and events[-1].end.code == grpc.StatusCode.OK.value[0]
    pending.cancel()
    await replies.aclose()


@run_async
async def test_after_close_a_new_request_ends_unavailable_at_once_and_the_call_ends():
    engine = Engine()
    server = StreamServer(engine.generate, status_of)
    call = Call(server)
    call.send(start(1, "hi", 1))
    await settle()
    server.close()  # the worker stops (any way: drain, Shutdown, a second signal)
    call.send(start(2, "hi", 1))  # the router has not heard yet
    await settle()
    assert "r2" not in engine.running
    assert call.events() == [(2, f"end UNAVAILABLE {stream_server.STOPPING}")]  # the router retries it
    engine.step()
    await asyncio.wait_for(call.task, 5)
    assert call.events()[1:] == [(1, "chunk [7]"), (1, "end OK")]


@run_async
async def test_a_request_aborted_before_its_task_ran_is_not_left_in_flight():
    engine = Engine()
    server = StreamServer(engine.generate, status_of)
    call = Call(server)
    call.send(start(1, "hi", 3), worker_pb2.StreamRequest(abort=1))  # read back to back, no turn between
    await settle()
    server.close()
    await asyncio.wait_for(call.task, 5)  # nothing in flight: the call ended
    assert call.events() == [] and not engine.running


@run_async
async def test_a_cancelled_error_from_inside_the_request_still_ends_it():
    async def broken(request, timeout):
        yield generation_pb2.GenerateChunk(token_ids=[1])
        raise asyncio.CancelledError  # e.g. a shut-down executor's future; not this task's cancel

    call = Call(StreamServer(broken, status_of))
    call.send(start(1, "hi", 3))
    await settle()
    await call.finish()
    assert call.events() == [(1, "chunk [1]"), (1, "end INTERNAL internal error: CancelledError")]
