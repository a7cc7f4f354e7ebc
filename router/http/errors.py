"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that
follows the gRPC status the router's own code raised (the same errors the gRPC front sends):

    INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE  400
    UNAUTHENTICATED                                      401
    NOT_FOUND (unknown model)                            404
    ALREADY_EXISTS                                       409
    RESOURCE_EXHAUSTED                                   429, with Retry-After: 1
    CANCELLED                                            499 (the client went away; nobody reads it)
    UNAVAILABLE                                          503
    DEADLINE_EXCEEDED                                    504
    anything else a worker answered                      502 (the router's log has the cause)

Bad input never gets a 500: a body that does not parse or validate is a 400 naming the field. Messages
are the router's own (worker addresses already redacted by router/service.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvpact.shared.errors import RequestError
from kvpact.shared.limits import excerpt
from kvpact.shared.rpc_errors import StatusError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
UPSTREAM = 502
# The fields a worker names when it refuses one (worker/engine/request.py's validate, the engine's
# checks), by the names the OpenAI parameters have too: the 400's `param`.
WORKER_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "top_logprobs",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "logit_bias",
    "min_tokens",
    "response_format",
    "max_tokens",
    "stop_token_ids",
    "stop",
    "n",
)
_FIELD = re.compile(r"\b(" + "|".join(re.escape(f) for f in WORKER_FIELDS) + r")\b")


class HttpError(Exception):
    """Raised by the HTTP front itself: a status, a message and the parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "error"),
            "param": param,
            "code": code,
        }
    }


def response(error: HttpError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(
        body(error.status, error.message, error.param, error.code), error.status, headers=headers
    )


def from_exception(exc: BaseException) -> HttpError:
    """The HttpError for an error the router's code raises on purpose; TypeError for anything else (the
    app answers that 500 "internal error", logged with its traceback)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, StatusError):
        status = HTTP_STATUS.get(exc.code, UPSTREAM)
        param = None
        if status == 400:  # the field a worker named, after its `worker "<id>": ` prefix
            reason = exc.details.partition('": ')[2] if exc.details.startswith('worker "') else exc.details
            found = _FIELD.search(reason.split(" (request id ")[0])
            param = found.group(1) if found else None
        code = "model_not_found" if exc.code is grpc.StatusCode.NOT_FOUND else exc.code.name.lower()
        return HttpError(status, exc.details, param, code)
    if isinstance(exc, RequestError):
        return HttpError(400, str(exc), None, "invalid_argument")
    raise TypeError(f"not an error the router raises on purpose: {type(exc).__name__}")


def from_validation(exc: RequestValidationError) -> HttpError:
    """A body that did not parse or validate: 400 naming the first field (as `messages[0].role`)."""
    errors: Sequence[Any] = exc.errors()
    if not errors:
        return HttpError(400, "the request body is not valid")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if loc[:1] == ["logit_bias"]:  # what follows is the client's own key (a token id), not a field
        loc = loc[:1]
    param: str | None = _dotted(loc)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unknown parameter {param!r}: kvpact does not implement it; leave it out"
    elif kind == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('msg', '')}"
        param = None
    elif kind == "missing":
        message = f"missing required parameter {param!r}"
    else:
        given = first.get("input")
        quoted = excerpt(given) if isinstance(given, str) else excerpt(repr(given))
        message = f"invalid value for {param!r}: {first.get('msg', '')} (given {quoted})"
    return HttpError(400, message, param or None, "invalid_value" if kind != "extra_forbidden" else None)


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool"):
            continue  # pydantic's union-member label, not a field
        else:
            out += f".{part}" if out else part
    return out
