"""The Python client for a kvpact router.

    from kvpact.client import Client

    with Client("127.0.0.1:50051", timeout=30) as client:
        print(client.complete("Hello", max_tokens=16, temperature=0).text)
        for chunk in client.generate("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)
        print(render_cluster_status(client.cluster_status()))

Over TLS, with an API key (docs/security.md):

    Client("router.example:50051", ca_file="ca.crt", api_key="...")   # TLS verified against ca.crt
    Client("router.example:50051", tls=True, api_key="...")           # TLS verified against system roots

`cert_file`/`key_file` present a client certificate (a server that requires one), `server_name` overrides
the name the router's certificate must carry, `credentials` takes any grpc.ChannelCredentials instead. The
key travels as `authorization: Bearer <key>` metadata with every call; it is never part of a repr.

`AsyncClient` is the same on grpc.aio: `await client.complete(...)`,
`async for chunk in client.generate(...)`.

The keyword arguments are `GenerateParams` (sampling, penalties, logit_bias, min_tokens, logprobs with
top_logprobs, echo with prompt_logprobs); with logprobs each token comes with its text (`tokens`) and,
with top_logprobs, its `Alternative`s; with echo the first chunk (or the completion) has the prompt as an
`EchoedPrompt`. Scoring a continuation, as an evaluation harness does:

    done = client.complete(prompt_ids + continuation_ids, max_tokens=1, echo=True, prompt_logprobs=0)
    score = sum(done.prompt.logprobs[len(prompt_ids) - 1 :])  # logprobs[i - 1] is token i's

Errors: every failed call raises `KvpactRpcError`, a `grpc.RpcError` subclass carrying the server's
status as `.code` (a `grpc.StatusCode`) and `.details` (its message), e.g. NOT_FOUND naming the served
models, UNAVAILABLE while the cluster is starting, DEADLINE_EXCEEDED past `timeout`. A value the wire
cannot carry (a negative top_k, seed or token id; max_tokens past 2**32 - 1) raises it too, with
INVALID_ARGUMENT, before anything is sent.
Breaking out of `generate()` early (or cancelling the async task) cancels the request on the server,
which aborts it and frees its KV cache.

Depends only on grpc and the generated kvpact.v1 messages (no torch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict, Unpack

import grpc

from kvpact.client.status_table import render_cluster_status
from kvpact.client.transport import TransportParams, open_channel, with_api_key
from kvpact.v1 import generation_pb2, router_pb2, router_pb2_grpc

__all__ = [
    "Alternative",
    "AsyncClient",
    "EchoedPrompt",
    "GenerateParams",
    "Chunk",
    "Client",
    "Completion",
    "KvpactRpcError",
    "TransportParams",
    "Model",
    "Usage",
    "render_cluster_status",
]

_FINISH = {
    generation_pb2.FINISH_REASON_UNSPECIFIED: None,
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
Prompt = str | Sequence[int]
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1


class GenerateParams(TypedDict, total=False):
    """The keyword arguments of complete/generate/chat/chat_stream (unset = the server's default)."""

    model: str | None  # None = the only served model
    max_tokens: int | None
    temperature: float | None  # 0 = greedy
    top_p: float | None
    top_k: int  # 0 = off
    min_p: float  # 0 = off
    repetition_penalty: float | None
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    min_tokens: int  # EOS and the stop token ids cannot end the output before this many tokens
    presence_penalty: float  # [-2, 2], 0 = off (OpenAI's)
    frequency_penalty: float  # [-2, 2], 0 = off (OpenAI's)
    logit_bias: Mapping[int, float]  # token id -> added to its logit, [-100, 100] (OpenAI's)
    logprobs: bool  # each token's logprob and its text (`tokens`)
    top_logprobs: int  # with logprobs: that many most likely alternatives per token (at most 20)
    echo: bool  # the first chunk carries the prompt (`prompt`)
    prompt_logprobs: int | None  # with echo: the prompt tokens' logprobs, and that many alternatives each
    request_id: str  # "" = assigned by the router


Metadata = Sequence[tuple[str, str]] | Mapping[str, str]


class KvpactRpcError(grpc.RpcError):
    """A failed call: `.code` is the grpc.StatusCode, `.details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> KvpactRpcError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(code, details or "")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


class Alternative(NamedTuple):
    """One of a position's most likely tokens (top_logprobs)."""

    token_id: int
    token: str  # its text, decoded alone
    logprob: float


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """The prompt as the worker tokenized it (echo): `logprobs` and `top_logprobs` (prompt_logprobs) have
    one entry per token after the first, which has no context."""

    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[Alternative, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed piece. The last one has `finish_reason` ("stop", "length", "abort") and `usage`.
    With logprobs: one logprob and one text (`tokens`) per token id, with top_logprobs its alternatives;
    with echo, the first chunk has the prompt."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[float, ...] = ()
    request_id: str = ""
    worker_id: str = ""
    tokens: tuple[str, ...] = ()
    top_logprobs: tuple[tuple[Alternative, ...], ...] = ()
    prompt: EchoedPrompt | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[float, ...] = ()
    request_id: str = ""
    worker_id: str = ""
    tokens: tuple[str, ...] = ()
    top_logprobs: tuple[tuple[Alternative, ...], ...] = ()
    prompt: EchoedPrompt | None = None


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    max_model_len: int
    num_workers: int


# -- protobuf at the edge ----------------------------------------------------------------------------


def build_request(
    prompt: Prompt | None = None,
    *,
    messages: Iterable[Mapping[str, str]] | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    echo: bool = False,
    prompt_logprobs: int | None = None,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) or chat messages ({"role", "content"} dicts).
    Raises KvpactRpcError(INVALID_ARGUMENT) for an integer outside its unsigned wire type."""
    _check_unsigned("max_tokens", max_tokens, UINT32_MAX)
    _check_unsigned("top_k", top_k, UINT32_MAX, " (0 = disabled)")
    _check_unsigned("seed", seed, UINT64_MAX)
    _check_unsigned("stop_token_ids", stop_token_ids, UINT32_MAX)
    _check_unsigned("min_tokens", min_tokens, UINT32_MAX)
    _check_unsigned("top_logprobs", top_logprobs, UINT32_MAX)
    _check_unsigned("prompt_logprobs", prompt_logprobs, UINT32_MAX)
    _check_unsigned("logit_bias token ids", list(logit_bias or ()), UINT32_MAX)
    sampling = generation_pb2.SamplingParams(
        top_k=top_k,
        min_p=min_p,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=dict(logit_bias or {}),
    )
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if seed is not None:
        sampling.seed = seed
    if isinstance(stop, str):
        stop = (stop,)
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        model=model or "",
        sampling=sampling,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        echo=echo,
    )
    if max_tokens is not None:
        request.max_tokens = max_tokens
    if messages is not None:
        request.chat.messages.extend(
            generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None and all(isinstance(t, int) for t in prompt):
        _check_unsigned("prompt token ids", prompt, UINT32_MAX)
        request.token_ids.ids.extend(prompt)
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    return request


def _check_unsigned(name: str, value: int | Sequence[int] | None, limit: int, note: str = "") -> None:
    """An integer (or each of a sequence) must fit its unsigned protobuf field."""
    values = () if value is None else (value,) if isinstance(value, int) else value
    bad = [v for v in values if isinstance(v, int) and not 0 <= v <= limit]
    if bad:
        got = value if isinstance(value, int) else bad[:5]
        raise KvpactRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be in [0, {limit}]{note}, got {got}"
        )


def usage_from_pb(msg: generation_pb2.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def _result_fields(msg: generation_pb2.GenerateChunk | generation_pb2.CompleteResponse) -> dict[str, Any]:
    """What a streamed chunk and a whole completion carry alike (their messages share these fields)."""
    return {
        "text": msg.text,
        "token_ids": tuple(msg.token_ids),
        "finish_reason": _FINISH.get(msg.finish_reason),
        "usage": usage_from_pb(msg.usage) if msg.HasField("usage") else None,
        "logprobs": tuple(msg.logprobs),
        "request_id": msg.request_id,
        "worker_id": msg.worker_id,
        "tokens": tuple(msg.tokens),
        "top_logprobs": _alternatives(msg.top_logprobs),
        "prompt": _echoed(msg.prompt) if msg.HasField("prompt") else None,
    }


def _alternatives(tops: Iterable[generation_pb2.TopLogprobs]) -> tuple[tuple[Alternative, ...], ...]:
    def names(t: generation_pb2.TopLogprobs) -> list[str]:  # "" where a server sent no name
        return [*t.tokens, *[""] * (len(t.token_ids) - len(t.tokens))]

    return tuple(
        tuple(
            Alternative(i, name, lp) for i, name, lp in zip(t.token_ids, names(t), t.logprobs, strict=False)
        )
        for t in tops
    )


def _echoed(msg: generation_pb2.PromptEcho) -> EchoedPrompt:
    return EchoedPrompt(
        msg.text,
        tuple(msg.token_ids),
        tuple(msg.tokens),
        tuple(msg.logprobs),
        _alternatives(msg.top_logprobs),
    )


def chunk_from_pb(msg: generation_pb2.GenerateChunk) -> Chunk:
    return Chunk(**_result_fields(msg))


def completion_from_pb(msg: generation_pb2.CompleteResponse) -> Completion:
    return Completion(**_result_fields(msg))


def models_from_pb(msg: router_pb2.ListModelsResponse) -> list[Model]:
    return [Model(m.name, m.max_model_len, m.num_workers) for m in msg.models]


def _metadata(metadata: Metadata | None) -> tuple[tuple[str, str], ...] | None:
    if not metadata:
        return None
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    return tuple((str(k), str(v)) for k, v in items)


# -- clients -----------------------------------------------------------------------------------------


class _Connection:
    """What `Client` and `AsyncClient` share: the channel (grpc or grpc.aio, by `_AIO`), its stub, the
    default deadline and the metadata sent with every call."""

    _AIO: bool

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        options: Sequence[tuple[str, Any]] = (),
        api_key: str | None = None,
        **transport: Unpack[TransportParams],
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.metadata = with_api_key(_metadata(metadata), api_key)
        self._channel = open_channel(target, options, aio=self._AIO, **transport)
        self._stub = router_pb2_grpc.GenerationStub(self._channel)

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class Client(_Connection):
    """Blocking client. `timeout` (seconds) is the default deadline of every call; each call may
    override it with its own `timeout=`. `metadata` is sent with every call, `api_key` as
    `authorization: Bearer <key>`. TLS: `tls=True` (system roots), or `ca_file` (and `cert_file` +
    `key_file` for a client certificate), `server_name`, or ready-made `credentials`."""

    _AIO = False

    def complete(
        self, prompt: Prompt, *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> Completion:
        return self._complete(build_request(prompt, **params), timeout)

    def generate(
        self, prompt: Prompt, *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> Iterator[Chunk]:
        return self._generate(build_request(prompt, **params), timeout)

    def chat(
        self,
        messages: Iterable[Mapping[str, str]],
        *,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        return self._complete(build_request(messages=messages, **params), timeout)

    def chat_stream(
        self,
        messages: Iterable[Mapping[str, str]],
        *,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Iterator[Chunk]:
        return self._generate(build_request(messages=messages, **params), timeout)

    def list_models(self, *, timeout: float | None = None) -> list[Model]:
        return models_from_pb(self._unary(self._stub.ListModels, router_pb2.ListModelsRequest(), timeout))

    def cluster_status(self, *, timeout: float | None = None) -> router_pb2.ClusterStatusResponse:
        status: router_pb2.ClusterStatusResponse = self._unary(
            self._stub.ClusterStatus, router_pb2.ClusterStatusRequest(), timeout
        )
        return status

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._deadline(timeout), metadata=self.metadata)
        except grpc.RpcError as exc:
            raise KvpactRpcError.from_rpc_error(exc) from None

    def _complete(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> Completion:
        return completion_from_pb(self._unary(self._stub.Complete, request, timeout))

    def _generate(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> Iterator[Chunk]:
        call = self._stub.Generate(request, timeout=self._deadline(timeout), metadata=self.metadata)
        try:
            for msg in call:
                yield chunk_from_pb(msg)
        except grpc.RpcError as exc:
            raise KvpactRpcError.from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op when finished; frees the worker's cache when the caller stops early


class AsyncClient(_Connection):
    """The grpc.aio twin of `Client`: same arguments, awaitable calls, async iterators for streams."""

    _AIO = True

    async def complete(
        self, prompt: Prompt, *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> Completion:
        return await self._complete(build_request(prompt, **params), timeout)

    def generate(
        self, prompt: Prompt, *, timeout: float | None = None, **params: Unpack[GenerateParams]
    ) -> AsyncIterator[Chunk]:
        return self._generate(build_request(prompt, **params), timeout)

    async def chat(
        self,
        messages: Iterable[Mapping[str, str]],
        *,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        return await self._complete(build_request(messages=messages, **params), timeout)

    def chat_stream(
        self,
        messages: Iterable[Mapping[str, str]],
        *,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> AsyncIterator[Chunk]:
        return self._generate(build_request(messages=messages, **params), timeout)

    async def list_models(self, *, timeout: float | None = None) -> list[Model]:
        return models_from_pb(
            await self._unary(self._stub.ListModels, router_pb2.ListModelsRequest(), timeout)
        )

    async def cluster_status(self, *, timeout: float | None = None) -> router_pb2.ClusterStatusResponse:
        status: router_pb2.ClusterStatusResponse = await self._unary(
            self._stub.ClusterStatus, router_pb2.ClusterStatusRequest(), timeout
        )
        return status

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._deadline(timeout), metadata=self.metadata)
        except grpc.RpcError as exc:
            raise KvpactRpcError.from_rpc_error(exc) from None

    async def _complete(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> Completion:
        return completion_from_pb(await self._unary(self._stub.Complete, request, timeout))

    async def _generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(request, timeout=self._deadline(timeout), metadata=self.metadata)
        try:
            async for msg in call:
                yield chunk_from_pb(msg)
        except grpc.RpcError as exc:
            raise KvpactRpcError.from_rpc_error(exc) from None
        finally:
            call.cancel()
