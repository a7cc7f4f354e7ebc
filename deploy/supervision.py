"""Supervision: ask every worker's actor how its worker is, all at once, and tell slow from dead.

NOTE: one `poll` call per actor, waited on together with `ray.wait` (bounded). An answer is the worker
process's exit code (None: running). No answer in time is SLOW, never a death: a busy node or a GCS
hiccup must not start a second worker beside a healthy one. A call not answered yet is waited on again
next round, not sent again, so a stalled actor's queue never grows. Only Ray saying the actor is gone
(ActorDiedError, its node or worker process lost) is DEAD; ActorUnavailableError is Ray's "try again"
and counts as SLOW. The verdict on an error is `judge_error`, a pure function.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

POLL_TIMEOUT_S = 2.0  # per round; a signal is answered between rounds


class Health(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"  # the worker process exited; exit_code says how
    SLOW = "slow"  # no answer in time, or Ray says the actor is briefly unavailable
    DEAD = "dead"  # the actor (or its node) is gone: only a new actor can run this worker


@dataclass(frozen=True, slots=True)
class Observation:
    health: Health
    exit_code: int | None = None
    detail: str = ""  # for SLOW and DEAD: what Ray said


def judge_error(exc: BaseException) -> Health:
    """What a failed `poll` means: DEAD only when Ray says the actor or its node is gone."""
    from ray import exceptions as rex

    if isinstance(exc, rex.ActorUnavailableError | rex.GetTimeoutError):
        return Health.SLOW
    if isinstance(exc, rex.RayActorError | rex.NodeDiedError | rex.WorkerCrashedError | rex.OwnerDiedError):
        return Health.DEAD
    if isinstance(exc, rex.ActorPlacementGroupRemoved | rex.ActorUnschedulableError):
        return Health.DEAD
    return Health.SLOW  # anything else (a system hiccup): ask again next round, never restart on it


class Poller:
    """Asks the actors, round after round; keeps each unanswered call to wait on it again."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[Any, Any]] = {}  # worker id -> (actor, its unanswered poll ref)

    def observe(self, actors: Mapping[str, Any], timeout_s: float = POLL_TIMEOUT_S) -> dict[str, Observation]:
        """worker id -> how it is, asking every actor's `poll()` at once and waiting `timeout_s` in all."""
        import ray

        result: dict[str, Observation] = {}
        refs = {}
        for worker_id, actor in actors.items():
            held = self.pending.pop(worker_id, None)
            if held is not None and held[0] is actor:  # still waiting for this actor's last answer
                refs[worker_id] = held[1]
                continue
            try:
                refs[worker_id] = actor.poll.remote()
            except Exception as exc:  # a handle Ray already knows is dead raises here
                result[worker_id] = _from_error(exc)
        ids = {ref: worker_id for worker_id, ref in refs.items()}
        ready, _ = ray.wait(list(ids), num_returns=len(ids), timeout=timeout_s) if ids else ([], [])
        for ref in ready:
            try:
                code = ray.get(ref, timeout=0)
            except Exception as exc:
                result[ids[ref]] = _from_error(exc)
            else:
                result[ids[ref]] = Observation(Health.RUNNING if code is None else Health.EXITED, code)
        for ref, worker_id in ids.items():
            if worker_id not in result:
                self.pending[worker_id] = (actors[worker_id], ref)
                result[worker_id] = Observation(Health.SLOW, detail=f"no answer within {timeout_s:g} s")
        return result


def observe(actors: Mapping[str, Any], timeout_s: float = POLL_TIMEOUT_S) -> dict[str, Observation]:
    """One round of a fresh Poller."""
    return Poller().observe(actors, timeout_s)


def _from_error(exc: BaseException) -> Observation:
    text = str(exc).strip()
    first = text.splitlines()[0][:200] if text else type(exc).__name__
    return Observation(judge_error(exc), detail=f"{type(exc).__name__}: {first}")
