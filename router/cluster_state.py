"""The cluster's startup state machine. Pure: the router feeds it events and acts on what it returns.

    STARTING --(N distinct workers admitted)-------------------------> SERVING
    STARTING --(a worker refused by policy, or failed, while starting)-> FAILED  (exit 78 for policy, else 1)
    STARTING --(startup timeout)-------------------------------------> FAILED  (exit 1; names who is still
                                                                        loading apart from who is missing)
    SERVING  --(anything)--------------------------------------------> SERVING (late workers refused alone)
    FAILED   is final.

All-or-nothing while starting: one worker that cannot meet the policy fails the whole cluster at once,
without waiting out the timeout. A worker counts once admitted, even if it later misses heartbeats
before the N-th arrives (routing skips it while it is DEAD).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpact.router.admission import Decision
from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY


class ClusterState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    FAILED = "failed"


@dataclass(slots=True)
class Startup:
    num_expected: int
    state: ClusterState = ClusterState.STARTING
    admitted_ids: set[str] = field(default_factory=set)
    cause: str = ""  # why FAILED, naming the worker
    exit_code: int = 0  # set when FAILED
    feature: str = ""  # the feature whose policy failed it (a policy refusal), else ""

    @property
    def num_admitted(self) -> int:
        return len(self.admitted_ids)

    def on_decision(self, worker_id: str, decision: Decision) -> ClusterState:
        """A worker registered and was admitted or refused."""
        if self.state is not ClusterState.STARTING:
            return self.state
        if decision.admitted:
            self.admitted_ids.add(worker_id)
            if self.num_admitted >= self.num_expected:
                self.state = ClusterState.SERVING
        else:
            self.feature = decision.feature
            self._fail(
                f'worker "{worker_id}" was refused while the cluster was starting: {decision.reason}',
                EXIT_POLICY if decision.policy_failure else EXIT_FATAL,
            )
        return self.state

    def on_timeout(
        self, timeout_s: float, registered_ids: list[str], loading_ids: list[str] | None = None
    ) -> ClusterState:
        """`loading_ids`: workers that announced a plan and had not finished loading (named apart from the
        missing ones: they are slow, not absent)."""
        if self.state is ClusterState.STARTING:
            loading = loading_ids or []
            missing = max(self.num_expected - self.num_admitted - len(loading), 0)
            who = ", ".join(f'"{w}"' for w in registered_ids) or "none"
            names = ", ".join(f'"{w}"' for w in loading)
            still = f"{len(loading)} still loading ({names}), " if loading else ""
            self._fail(
                f"startup timed out after {timeout_s:g} s with {self.num_admitted} of {self.num_expected} "
                f"workers admitted: {still}{missing} missing (registered: {who}); start the missing workers "
                f"with --router pointing here, or raise --startup-timeout",
                EXIT_FATAL,
            )
        return self.state

    def _fail(self, cause: str, exit_code: int) -> None:
        self.state = ClusterState.FAILED
        self.cause = cause
        self.exit_code = exit_code

    def describe(self) -> str:
        """What a client hears while the cluster is not serving."""
        if self.state is ClusterState.STARTING:
            return f"cluster is starting ({self.num_admitted} of {self.num_expected} workers admitted)"
        if self.state is ClusterState.FAILED:
            return f"cluster failed to start and the router is exiting: {self.cause}"
        return "cluster is serving"
