"""Echo with the prompt's logprobs (what an evaluation harness scores a continuation by): each prompt
token after the first gets the logprob the model gives it after the tokens before it, equal to
transformers' own forward over the prompt, on both caches, in one step or in several prefill chunks,
and with a prefix cache that already holds the prompt (it must not skip the positions it needs)."""

from __future__ import annotations

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
        import asyncio

        asyncio.run(collect(engine, request))
