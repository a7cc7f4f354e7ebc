"""Autoscaling on load (`workers[].autoscale`): when a group's measured load has stayed above its target
long enough, one worker more; below it long enough, one fewer; always within the group's bounds.

NOTE: pure, no Ray, time passed in. The load is measured over the group's admitted workers, from the loads
their heartbeats report (ClusterStatus, through the router's report file):
- `waiting`: the mean number of requests queued in a worker's scheduler (WorkerLoad.num_waiting);
- `kv_usage`: the mean fraction of its KV blocks (or eager slots) in use, 0 to 1.
The launcher asks only while the group is settled (its size is its target, nobody joining or leaving), so a
worker still loading never counts as idle capacity and one decision waits for the last to take effect. A
decision restarts both clocks: the next one needs the same sustained load again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

METRICS = ("waiting", "kv_usage")


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    metric: str  # one of METRICS
    target: float
    up_after_s: float = 30.0
    down_after_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Decision:
    num: int  # the group's new size
    reason: str  # one line: the metric, its value, the target and how long


def measure(metric: str, loads: Sequence[Mapping[str, Any]]) -> float | None:
    """The group's load from its admitted workers' WorkerLoad (protobuf JSON mapping); None: no worker."""
    if not loads:
        return None
    if metric == "waiting":
        return sum(float(load.get("numWaiting", 0)) for load in loads) / len(loads)
    used = []
    for load in loads:
        total = float(load.get("numTotalBlocks", 0))
        used.append(1.0 - float(load.get("numFreeBlocks", 0)) / total if total else 0.0)
    return sum(used) / len(used)


class Autoscaler:
    """One group's clocks: since when its load has been above, or below, its target."""

    def __init__(self, policy: AutoscalePolicy, min_replicas: int, max_replicas: int) -> None:
        self.policy = policy
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.above_since: float | None = None
        self.below_since: float | None = None

    def reset(self) -> None:
        """After any change of size (a decision, a `scale`): the next decision needs its own stretch."""
        self.above_since = self.below_since = None

    def observe(self, load: float | None, num: int, now: float) -> Decision | None:
        """The group has `num` admitted workers whose load is `load` at `now`: a new size, or None."""
        p = self.policy
        if load is None or math.isclose(load, p.target):
            self.reset()
            return None
        if load > p.target:
            self.below_since = None
            self.above_since = now if self.above_since is None else self.above_since
            if now - self.above_since >= p.up_after_s and num < self.max_replicas:
                self.reset()
                return Decision(num + 1, self._why(load, "above", p.up_after_s))
        else:
            self.above_since = None
            self.below_since = now if self.below_since is None else self.below_since
            if now - self.below_since >= p.down_after_s and num > self.min_replicas:
                self.reset()
                return Decision(num - 1, self._why(load, "below", p.down_after_s))
        return None

    def _why(self, load: float, side: str, after_s: float) -> str:
        p = self.policy
        return f"{p.metric} {load:.2f} {side} its target {p.target:g} for {after_s:g} s"
