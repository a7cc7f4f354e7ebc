"""Protobuf at the worker's edge (the Generate call, and the device's Capabilities for the handshake):
GenerateRequest -> GenerationRequest, GenerationOutput -> GenerateChunk,
DeviceProbe -> Capabilities. One place per type; the engine never sees a protobuf message. The
engine's load is already the shared WorkerLoad, sent by shared.handshake_pb.load_to_pb.

Unset optional sampling fields take the defaults the proto documents (temperature 1, top_p 1,
repetition_penalty 1, no seed); an unset max_tokens stays None (the engine picks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpact.shared.errors import RequestError
from kvpact.shared.limits import MAX_MESSAGE_BYTES
from kvpact.v1 import cache_pb2, generation_pb2, worker_pb2
from kvpact.worker.engine.request import (
    ChatMessage,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    Prompt,
    ResponseFormat,
    SamplingParams,
    TopLogprobs,
)

if TYPE_CHECKING:  # torch comes with it: a process that only converts chunks needs none
    from kvpact.worker.startup.device import DeviceProbe

_FINISH_TO_PB = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}

MAX_ECHO_BYTES = MAX_MESSAGE_BYTES // 2  # an echoed prompt's chunk: room left for the router's relay


def sampling_from_pb(msg: generation_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        top_logprobs=msg.top_logprobs,
        logit_bias=dict(msg.logit_bias),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def prompt_from_pb(msg: generation_pb2.GenerateRequest) -> Prompt:
    which = msg.WhichOneof("prompt")
    if which == "text":
        return msg.text
    if which == "chat":
        return tuple(ChatMessage(role=m.role, content=m.content) for m in msg.chat.messages)
    if which == "token_ids":
        return tuple(msg.token_ids.ids)
    raise RequestError("the request has no prompt: set one of text, chat or token_ids")


def response_format_from_pb(msg: generation_pb2.GenerateRequest) -> ResponseFormat | None:
    if not msg.HasField("response_format"):
        return None
    kind = msg.response_format.WhichOneof("kind")
    if kind == "json_schema":
        return ResponseFormat(json_schema=msg.response_format.json_schema)
    if kind == "json_object" and msg.response_format.json_object:
        return ResponseFormat()
    raise RequestError(
        "response_format is set but asks for nothing: set json_object to true or json_schema to a JSON "
        "Schema (or leave response_format unset for free text)"
    )


def request_from_pb(msg: generation_pb2.GenerateRequest, request_id: str) -> GenerationRequest:
    """`request_id` is the message's, or one the server assigned when the message had none."""
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt_from_pb(msg),
        sampling=sampling_from_pb(msg.sampling),
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        response_format=response_format_from_pb(msg),
        n=max(msg.n, 1),  # 0 (unset) = 1
        echo=msg.echo,
    )


def chunk_to_pb(output: GenerationOutput, worker_id: str) -> generation_pb2.GenerateChunk:
    chunk = generation_pb2.GenerateChunk(
        request_id=output.request_id,
        text=output.text,
        token_ids=output.token_ids,
        logprobs=output.logprobs,
        worker_id=worker_id,
        index=output.index,
        top_logprobs=[_top_to_pb(t) for t in output.top_logprobs],
        tokens=output.tokens,
    )
    if output.prompt is not None:
        echo = output.prompt
        chunk.prompt.CopyFrom(
            generation_pb2.PromptEcho(
                text=echo.text,
                token_ids=echo.token_ids,
                tokens=echo.tokens,
                logprobs=echo.logprobs,
                top_logprobs=[_top_to_pb(t) for t in echo.top_logprobs],
            )
        )
        size = chunk.ByteSize()
        if size > MAX_ECHO_BYTES:  # it would fail the router's call to this worker, every request on it
            k = len(echo.top_logprobs[0].token_ids) if echo.top_logprobs else 0
            raise RequestError(
                f"the echoed prompt ({len(echo.token_ids)} tokens, prompt_logprobs {k}) is {size} bytes, "
                f"over the {MAX_ECHO_BYTES} one message may carry; ask fewer prompt_logprobs, or score the "
                "prompt in shorter parts"
            )
    if output.finish_reason is not None:
        chunk.finish_reason = _FINISH_TO_PB[output.finish_reason]
    if output.usage is not None:
        chunk.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=output.usage.prompt_tokens,
                completion_tokens=output.usage.completion_tokens,
                cached_prompt_tokens=output.usage.cached_prompt_tokens,
            )
        )
    return chunk


def capabilities_to_pb(probe: DeviceProbe) -> worker_pb2.Capabilities:
    """What the device can do, for the handshake (sent whether startup then succeeds or fails)."""
    info = probe.info
    cc = info.compute_capability or (0, 0)
    backends = [cache_pb2.PAGED_BACKEND_TORCH]
    if info.kind == "cuda" and info.triton_version:
        backends.append(cache_pb2.PAGED_BACKEND_TRITON)
    return worker_pb2.Capabilities(
        device_kind=info.kind,
        device_name=info.name,
        memory_total_bytes=probe.memory_total_bytes,
        memory_free_bytes=probe.memory_free_bytes,
        compute_capability_major=cc[0],
        compute_capability_minor=cc[1],
        torch_version=probe.torch_version,
        triton_version=info.triton_version or "",
        supported_backends=backends,
    )


def _top_to_pb(top: TopLogprobs) -> generation_pb2.TopLogprobs:
    return generation_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs, tokens=top.tokens)
