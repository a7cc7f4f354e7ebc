"""GenerateChunks -> OpenAI's response objects, streamed (SSE events) or whole.

Shapes (what the openai SDK's types read):
- chat: `chat.completion` / `chat.completion.chunk`, id `chatcmpl-<request id>`; the first delta of each
  choice carries `role: "assistant"`, the chunk that ends a choice carries its `finish_reason`.
- completions: `text_completion` for both, id `cmpl-<request id>`.
- with `stream_options.include_usage`, every chunk has `usage: null` and one last chunk has empty
  `choices` and the usage; usage.prompt_tokens_details.cached_tokens is the prefix cache's hit
  (Usage.cached_prompt_tokens).
- logprobs: a token, sampled or an alternative (top_logprobs), is named by the text the worker decoded for
  it alone (GenerateChunk.tokens, TopLogprobs.tokens; `bytes` are that text's UTF-8), as vLLM names
  them. The router holds no tokenizer: from a worker that sends no names (one older than them), a
  token is named by the chunk's text where the chunk carries exactly one token and as `token_id:<id>`
  otherwise (vLLM's `return_tokens_as_token_ids` form).

A worker's usage counts its own request: prompt and cached tokens once per prompt (the largest any of
its chunks reported), completion tokens summed over its completions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpact.router.http.errors import UPSTREAM, HttpError
from kvpact.v1 import generation_pb2

FINISH_REASON = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def token_names(chunk: generation_pb2.GenerateChunk) -> list[str]:
    """A name for each of the chunk's tokens (the module docstring's logprobs rule)."""
    if not chunk.tokens and len(chunk.token_ids) == 1:
        return [chunk.text]
    return _names(chunk.token_ids, chunk.tokens)


def alternative_names(top: generation_pb2.TopLogprobs) -> list[str]:
    return _names(top.token_ids, top.tokens)


def _names(ids: Sequence[int], names: Sequence[str]) -> list[str]:
    """The worker's names, or (a worker that sends none) `token_id:<id>`."""
    return list(names) if len(names) == len(ids) else [f"token_id:{t}" for t in ids]


Alternatives = list[tuple[str, float]]
Row = tuple[str, float | None, Alternatives | None]  # a token's name, logprob, alternatives


def echoed_rows(echoed: generation_pb2.PromptEcho) -> list[Row]:
    """An echoed prompt's tokens as logprobs rows: the first without logprob or alternatives (it has no
    context), the rest with what the worker computed (None where none was asked for)."""
    logprobs: list[float | None] = [None, *echoed.logprobs]
    tops: list[Alternatives | None] = [None]
    tops += [list(zip(alternative_names(t), t.logprobs, strict=True)) for t in echoed.top_logprobs]
    return [
        (name, logprobs[k] if k < len(logprobs) else None, tops[k] if k < len(tops) else None)
        for k, name in enumerate(echoed.tokens)
    ]


@dataclass(slots=True)
class _Usage:
    prompt: int = 0
    cached: int = 0
    completion: int = 0


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # its first delta went out (chat: with the role)
    name_chars: int = 0  # its tokens' names so far, laid end to end (completions' text_offset)
    logprobs: list[Any] = field(default_factory=list)  # chat: content entries; completions: per token


class Rendering:
    """One response in the making: feed it (choice index, chunk) pairs; it gives SSE events or, at the
    end, the whole object."""

    def __init__(
        self, chat: bool, request_id: str, model: str, logprobs: bool, include_usage: bool, echo: bool = False
    ) -> None:
        self.chat = chat
        self.echo = echo  # each choice's first chunk must carry the prompt (GenerateChunk.prompt)
        self.id = f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}"
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, _Usage] = {}
        fixed = {"id": self.id, "object": self.object, "created": self.created, "model": model}
        self._prefix = "data: " + json.dumps(fixed, separators=(",", ":"), ensure_ascii=False)[:-1]
        self._prefix += ',"choices":['
        self._suffix = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    # -- both forms

    def add(self, index: int, chunk: generation_pb2.GenerateChunk) -> dict[str, Any] | None:
        """Take a chunk; the streamed choice it makes (None when it carries nothing to send)."""
        choice = self.choices.setdefault(index, _Choice())
        if self.echo and not choice.started and not chunk.HasField("prompt"):
            raise HttpError(
                UPSTREAM,
                f'worker "{chunk.worker_id}" did not echo the prompt (it is older than echo); send the '
                "request without echo, or to a cluster whose workers are all current",
                "echo",
            )
        if chunk.HasField("usage"):
            usage = self.usage.setdefault(chunk.request_id, _Usage())
            usage.prompt = max(usage.prompt, chunk.usage.prompt_tokens)
            usage.cached = max(usage.cached, chunk.usage.cached_prompt_tokens)
            usage.completion += chunk.usage.completion_tokens
        finish = FINISH_REASON.get(chunk.finish_reason)
        if finish is not None:
            choice.finish_reason = finish
        echoed = chunk.prompt if not self.chat and chunk.HasField("prompt") else None
        text = chunk.text if echoed is None else echoed.text + chunk.text
        wanted = self.logprobs and (chunk.token_ids or echoed is not None)
        logprobs = self._logprobs(choice, chunk, echoed) if wanted else None
        choice.text.append(text)
        if not text and finish is None and logprobs is None and choice.started:
            return None
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or not choice.started else {}
            if not choice.started:
                delta["role"] = "assistant"
            out = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        choice.started = True
        return out

    def usage_object(self) -> dict[str, Any]:
        prompt = sum(u.prompt for u in self.usage.values())
        completion = sum(u.completion for u in self.usage.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached for u in self.usage.values())},
        }

    # -- streamed

    def event(self, choice: dict[str, Any]) -> str:
        """One SSE event: the stream's fixed fields, rendered once (`_prefix`), then this choice."""
        return f"{self._prefix}{json.dumps(choice, separators=(',', ':'), ensure_ascii=False)}{self._suffix}"

    def closing_events(self) -> str:
        """The usage chunk (when asked for) and [DONE]."""
        if not self.include_usage:
            return DONE
        obj = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage_object(),
        }
        return sse(obj) + DONE

    # -- whole

    def whole(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            text = "".join(choice.text)
            logprobs = self._whole_logprobs(choice) if self.logprobs else None
            entry: dict[str, Any] = {
                "index": index,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            choices.append(entry)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage_object(),
        }

    # -- logprobs

    def _logprobs(
        self, choice: _Choice, chunk: generation_pb2.GenerateChunk, echoed: generation_pb2.PromptEcho | None
    ) -> dict[str, Any]:
        """The chunk's logprobs object (chat: `content` entries; completions: the legacy lists, an echoed
        prompt's tokens first: the first has no logprob, having no context)."""
        entries: list[tuple[str, float | None, Alternatives]] = []
        for k, name in enumerate(token_names(chunk)):
            logprob = chunk.logprobs[k] if k < len(chunk.logprobs) else None
            alternatives = chunk.top_logprobs[k] if k < len(chunk.top_logprobs) else None
            top = (
                list(zip(alternative_names(alternatives), alternatives.logprobs, strict=False))
                if alternatives is not None
                else []
            )
            entries.append((name, logprob, top))
        if self.chat:
            content = [
                {
                    "token": name,
                    "logprob": logprob,
                    "bytes": list(name.encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
                }
                for name, logprob, top in entries
            ]
            choice.logprobs.extend(content)
            return {"content": content}
        # text_offset: where each token starts in its names laid end to end (vLLM's), so however chunks
        # were merged the offsets are the same; a name the worker did not send (`token_id:<id>`) is 0 wide
        prompt = echoed_rows(echoed) if echoed is not None else []
        named = bool(chunk.tokens) or len(chunk.token_ids) == 1
        widths = [len(name) for name, _, _ in prompt] + [len(name) if named else 0 for name, _, _ in entries]
        offsets = []
        for width in widths:
            offsets.append(choice.name_chars)
            choice.name_chars += width
        rows: list[Row] = [*prompt, *entries]
        with_tops = any(top for _, _, top in entries) or bool(echoed is not None and echoed.top_logprobs)
        part = {
            "tokens": [name for name, _, _ in rows],
            "token_logprobs": [logprob for _, logprob, _ in rows],
            "top_logprobs": [None if top is None else dict(top) for _, _, top in rows] if with_tops else None,
            "text_offset": offsets,
        }
        choice.logprobs.append(part)
        return part

    def _whole_logprobs(self, choice: _Choice) -> dict[str, Any]:
        if self.chat:
            return {"content": list(choice.logprobs)}
        merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
        for part in choice.logprobs:
            merged["tokens"] += part["tokens"]
            merged["token_logprobs"] += part["token_logprobs"]
            merged["text_offset"] += part["text_offset"]
            if part["top_logprobs"] is not None:
                merged["top_logprobs"] = (merged["top_logprobs"] or []) + part["top_logprobs"]
        return merged
