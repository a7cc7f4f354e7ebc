"""How `kvpact-launch scale` reaches a running launcher: a Ray named actor, `kvpact-launcher` in namespace
`kvpact`, that the launcher creates once its cluster serves.

NOTE: the actor only holds state; the launcher decides. `scale` checks the group and the bounds (an error
string, the command exits 2) and records the group's new target size. Each supervision round the launcher
calls `exchange(status)`: it publishes what each group has now (admitted and leaving worker ids, what
blocks it) and takes the targets back. A target the launcher could not reach (a refused joiner, a
placement never granted) is lowered by the launcher with `set_target`, the reason in `gave_up`, so the
command that asked fails with it instead of waiting forever; an autoscaling decision arrives through
`autoscaled`, and a later `scale` overrides it. Every change of a target is recorded as a decision (kept in
`decisions()`, and counted in Ray's metrics when Ray runs this: `kvpact_scaling_decisions` by group,
direction and cause, `kvpact_group_target_workers` by group; Ray exports both to Prometheus with its own).
Plain Python: the launcher wraps it with `ray.remote`; tests call it directly. Never detached: it goes
with the launcher's job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CONTROL_NAME = "kvpact-launcher"
CONTROL_NAMESPACE = "kvpact"
MAX_DECISIONS = 100


def _ray_metrics() -> tuple[Any, Any] | None:
    """Ray's Counter and Gauge for the decisions, when this runs inside Ray; None elsewhere (tests)."""
    try:
        import ray
        from ray.util.metrics import Counter, Gauge

        if not ray.is_initialized():
            return None
        return (
            Counter(
                "kvpact_scaling_decisions",
                description="Changes of a worker group's target size (kvpact-launch scale, autoscaling)",
                tag_keys=("group", "direction", "cause"),
            ),
            Gauge(
                "kvpact_group_target_workers",
                description="The target number of workers of a group",
                tag_keys=("group",),
            ),
        )
    except Exception:  # no Ray, or its metrics agent is not there: the decisions are still kept
        return None


@dataclass(frozen=True, slots=True)
class GroupBounds:
    min_replicas: int
    replicas: int
    max_replicas: int


@dataclass(slots=True)
class GroupStatus:
    """What a group has now, as the launcher last published it."""

    target: int
    admitted_ids: list[str] = field(default_factory=list)
    leaving_ids: list[str] = field(default_factory=list)  # told to drain, not gone yet
    blocked: str = ""  # why the target is not met yet (a pending placement, a worker loading), "" if nothing
    gave_up: str = ""  # why the launcher lowered the target it was given (set_target), until the next scale

    def reached(self, num: int) -> bool:
        """`num` admitted workers and none still leaving."""
        return self.target == num and len(self.admitted_ids) == num and not self.leaving_ids


class LauncherControl:
    def __init__(self, bounds: dict[str, GroupBounds], timeout_s: float) -> None:
        self.bounds = bounds
        self.timeout_s = timeout_s  # the scale command's default wait (ray.placement_timeout_s)
        self.targets = {name: b.replicas for name, b in bounds.items()}
        self.status: dict[str, GroupStatus] = {name: GroupStatus(b.replicas) for name, b in bounds.items()}
        self._decisions: list[dict[str, Any]] = []
        self._metrics = _ray_metrics()
        for name, num in self.targets.items():
            self._gauge(name, num)

    def _decide(self, group: str, num: int, cause: str, reason: str) -> None:
        before = self.targets[group]
        direction = "up" if num > before else "down" if num < before else "same"
        self.targets[group] = num
        self.status[group].target = num
        self._decisions.append(
            {
                "group": group,
                "from": before,
                "to": num,
                "cause": cause,
                "direction": direction,
                "reason": reason,
            }
        )
        del self._decisions[:-MAX_DECISIONS]
        if self._metrics is not None:
            self._metrics[0].inc(tags={"group": group, "direction": direction, "cause": cause})
        self._gauge(group, num)

    def _gauge(self, group: str, num: int) -> None:
        if self._metrics is not None:
            self._metrics[1].set(num, tags={"group": group})

    def decisions(self) -> list[dict[str, Any]]:
        """The latest changes of a target (oldest first), each {group, from, to, cause, direction, reason}."""
        return list(self._decisions)

    def scale(self, group: str, num: int) -> dict[str, Any]:
        """Set `group`'s target to `num`: {"error": why} (unknown group, outside the bounds), else
        {"timeout_s": the default wait}."""
        bounds = self.bounds.get(group)
        if bounds is None:
            names = ", ".join(sorted(self.bounds))
            return {"error": f"no worker group {group!r} in this cluster (its groups: {names}); pass --group"}
        if not bounds.min_replicas <= num <= bounds.max_replicas:
            return {
                "error": f"--replicas {num} is outside group {group!r}'s bounds [{bounds.min_replicas}, "
                f"{bounds.max_replicas}] (workers[].min_replicas and max_replicas in the cluster file)"
            }
        self._decide(group, num, "scale", "kvpact-launch scale")
        self.status[group].gave_up = ""
        return {"timeout_s": self.timeout_s}

    def set_target(self, group: str, num: int, reason: str) -> None:
        """The launcher gives up on the target it had (and says why)."""
        self._decide(group, num, "gave-up", reason)
        self.status[group].gave_up = reason

    def autoscaled(self, group: str, num: int, reason: str) -> None:
        """The launcher's autoscaling chose a new size (deploy/autoscale.py)."""
        self._decide(group, num, "autoscale", reason)

    def exchange(self, status: dict[str, dict[str, Any]]) -> dict[str, int]:
        """The launcher's round: publish each group's status (admitted_ids, leaving_ids, blocked); take the
        targets."""
        for name, published in status.items():
            current = self.status[name]
            current.admitted_ids = list(published.get("admitted_ids", []))
            current.leaving_ids = list(published.get("leaving_ids", []))
            current.blocked = str(published.get("blocked", ""))
        return dict(self.targets)

    def group_status(self, group: str) -> dict[str, Any]:
        return asdict(self.status[group])
