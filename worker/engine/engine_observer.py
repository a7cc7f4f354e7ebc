"""What the engine tells an observer (the worker's metrics) about each request, and when.

The engine calls these from its step thread (`request_rejected` from the caller's thread), with times
taken once per step, so an observer adds O(1) work per token: keep implementations to counter
increments and histogram observations. Outcomes: "stop", "length", "abort" (the finish reason),
"error" (the engine failed the request, or closed under it) and "rejected" (refused before it was
queued: a bad request, a duplicate id, a closed engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

OUTCOMES = ("stop", "length", "abort", "error", "rejected")


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    outcome: str
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served
    queued_s: float | None  # arrival -> first scheduled; None if it never was
    duration_s: float  # arrival -> finished


class EngineObserver(Protocol):
    def request_rejected(self) -> None: ...

    def first_token(self, seconds: float) -> None:
        """Arrival -> the first generated token (time to first token)."""

    def next_token(self, seconds: float) -> None:
        """The previous token -> this one (inter-token latency)."""

    def request_finished(self, request: FinishedRequest) -> None: ...
