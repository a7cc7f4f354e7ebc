"""The OpenAI-style generation parameters end to end on a tiny Llama (both caches): min_tokens,
top_logprobs, presence/frequency penalties; and their protobuf conversion at the worker's edge."""

from __future__ import annotations

import pytest

from kvpact.shared.errors import RequestError
from kvpact.v1 import generation_pb2
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.request import (
    FinishReason,
    GenerationOutput,
    PromptEcho,
    SamplingParams,
    TopLogprobs,
)
from kvpact.worker.generate_pb import chunk_to_pb, request_from_pb
from tests.worker.conftest import greedy

MODES = {"eager": dict(mode="off"), "paged": dict(mode="on", context_tokens=2048)}
PROMPT = (5, 9, 13, 17, 21)


@pytest.fixture(params=list(MODES))
def engine(request, make_engine, tiny_llama) -> Engine:
    return make_engine(tiny_llama, max_model_len=128, **MODES[request.param])


def test_min_tokens_masks_the_stop_tokens_until_reached(engine):
    (free,) = engine.run([greedy("free", PROMPT, max_tokens=8)], timeout=60)
    first = free.token_ids[0]
    # the greedy first token as a stop token ends the output at once...
    (stopped,) = engine.run([greedy("stopped", PROMPT, max_tokens=8, stop_token_ids=(first,))], timeout=60)
    assert (stopped.token_ids, stopped.finish_reason) == ([first], FinishReason.STOP)
    # ...unless min_tokens holds it back: then it never appears among the first min_tokens tokens
    (held,) = engine.run(
        [greedy("held", PROMPT, max_tokens=8, stop_token_ids=(first,), min_tokens=4)], timeout=60
    )
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    if held.finish_reason is FinishReason.STOP:
        assert held.token_ids[-1] == first


def test_min_tokens_above_the_default_max_tokens_is_refused_naming_both(engine):
    request = greedy("r", PROMPT, max_tokens=None, min_tokens=200)  # default: 128 - 5 = 123 tokens
    with pytest.raises(RequestError) as info:
        engine.run([request], timeout=60)
    assert "min_tokens (200) must be <= max_tokens (123, the default for this prompt)" in str(info.value)


def test_top_logprobs_come_with_every_token_the_first_being_the_greedy_pick(engine):
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    request = greedy("r", PROMPT, max_tokens=6)
    request.sampling = params
    (result,) = engine.run([request], timeout=60)
    assert len(result.top_logprobs) == len(result.token_ids) == len(result.logprobs) == 6
    for token_id, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs, strict=True):
        assert len(top.token_ids) == 3 and top.token_ids[0] == token_id
        assert top.logprobs[0] == pytest.approx(logprob) and top.logprobs == sorted(
            top.logprobs, reverse=True
        )


def test_penalties_leave_a_greedy_output_alone_when_zero_and_change_a_repetitive_one(engine):
    (plain,) = engine.run([greedy("plain", PROMPT, max_tokens=24)], timeout=60)
    request = greedy("penalized", PROMPT, max_tokens=24)
    request.sampling = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    (penalized,) = engine.run([request], timeout=60)
    # a random tiny model repeats under greedy; strong penalties make it repeat less
    assert len(set(plain.token_ids)) < len(plain.token_ids)
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))


def test_the_wire_carries_the_new_fields_both_ways():
    msg = generation_pb2.GenerateRequest(
        text="hi",
        min_tokens=3,
        sampling=generation_pb2.SamplingParams(
            presence_penalty=0.5, frequency_penalty=-1.5, logprobs=True, top_logprobs=4
        ),
    )
    request = request_from_pb(msg, "r")
    assert request.min_tokens == 3
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.top_logprobs) == (0.5, -1.5, 4)
    too_big = GenerationOutput("r", "a", [7], [-0.25], prompt=PromptEcho("x" * (3 << 20), [1], ["x"]))
    with pytest.raises(
        RequestError, match=r"the echoed prompt \(1 tokens, prompt_logprobs 0\) is \d+ bytes, over"
    ):
        chunk_to_pb(too_big, "w")  # refused alone: one message that size would fail the router's whole call
    piece = GenerationOutput("r", "a", [7], [-0.25], top_logprobs=[TopLogprobs([7, 3], [-0.25, -1.5])])
    chunk = chunk_to_pb(piece, "w")
    assert [(list(t.token_ids), list(t.logprobs)) for t in chunk.top_logprobs] == [([7, 3], [-0.25, -1.5])]
