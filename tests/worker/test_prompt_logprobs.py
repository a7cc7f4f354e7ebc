"""Echo with the prompt's logprobs (what an evaluation harness scores a continuation by): each prompt
token after the first gets the logprob the model gives it after the tokens before it, equal to
transformers' own forward over the prompt, on both caches, in one step or in several prefill chunks,
and with a prefix cache that already holds the prompt (it must not skip the positions it needs)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvpact.shared.errors import RequestError
from kvpact.worker.engine.request import GenerationRequest, SamplingParams
from tests.worker.conftest import collect, run_staggered

PROMPT = tuple(torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(7)).tolist())
TOP = 3


@pytest.fixture(scope="module")
def expected(tiny_llama) -> torch.Tensor:
    """transformers' log-softmax over the prompt: row p is the distribution of token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def echo(request_id: str, **kwargs: object) -> GenerationRequest:
    sampling = SamplingParams(temperature=0.0, logprobs=True, prompt_logprobs=TOP)
    return GenerationRequest(request_id, PROMPT, sampling, max_tokens=2, ignore_eos=True, echo=True, **kwargs)  # type: ignore[arg-type]


CONFIGS = {
    "eager": dict(mode="off"),
    "paged-prefix-cached": dict(mode="on", context_tokens=4096, block_size=8),
    "paged-chunked": dict(mode="on", context_tokens=4096, block_size=8, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_echo_carries_the_prompt_and_its_logprobs_as_transformers_computes_them(
    make_engine, tiny_llama, expected, config
):
    engine = make_engine(tiny_llama, **CONFIGS[config])
    run_staggered(engine, [echo("warm")])  # a second request with the same prompt finds it cached
    [result] = run_staggered(engine, [echo("scored", n=2)])
    prompt = result.prompt
    assert prompt is not None and prompt.token_ids == list(PROMPT) and len(prompt.tokens) == len(PROMPT)
    targets = torch.tensor(PROMPT[1:])
    want = expected.gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(prompt.logprobs), want, atol=1e-3)
    top_values, top_ids = expected.topk(TOP, dim=-1)
    assert [t.token_ids for t in prompt.top_logprobs] == top_ids.tolist()
    assert torch.allclose(torch.tensor([t.logprobs for t in prompt.top_logprobs]), top_values, atol=1e-3)
    assert all(t.tokens and len(t.tokens) == TOP for t in prompt.top_logprobs)


def test_prompt_logprobs_without_echo_are_refused_by_name(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, mode="off")
    request = echo("r")
    request.echo = False
    with pytest.raises(RequestError, match="prompt_logprobs needs echo"):
        asyncio.run(collect(engine, request))


@pytest.mark.parametrize("mode", ["off", "on"])
def test_each_of_n_completions_echoes_the_same_prompt_logprobs(make_engine, tiny_llama, expected, mode):
    engine = make_engine(tiny_llama, mode, context_tokens=4096, block_size=8)
    request = echo("n3", n=3)

    async def pieces():  # type: ignore[no-untyped-def]
        return [p async for p in engine.generate(request)]

    prompts = {p.index: p.prompt for p in asyncio.run(pieces()) if p.prompt is not None}
    assert sorted(prompts) == [0, 1, 2]  # one echo per completion, on its first piece
    want = expected.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    for prompt in prompts.values():
        assert torch.allclose(torch.tensor(prompt.logprobs), want, atol=1e-3)
        assert len(prompt.top_logprobs) == len(PROMPT) - 1


def test_preempted_sequences_record_their_prompt_logprobs_once(make_engine, tiny_llama):
    def requests(n: int) -> list[GenerationRequest]:
        sampling = SamplingParams(temperature=0.0, logprobs=True, prompt_logprobs=2)
        return [
            GenerationRequest(
                f"r{i}", tuple(range(3 + i, 23 + i)), sampling, 40, ignore_eos=True, echo=True, n=n
            )
            for i in range(6)
        ]

    roomy = make_engine(tiny_llama, "on", max_model_len=64, context_tokens=4096)
    tight = make_engine(tiny_llama, "on", max_model_len=64, context_tokens=64, max_num_batched_tokens=8)
    for n in (1, 2):
        want = run_staggered(roomy, requests(n), gap_s=0.0)
        got = run_staggered(tight, requests(n), gap_s=0.002)
        for g, e in zip(got, want, strict=True):
            assert g.prompt is not None and e.prompt is not None and len(g.prompt.logprobs) == 19
            assert torch.allclose(torch.tensor(g.prompt.logprobs), torch.tensor(e.prompt.logprobs), atol=1e-4)
            assert g.token_ids == e.token_ids or n > 1  # n > 1: the joined completions' order is the steps'
    assert tight.stats().num_preemptions > 0  # the pool of 4 blocks made it preempt
