"""worker.sampling: each filter's exact effect, seeds, logprobs; worker.request validation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvpact.shared.errors import RequestError
from kvpact.worker.engine.request import ChatMessage, GenerationRequest, SamplingParams
from kvpact.worker.engine.sampling import SampleRow, make_generator, sample

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
    ids, logprobs, _ = sample(logits, [row(temperature=0), row(temperature=0)])
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
    ids, _, _ = sample(logits_of(LOGITS), [row(history=[7, 4], temperature=0, repetition_penalty=4.0)])
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
    ids, _, _ = sample(logits, [row(history=history, **params), row(temperature=0)])
    assert ids == [7, 7]


def test_repetition_penalty_applies_only_to_its_own_row():
    logits = logits_of(LOGITS, LOGITS)
    ids, _, _ = sample(logits, [row(history=[7], temperature=0, repetition_penalty=4.0), row(temperature=0)])
    assert ids == [0, 7]


def test_logprob_is_the_raw_models_log_softmax_of_the_sampled_token():
    logits = logits_of(LOGITS)
    ids, logprobs, _ = sample(
        logits, [row(temperature=0, logprobs=True, repetition_penalty=4.0, history=[7])]
    )
    assert ids == [0]
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits[0], 0)[0].item())


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)

    def run(batch_rows: list[int]) -> list[int]:
        gens = {i: make_generator(1000 + i, torch.device("cpu")) for i in batch_rows}
        out = []
        for _ in range(20):
            ids, _, _ = sample(
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
    ids, _, _ = sample(logits, [row(top_k=1), row(generator=gen, top_k=1), row(temperature=0)])
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


# ---- presence / frequency penalties, min_tokens mask, top_logprobs ----


def out_row(prompt=(), output=(), **params) -> SampleRow:
    """A row whose history is prompt + output (the OpenAI penalties look at the output only)."""
    return SampleRow(SamplingParams(temperature=0, **params), None, [*prompt, *output], len(prompt))


def test_frequency_penalty_subtracts_per_occurrence_in_the_output():
    # token 7 (3.0) twice in the output: 3.0 - 2 * 0.6 = 1.8 < 2.0 -> token 0 wins; once: 2.4 -> 7 stays
    assert sample(logits_of(LOGITS), [out_row(output=[7, 7], frequency_penalty=0.6)]).token_ids == [0]
    assert sample(logits_of(LOGITS), [out_row(output=[7], frequency_penalty=0.6)]).token_ids == [7]
    # the prompt does not count
    assert sample(logits_of(LOGITS), [out_row(prompt=[7, 7, 7], frequency_penalty=2.0)]).token_ids == [7]


def test_presence_penalty_subtracts_once_whatever_the_count():
    # 7 present (any count): 3.0 - 0.9 = 2.1 > 2.0 stays; 3.0 - 1.1 = 1.9 loses to 0
    assert sample(logits_of(LOGITS), [out_row(output=[7, 7, 7], presence_penalty=0.9)]).token_ids == [7]
    assert sample(logits_of(LOGITS), [out_row(output=[7], presence_penalty=1.1)]).token_ids == [0]
    # a negative penalty favors what was generated: 4 (-1.0) three times, -1.0 + 3 * 2 = 5.0 > 3.0
    assert sample(logits_of(LOGITS), [out_row(output=[4, 4, 4], frequency_penalty=-2.0)]).token_ids == [4]


def test_penalties_change_only_their_own_rows_and_keep_raw_logprobs():
    logits = logits_of(LOGITS, LOGITS)
    got = sample(logits, [out_row(output=[7], presence_penalty=2.0, logprobs=True), out_row(logprobs=True)])
    assert got.token_ids == [0, 7]
    raw = torch.log_softmax(torch.tensor(LOGITS), 0)
    assert got.logprobs == pytest.approx([raw[0].item(), raw[7].item()])


def test_masked_tokens_are_never_sampled():
    rows = [
        SampleRow(SamplingParams(temperature=0), None, [], 0, masked_token_ids=frozenset({7, 0})),
        row(temperature=0),
    ]
    assert sample(logits_of(LOGITS, LOGITS), rows).token_ids == [1, 7]
    gen = make_generator(0, torch.device("cpu"))
    seeded = SampleRow(SamplingParams(temperature=100.0), gen, [], 0, masked_token_ids=frozenset({7}))
    assert 7 not in {sample(logits_of(LOGITS), [seeded]).token_ids[0] for _ in range(400)}


def test_top_logprobs_are_the_k_most_likely_raw_tokens_per_row():
    raw = torch.log_softmax(torch.tensor(LOGITS), 0)
    got = sample(
        logits_of(LOGITS, LOGITS, LOGITS),
        [
            row(temperature=0, logprobs=True, top_logprobs=3),
            row(temperature=0, logprobs=True),
            row(logprobs=True, top_logprobs=1, temperature=0, repetition_penalty=100.0, history=[7]),
        ],
    )
    first, none, last = got.top_logprobs
    assert first is not None and first.token_ids == [7, 0, 1]
    assert first.logprobs == pytest.approx([raw[7].item(), raw[0].item(), raw[1].item()])
    assert none is None
    # the alternatives are the model's raw belief: the penalty moved the sample (0), not the top token (7)
    assert last is not None and last.token_ids == [7] and got.token_ids[2] == 0


def test_logit_bias_moves_only_its_rows_tokens_and_keeps_raw_logprobs():
    logits = logits_of(LOGITS, LOGITS, LOGITS)
    got = sample(
        logits,
        [
            row(temperature=0, logit_bias={5: 100.0}, logprobs=True),  # -2.0 + 100: forced
            row(temperature=0, logit_bias={7: -1.5, 0: 0.25}),  # 7: 1.5, 0: 2.25 -> 0 wins
            row(temperature=0),  # untouched
        ],
    )
    assert got.token_ids == [5, 0, 7]
    assert got.logprobs[0] == pytest.approx(torch.log_softmax(torch.tensor(LOGITS), 0)[5].item())
    gen = make_generator(0, torch.device("cpu"))
    banned = row(generator=gen, temperature=5.0, logit_bias={7: -100.0, 0: -100.0})
    assert not {sample(logits_of(LOGITS), [banned]).token_ids[0] for _ in range(400)} & {7, 0}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2] (0 = disabled), got 2.5"),
        (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=math.nan), "frequency_penalty must be in [-2, 2]"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20], got 21"),
        (dict(top_logprobs=2), "top_logprobs (2) needs logprobs"),
        (dict(logit_bias={3: 100.5}), "logit_bias values must be in [-100, 100], got 3: 100.5"),
        (dict(logit_bias={3: math.inf}), "logit_bias values must be in [-100, 100]"),
    ],
)
def test_penalty_and_top_logprobs_out_of_range_are_refused(params, message):
    with pytest.raises(RequestError) as info:
        SamplingParams(**params).validate()
    assert message in str(info.value)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, logprobs=True, top_logprobs=20).validate()


def test_min_tokens_above_max_tokens_is_refused_naming_both():
    with pytest.raises(RequestError) as info:
        GenerationRequest("r", "hi", max_tokens=4, min_tokens=5).validate()
    assert "min_tokens (5) must be <= max_tokens (4)" in str(info.value)
    GenerationRequest("r", "hi", max_tokens=5, min_tokens=5).validate()


def test_greedy_picks_as_torch_argmax_does_with_ties_nan_inf_and_masked_rows():
    from kvpact.worker.engine.sampling import _argmax

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = math.nan  # a NaN counts as the largest
    logits[2] = 1.0  # all tied: the first
    logits[3, 7] = logits[3, 9] = math.inf
    logits[4] = -math.inf  # every token masked
    logits[5, 998] = logits[5].max() + 1
    assert _argmax(logits).tolist() == logits.argmax(dim=-1).tolist() == [
        logits[0].argmax().item(), 3, 0, 7, 0, 998,
    ]  # fmt: skip
    assert _argmax(logits[:, :500]).tolist() == logits[:, :500].argmax(dim=-1).tolist()  # not contiguous
