"""The OpenAI request bodies the HTTP front accepts, as pydantic models.

Invariant: every field declared here is honored (router/http/requests.py maps each one onto the
GenerateRequest, or refuses a value it cannot honor by name); anything not declared is refused by
`extra="forbid"` with a 400 naming it, as OpenAI's own API does. The few OpenAI parameters that a
client may send with a neutral value (`best_of: 1`, `tools: []`, `functions: []`, `store: false`...)
are declared so that the neutral value passes and any other value is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpact.shared.limits import MAX_LOGIT_BIAS, MAX_MODEL_NAME_CHARS, MAX_TOP_LOGPROBS

MAX_N = 128  # completions per request (OpenAI's own cap)
MAX_COMPLETION_LOGPROBS = 5
MAX_USER_CHARS = 256
# A logit_bias key: a token id, written as a JSON object key (a string of digits)
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]  # no leading zeros: one id, one key
# OpenAI parameters kvpact does not implement; a neutral value (None, [], {}, false) is taken as "not
# asked for", anything else gets a 400 naming the parameter and this reason.
REFUSED: dict[str, str] = {
    "tools": "tool calling is not implemented by kvpact",
    "tool_choice": "tool calling is not implemented by kvpact",
    "parallel_tool_calls": "tool calling is not implemented by kvpact",
    "functions": "function calling is not implemented by kvpact",
    "function_call": "function calling is not implemented by kvpact",
    "suffix": "suffix (fill-in-the-middle) is not implemented by kvpact",
    "best_of": "best_of is not implemented by kvpact; use n",
    "audio": "audio output is not implemented by kvpact",
    "modalities": "kvpact generates text only",
    "prediction": "predicted outputs are not implemented by kvpact",
    "store": "kvpact stores no completions",
    "metadata": "kvpact stores no completions (metadata goes with store)",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # developer: OpenAI's newer name for system; rendered as system by the model's chat template
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", default_factory=dict)
    strict: bool | None = None  # grammar-constrained decoding is strict whatever this says


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class _Generation(_Strict):
    """What both endpoints take."""

    model: str = Field(default="", max_length=MAX_MODEL_NAME_CHARS)  # "" = the only served model
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # OpenAI's newer name for max_tokens; taken on completions too (guidellm sends both, equal)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, lt=1 << 32)] = 0  # -1 or 0 = disabled
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, lt=1 << 32)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] | None = None
    # OpenAI's: token ids (as JSON object keys, so strings) -> a bias added to the logit
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    # OpenAI parameters that are refused unless neutral (REFUSED)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    store: Any = None
    metadata: Any = None

    def refused(self) -> tuple[str, str] | None:
        """(parameter, reason) of the first REFUSED parameter given a non-neutral value."""
        for name, reason in REFUSED.items():
            if name in self.model_fields_set and not _neutral(name, getattr(self, name)):
                return name, reason
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None


def _neutral(name: str, value: Any) -> bool:
    """A value of a REFUSED parameter that asks for nothing."""
    if value is None or value is False or (isinstance(value, list | dict) and not value):
        return True
    return (name == "best_of" and value == 1) or (name == "modalities" and value == ["text"])


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().refused()


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False  # the prompt first in each choice's text (and, with logprobs, its tokens' logprobs)
    suffix: Any = None
    best_of: Any = None
