"""worker.engine on a tiny Llama, both caches: what a caller of generate/abort/stats/close sees."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvpact.shared.errors import RequestError
from kvpact.shared.handshake import WorkerLoad
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.request import (
    EngineClosedError,
    EngineOverloadedError,
    FinishReason,
    GenerationError,
    GenerationRequest,
    SamplingParams,
)
from tests.factories.eventually import eventually, eventually_async
from tests.worker.conftest import collect, greedy, paced_steps, run_staggered

MODES = {"eager": dict(mode="off"), "paged": dict(mode="on", context_tokens=2048)}
TEXT = "Hello, world! How are you today?"


@pytest.fixture(params=list(MODES))
def engine(request, make_engine, tiny_llama) -> Engine:
    return make_engine(tiny_llama, max_model_len=128, **MODES[request.param])


def first_error(engine: Engine, request: GenerationRequest) -> BaseException:
    async def main() -> BaseException:
        stream = engine.generate(request)
        with pytest.raises(Exception) as info:
            await stream.__anext__()  # raised before any piece is yielded
        return info.value

    return asyncio.run(main())


def all_blocks_free(engine: Engine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


# ---- refused up front ----


def test_a_request_that_can_never_fit_is_refused_naming_both_numbers(engine):
    error = first_error(engine, greedy("long", tuple(range(3, 123)), max_tokens=20))
    assert isinstance(error, RequestError)
    assert (
        "120 tokens" in str(error) and "max_tokens (20)" in str(error) and "max_model_len 128" in str(error)
    )
    error = first_error(engine, greedy("longer", tuple([5] * 128), max_tokens=1))
    assert isinstance(error, RequestError) and "128 tokens but max_model_len is 128" in str(error)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest("e", ""), "the prompt is empty"),
        (GenerationRequest("t", "hi", SamplingParams(temperature=-1.0)), "temperature must be >= 0"),
        (GenerationRequest("p", "hi", SamplingParams(top_p=1.5)), "top_p must be in (0, 1]"),
        (GenerationRequest("v", (1, 2, 99999)), "prompt token ids must be in [0, 384)"),
        (GenerationRequest("s", "hi", stop_token_ids=(-1,)), "stop_token_ids must be in [0, 384)"),
    ],
)
def test_bad_requests_raise_before_the_first_piece(engine, request_, message):
    error = first_error(engine, request_)
    assert isinstance(error, RequestError) and message in str(error)
    assert all_blocks_free(engine)
    assert engine.run([greedy("after", (5, 6, 7), 3)])[0].usage.completion_tokens == 3  # still serving


def test_max_tokens_defaults_to_what_fits(engine):
    [result] = engine.run(
        [GenerationRequest("r", tuple(range(3, 103)), SamplingParams(temperature=0), ignore_eos=True)]
    )
    assert (result.finish_reason, result.usage.prompt_tokens, result.usage.completion_tokens) == (
        FinishReason.LENGTH,
        100,
        28,
    )


def test_a_request_id_already_in_flight_is_refused(engine):
    paced_steps(engine)

    async def main() -> None:
        first = asyncio.create_task(collect(engine, greedy("same", (5, 6, 7), 60)))
        assert await eventually_async(lambda: engine.stats().num_running == 1)
        with pytest.raises(RequestError, match="request_id 'same' is already in flight"):
            async for _ in engine.generate(greedy("same", (5, 6, 7), 1)):
                pass
        assert (await first).usage.completion_tokens == 60

    asyncio.run(main())


# ---- what the stream carries ----


def test_text_usage_and_logprobs(engine):
    request = GenerationRequest(
        "r", TEXT, SamplingParams(temperature=0, logprobs=True), max_tokens=12, ignore_eos=True
    )
    [result] = engine.run([request])
    assert result.usage.prompt_tokens == len(engine.tokenizer.encode(TEXT))
    assert (result.usage.completion_tokens, result.usage.cached_prompt_tokens) == (12, 0)
    assert len(result.token_ids) == len(result.logprobs) == 12
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert result.text == engine.tokenizer.decode(result.token_ids)


def test_stop_token_id_ends_the_output_without_its_text(engine):
    [free] = engine.run([greedy("free", TEXT, 24)])
    k = next(i for i in range(3, 24) if free.token_ids[i] not in free.token_ids[:i])
    [stopped] = engine.run([greedy("stopped", TEXT, 24, stop_token_ids=(free.token_ids[k],))])
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: k + 1]
    assert stopped.text == engine.tokenizer.decode(free.token_ids[:k])


def test_stop_string_across_a_token_boundary_cuts_the_text_before_it(engine):
    pieces, tokens = stream_pieces(engine, greedy("free", TEXT, 32))
    text = "".join(pieces)
    # a 2-character stop string made of the last character of one piece and the first of the next
    for k in range(len(pieces) - 1):
        end = len("".join(pieces[: k + 1]))
        if pieces[k] and pieces[k + 1] and "\ufffd" not in pieces[k][-1] + pieces[k + 1][0]:
            stop = text[end - 1 : end + 1]
            if text.find(stop) == end - 1:
                break
    else:
        pytest.skip("no usable boundary in this output")
    [result] = engine.run([greedy("stopped", TEXT, 32, stop=("never-there", stop))])
    assert result.finish_reason is FinishReason.STOP
    assert result.text == text[: end - 1]
    assert result.token_ids == tokens[: k + 2]  # up to the token that completed the stop string


def stream_pieces(engine: Engine, request: GenerationRequest) -> tuple[list[str], list[int]]:
    """The pieces as the step thread emits them, one per token (`submit`'s sink: nothing merged)."""
    outputs, done = [], threading.Event()

    def sink(piece) -> None:  # noqa: ANN001 - a GenerationOutput or the error
        outputs.append(piece)
        if isinstance(piece, BaseException) or piece.usage is not None:
            done.set()

    engine.submit(request, sink)
    assert done.wait(60) and not isinstance(outputs[-1], BaseException), outputs[-1:]
    assert all(len(o.token_ids) == 1 for o in outputs)
    return [o.text for o in outputs], [o.token_ids[0] for o in outputs]


def test_a_seeded_request_gives_the_same_tokens_whatever_else_is_in_the_batch(engine):
    seeded = GenerationRequest(
        "x", TEXT, SamplingParams(temperature=1.0, top_k=50, seed=42), max_tokens=24, ignore_eos=True
    )
    [alone] = engine.run([seeded])
    others = [
        GenerationRequest(
            f"o{i}",
            tuple(range(3 + i, 20 + 3 * i)),
            SamplingParams(temperature=0.8, seed=i if i % 2 else None),
            max_tokens=30,
            ignore_eos=True,
        )
        for i in range(5)
    ]
    crowd = run_staggered(engine, [*others[:2], seeded, *others[2:]], gap_s=0.005)
    assert crowd[2].token_ids == alone.token_ids
    unseeded = [
        GenerationRequest(f"u{i}", TEXT, SamplingParams(temperature=1.0), max_tokens=24, ignore_eos=True)
        for i in range(3)
    ]
    assert len({tuple(r.token_ids) for r in engine.run(unseeded)}) > 1  # without a seed they differ


# ---- aborts and cancellation free the cache ----


def test_abort_mid_generation_ends_the_stream_and_frees_every_block(engine):
    paced_steps(engine)

    async def main() -> None:
        pieces = []
        async for piece in engine.generate(greedy("a", TEXT, 100)):
            pieces.append(piece)
            if len(pieces) == 3:
                assert engine.abort("a") is True
        assert pieces[-1].finish_reason is FinishReason.ABORT
        assert pieces[-1].usage is not None and 3 <= pieces[-1].usage.completion_tokens < 100

    asyncio.run(main())
    assert all_blocks_free(engine)
    assert engine.abort("a") is False and engine.abort("unknown") is False


def test_abort_of_a_waiting_request(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, mode="on", max_model_len=512, max_num_seqs=1, context_tokens=1024)

    async def main() -> None:
        # "run" holds the only sequence slot for up to 480 tokens (a tiny model decodes 60 in a few
        # ms, so a short one could end before "wait" is queued and aborted), and is aborted last.
        running = asyncio.create_task(collect(engine, greedy("run", TEXT, 480)))
        # "run" first: two prepare threads would otherwise race to queue first, and "wait" could run.
        assert await eventually_async(lambda: engine.stats().num_running == 1)
        waiting = asyncio.create_task(collect(engine, greedy("wait", TEXT, 60)))
        assert await eventually_async(lambda: engine.stats().num_waiting == 1)
        assert engine.abort("wait")
        aborted = await waiting
        assert (aborted.finish_reason, aborted.token_ids) == (FinishReason.ABORT, [])
        assert engine.abort("run")
        ran = await running
        assert ran.finish_reason is FinishReason.ABORT and 0 < ran.usage.completion_tokens < 480

    asyncio.run(main())
    assert all_blocks_free(engine)


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_a_consumer_that_goes_away_aborts_its_request(engine, how):
    paced_steps(engine)

    async def main() -> None:
        if how == "break":
            stream = engine.generate(greedy("gone", TEXT, 100))
            async for _ in stream:
                break
            await stream.aclose()
        else:
            task = asyncio.create_task(collect(engine, greedy("gone", TEXT, 100)))
            await eventually_async(lambda: engine.stats().num_running == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert eventually(lambda: all_blocks_free(engine))
    assert engine.abort("gone") is False


def test_every_request_finished_or_aborted_leaves_all_blocks_free(engine):
    requests = [greedy(f"r{i}", tuple(range(3, 10 + 7 * i)), 5 + 3 * i) for i in range(8)]

    async def main() -> None:
        tasks = [asyncio.create_task(collect(engine, r, 0.003 * i)) for i, r in enumerate(requests)]
        await asyncio.sleep(0.02)
        for r in requests[::3]:
            engine.abort(r.request_id)
        results = await asyncio.gather(*tasks)
        assert {res.finish_reason for res in results} <= {FinishReason.LENGTH, FinishReason.ABORT}

    asyncio.run(main())
    assert eventually(lambda: all_blocks_free(engine))


def test_stats_is_the_load_the_router_sees(engine):
    engine.run([greedy("s", tuple(range(3, 10)), 4)], timeout=30)
    stats = engine.stats()
    assert type(stats) is WorkerLoad  # the heartbeat and the Stats RPC send it as is
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks > 0
    # The drift counters (router/drift.py): prompt tokens looked up in the prefix cache and served from it.
    engine.run([greedy("again", tuple(range(3, 40)), 1)], timeout=30)
    engine.run([greedy("again2", tuple(range(3, 40)), 1)], timeout=30)
    stats = engine.stats()
    paged = engine.realized.prefix_caching
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == ((7 + 37 + 37, 32) if paged else (0, 0))
    assert stats.eager_steps_under_graphs == 0  # no CUDA graphs in this build


# ---- failures and shutdown ----


def test_a_failing_step_fails_its_requests_clearly_and_the_engine_keeps_serving(engine):
    run = engine.step_loop.runner.run
    calls = {"n": 0}

    def flaky(chunks):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device fault")
        return run(chunks)

    engine.step_loop.runner.run = flaky  # type: ignore[method-assign]
    with pytest.raises(GenerationError, match="RuntimeError: simulated device fault"):
        engine.run([greedy("doomed", TEXT, 10)], timeout=30)
    assert eventually(lambda: all_blocks_free(engine))
    assert engine.run([greedy("fine", TEXT, 4)])[0].usage.completion_tokens == 4


def test_close_fails_in_flight_requests_and_refuses_new_ones(engine):
    paced_steps(engine)

    async def main() -> None:
        task = asyncio.create_task(collect(engine, greedy("inflight", TEXT, 100)))
        await eventually_async(lambda: engine.stats().num_running == 1)
        started = time.monotonic()
        await asyncio.to_thread(engine.close)
        assert time.monotonic() - started < 5
        with pytest.raises(EngineClosedError):
            await task

    asyncio.run(main())
    engine.close()  # idempotent
    with pytest.raises(EngineClosedError):
        engine.run([greedy("late", TEXT, 2)])


def test_an_internal_scheduler_fault_stops_the_engine_once_instead_of_spinning(engine):
    """A bug outside the model call (here the scheduler, also broken when freeing) leaves no state to
    trust: the engine fails what is in flight, refuses new work and tells its owner, exactly once."""
    fatal: list[str] = []
    engine.step_loop.on_fatal = fatal.append

    def broken(*_args: object) -> None:
        raise RuntimeError("scheduler bug")

    engine.step_loop.scheduler.schedule = broken  # type: ignore[method-assign]
    engine.step_loop.scheduler.finish = broken  # type: ignore[method-assign]
    with pytest.raises(GenerationError, match="RuntimeError: scheduler bug"):
        engine.run([greedy("doomed", TEXT, 4)], timeout=30)
    assert eventually(lambda: not engine.step_loop._thread.is_alive())
    assert fatal == ["the engine failed: RuntimeError: scheduler bug"]
    with pytest.raises(EngineClosedError):
        engine.run([greedy("late", TEXT, 2)])


def test_whoever_receives_a_piece_sees_that_steps_counts(engine):
    """Stats read when a piece arrives (here inside the sink, on the step thread) already count the
    request as running: the router and tests poll Stats right after the first chunk."""
    running_at_first_piece: list[int] = []
    done = threading.Event()

    def sink(item: object) -> None:
        if not running_at_first_piece:
            running_at_first_piece.append(engine.stats().num_running)
        if isinstance(item, BaseException) or item.finish_reason is not None:  # type: ignore[attr-defined]
            done.set()

    engine.submit(greedy("counted", TEXT, 4), sink)
    assert done.wait(30)
    assert running_at_first_piece == [1]


def test_past_max_waiting_a_new_request_is_refused_at_once_naming_the_flag(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, mode="on", max_model_len=256, max_num_seqs=1, context_tokens=512)
    engine.max_waiting = 2
    paced_steps(engine)

    async def main() -> None:
        # long enough to still be running while the two waiters queue, however fast a decode step is
        tasks = [asyncio.create_task(collect(engine, greedy("run", TEXT, 200)))]
        assert await eventually_async(lambda: engine.stats().num_running == 1)
        tasks += [asyncio.create_task(collect(engine, greedy(f"wait{i}", TEXT, 5))) for i in range(2)]
        assert await eventually_async(lambda: engine.stats().num_waiting == 2)
        with pytest.raises(EngineOverloadedError) as err:
            await collect(engine, greedy("one too many", TEXT, 5))
        assert str(err.value) == (
            "2 requests are already waiting for a place in the batch (--max-waiting 2); retry later, or "
            "send fewer requests at once"
        )
        results = await asyncio.gather(*tasks)  # the accepted ones complete
        assert [r.usage.completion_tokens for r in results] == [200, 5, 5]

    asyncio.run(main())
    assert all_blocks_free(engine)


def test_a_caller_that_falls_behind_gets_the_queued_tokens_merged(engine):
    """The pieces queued while the caller was busy go out as one (fewer messages), in order, with their
    logprobs; the stream says what an unhurried one says. (The first piece is whatever had queued when the
    caller first looked: one token on a quiet machine, more when its event loop was late; CI saw 3.)"""
    paced_steps(engine)  # else all 24 tokens can be ready before the caller first looks
    request = GenerationRequest(
        "slow", TEXT, SamplingParams(temperature=0, logprobs=True), max_tokens=24, ignore_eos=True
    )

    async def slow_reader() -> list:
        pieces = []
        async for piece in engine.generate(request):
            pieces.append(piece)
            if len(pieces) == 1:  # the step thread keeps going while this caller is away
                assert await eventually_async(lambda: engine.stats().num_running == 0, timeout=60)
        return pieces

    pieces = asyncio.run(slow_reader())
    [whole] = engine.run([request])
    assert len(pieces) == 2  # what came while the caller was away went out as one piece
    assert pieces[0].token_ids and pieces[0].finish_reason is None
    assert [t for p in pieces for t in p.token_ids] == list(whole.token_ids)
    assert [lp for p in pieces for lp in p.logprobs] == pytest.approx(list(whole.logprobs))
    assert "".join(p.text for p in pieces) == whole.text
    assert (pieces[-1].finish_reason, pieces[-1].usage.completion_tokens) == (FinishReason.LENGTH, 24)
