"""Size caps on every string and list field of a GenerateRequest, and how errors quote a value.

The router checks them before it routes, the worker before it converts, renders or tokenizes: a
request's cost must never grow faster than its size, and a huge value must not be echoed back (in
every chunk, a log line or an error message). Scalars (sampling values, max_tokens) are range-checked
by the engine; token ids against the vocabulary after the caps.

    field                       cap
    request_id                  MAX_REQUEST_ID_CHARS characters
    model                       MAX_MODEL_NAME_CHARS characters
    text / chat contents        MAX_PROMPT_BYTES UTF-8 bytes in all (chat: every role and content)
    chat.messages               MAX_CHAT_MESSAGES messages, each role MAX_ROLE_CHARS characters
    token_ids.ids               MAX_PROMPT_TOKEN_IDS ids
    stop                        MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS characters each
    stop_token_ids              MAX_STOP_TOKEN_IDS ids
    response_format.json_schema MAX_JSON_SCHEMA_CHARS characters
    n                           MAX_COMPLETIONS completions (n > 1: n x max_tokens at most
                                MAX_REQUEST_COMPLETION_TOKENS)

Above all of them, a whole message larger than MAX_MESSAGE_BYTES is refused by gRPC itself with
RESOURCE_EXHAUSTED ("Received message larger than max"), on the router and on the worker alike.

Errors quote at most QUOTE_CHARS characters of an offending value (`excerpt`).
"""

from __future__ import annotations

from kvpact.shared.errors import RequestError
from kvpact.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 128
MAX_MODEL_NAME_CHARS = 256
MAX_PROMPT_BYTES = 1 << 20  # 1 MiB of prompt text
MAX_CHAT_MESSAGES = 1024
MAX_ROLE_CHARS = 32
MAX_PROMPT_TOKEN_IDS = 1 << 18
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_JSON_SCHEMA_CHARS = 64 * 1024  # a schema compiles into a grammar: its cost grows with its size
MAX_COMPLETIONS = 16  # n: completions of one prompt (OpenAI's `n`)
MAX_TOP_LOGPROBS = 20  # top_logprobs (and prompt_logprobs): alternatives per token (OpenAI's cap)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
MAX_REQUEST_COMPLETION_TOKENS = 1 << 16  # n x max_tokens: what one request may ask the worker to generate
# gRPC's receive (and send) limit on both servers and on the router->worker channel: room for the
# largest request the caps allow (1 MiB of text, or 256 Ki token ids at up to 5 bytes each) and its
# framing, far below what would let one message cost much memory.
MAX_MESSAGE_BYTES = 4 << 20
# Tokens in one streamed chunk when ready ones are merged (the worker's ReadyPieces, the router's relay):
# a long backlog with top_logprobs stays one message far below MAX_MESSAGE_BYTES.
MAX_TOKENS_PER_MESSAGE = 1024
QUOTE_CHARS = 40

GRPC_MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def excerpt(value: str, limit: int = QUOTE_CHARS) -> str:
    """`value` quoted for an error message: whole when short, else its first `limit` characters and its
    length, so a message never grows with the input."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _too_long(field: str, value: str, cap: int, unit: str = "characters") -> RequestError:
    return RequestError(f"{field} has {len(value)} {unit}, more than the cap of {cap}: {excerpt(value)}")


def check_request_limits(msg: generation_pb2.GenerateRequest) -> None:
    """Raise RequestError (INVALID_ARGUMENT) naming the first field over its cap. Cheap: lengths only,
    and one pass over the prompt's text to count its UTF-8 bytes."""
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise _too_long("request_id", msg.request_id, MAX_REQUEST_ID_CHARS)
    if len(msg.model) > MAX_MODEL_NAME_CHARS:
        raise _too_long("model", msg.model, MAX_MODEL_NAME_CHARS)
    which = msg.WhichOneof("prompt")
    if which == "text":
        _check_prompt_bytes(len(msg.text.encode("utf-8", "surrogatepass")))
    elif which == "chat":
        messages = msg.chat.messages
        if len(messages) > MAX_CHAT_MESSAGES:
            raise RequestError(
                f"the chat has {len(messages)} messages, more than the cap of {MAX_CHAT_MESSAGES}; "
                "send fewer (join consecutive messages of one role)"
            )
        size = 0
        for i, message in enumerate(messages):
            if len(message.role) > MAX_ROLE_CHARS:
                raise _too_long(f"chat message {i}'s role", message.role, MAX_ROLE_CHARS)
            size += len(message.role) + len(message.content.encode("utf-8", "surrogatepass"))
        _check_prompt_bytes(size)
    elif which == "token_ids" and len(msg.token_ids.ids) > MAX_PROMPT_TOKEN_IDS:
        raise RequestError(
            f"the prompt has {len(msg.token_ids.ids)} token ids, more than the cap of {MAX_PROMPT_TOKEN_IDS}"
        )
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(msg.stop)} strings, more than the cap of {MAX_STOP_STRINGS}")
    for i, stop in enumerate(msg.stop):
        if len(stop) > MAX_STOP_CHARS:
            raise _too_long(f"stop string {i}", stop, MAX_STOP_CHARS)
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(
            f"stop_token_ids has {len(msg.stop_token_ids)} ids, more than the cap of {MAX_STOP_TOKEN_IDS}"
        )
    if msg.n > MAX_COMPLETIONS:
        raise RequestError(f"n is {msg.n}, more than the cap of {MAX_COMPLETIONS} completions per request")
    if msg.HasField("max_tokens"):
        check_completion_budget(max(msg.n, 1), msg.max_tokens)
    schema = msg.response_format.json_schema
    if len(schema) > MAX_JSON_SCHEMA_CHARS:
        raise _too_long("response_format.json_schema", schema, MAX_JSON_SCHEMA_CHARS)


def _check_prompt_bytes(size: int) -> None:
    if size > MAX_PROMPT_BYTES:
        raise RequestError(
            f"the prompt is {size} bytes of text, more than the cap of {MAX_PROMPT_BYTES} bytes; "
            "shorten it (the model could not take that many tokens anyway)"
        )


def check_completion_budget(n: int, max_tokens: int) -> None:
    """RequestError unless n x max_tokens <= MAX_REQUEST_COMPLETION_TOKENS, for n > 1 (one completion
    is bounded by max_model_len alone, which may be longer)."""
    if n > 1 and n * max_tokens > MAX_REQUEST_COMPLETION_TOKENS:
        raise RequestError(
            f"n ({n}) x max_tokens ({max_tokens}) is {n * max_tokens} tokens, more than the cap of "
            f"{MAX_REQUEST_COMPLETION_TOKENS} per request; lower n or max_tokens"
        )
