"""A model's chat template (jinja2), rendered in a sandbox the way transformers renders it.

Same environment as transformers' `apply_chat_template`: `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the loop-controls extension, a `tojson` filter that keeps
non-ASCII, and the globals `raise_exception` and `strftime_now`. The context carries `messages`,
`add_generation_prompt` and the special tokens (`bos_token`, `eos_token`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpact.shared.errors import ModelLoadError, RequestError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """Compiled once per model; `render` is safe to call from any thread (the environment is immutable)."""

    def __init__(
        self, source: str, *, special_tokens: Mapping[str, str | None], origin: str = "chat template"
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(
                f"{origin}: the chat template does not compile: {e} (line {e.lineno})"
            ) from e
        self.source = source
        self._special = {k: v for k, v in special_tokens.items() if v is not None}

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` (each a mapping with at least `role` and `content`).
        A template that refuses the conversation (`raise_exception`) raises RequestError."""
        context = {
            **self._special,
            **extra,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise RequestError(f"the model's chat template rejected the messages: {e}") from e
