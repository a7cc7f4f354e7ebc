"""worker.engine.ready_pieces: what a caller that keeps up, and one that fell behind, take from a request's
pieces (the engine streams through it, and so does the router suite's synthetic worker); and the
LoopHandoff that carries pieces from the step thread to the caller's event loop."""

from __future__ import annotations

import asyncio
import threading

from kvpact.shared.limits import MAX_TOKENS_PER_MESSAGE
from kvpact.worker.engine.ready_pieces import LoopHandoff, ReadyPieces
from kvpact.worker.engine.request import FinishReason, GenerationOutput, Usage


def piece(i: int, index: int = 0, last: bool = False, usage: bool = False) -> GenerationOutput:
    return GenerationOutput(
        "r",
        f"t{i};",
        [i],
        [-float(i)],
        finish_reason=FinishReason.LENGTH if last else None,
        usage=Usage(1, i, 0) if usage else None,
        index=index,
    )


def take_all(pieces: ReadyPieces, count: int) -> list[GenerationOutput | BaseException]:
    """`count` next() calls, each taking what is queued at that moment."""

    async def main() -> list[GenerationOutput | BaseException]:
        return [await pieces.next() for _ in range(count)]

    return asyncio.run(main())


def test_a_caller_that_keeps_up_gets_each_piece_alone_as_it_comes():
    async def main() -> list[GenerationOutput | BaseException]:
        pieces, taken = ReadyPieces(), []
        for i in range(1, 4):
            pieces.put(piece(i, last=i == 3, usage=i == 3))
            taken.append(await pieces.next())
        return taken

    taken = asyncio.run(main())
    assert [p.token_ids for p in taken] == [[1], [2], [3]]


def test_the_first_piece_goes_alone_and_what_queued_behind_it_goes_as_one_in_order():
    async def main() -> list[GenerationOutput | BaseException]:
        pieces = ReadyPieces()
        pieces.put(piece(1))
        first = await pieces.next()  # never waits for company
        for i in range(2, 7):  # the step thread went on while the caller was writing
            pieces.put(piece(i, last=i == 6, usage=i == 6))
        return [first, await pieces.next()]

    first, rest = asyncio.run(main())
    assert first.token_ids == [1]
    assert rest.token_ids == [2, 3, 4, 5, 6]
    assert rest.text == "t2;t3;t4;t5;t6;"
    assert rest.logprobs == [-2.0, -3.0, -4.0, -5.0, -6.0]
    assert (rest.finish_reason, rest.usage) == (FinishReason.LENGTH, Usage(1, 6, 0))


def test_completions_are_never_merged_together_nor_past_a_completions_last_piece():
    pieces = ReadyPieces()
    for p in (piece(1), piece(2), piece(10, index=1), piece(3, last=True), piece(4)):
        pieces.put(p)
    taken = take_all(pieces, 4)
    assert [(p.index, p.token_ids) for p in taken] == [
        (0, [1, 2]),
        (1, [10]),
        (0, [3]),
        (0, [4]),
    ]


def test_an_error_comes_after_every_piece_queued_before_it_and_is_returned_not_merged():
    pieces = ReadyPieces()
    failure = RuntimeError("the step failed")
    for p in (piece(1), piece(2), failure, piece(3)):
        pieces.put(p)
    merged, error, after = take_all(pieces, 3)
    assert merged.token_ids == [1, 2]
    assert error is failure
    assert after.token_ids == [3]


def test_a_long_backlog_goes_out_in_pieces_of_at_most_the_merge_cap():
    n = 2 * MAX_TOKENS_PER_MESSAGE + 10
    pieces = ReadyPieces()
    for i in range(n):
        pieces.put(piece(i, last=i == n - 1, usage=i == n - 1))
    taken = take_all(pieces, 3)
    assert [len(p.token_ids) for p in taken] == [MAX_TOKENS_PER_MESSAGE, MAX_TOKENS_PER_MESSAGE, 10]
    assert [t for p in taken for t in p.token_ids] == list(range(n)) and taken[-1].usage is not None


def test_pieces_sent_from_another_thread_reach_every_request_once_in_order_one_wake_up_a_step():
    """What the step thread does: a step's pieces for every stream, step after step, from its own thread,
    while the loop is busy elsewhere. Every piece arrives, each request's in order, and each step's sends
    cost the loop one wake-up (one piece at a time would be one per stream)."""
    streams, steps = 8, 40

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            nonlocal wake_ups
            wake_ups += 1
            return schedule(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        handoff = LoopHandoff(loop)
        pieces = [ReadyPieces() for _ in range(streams)]
        sent, taken = threading.Event(), threading.Event()

        def step_thread() -> None:
            for i in range(1, steps + 1):
                for p in pieces:
                    assert handoff.send(p, piece(i, last=i == steps, usage=i == steps))
                sent.set()
                assert taken.wait(5)
                taken.clear()

        thread = threading.Thread(target=step_thread)
        thread.start()
        got: list[list[int]] = [[] for _ in range(streams)]
        for _ in range(steps):
            assert sent.wait(5)  # blocking: the loop runs nothing while the step's pieces are sent
            sent.clear()
            for s, p in enumerate(pieces):
                got[s] += (await p.next()).token_ids  # type: ignore[union-attr]
            taken.set()
        thread.join(5)
        return got, wake_ups

    got, wake_ups = asyncio.run(asyncio.wait_for(main(), 30))
    assert got == [list(range(1, steps + 1))] * streams
    assert wake_ups == steps


def test_a_send_to_a_closed_loop_says_so_so_the_engine_can_abort_the_request():
    loop = asyncio.new_event_loop()
    handoff = LoopHandoff(loop)
    loop.close()
    assert handoff.send(ReadyPieces(), piece(1)) is False
    assert handoff.send(ReadyPieces(), piece(2)) is False  # a later send is refused too, not queued forever
