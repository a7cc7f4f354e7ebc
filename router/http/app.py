"""The OpenAI-compatible routes, a FastAPI app over the router's own GenerationService and Cluster.

    POST /v1/chat/completions, POST /v1/completions   streamed (SSE) or whole
    GET  /v1/models                                    models of admitted workers, with a `kvpact` object
    GET  /health                                       200 while SERVING, else 503 with the state; open

With --api-key-file every /v1/ path needs `Authorization: Bearer <key>` (401 otherwise). A stream's
errors before its first chunk are an HTTP status (router/http/errors.py); after it, one SSE event
`{"error": ...}` then `data: [DONE]`. A client that goes away mid-stream cancels its worker call.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpact.router.api_keys import AUTHORIZATION, bearer
from kvpact.router.cluster import Cluster
from kvpact.router.cluster_state import ClusterState
from kvpact.router.http import errors
from kvpact.router.http.errors import HttpError
from kvpact.router.http.relay import Item, choice_chunks
from kvpact.router.http.requests import chat_request, completion_requests
from kvpact.router.http.responses import DONE, Rendering, sse
from kvpact.router.http.schema import ChatCompletionRequest, CompletionRequest
from kvpact.router.registry import WorkerEntry, WorkerState
from kvpact.router.service import GenerationService
from kvpact.shared.auth import SecretFile
from kvpact.shared.errors import RequestError
from kvpact.shared.limits import MAX_MESSAGE_BYTES
from kvpact.shared.rpc_errors import StatusError
from kvpact.v1 import generation_pb2

log = structlog.get_logger("router.http")

MISSING_KEY = (
    "this router requires an API key: send the header 'Authorization: Bearer <key>' "
    "(openai SDK: api_key=...; curl: -H 'Authorization: Bearer <key>')"
)
WRONG_KEY = "the API key is not accepted by this router; ask its operator for a current key"
MAX_BODY_BYTES = MAX_MESSAGE_BYTES  # the same bound as a gRPC message (shared/limits.py)
ROUTER_ERRORS = (StatusError, RequestError, HttpError)


def build_app(service: GenerationService, api_keys: SecretFile) -> FastAPI:
    cluster = service.cluster
    app = FastAPI(title="kvpact", docs_url=None, redoc_url=None, openapi_url=None)

    async def require_key(authorization: str | None = Header(default=None)) -> None:
        if not api_keys.required:
            return
        given = bearer(((AUTHORIZATION, authorization),)) if authorization else None
        if given is not None and api_keys.matches(given):
            return
        log.warning("client_unauthenticated", api="http", key_given=given is not None)
        raise HttpError(401, WRONG_KEY if given is not None else MISSING_KEY, None, "invalid_api_key")

    keyed = [Depends(require_key)]

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
        return errors.response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return errors.response(errors.from_validation(exc))

    @app.exception_handler(StatusError)
    @app.exception_handler(RequestError)
    async def _router_error(request: Request, exc: Exception) -> JSONResponse:
        return errors.response(errors.from_exception(exc))

    @app.exception_handler(HTTPException)
    async def _starlette(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(errors.body(exc.status_code, message), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("http_internal_error", path=request.url.path, error_type=type(exc).__name__)
        message = f"internal error in {request.url.path}: {type(exc).__name__} (see the router's log)"
        return JSONResponse(errors.body(500, message), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = "stopping" if cluster.stopping else cluster.state.value
        if not cluster.serving_health and state == ClusterState.SERVING.value:
            state = "no_live_worker"
        ok = cluster.serving_health and not cluster.stopping
        return JSONResponse(
            {"status": "SERVING" if ok else "NOT_SERVING", "state": state}, 200 if ok else 503
        )

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict[str, Any]:
        service.check_serving()
        return {"object": "list", "data": model_list(cluster)}

    @app.post("/v1/chat/completions", dependencies=keyed, response_model=None)
    async def chat(body: ChatCompletionRequest) -> Response:
        request = chat_request(body)
        return await respond(True, [request], body.n, body.logprobs, body.stream, _usage(body), body.user)

    @app.post("/v1/completions", dependencies=keyed, response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        requests = completion_requests(body)
        logprobs = body.logprobs is not None
        return await respond(False, requests, body.n, logprobs, body.stream, _usage(body), body.user)

    async def respond(
        chat: bool,
        requests: list[generation_pb2.GenerateRequest],
        n: int,
        logprobs: bool,
        stream: bool,
        include_usage: bool,
        user: str | None,
    ) -> Response:
        request_id = requests[0].request_id
        fields = {"request_id": request_id, "api": "http", "endpoint": "chat" if chat else "completions"}
        if user is not None:
            fields["user"] = user
        with structlog.contextvars.bound_contextvars(**fields):
            chunks = choice_chunks(service, requests, n)
            try:
                first = await anext(chunks)
            except StopAsyncIteration:  # a worker's stream always ends with a chunk: never expected
                await chunks.aclose()
                error = HttpError(502, f"request {request_id}: the worker's stream ended without a chunk")
                _log_done(None, error)
                raise error from None
            except BaseException as exc:
                await chunks.aclose()
                _log_done(None, exc)
                raise
            rendering = Rendering(
                chat, request_id, requests[0].model, logprobs, include_usage, requests[0].echo
            )
            if not stream:
                async with aclosing(chunks):
                    try:
                        rendering.add(*first)
                        async for item in chunks:
                            rendering.add(*item)
                    except BaseException as exc:
                        _log_done(first[1].worker_id, exc)
                        raise
                _log_done(first[1].worker_id, None)
                return JSONResponse(rendering.whole())
        return _Stream(_events(chunks, first, rendering, fields), chunks)

    app.add_middleware(BodyLimit)
    return app


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Stream(StreamingResponse):
    """The SSE response; however it ends (done, the client gone before the first event was written),
    the relay is closed when it does, so no worker call outlives its client."""

    def __init__(self, events: AsyncGenerator[str, None], chunks: AsyncGenerator[Item, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events, self._chunks = events, chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._chunks.aclose()


async def _events(
    chunks: AsyncGenerator[Item, None], first: Item, rendering: Rendering, fields: dict[str, str]
) -> AsyncGenerator[str, None]:
    """The SSE body; closing it (the client went away) closes `chunks`, which aborts the worker requests."""
    with structlog.contextvars.bound_contextvars(**fields):
        worker_id = first[1].worker_id
        try:
            async with aclosing(chunks):
                choice = rendering.add(*first)
                if choice is not None:
                    yield rendering.event(choice)
                async for item in chunks:
                    choice = rendering.add(*item)
                    if choice is not None:
                        yield rendering.event(choice)
            yield rendering.closing_events()
            _log_done(worker_id, None)
        except ROUTER_ERRORS as exc:
            error = errors.from_exception(exc)
            _log_done(worker_id, exc)
            yield sse(errors.body(error.status, error.message, error.param, error.code)) + DONE
        except BaseException as exc:
            _log_done(worker_id, exc)
            raise


def _log_done(worker_id: str | None, exc: BaseException | None) -> None:
    if exc is None:
        log.info("http_request_done", worker_id=worker_id, status=200)
    elif isinstance(exc, ROUTER_ERRORS):
        error = errors.from_exception(exc)
        log.info("http_request_done", worker_id=worker_id, status=error.status, error=error.message)
    else:
        log.info("http_request_done", worker_id=worker_id, status=499, error=type(exc).__name__)


def _usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def model_list(cluster: Cluster) -> list[dict[str, Any]]:
    """OpenAI's model objects, each with `kvpact`: the realized state of every worker admitted for it."""
    by_model: dict[str, list[WorkerEntry]] = {}
    for entry in cluster.registry.entries():
        if entry.state in (WorkerState.ADMITTED, WorkerState.DEAD, WorkerState.DRAINING):
            by_model.setdefault(entry.model_name, []).append(entry)
    out = []
    for name, entries in sorted(by_model.items()):
        lens = [e.realized.max_model_len for e in entries if e.serving and e.realized is not None]
        out.append(
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kvpact",
                "kvpact": {
                    "policy": cluster.config.policy.value,
                    "policies": {name: mode.value for name, mode in cluster.config.all_policies().items()},
                    "max_model_len": min(lens, default=0),
                    "num_serving_workers": sum(e.serving for e in entries),
                    "workers": [_worker(e) for e in sorted(entries, key=lambda e: e.worker_id)],
                },
            }
        )
    return out


def _worker(entry: WorkerEntry) -> dict[str, Any]:
    realized = entry.realized
    return {
        "worker_id": entry.worker_id,
        "state": entry.state.value,
        "requested": {"paged_attn": entry.spec.cache.mode.value},
        "realized": None
        if realized is None
        else {
            "kv_cache": realized.kind.value,
            "scheduler": realized.scheduler,
            "backend": realized.backend.value if realized.backend else None,
            "block_size": realized.block_size,
            "num_blocks": realized.num_blocks,
            "prefix_caching": realized.prefix_caching,
            "cache_dtype": realized.cache_dtype.value,
            "max_model_len": realized.max_model_len,
            "fallbacks": [{"component": f.component, "reason": f.reason} for f in realized.fallbacks],
            "features": [
                {
                    "name": f.name,
                    "requested": f.requested.value,
                    "realized": f.realized,
                    "reason": f.code or None,
                    "message": f.message or None,
                    "component": f.component or None,
                }
                for f in realized.features
            ],
        },
    }


class BodyLimit:
    """413 for a request body over MAX_BODY_BYTES, counted as it arrives (a Content-Length or not)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await _too_large(send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    raise HttpError(413, _TOO_LARGE)
            return message

        await self.app(scope, counted, send)


_TOO_LARGE = f"the request body is larger than {MAX_BODY_BYTES} bytes; send a shorter prompt"


async def _too_large(send: Callable[[Message], Awaitable[None]]) -> None:
    response = JSONResponse(errors.body(413, _TOO_LARGE), 413)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - a JSONResponse never reads
    return {"type": "http.disconnect"}
