"""n > 1 completions of one prompt on a tiny Llama, both caches: each chunk carries its index, usage
counts the prompt once, a seed gives completion i the draws of seed + i, and an abort frees every block.
On the paged cache the n sequences share the prompt's blocks (tests/worker/test_scheduler.py has the
exact block ids)."""

from __future__ import annotations

import asyncio

import pytest

from kvpact.shared.errors import RequestError
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.request import FinishReason, GenerationOutput, GenerationRequest, SamplingParams
from kvpact.worker.generate_pb import chunk_to_pb
from tests.factories.eventually import eventually
from tests.worker.conftest import greedy

MODES = {"eager": dict(mode="off"), "paged": dict(mode="on", context_tokens=2048)}
PROMPT = tuple(range(5, 25))  # 20 tokens: one full block of 16 and a partial one


@pytest.fixture(params=list(MODES))
def engine(request, make_engine, tiny_llama) -> Engine:
    return make_engine(tiny_llama, max_model_len=128, **MODES[request.param])


def sampled(request_id: str, seed: int | None, n: int = 1, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        PROMPT,
        SamplingParams(temperature=1.0, seed=seed),
        max_tokens=max_tokens,
        ignore_eos=True,
        n=n,
    )


def test_greedy_n_gives_n_copies_of_the_single_completion_and_counts_the_prompt_once(engine):
    (single,) = engine.run([greedy("one", PROMPT, max_tokens=10)], timeout=60)
    (choices,) = engine.run_choices([greedy("four", PROMPT, max_tokens=10, n=4)], timeout=60)
    assert [c.token_ids for c in choices] == [single.token_ids] * 4
    assert [c.text for c in choices] == [single.text] * 4
    assert {c.finish_reason for c in choices} == {FinishReason.LENGTH}
    usage = choices[0].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 40)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_seed_gives_completion_i_the_tokens_of_seed_plus_i(engine):
    (choices,) = engine.run_choices([sampled("n", seed=7, n=3)], timeout=60)
    alone = engine.run([sampled(f"s{i}", seed=7 + i) for i in range(3)], timeout=60)
    assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in choices}) == 3  # distinct
    (again,) = engine.run_choices([sampled("again", seed=7, n=3)], timeout=60)
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]  # reproducible


def test_the_stream_interleaves_indices_and_ends_once_all_finished_with_the_usage(engine):
    async def main() -> list[GenerationOutput]:
        return [p async for p in engine.generate(greedy("r", PROMPT, max_tokens=6, n=3))]

    pieces = asyncio.run(main())
    assert sorted({p.index for p in pieces}) == [0, 1, 2]
    assert [sum(1 for p in pieces if p.index == i) for i in range(3)] == [6, 6, 6]
    assert sum(1 for p in pieces if p.finish_reason is not None) == 3
    assert [p.usage is not None for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 18
    assert [chunk_to_pb(p, "w").index for p in pieces] == [p.index for p in pieces]


def test_cancelling_an_n_request_frees_every_block_of_all_its_sequences(engine):
    total = engine.stats().num_total_blocks

    async def main() -> int:
        stream = engine.generate(greedy("long", PROMPT, max_tokens=100, n=4))
        got = 0
        async for _ in stream:
            got += 1
            if got == 8:  # every completion has begun
                break
        await stream.aclose()
        return got

    assert asyncio.run(main()) == 8
    eventually(
        lambda: engine.stats().num_free_blocks == total and engine.stats().num_running == 0, timeout=30
    )
    assert engine.stats().num_free_blocks == total


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(n=17), "n must be in [1, 16], got 17"),
        (dict(n=0), "n must be in [1, 16], got 0"),
        (
            dict(n=16, max_tokens=5000),
            "n (16) x max_tokens (5000) is 80000 tokens, more than the cap of 65536",
        ),
    ],
)
def test_n_out_of_bounds_is_refused_naming_it(fields, message):
    with pytest.raises(RequestError) as info:
        GenerationRequest("r", "hi", **fields).validate()
    assert message in str(info.value)


def test_n_above_the_batch_is_refused(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, "on", max_model_len=128, context_tokens=2048, max_num_seqs=2)
    with pytest.raises(RequestError) as info:
        engine.run([greedy("r", PROMPT, n=3)], timeout=60)
    assert "n (3) is more than the 2 sequences this worker runs at once (--max-num-seqs)" in str(info.value)
