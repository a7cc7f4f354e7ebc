"""The Python client for a kvpact router.

    from kvpact.client import Client

    with Client("127.0.0.1:50051", timeout=30) as client:
        print(client.complete("Hello", max_tokens=16, temperature=0).text)
        for chunk in client.generate("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)
        print(render_cluster_status(client.cluster_status()))

`AsyncClient` is the same on grpc.aio: `await client.complete(...)`,
`async for chunk in client.generate(...)`.

Errors: every failed call raises `KvpactRpcError`, a `grpc.RpcError` subclass carrying the server's
status as `.code` (a `grpc.StatusCode`) and `.details` (its message), e.g. NOT_FOUND naming the served
models, UNAVAILABLE while the cluster is starting, DEADLINE_EXCEEDED past `timeout`.
Breaking out of `generate()` early (or cancelling the async task) cancels the request on the server,
which aborts it and frees its KV cache.

Depends only on grpc and the generated kvpact.v1 messages (no torch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import grpc

from kvpact.v1 import cache_pb2, generation_pb2, router_pb2, router_pb2_grpc, worker_pb2

__all__ = [
    "AsyncClient",
    "GenerateParams",
    "Chunk",
    "Client",
    "Completion",
    "KvpactRpcError",
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
    logprobs: bool
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


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed piece. The last one has `finish_reason` ("stop", "length", "abort") and `usage`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[float, ...] = ()
    request_id: str = ""
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[float, ...] = ()
    request_id: str = ""
    worker_id: str = ""


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
    logprobs: bool = False,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) or chat messages ({"role", "content"} dicts)."""
    sampling = generation_pb2.SamplingParams(top_k=top_k, min_p=min_p, logprobs=logprobs)
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
        request.token_ids.ids.extend(prompt)
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    return request


def usage_from_pb(msg: generation_pb2.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def chunk_from_pb(msg: generation_pb2.GenerateChunk) -> Chunk:
    return Chunk(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=_FINISH.get(msg.finish_reason),
        usage=usage_from_pb(msg.usage) if msg.HasField("usage") else None,
        logprobs=tuple(msg.logprobs),
        request_id=msg.request_id,
        worker_id=msg.worker_id,
    )


def completion_from_pb(msg: generation_pb2.CompleteResponse) -> Completion:
    return Completion(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=_FINISH.get(msg.finish_reason),
        usage=usage_from_pb(msg.usage) if msg.HasField("usage") else None,
        logprobs=tuple(msg.logprobs),
        request_id=msg.request_id,
        worker_id=msg.worker_id,
    )


def models_from_pb(msg: router_pb2.ListModelsResponse) -> list[Model]:
    return [Model(m.name, m.max_model_len, m.num_workers) for m in msg.models]


def _metadata(metadata: Metadata | None) -> tuple[tuple[str, str], ...] | None:
    if not metadata:
        return None
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    return tuple((str(k), str(v)) for k, v in items)


# -- clients -----------------------------------------------------------------------------------------


class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call; each call may
    override it with its own `timeout=`. `metadata` is sent with every call."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.metadata = _metadata(metadata)
        self._channel = grpc.insecure_channel(target, options=list(options))
        self._stub = router_pb2_grpc.GenerationStub(self._channel)

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
        return self._unary(self._stub.ClusterStatus, router_pb2.ClusterStatusRequest(), timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

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


class AsyncClient:
    """The grpc.aio twin of `Client`: same arguments, awaitable calls, async iterators for streams."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.metadata = _metadata(metadata)
        self._channel = grpc.aio.insecure_channel(target, options=list(options))
        self._stub = router_pb2_grpc.GenerationStub(self._channel)

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
        return await self._unary(self._stub.ClusterStatus, router_pb2.ClusterStatusRequest(), timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

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


# -- the status table --------------------------------------------------------------------------------


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    return enum_type.Name(value).removeprefix(prefix)


def _describe_asked(spec: worker_pb2.WorkerSpec) -> str:
    mode = cache_pb2.PagedAttentionMode.Name(spec.cache.mode).removeprefix("PAGED_ATTENTION_MODE_").lower()
    mode = "auto" if mode == "unspecified" else mode
    backend = spec.cache.paged.backend if spec.cache.HasField("paged") else 0
    if backend in (cache_pb2.PAGED_BACKEND_TRITON, cache_pb2.PAGED_BACKEND_TORCH):
        mode += f" ({_enum_name(cache_pb2.PagedBackend, backend, 'PAGED_BACKEND_').lower()})"
    return mode


def _describe_realized(realized: cache_pb2.RealizedCache) -> tuple[str, str]:
    if realized.kind == cache_pb2.CACHE_KIND_PAGED:
        backend = _enum_name(cache_pb2.PagedBackend, realized.backend, "PAGED_BACKEND_").lower()
        kind = f"PAGED {backend} {realized.num_blocks}x{realized.block_size}"
    elif realized.kind == cache_pb2.CACHE_KIND_EAGER:
        kind = f"EAGER {realized.num_blocks} slots"
    else:
        return "-", "-"
    return kind, f"{realized.capacity_tokens} tok"


def render_cluster_status(status: router_pb2.ClusterStatusResponse) -> str:
    """ClusterStatus as a readable table: one row per worker, then its fallback reasons and failures."""
    state = _enum_name(router_pb2.ClusterState, status.state, "CLUSTER_STATE_")
    policy = cache_pb2.PagedAttentionMode.Name(status.policy).removeprefix("PAGED_ATTENTION_MODE_").lower()
    num_admitted = sum(1 for w in status.workers if w.state == router_pb2.WORKER_STATE_ADMITTED)
    head = (
        f"cluster {state}  policy --paged-attn {policy}  "
        f"workers {num_admitted}/{status.expected_workers} admitted"
    )
    columns = ("WORKER", "STATE", "MODEL", "ADDRESS", "ASKED", "REALIZED", "CAPACITY", "LOAD", "HEARTBEAT")
    rows, notes = [], []
    for w in status.workers:
        kind, capacity = _describe_realized(w.realized) if w.HasField("realized") else ("-", "-")
        load = (
            f"{w.load.num_running} run {w.load.num_waiting} wait "
            f"{w.load.num_free_blocks}/{w.load.num_total_blocks} free {w.num_outstanding} out"
        )
        rows.append(
            (
                w.worker_id,
                _enum_name(router_pb2.WorkerState, w.state, "WORKER_STATE_"),
                w.model_name,
                w.address,
                _describe_asked(w.requested),
                kind,
                capacity,
                load,
                f"{w.seconds_since_heartbeat:.1f}s ago",
            )
        )
        for f in w.realized.fallbacks:
            notes.append(f"  {w.worker_id}: fallback [{f.component}] {f.reason}")
        if w.HasField("failure"):
            code = _enum_name(worker_pb2.StartupFailureCode, w.failure.code, "STARTUP_FAILURE_CODE_")
            notes.append(f"  {w.worker_id}: failed ({code}) [{w.failure.component}] {w.failure.reason}")
        if w.state != router_pb2.WORKER_STATE_ADMITTED or not w.HasField("realized"):
            notes.append(f"  {w.worker_id}: {w.state_reason}")
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = [head, "  ".join(c.ljust(n) for c, n in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(v).ljust(n) for v, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    if notes:
        lines += ["", "reasons:", *notes]
    if status.failure_report:
        lines += ["", status.failure_report]
    return "\n".join(lines)
