"""The engine's public request and result types.

The gRPC servicers convert these to and from protobuf at the edge (kvpact.v1 GenerateRequest /
GenerateChunk); inside the worker only these dataclasses travel. `validate()` methods raise
RequestError (INVALID_ARGUMENT) naming the field, the value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from kvpact.shared.errors import KvpactError, RequestError
from kvpact.shared.limits import (
    MAX_COMPLETIONS,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    check_completion_budget,
    excerpt,
)

MAX_SEED = 2**64 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0, top_p 1, min_p 0, repetition_penalty 1 and presence/frequency
    penalty 0 disable those. A seed makes the sampled tokens a function of (seed, prompt) alone, whatever
    else is in the batch. `top_logprobs` > 0 (needs `logprobs`) also returns that many most likely
    alternatives per sampled token. `logit_bias` adds its value to its token's logit before sampling
    (100 all but forces the token, -100 all but bans it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per occurrence in the generated tokens
    top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias
    prompt_logprobs: int | None = None  # with echo: the prompt's logprobs and this many alternatives each

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(
                f"repetition_penalty must be > 0 (1 = disabled), got {self.repetition_penalty}"
            )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise RequestError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise RequestError(f"{name} must be in [-2, 2] (0 = disabled), got {value}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise RequestError(
                f"top_logprobs ({self.top_logprobs}) needs logprobs: set logprobs too, or top_logprobs to 0"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        bad = [
            f"{t}: {b}"
            for t, b in self.logit_bias.items()
            if not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS)
        ]
        if bad:
            raise RequestError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                + ", ".join(bad[:5])
            )


CHAT_ROLES = ("system", "user", "assistant")


@dataclass(slots=True)
class ChatMessage:
    role: str  # one of CHAT_ROLES
    content: str


Prompt = str | tuple[ChatMessage, ...] | tuple[int, ...]


@dataclass(slots=True)
class ResponseFormat:
    """Grammar-constrained output (worker/engine/grammar.py): `json_schema` None = any JSON object, else the
    output is JSON matching that JSON Schema (given as JSON text)."""

    json_schema: str | None = None


@dataclass(slots=True)
class GenerationRequest:
    """`prompt`: plain text, chat messages (rendered with the model's chat template) or token ids.
    `max_tokens` None = min(256, what fits in max_model_len after the prompt). `min_tokens`: EOS and
    the stop token ids cannot be sampled before that many tokens were generated (stop strings still
    apply). `n` completions of the prompt (1..MAX_COMPLETIONS), each with its own `index`; a seeded
    request's completion i draws from seed + i. `echo`: each completion's first piece carries the
    prompt (`PromptEcho`; its logprobs with `sampling.prompt_logprobs`)."""

    request_id: str
    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    n: int = 1
    echo: bool = False

    def validate(self) -> None:
        """Checks that need no tokenizer (the engine checks lengths and token ids after tokenizing)."""
        if not self.request_id:
            raise RequestError("request_id must not be empty")
        if isinstance(self.prompt, str) and not self.prompt:
            raise RequestError("the prompt is empty; send some text (or chat messages, or token ids)")
        if isinstance(self.prompt, tuple) and not self.prompt:
            raise RequestError(
                "the prompt is empty (no messages or token ids); send at least one chat message or token id"
            )
        for i, message in enumerate(self.prompt if isinstance(self.prompt, tuple) else ()):
            if isinstance(message, ChatMessage) and message.role not in CHAT_ROLES:
                raise RequestError(
                    f"chat message {i} has role {excerpt(message.role)}; use one of {', '.join(CHAT_ROLES)}"
                )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.n <= MAX_COMPLETIONS:
            raise RequestError(f"n must be in [1, {MAX_COMPLETIONS}], got {self.n}")
        if self.max_tokens is not None:
            check_completion_budget(self.n, self.max_tokens)
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}); "
                "lower min_tokens or raise max_tokens"
            )
        if self.min_tokens and self.response_format is not None:
            raise RequestError(
                "min_tokens cannot be combined with response_format (the grammar decides where the output "
                "ends); leave min_tokens at 0"
            )
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        if self.sampling.prompt_logprobs is not None and not self.echo:
            raise RequestError(
                "prompt_logprobs needs echo (the prompt comes back with its logprobs); set echo"
            )
        self.sampling.validate()


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache (not recomputed)


@dataclass(slots=True)
class TopLogprobs:
    """The most likely tokens at one position, most likely first, with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str] = field(default_factory=list)  # each id's text (Tokenizer.token_texts), once named


@dataclass(slots=True)
class PromptEcho:
    """The prompt as the worker tokenized it (GenerationRequest.echo): its text (the request's own, or its
    token ids decoded), ids, each id's text alone, and with prompt_logprobs each token's logprob after the
    first (the first has no context) and its alternatives."""

    text: str
    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class GenerationOutput:
    """One streamed piece: the text delta and the tokens sampled since the last piece (one logprob per
    token when requested, one TopLogprobs per token when top_logprobs > 0), of completion `index`
    (0..n-1). The last piece of a completion has `finish_reason`; the last piece of the request (all n
    finished) also has `usage`: the prompt counted once, the completion tokens summed."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    index: int = 0
    tokens: list[str] = field(default_factory=list)  # with logprobs: each token id's text, decoded alone
    prompt: PromptEcho | None = None  # echo: on each completion's first piece


def merge_pieces(first: GenerationOutput, then: GenerationOutput) -> GenerationOutput:
    """One piece saying what `first` then `then` (of the same completion, `first` not its last) say."""
    return GenerationOutput(
        request_id=first.request_id,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=first.logprobs + then.logprobs,
        finish_reason=then.finish_reason,
        usage=then.usage,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        index=first.index,
        tokens=first.tokens + then.tokens,
        prompt=first.prompt or then.prompt,
    )


class GenerationError(KvpactError):
    """The engine failed while serving a request (a step raised); the message says what failed."""


class EngineClosedError(GenerationError):
    """The engine was closed before or while serving the request (maps to UNAVAILABLE)."""


class EngineOverloadedError(KvpactError):
    """Too many requests already wait for a place in the batch (maps to RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class GenerationResult:
    """A whole generation, joined from its streamed pieces (what unary callers and tests want)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    usage: Usage
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    prompt: PromptEcho | None = None

    @classmethod
    def join(cls, outputs: list[GenerationOutput]) -> GenerationResult:
        last = outputs[-1]
        assert last.finish_reason is not None and last.usage is not None, "the stream has not finished"
        return cls(
            request_id=last.request_id,
            text="".join(o.text for o in outputs),
            token_ids=[t for o in outputs for t in o.token_ids],
            logprobs=[lp for o in outputs for lp in o.logprobs],
            finish_reason=last.finish_reason,
            usage=last.usage,
            top_logprobs=[t for o in outputs for t in o.top_logprobs],
            tokens=[t for o in outputs for t in o.tokens],
            prompt=next((o.prompt for o in outputs if o.prompt is not None), None),
        )

    @classmethod
    def join_choices(cls, outputs: list[GenerationOutput]) -> list[GenerationResult]:
        """A request's n completions (index order), each joined from its own pieces; each carries the
        request's usage (the prompt once, the completion tokens of all n)."""
        last = outputs[-1]
        assert last.usage is not None, "the stream has not finished"
        by_index: dict[int, list[GenerationOutput]] = {}
        for o in outputs:
            by_index.setdefault(o.index, []).append(o)
        results = []
        for index in sorted(by_index):
            pieces = by_index[index]
            if pieces[-1].usage is None:
                pieces = [*pieces[:-1], dataclasses.replace(pieces[-1], usage=last.usage)]
            results.append(cls.join(pieces))
        return results
