"""Supervision: ask every worker's actor how its worker is, all at once, and tell slow from dead.

NOTE: one `poll` call per actor, waited on together with `ray.wait` (bounded). An answer is the worker
process's exit code (None: running). No answer in time is SLOW, never a death: a busy node or a GCS hiccup
must not start a second worker beside a healthy one. Only Ray saying the actor is gone (ActorDiedError,
its node or worker process lost) is DEAD; ActorUnavailableError is Ray's "try again" and counts as SLOW.
The verdict on an error is `judge_error`, a pure function.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

POLL_TIMEOUT_S = 10.0


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


def observe(actors: Mapping[str, Any], timeout_s: float = POLL_TIMEOUT_S) -> dict[str, Observation]:
    """worker id -> how it is, asking every actor's `poll()` at once and waiting `timeout_s` in all."""
    import ray

    refs = {}
    result: dict[str, Observation] = {}
    for worker_id, actor in actors.items():
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
    for worker_id in ids.values():
        result.setdefault(worker_id, Observation(Health.SLOW, detail=f"no answer within {timeout_s:g} s"))
    return result


def _from_error(exc: BaseException) -> Observation:
    text = str(exc).strip()
    first = text.splitlines()[0][:200] if text else type(exc).__name__
    return Observation(judge_error(exc), detail=f"{type(exc).__name__}: {first}")
