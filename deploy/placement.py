"""The Ray side of a launch: connect, one placement group with a bundle per worker, one WorkerActor pinned
to each bundle, and their release. Imports ray only when called (the cluster file is validated first).

Every wait is bounded; every failure is a LaunchFailure whose message is one line saying which and where.
Actors and the placement group are never detached: if the launcher dies, Ray releases them with its job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpact.deploy.cluster_file import ClusterFile, WorkerSlot
from kvpact.deploy.restarts import RestartBudget
from kvpact.deploy.worker_actor import WorkerActor

ACTOR_READY_TIMEOUT_S = 120.0  # an actor process on a busy node: Python, kvpact's imports
STOP_MARGIN_S = 10.0  # a worker's stop grace: its --drain-timeout plus this (never SIGKILLed mid-drain)
PROGRESS_EVERY_S = 30.0
OUTPUT_TAIL_CHARS = 3000  # of a failed worker's own output, in the failure report
_RAY_LABEL_NODE, _RAY_LABEL_NODE_IP, _RAY_LABEL_BUNDLE = "ray.node", "ray.node_ip", "ray.bundle"


class LaunchFailure(RuntimeError):
    """The cluster could not be placed or started for a reason outside the policy (exit 1)."""


@dataclass(slots=True)
class PlacedWorker:
    """A worker slot and the actor that runs it (replaced when the actor is lost and restarted)."""

    slot: WorkerSlot
    actor: Any  # a ray ActorHandle of WorkerActor
    node_id: str = ""
    node_ip: str = ""
    log_dir: str = ""
    pid: int = 0  # its worker process, on its node
    argv: list[str] = field(default_factory=list)
    budget: RestartBudget = field(default_factory=lambda: RestartBudget(0))
    own_group: Any = None  # its own one-bundle placement group (added by scaling); None: the launch's
    added: bool = False  # added while serving (kvpact-launch scale), not one of the starting workers

    @property
    def labels(self) -> dict[str, str]:
        return {
            _RAY_LABEL_NODE: self.node_id[:12],
            _RAY_LABEL_NODE_IP: self.node_ip,
            _RAY_LABEL_BUNDLE: str(self.slot.bundle_index),
        }

    def where(self) -> str:
        node = f"node {self.node_id[:12]} ({self.node_ip})" if self.node_id else "a node not known yet"
        return f"bundle {self.slot.bundle_index} on {node}"


def connect(address: str) -> None:
    """ray.init for the cluster file's ray.address ("auto": $RAY_ADDRESS or the local head; "local":
    start one here). Raises LaunchFailure when there is no cluster to join."""
    import ray

    # log_to_driver: each WorkerActor copies its worker's output to its stdout/stderr, which Ray streams here
    # (and so into `ray job logs`) prefixed with the actor's repr, WorkerActor(<worker id>).
    # RAY_COLOR_PREFIX=0: plain prefixes, no terminal colour codes in the job's log file (unless set).
    options: dict[str, Any] = {"log_to_driver": True, "logging_level": "WARNING"}
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        if address == "local":
            ray.init(include_dashboard=False, **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, RuntimeError) as exc:
        raise LaunchFailure(
            f"cannot connect to Ray at ray.address {address!r}: {' '.join(str(exc).split())[:300]}; start a "
            'head with `ray start --head`, set RAY_ADDRESS, or set ray.address: "local"'
        ) from None


def node_ip() -> str:
    """This (the driver's) node's IP as Ray reports it."""
    import ray

    return str(ray.util.get_node_ip_address())


def reserve(cluster: ClusterFile, name: str, cancelled: Any) -> Any:
    """Create the placement group and wait (bounded by ray.placement_timeout_s) until it is granted.
    `cancelled()` ends the wait early (a signal): returns None. LaunchFailure names the resources."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = cluster.bundles()
    group = placement_group(bundles, strategy=cluster.ray.placement_strategy, name=name)
    deadline = time.monotonic() + cluster.ray.placement_timeout_s
    while time.monotonic() < deadline:
        ready, _ = ray.wait([group.ready()], timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        if ready:
            return group
        if cancelled():
            remove_placement_group(group)
            return None
    remove_placement_group(group)
    raise LaunchFailure(
        f"placement: {len(bundles)} bundles {describe_bundles(cluster)} "
        f"(strategy {cluster.ray.placement_strategy}) were not granted within ray.placement_timeout_s "
        f"{cluster.ray.placement_timeout_s:g} s; the cluster has "
        f"{describe_resources(ray.cluster_resources())} in all, "
        f"{describe_resources(ray.available_resources())} free; add nodes with these resources, lower "
        "workers[].resources or replicas, or choose another ray.placement_strategy"
    )


def reserve_one(
    resources: dict[str, float],
    name: str,
    timeout_s: float,
    cancelled: Callable[[], bool],
    waiting: Callable[[str], None],
) -> tuple[Any, str]:
    """A one-bundle placement group (a worker added while serving), once granted: (group, ""). Until then
    `waiting(what it waits for)` every half second; (None, "") if `cancelled()`, (None, why) after
    `timeout_s` (the group removed either way). A pending bundle is what makes an autoscaler add a node."""
    import ray
    from ray.util.placement_group import placement_group

    pg = placement_group([resources], name=name)
    wanted = describe_resources(resources)
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        ready, _ = ray.wait([pg.ready()], timeout=0.5)
        if ready:
            return pg, ""
        if cancelled():
            remove_group(pg)
            return None, ""
        free = describe_resources(ray.available_resources())
        waiting(
            f"its placement group {wanted} is pending ({time.monotonic() - started:.0f} s of "
            f"ray.placement_timeout_s {timeout_s:g}; free now: {free})"
        )
    remove_group(pg)
    return None, (
        f"its placement group {wanted} was not granted within ray.placement_timeout_s {timeout_s:g} s "
        f"(free: {describe_resources(ray.available_resources())}); add nodes or lower the group's resources"
    )


def describe_bundles(cluster: ClusterFile) -> str:
    """e.g. `gpu x2 {GPU: 1, CPU: 4}, cpu x1 {CPU: 1}`; a tensor-parallel group's: `tp x1 {GPU: 2} tp 2`
    (one bundle per worker, holding all of its ranks)."""
    return ", ".join(
        f"{g.name} x{g.replicas} {describe_resources(g.resources)}"
        + (f" tp {g.tensor_parallel_size}" if g.tensor_parallel_size > 1 else "")
        for g in cluster.workers
    )


def describe_resources(resources: dict[str, float] | Any) -> str:
    hidden = ("node:", "object_store_memory", "bundle_group_")  # Ray's own bookkeeping, not what to add
    shown = {k: v for k, v in resources.items() if not k.startswith(hidden)}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def start_actor(slot: WorkerSlot, group: Any) -> Any:
    """A WorkerActor in `slot`'s bundle, asking for exactly that bundle's resources."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = dict(slot.group.resources)
    options: dict[str, Any] = {
        "num_cpus": resources.pop("CPU", 0),
        "num_gpus": resources.pop("GPU", 0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=slot.bundle_index
        ),
        "max_restarts": 0,  # the launcher restarts workers itself (workers[].max_restarts), in the bundle
    }
    if "memory" in resources:
        options["memory"] = resources.pop("memory")
    if resources:
        options["resources"] = resources
    return ray.remote(WorkerActor).options(**options).remote(slot.worker_id)


def locate(
    placed: list[PlacedWorker],
    timeout_s: float = ACTOR_READY_TIMEOUT_S,
    cancelled: Callable[[], bool] = lambda: False,
    progress: Callable[[str], None] | None = None,
) -> bool:
    """Ask each actor where it runs (fills node_id, node_ip, log_dir), waiting for all at once up to
    `timeout_s` (a bundle whose node is being replaced waits here) and saying every PROGRESS_EVERY_S what
    it waits for. False if `cancelled()` ends the wait; LaunchFailure if an actor is lost or late."""
    import ray
    from ray.exceptions import RayError

    by_ref = {p.actor.placement.remote(): p for p in placed}
    pending = list(by_ref)
    started = time.monotonic()
    next_progress = started + PROGRESS_EVERY_S
    while pending:
        left = started + timeout_s - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(1.0, left)))
        for ref in ready:
            worker = by_ref[ref]
            try:
                where = ray.get(ref, timeout=0)
            except RayError as exc:
                raise LaunchFailure(lost(worker, "while starting", exc)) from None
            worker.node_id, worker.node_ip = where["node_id"], where["node_ip"]
            worker.log_dir = where["log_dir"]
        if not pending:
            break
        waiting = ", ".join(by_ref[ref].slot.worker_id for ref in pending)
        if cancelled():
            return False
        if time.monotonic() - started >= timeout_s:
            raise LaunchFailure(
                f"worker {waiting}: its Ray actor did not start within {timeout_s:g} s (its bundle's node "
                "was never ready: see `ray status` for pending resources)"
            )
        if progress is not None and time.monotonic() >= next_progress:
            next_progress += PROGRESS_EVERY_S
            progress(
                f"waiting for the actor of worker {waiting} to start "
                f"({time.monotonic() - started:.0f} s of {timeout_s:g} s; its bundle may wait for a node)"
            )
    return True


def lost(worker: PlacedWorker, when: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"worker {worker.slot.worker_id}: its Ray actor in {worker.where()} was lost {when} ({first[:200]})"
    )


def stop_grace_s(worker: PlacedWorker) -> float:
    """How long a worker gets between SIGTERM and SIGKILL: its whole drain, and a margin."""
    return worker.slot.group.drain_timeout_s + STOP_MARGIN_S


def stop_workers(placed: list[PlacedWorker]) -> list[str]:
    """SIGTERM every worker through its actor, in parallel; each drains its in-flight streams (up to its
    --drain-timeout) and exits, or is SIGKILLed after `stop_grace_s`. One log line; never raises."""
    import ray

    stops = {}
    for worker in placed:
        try:
            stops[worker.slot.worker_id] = (worker.actor.stop.remote(stop_grace_s(worker)), worker)
        except Exception:  # a dead actor: nothing to stop
            pass
    codes = []
    for worker_id, (ref, worker) in stops.items():
        try:
            codes.append(f"{worker_id} {ray.get(ref, timeout=stop_grace_s(worker) + 5)}")
        except Exception:  # teardown goes on whatever one step says
            codes.append(f"{worker_id} (actor gone)")
    return [f"workers stopped (exit codes): {', '.join(codes)}"] if codes else []


def output_tails(workers: list[PlacedWorker]) -> str:
    """The last lines each of these workers printed, fetched through its actor (its node may be
    another machine, whose files go with it)."""
    import ray

    refs = {}
    for worker in workers:
        try:
            refs[worker.slot.worker_id] = worker.actor.output.remote(OUTPUT_TAIL_CHARS)
        except Exception:  # a dead actor: nothing to fetch
            pass
    blocks = []
    for worker in workers:
        ref = refs.get(worker.slot.worker_id)
        try:
            text = ray.get(ref, timeout=10) if ref is not None else "(its actor is gone)"
        except Exception as exc:  # the report goes on without it
            text = f"(its output could not be fetched: {type(exc).__name__})"
        blocks.append(
            f"worker {worker.slot.worker_id} in {worker.where()}: its last output lines\n{text.rstrip()}"
        )
    return "\n\n".join(blocks)


def kill_actor(actor: Any) -> None:
    if actor is None:  # never started
        return
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass


def remove_group(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:  # already gone
        pass


def release(placed: list[PlacedWorker], group: Any) -> list[str]:
    """Kill the actors, remove the placement group. One log line per step; never raises."""
    from ray.util.placement_group import remove_placement_group

    lines = []
    for worker in placed:
        kill_actor(worker.actor)
        if worker.own_group is not None:
            remove_group(worker.own_group)
    if placed:
        lines.append(f"{len(placed)} Ray actors killed")
    num_own = sum(w.own_group is not None for w in placed)
    if num_own:
        lines.append(f"{num_own} placement groups of added workers removed")
    if group is not None:
        try:
            remove_placement_group(group)
            lines.append("placement group removed")
        except Exception as exc:  # teardown goes on whatever one step says
            lines.append(f"placement group not removed: {exc}")
    return lines
