"""The request caps (shared/limits.py): each field over its cap is refused naming the field and the cap,
quoting only a short prefix; a request at every cap passes; the check costs time linear in the size."""

from __future__ import annotations

import time

import pytest

from kvpact.shared import limits
from kvpact.shared.errors import RequestError
from kvpact.shared.limits import check_request_limits, excerpt
from kvpact.v1 import generation_pb2


def chat(*contents: str, role: str = "user") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatPrompt(
            messages=[generation_pb2.ChatMessage(role=role, content=c) for c in contents]
        )
    )


AT_CAPS = generation_pb2.GenerateRequest(
    request_id="r" * limits.MAX_REQUEST_ID_CHARS,
    model="m" * limits.MAX_MODEL_NAME_CHARS,
    text="é" * (limits.MAX_PROMPT_BYTES // 2),
    stop=["s" * limits.MAX_STOP_CHARS] * limits.MAX_STOP_STRINGS,
    stop_token_ids=[1] * limits.MAX_STOP_TOKEN_IDS,
    n=limits.MAX_COMPLETIONS,
    max_tokens=limits.MAX_REQUEST_COMPLETION_TOKENS // limits.MAX_COMPLETIONS,
    response_format=generation_pb2.ResponseFormat(
        json_schema="{" + " " * (limits.MAX_JSON_SCHEMA_CHARS - 2) + "}"
    ),
)

OVER = [
    ("request_id", generation_pb2.GenerateRequest(text="hi", request_id="r" * 129),
     f"request_id has 129 characters, more than the cap of 128: {'r' * 40!r}... (129 characters)"),
    ("model", generation_pb2.GenerateRequest(text="hi", model="m" * 257), "model has 257 characters"),
    ("text bytes", generation_pb2.GenerateRequest(text="é" * (limits.MAX_PROMPT_BYTES // 2 + 1)),
     "the prompt is 1048578 bytes of text, more than the cap of 1048576 bytes"),
    ("chat bytes", chat("x" * limits.MAX_PROMPT_BYTES), "bytes of text, more than the cap of 1048576"),
    ("chat messages", chat(*["x"] * 1025), "the chat has 1025 messages, more than the cap of 1024"),
    ("chat role", chat("x", role="r" * 33),
     "chat message 0's role has 33 characters, more than the cap of 32"),
    ("token ids", generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1] * (2**18 + 1))),
     "the prompt has 262145 token ids, more than the cap of 262144"),
    ("stop count", generation_pb2.GenerateRequest(text="hi", stop=["a"] * 17), "stop has 17 strings"),
    ("stop length", generation_pb2.GenerateRequest(text="hi", stop=["ok", "x" * 257]),
     "stop string 1 has 257 characters, more than the cap of 256"),
    ("stop token ids", generation_pb2.GenerateRequest(text="hi", stop_token_ids=[1] * 257),
     "stop_token_ids has 257 ids, more than the cap of 256"),
    ("n", generation_pb2.GenerateRequest(text="hi", n=17), "n is 17, more than the cap of 16 completions"),
    ("n x max_tokens", generation_pb2.GenerateRequest(text="hi", n=2, max_tokens=40000),
     "n (2) x max_tokens (40000) is 80000 tokens, more than the cap of 65536 per request"),
    ("json_schema", generation_pb2.GenerateRequest(
        text="hi", response_format=generation_pb2.ResponseFormat(json_schema="x" * 65537)),
     "response_format.json_schema has 65537 characters, more than the cap of 65536"),
]  # fmt: skip


def test_one_completion_is_bounded_by_max_model_len_alone():
    check_request_limits(generation_pb2.GenerateRequest(text="hi", max_tokens=10**6))


def test_a_request_at_every_cap_passes():
    check_request_limits(AT_CAPS)


@pytest.mark.parametrize(("request_", "message"), [c[1:] for c in OVER], ids=[c[0] for c in OVER])
def test_a_field_over_its_cap_is_refused_naming_field_and_cap(request_, message):
    with pytest.raises(RequestError) as exc:
        check_request_limits(request_)
    assert message in str(exc.value)
    assert len(str(exc.value)) < 300


def test_excerpt_quotes_short_values_whole_and_long_ones_by_a_prefix():
    assert excerpt("tiny") == "'tiny'"
    assert excerpt("x" * 10_000_000) == f"{'x' * 40!r}... (10000000 characters)"


def test_checking_a_huge_request_is_fast():
    huge = chat(*["x"] * 330_000)
    started = time.monotonic()
    with pytest.raises(RequestError):
        check_request_limits(huge)
    assert time.monotonic() - started < 0.1
