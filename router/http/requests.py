"""OpenAI request bodies -> GenerateRequests (protobuf at the edge: this is the one place they meet).

One GenerateRequest per prompt: a chat is one; a completions `prompt` that is a list of strings or of
token-id lists is one per entry (choice index = prompt index * n + GenerateChunk.index). Every field of
router/http/schema.py is mapped here or refused by name (`refuse`); the worker refuses by name what it
does not honor yet, and router/http/errors.py turns that into a 400 naming the OpenAI parameter.
"""

from __future__ import annotations

import json
import uuid

from kvpact.router.http.errors import HttpError
from kvpact.router.http.schema import ChatCompletionRequest, CompletionRequest, _Generation
from kvpact.shared.limits import MAX_PROMPT_BYTES
from kvpact.v1 import generation_pb2

ROLE = {"developer": "system"}  # OpenAI's newer name for the system message


def refuse(body: _Generation) -> None:
    refused = body.refused()
    if refused is not None:
        name, reason = refused
        raise HttpError(400, f"{name}: {reason}; leave it out", name, "unsupported_parameter")


def _max_tokens(body: _Generation) -> int | None:
    """max_tokens or its newer name max_completion_tokens; both only when they agree."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise HttpError(
                400,
                "max_tokens and max_completion_tokens disagree; send one of them",
                "max_completion_tokens",
            )
    return body.max_completion_tokens or body.max_tokens


def chat_request(body: ChatCompletionRequest) -> generation_pb2.GenerateRequest:
    refuse(body)
    request = _common(body, _max_tokens(body))
    for message in body.messages:
        content = (
            message.content
            if isinstance(message.content, str)
            else "".join(part.text for part in message.content)
        )
        request.chat.messages.add(role=ROLE.get(message.role, message.role), content=content)
    request.sampling.logprobs = body.logprobs
    request.sampling.top_logprobs = body.top_logprobs or 0
    return request


def completion_requests(body: CompletionRequest) -> list[generation_pb2.GenerateRequest]:
    refuse(body)
    prompt = body.prompt
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]  # type: ignore[list-item]  # one prompt of token ids
    else:
        prompts = list(prompt)  # type: ignore[arg-type]  # several prompts
    if not all(p for p in prompts):
        raise HttpError(400, "prompt: an empty prompt cannot be completed", "prompt")
    if sum(len(p) for p in prompts if isinstance(p, str)) > MAX_PROMPT_BYTES:
        raise HttpError(400, f"prompt: more than {MAX_PROMPT_BYTES} characters in all", "prompt")
    requests = []
    base_id = uuid.uuid4().hex
    for i, one in enumerate(prompts):
        request = _common(body, _max_tokens(body))
        if isinstance(one, str):
            request.text = one
        else:
            request.token_ids.ids.extend(one)
        if body.logprobs is not None:
            request.sampling.logprobs = True
            request.sampling.top_logprobs = body.logprobs
        if body.echo:
            request.echo = True
            if body.logprobs is not None:  # lm-eval's loglikelihood: echo, logprobs 1, max_tokens 1
                request.sampling.prompt_logprobs = body.logprobs
        request.request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
        requests.append(request)
    return requests


def _common(body: _Generation, max_tokens: int | None) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        model=body.model,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        n=body.n if body.n > 1 else 0,
    )
    if max_tokens is not None:
        if max_tokens >= 1 << 32:
            raise HttpError(400, f"max_tokens: {max_tokens} is more than any model can take", "max_tokens")
        request.max_tokens = max_tokens
    sampling = request.sampling
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    sampling.top_k = max(body.top_k, 0)
    sampling.min_p = body.min_p
    if body.repetition_penalty is not None:
        sampling.repetition_penalty = body.repetition_penalty
    if body.seed is not None:
        sampling.seed = body.seed
    sampling.presence_penalty = body.presence_penalty
    sampling.frequency_penalty = body.frequency_penalty
    if body.stop is not None:
        request.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        request.stop_token_ids.extend(body.stop_token_ids)
    for token, bias in (body.logit_bias or {}).items():
        if int(token) >= 1 << 32:
            raise HttpError(400, f"logit_bias: {token} is not a token id", "logit_bias")
        sampling.logit_bias[int(token)] = bias
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        request.response_format.json_object = True
    elif fmt is not None and fmt.json_schema is not None:
        request.response_format.json_schema = json.dumps(fmt.json_schema.schema_)
    return request
