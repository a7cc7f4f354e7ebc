"""worker.sampling: each filter's exact effect, seeds, logprobs; worker.request validation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvpact.shared.errors import RequestError
from kvpact.worker.request import ChatMessage, GenerationRequest, SamplingParams
from kvpact.worker.sampling import SampleRow, make_generator, sample

VOCAB = 8


def row(history=(), generator=None, **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), generator, list(history))


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def draws(logits_row: list[float], n: int = 400, **params) -> set[int]:
    """The set of tokens n seeded draws from one row ever produce."""
    gen = make_generator(0, torch.device("cpu"))
    logits = logits_of(logits_row)
    return {sample(logits, [row(generator=gen, **params)])[0][0] for _ in range(n)}


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, 3.0]  # best: 7, then 0, 1, 2, 3, ...


def test_greedy_is_argmax_per_row():
    logits = logits_of(LOGITS, list(reversed(LOGITS)))
    ids, logprobs = sample(logits, [row(temperature=0), row(temperature=0)])
    assert ids == [7, 0]
    assert logprobs == [None, None]


def test_top_k_keeps_exactly_the_k_best():
    assert draws(LOGITS, top_k=2, temperature=5.0) == {7, 0}
    assert draws(LOGITS, top_k=1, temperature=5.0) == {7}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.softmax(torch.tensor(LOGITS), 0)
    # 7 alone has ~0.63 of the mass; 7 + 0 ~0.87; so p=0.5 keeps {7}, p=0.8 keeps {7, 0}
    assert probs[7] > 0.5 and probs[7] + probs[0] > 0.8 > probs[7]
    assert draws(LOGITS, top_p=0.5) == {7}
    assert draws(LOGITS, top_p=0.8) == {7, 0}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # p(t) / p(7) = exp(logit - 3): 0 -> e^-1 = 0.37, 1 -> e^-2 = 0.14, 2 -> e^-2.5 = 0.08
    assert draws(LOGITS, min_p=0.3) == {7, 0}
    assert draws(LOGITS, min_p=0.1) == {7, 0, 1}


def test_temperature_zero_point_one_is_near_greedy_and_high_temperature_spreads():
    assert draws(LOGITS, temperature=0.1) == {7}
    assert draws(LOGITS, temperature=100.0, n=2000) == set(range(VOCAB))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # token 7 (3.0) seen: 3.0 / 4 = 0.75 < 2.0 -> token 0 wins; token 4 (-1.0) seen: -4.0
    ids, _ = sample(logits_of(LOGITS), [row(history=[7, 4], temperature=0, repetition_penalty=4.0)])
    assert ids == [0]
    # penalty 1 leaves the logits alone; a penalty < 1 favors seen tokens
    assert sample(logits_of(LOGITS), [row(history=[7], temperature=0, repetition_penalty=1.0)])[0] == [7]
    assert sample(logits_of(LOGITS), [row(history=[0], temperature=0, repetition_penalty=0.1)])[0] == [0]


@pytest.mark.parametrize(
    ("history", "params"),
    [
        ((), dict(temperature=1e-45)),
        ((7, 0), dict(repetition_penalty=1e-38)),
        ((7,), dict(temperature=1e-38)),
    ],
)
def test_a_temperature_or_penalty_that_overflows_the_logits_still_samples_the_best(history, params):
    """logits / 1e-45 is +-inf; unclamped, softmax made nan and the draw failed the whole batch."""
    logits = logits_of(LOGITS, LOGITS)
    ids, _ = sample(logits, [row(history=history, **params), row(temperature=0)])
    assert ids == [7, 7]


def test_repetition_penalty_applies_only_to_its_own_row():
    logits = logits_of(LOGITS, LOGITS)
    ids, _ = sample(logits, [row(history=[7], temperature=0, repetition_penalty=4.0), row(temperature=0)])
    assert ids == [0, 7]


def test_logprob_is_the_raw_models_log_softmax_of_the_sampled_token():
    logits = logits_of(LOGITS)
    ids, logprobs = sample(logits, [row(temperature=0, logprobs=True, repetition_penalty=4.0, history=[7])])
    assert ids == [0]
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits[0], 0)[0].item())


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)

    def run(batch_rows: list[int]) -> list[int]:
        gens = {i: make_generator(1000 + i, torch.device("cpu")) for i in batch_rows}
        out = []
        for _ in range(20):
            ids, _ = sample(
                logits[batch_rows], [row(generator=gens[i], temperature=1.0, top_k=20) for i in batch_rows]
            )
            out.append(ids)
        return [seq[batch_rows.index(3)] for seq in out]

    alone = run([3])
    assert run([0, 1, 2, 3, 4, 5]) == alone
    assert run([5, 3]) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_and_seeded_rows_mix():
    logits = logits_of(LOGITS, LOGITS, LOGITS)
    gen = make_generator(7, torch.device("cpu"))
    ids, _ = sample(logits, [row(top_k=1), row(generator=gen, top_k=1), row(temperature=0)])
    assert ids == [7, 7, 7]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(min_p=1.5), "min_p must be in [0, 1]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(seed=-1), "seed must be in [0, 2**64 - 1]"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(params, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        SamplingParams(**params).validate()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=""), "the prompt is empty"),
        (dict(prompt=()), "the prompt is empty"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(stop=("",)), "stop strings must not be empty"),
        (
            dict(prompt=(ChatMessage("user", "hi"), ChatMessage("wizard", "x"))),
            "chat message 1 has role 'wizard'; use one of system, user, assistant",
        ),
    ],
)
def test_bad_requests_are_refused(kwargs, message):
    request = GenerationRequest(**{"request_id": "r", "prompt": "hi", **kwargs})
    with pytest.raises(RequestError, match=message):
        request.validate()
