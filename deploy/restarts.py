"""When a worker that died after the cluster served may be started again: backoff and a budget.

NOTE: pure, no Ray. A worker gets at most `max_restarts` restarts within any `window_s` (a worker that
crashes once a day is restarted every time; one that crash-loops stops being restarted). Before restart n
(1, 2, ...) of the window it waits `base_delay_s * 2**(n-1)`, capped at `max_delay_s`, so a crash loop does
not hammer its node. Time is passed in, so the schedule is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RESTART_WINDOW_S = 600.0
BASE_DELAY_S = 1.0
MAX_DELAY_S = 60.0


@dataclass(slots=True)
class RestartBudget:
    max_restarts: int
    window_s: float = RESTART_WINDOW_S
    base_delay_s: float = BASE_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    restarted_at: list[float] = field(default_factory=list)

    def recent(self, now: float) -> int:
        """Restarts within the window ending `now`."""
        return sum(1 for t in self.restarted_at if now - t < self.window_s)

    def can_restart(self, now: float) -> bool:
        return self.recent(now) < self.max_restarts

    def delay(self, now: float) -> float:
        """Seconds to wait before the next restart (the n-th of the window waits base * 2**(n-1))."""
        return min(self.max_delay_s, self.base_delay_s * 2 ** self.recent(now))

    def record(self, now: float) -> int:
        """A restart begins now; returns its number within the window (1 = the first)."""
        self.restarted_at = [t for t in self.restarted_at if now - t < self.window_s] + [now]
        return len(self.restarted_at)
