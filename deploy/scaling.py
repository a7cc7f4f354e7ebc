"""Groups that grow and shrink while the cluster serves: the launcher's side of `kvpact-launch scale`.

NOTE: each supervision round, `Scaler.round` trades status for targets with the control actor
(deploy/control.py) and moves each group toward its target:
- too few: a worker is added (a thread each, beside supervision) in a bundle a removed starting worker left
  free in the launch's placement group, else in a one-bundle placement group of its own (waited for up to
  ray.placement_timeout_s; a pending bundle is what makes an autoscaler add a node). Its id is the group's
  next (NAME-<n>, never reused), and the router judges it as any joiner.
- too many: the newest workers leave. The router is asked to drain each (Registry.Drain: nothing new is
  routed to it; its heartbeat reply says `drain`; it runs its SIGTERM drain and exits 0). A worker the
  router does not know as serving (still loading), or a router that cannot be asked, gets SIGTERM through
  its actor instead: the same drain. One still running after its drain timeout and a margin is stopped.
- a leaver's exit is never restarted nor counted against max_restarts; its actor is killed and its
  placement group removed (or its bundle kept free for the next worker of the group).
- a joiner that exits 78 (the policy refused it) is released, never restarted, and its group's target is
  lowered to what it has, with the router's reason, so the `scale` that asked fails with it. So is the
  target of a group whose worker supervision stops restarting (max_restarts): no replacement crash loop.
- a group with `autoscale` gets its target from deploy/autoscale.py while it is settled; `scale` sets a
  new size, and autoscaling goes on from it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from kvpact.deploy import placement
from kvpact.deploy.autoscale import Autoscaler, measure
from kvpact.deploy.cluster_file import ClusterFile, WorkerGroup, WorkerSlot
from kvpact.deploy.control import CONTROL_NAME, CONTROL_NAMESPACE, GroupBounds, LauncherControl
from kvpact.deploy.placement import LaunchFailure, PlacedWorker
from kvpact.deploy.restarts import RestartBudget
from kvpact.shared.errors import EXIT_POLICY


class LaunchView(Protocol):
    """What scaling uses of the launch (deploy/launch.py's Launch)."""

    cluster: ClusterFile
    name: str  # the launch's placement group; an added worker's is NAME-<worker id>
    group: Any  # the launch's placement group
    placed: list[PlacedWorker]
    restarting: dict[str, threading.Thread]
    stopping: threading.Event
    auth_token: str | None
    router_address: str

    def say(self, message: str) -> None: ...
    def say_error(self, message: str) -> None: ...
    def report_status(self) -> dict[str, Any]: ...
    def start_worker(self, worker: PlacedWorker) -> None: ...


EXCHANGE_WAIT_S = 0.0  # never wait in the round: an answer not there yet is taken next round (0.5 s)
DRAIN_CALL_TIMEOUT_S = 5.0
LEAVE_MARGIN_S = 10.0  # beyond a leaver's drain timeout (and a heartbeat or two) before it is stopped


def group_of(worker_id: str) -> str:
    """NAME-<n> -> NAME (group names may hold '-', the index never does)."""
    return worker_id.rsplit("-", 1)[0]


def index_of(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 1)[1])


def choose_leavers(members: list[PlacedWorker], num: int) -> list[PlacedWorker]:
    """The `num` workers to remove: the newest first (the highest index)."""
    return sorted(members, key=lambda w: index_of(w.slot.worker_id), reverse=True)[:num]


class Scaler:
    def __init__(self, launch: LaunchView) -> None:
        self.launch = launch
        groups = launch.cluster.workers
        self.groups: dict[str, WorkerGroup] = {g.name: g for g in groups}
        self.targets = {g.name: g.replicas for g in groups}
        self.next_index = {g.name: g.replicas for g in groups}
        self.free_bundles: dict[str, list[int]] = {g.name: [] for g in groups}
        self.adding: dict[str, threading.Thread] = {}  # worker id -> the thread adding it
        self.leaving: dict[str, float] = {}  # worker id -> when it is stopped if it has not left
        self.forced: set[str] = set()  # leavers sent SIGTERM through their actor
        self.blocked: dict[str, str] = {}  # group -> what an add waits for now
        self.autoscalers = {
            g.name: Autoscaler(g.autoscale, g.min_replicas, g.max_replicas) for g in groups if g.autoscale
        }
        self.control: Any = None
        self._exchange: tuple[Any, int] | None = None  # the control call not answered yet, and its epoch
        self._epoch = 0  # bumped when the launcher lowers a target itself
        self._lock = threading.Lock()

    # -- the control actor ---------------------------------------------------------------------------

    def start(self) -> None:
        """Create the named control actor; a name already taken (another kvpact launch on this Ray
        cluster) leaves this launch unscalable, with a warning."""
        import ray

        bounds = {n: GroupBounds(g.min_replicas, g.replicas, g.max_replicas) for n, g in self.groups.items()}
        try:
            self.control = (
                ray.remote(LauncherControl)
                .options(name=CONTROL_NAME, namespace=CONTROL_NAMESPACE, num_cpus=0, max_restarts=0)
                .remote(bounds, self.launch.cluster.ray.placement_timeout_s)
            )  # not waited for: a stop meanwhile is answered at once; a failed start shows in _trade
        except Exception as exc:  # the name is held by another launch, or the actor did not start
            self.control = None
            self.launch.say_error(
                f"warning: `kvpact-launch scale` cannot reach this launch: its control actor "
                f"{CONTROL_NAME!r} (namespace {CONTROL_NAMESPACE!r}) was not created ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}); is another kvpact launch running on this Ray cluster?"
            )

    def _trade(self) -> None:
        """Publish the groups' status, take their targets (a slow answer is taken next round)."""
        import ray

        if self.control is None:
            return
        if self._exchange is None:
            with self._lock:
                self._exchange = (self.control.exchange.remote(self._status()), self._epoch)
        ready, _ = ray.wait([self._exchange[0]], timeout=EXCHANGE_WAIT_S)
        if not ready:
            return
        (ref, epoch), self._exchange = self._exchange, None
        try:
            targets = ray.get(ref, timeout=0)
        except Exception as exc:  # a lost control actor: the cluster serves on at its current size
            self.launch.say_error(f"warning: the control actor is gone ({type(exc).__name__}); scaling stops")
            self.control = None
            return
        if epoch != self._epoch:
            return
        for name, num in targets.items():
            if num != self.targets.get(name):
                self.launch.say(
                    f"scale: group {name} from {self.targets[name]} to {num} workers (kvpact-launch scale)"
                )
                self.targets[name] = num
                self.blocked.pop(name, None)
                if name in self.autoscalers:
                    self.autoscalers[name].reset()  # autoscaling goes on from the new size

    def _status(self) -> dict[str, dict[str, Any]]:
        workers = self.launch.report_status().get("workers", [])
        admitted = [w.get("workerId", "") for w in workers if w.get("state") == "WORKER_STATE_ADMITTED"]
        states = {w.get("workerId", ""): w.get("stateReason", "") or w.get("state", "") for w in workers}
        status = {}
        for name in self.groups:
            admitted_ids = [i for i in admitted if group_of(i) == name and i not in self.leaving]
            starting = [
                f"worker {i} is starting (the router: {states.get(i) or 'not registered yet'})"
                for i in (w.slot.worker_id for w in self._members(name))
                if i not in admitted_ids
            ]
            starting += [f"worker {i} is being placed" for i in self._adding(name)]
            status[name] = {
                "admitted_ids": admitted_ids,
                "leaving_ids": [i for i in list(self.leaving) if group_of(i) == name],
                "blocked": self.blocked.get(name) or "; ".join(starting),
            }
        return status

    def _give_up(self, name: str, reason: str) -> None:
        """The target cannot be reached: it becomes what the group has (members and adds in flight; the
        failed one already released), with the reason."""
        num = len(self._members(name)) + len(self._adding(name))
        self.launch.say_error(f"scale: group {name} stays at {num} workers: {reason}")
        with self._lock:
            self._epoch += 1  # an exchange sent before this brings the old target: not taken
            self.targets[name] = num
            self.blocked.pop(name, None)
            if self.control is not None:
                try:
                    self.control.set_target.remote(name, num, reason)
                except Exception:  # the control actor is gone: nobody waits for the answer
                    pass

    # -- the round -----------------------------------------------------------------------------------

    def _adding(self, name: str) -> list[str]:
        """The ids of `name`'s workers being added (a copy: add threads change the dict)."""
        return [i for i in list(self.adding) if group_of(i) == name]

    def _members(self, name: str) -> list[PlacedWorker]:
        placed = list(self.launch.placed)
        return [w for w in placed if w.slot.group.name == name and w.slot.worker_id not in self.leaving]

    def round(self) -> None:
        """Autoscale the settled groups, move every group toward its target, stop leavers that overstay."""
        self._trade()
        self._autoscale()
        for name in self.groups:
            members = self._members(name)
            num_adding = len(self._adding(name))
            have = len(members) + num_adding
            target = self.targets[name]
            if have < target:
                for _ in range(target - have):
                    self._add(self.groups[name])
            elif have > target and not num_adding:
                candidates = [w for w in members if w.slot.worker_id not in self.launch.restarting]
                for worker in choose_leavers(candidates, have - target):
                    self._drain(worker)
        now = time.monotonic()
        for worker_id, deadline in list(self.leaving.items()):
            if now > deadline and worker_id not in self.forced:
                overstaying = self._placed(worker_id)
                if overstaying is not None:
                    self.launch.say(f"scale: worker {worker_id} has not left after its drain; stopping it")
                    self._stop(overstaying)

    def _autoscale(self) -> None:
        """Each autoscaled group that is settled (its size is its target, every member admitted, nobody
        joining or leaving) is measured; a decision becomes its new target (deploy/autoscale.py)."""
        workers = self.launch.report_status().get("workers", [])
        admitted = {w.get("workerId", ""): w for w in workers if w.get("state") == "WORKER_STATE_ADMITTED"}
        for name, autoscaler in self.autoscalers.items():
            member_ids = {w.slot.worker_id for w in self._members(name)}
            busy = any(group_of(i) == name for i in [*list(self.adding), *list(self.leaving)])
            if busy or len(member_ids) != self.targets[name] or not member_ids <= admitted.keys():
                autoscaler.reset()
                continue
            metric = autoscaler.policy.metric
            load = measure(metric, [admitted[i].get("load", {}) for i in sorted(member_ids)])
            decision = autoscaler.observe(load, len(member_ids), time.monotonic())
            if decision is None:
                continue
            old, new = self.targets[name], decision.num
            self.launch.say(f"autoscale: group {name} from {old} to {new} workers: {decision.reason}")
            with self._lock:
                self._epoch += 1  # an exchange sent before this brings the old target: not taken
                self.targets[name] = decision.num
                if self.control is not None:
                    try:
                        self.control.autoscaled.remote(name, decision.num, decision.reason)
                    except Exception:  # the control actor is gone: the launcher's target stands
                        pass

    def _placed(self, worker_id: str) -> PlacedWorker | None:
        return next((w for w in self.launch.placed if w.slot.worker_id == worker_id), None)

    # -- leaving -------------------------------------------------------------------------------------

    def _drain(self, worker: PlacedWorker) -> None:
        worker_id = worker.slot.worker_id
        self.leaving[worker_id] = time.monotonic() + placement.stop_grace_s(worker) + LEAVE_MARGIN_S
        state, in_flight = self._ask_router_to_drain(worker_id)
        if state == "draining":
            then = "they finish first, then it exits 0" if in_flight else "it exits 0"
            self.launch.say(
                f"scale: worker {worker_id} in {worker.where()} leaves: the router drains it ({in_flight} "
                f"streams in flight: {then})"
            )
            return
        self.launch.say(
            f"scale: worker {worker_id} in {worker.where()} leaves: {state}; SIGTERM through its actor "
            "(the same drain)"
        )
        self._stop(worker)

    def _ask_router_to_drain(self, worker_id: str) -> tuple[str, int]:
        """Registry.Drain: ("draining", the streams in flight on it then), or what happened instead."""
        import grpc

        from kvpact.v1 import worker_pb2, worker_pb2_grpc

        request = worker_pb2.DrainRequest(
            worker_id=worker_id, auth_token=self.launch.auth_token or "", reason="kvpact-launch scale-down"
        )
        try:
            with grpc.insecure_channel(self.launch.router_address) as channel:
                reply = worker_pb2_grpc.RegistryStub(channel).Drain(request, timeout=DRAIN_CALL_TIMEOUT_S)
        except grpc.RpcError as exc:  # e.g. a TLS router
            return f"the router could not be asked to drain it ({exc.code().name})", 0
        if not reply.known:
            return "the router does not know it (not registered yet)", 0
        if reply.state != "draining":
            return f"the router knows it as {reply.state}, not serving", 0
        return "draining", reply.num_outstanding

    def _stop(self, worker: PlacedWorker) -> None:
        """SIGTERM through the actor (its drain), SIGKILL after its grace; the exit is seen by supervision."""
        self.forced.add(worker.slot.worker_id)
        try:
            worker.actor.stop.remote(placement.stop_grace_s(worker))
        except Exception:  # a dead actor: supervision sees it gone
            pass

    def on_exit(self, worker: PlacedWorker, exit_code: int | None, what: str) -> bool:
        """A worker exited or its actor died while serving; True when scaling handles it (no restart)."""
        worker_id = worker.slot.worker_id
        if worker_id in self.leaving:
            self._release(worker)
            self.launch.say(f"scale: worker {worker_id} left ({what}); {self._released_what(worker)}")
            return True
        if worker.added and exit_code == EXIT_POLICY:  # refused by the policy: a restart would be too
            reason = self._router_reason(worker_id) or f"it exited with code {exit_code}"
            self._release(worker)
            released = self._released_what(worker)
            self.launch.say_error(f"scale: worker {worker_id} was refused ({reason}); {released}")
            self._give_up(worker.slot.group.name, f"worker {worker_id} was refused: {reason}")
            return True
        return False

    def retired(self, worker: PlacedWorker, reason: str) -> None:
        """A worker supervision gave up on (its restart budget spent): its group's target drops to what it
        has, so no replacement is started in a loop; `scale` can ask for more again."""
        self._give_up(worker.slot.group.name, reason)

    def _router_reason(self, worker_id: str) -> str:
        for w in self.launch.report_status().get("workers", []):
            if w.get("workerId") == worker_id:
                return str(w.get("stateReason", ""))
        return ""

    def _released_what(self, worker: PlacedWorker) -> str:
        if worker.own_group is not None:
            return "its actor killed, its placement group removed"
        return f"its actor killed, its bundle {worker.slot.bundle_index} kept for the group's next worker"

    def _release(self, worker: PlacedWorker) -> None:
        worker_id = worker.slot.worker_id
        if worker in self.launch.placed:
            self.launch.placed.remove(worker)
        self.leaving.pop(worker_id, None)
        self.forced.discard(worker_id)
        placement.kill_actor(worker.actor)
        if worker.own_group is not None:
            placement.remove_group(worker.own_group)
        else:
            self.free_bundles[worker.slot.group.name].append(worker.slot.bundle_index)

    # -- adding --------------------------------------------------------------------------------------

    def _add(self, group: WorkerGroup) -> None:
        worker_id = f"{group.name}-{self.next_index[group.name]}"
        self.next_index[group.name] += 1
        thread = threading.Thread(target=self._add_worker, args=(group, worker_id), name=f"add-{worker_id}")
        self.adding[worker_id] = thread
        thread.start()

    def _add_worker(self, group: WorkerGroup, worker_id: str) -> None:
        """Place, start and hand over to supervision one new worker; on failure, give up the target."""
        worker: PlacedWorker | None = None
        own_group = None
        failure = ""
        try:
            if self.free_bundles[group.name]:
                slot = WorkerSlot(worker_id, group, self.free_bundles[group.name].pop(0))
                where = f"bundle {slot.bundle_index} of the launch's placement group"
            else:
                own_group, failure = self._own_group(group, worker_id)
                if own_group is None:
                    return
                slot = WorkerSlot(worker_id, group, 0)
                where = "a placement group of its own"
            actor = placement.start_actor(slot, own_group or self.launch.group)
            worker = PlacedWorker(slot, actor, own_group=own_group, added=True)
            worker.budget = RestartBudget(group.max_restarts)
            timeout_s = self.launch.cluster.ray.placement_timeout_s
            if not placement.locate([worker], timeout_s, self.launch.stopping.is_set, self.launch.say):
                return
            self.launch.say(f"scale: adding worker {worker_id} in {where}, {worker.where()}")
            self.launch.placed.append(worker)
            self.launch.start_worker(worker)
            worker = None  # supervision owns it now
        except LaunchFailure as exc:
            failure = f"worker {worker_id} could not be added: {exc}"
        except Exception as exc:  # a Ray error: the same, never a dead thread
            failure = f"worker {worker_id} could not be added: {type(exc).__name__}: {exc}"
        finally:
            if worker is not None:
                self._release(worker)
            elif own_group is not None and self._placed(worker_id) is None:
                placement.remove_group(own_group)
            self.adding.pop(worker_id, None)
            if failure and not self.launch.stopping.is_set():
                self._give_up(group.name, failure)

    def _own_group(self, group: WorkerGroup, worker_id: str) -> tuple[Any, str]:
        """A one-bundle placement group for `worker_id` once granted, or (None, why not: "" if stopped);
        what it waits for is the group's `blocked` meanwhile."""

        def waiting(line: str) -> None:
            self.blocked[group.name] = f"worker {worker_id}: {line}"

        try:
            pg, why = placement.reserve_one(
                dict(group.resources),
                f"{self.launch.name}-{worker_id}",
                self.launch.cluster.ray.placement_timeout_s,
                self.launch.stopping.is_set,
                waiting,
            )
        finally:
            self.blocked.pop(group.name, None)
        return pg, f"worker {worker_id}: {why}" if why else ""

    # -- the stop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Teardown: adds in flight give up (the launch's stopping is set); the control actor goes."""
        for thread in list(self.adding.values()):
            thread.join(timeout=placement.STOP_MARGIN_S)
        if self.control is not None:
            placement.kill_actor(self.control)
            self.control = None
