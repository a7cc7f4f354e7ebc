"""`kvpact-launch --config FILE` (or `python -m kvpact.deploy.launch`): a kvpact cluster on Ray.

    validate the cluster file (deploy/cluster_file.py; exit 2, one line, Ray never touched)
    -> connect to Ray -> one placement group, a bundle per worker (bounded by ray.placement_timeout_s)
    -> the router as this process's child, on this (the driver's) node: its exit code is the verdict; it
       keeps a JSON report (router --report-file) that this launcher reads for its address and state
    -> one WorkerActor per bundle, each running the `worker` CLI with exactly the GPUs Ray assigned (none:
       CUDA_VISIBLE_DEVICES=""), on a port it binds on its node's IP (from workers[].port_range if set),
       with labels naming its Ray node and bundle (shown in ClusterStatus)
    -> supervise until the router's report says SERVING: print the cluster table and the address, serve
       until SIGINT/SIGTERM. Every worker is asked at once each round; one whose process exits, or whose
       actor Ray reports dead, is restarted beside supervision (deploy/restarts.py: backoff, at most
       workers[].max_restarts per window), else the router marks it DEAD. A slow answer is never a death.
       Each round also moves every group toward its target size (`kvpact-launch scale`, through the named
       actor kvpact-launcher: deploy/scaling.py, deploy/control.py, deploy/scale.py)
    -> the stop, in order (always): the router refuses new work (SIGTERM) and exits once its streams are
       done; then the workers drain what is left (SIGTERM, each up to its --drain-timeout, SIGKILL only
       after that and a margin); then actors killed and the placement group removed

Exit codes, printed LAST as a short verdict (a failed Ray job keeps only the tail of its output):
    0   stopped by SIGINT/SIGTERM (e.g. `ray job stop`)
    1   infrastructure: no Ray cluster, a placement group never granted (naming the resources), an actor
        or node lost while starting, the router's own startup timeout or another router failure
    2   the cluster file is not valid (the key and what is allowed)
    78  a feature policy (--paged-attn, --policy) cannot be honored, or the workers of one model name are not
        interchangeable (router --uniform): the router's report, then which worker and why

`--plan`: the same placement, then each worker's pre-load plan judged as the router would, a verdict table,
exit 0 / 78 (1 as above); nothing loads (deploy/plan.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpact.deploy import placement
from kvpact.deploy.cluster_file import ClusterFile, ClusterFileError, load_cluster_file, worker_argv
from kvpact.deploy.placement import LaunchFailure, PlacedWorker
from kvpact.deploy.ports import node_shares, port_candidates
from kvpact.deploy.processes import ProcessHandle, start_process, stop
from kvpact.deploy.restarts import RestartBudget
from kvpact.deploy.scaling import Scaler
from kvpact.deploy.stop import stop_wait_warning
from kvpact.deploy.supervision import Health, Observation, Poller
from kvpact.deploy.whole_lines import keep_lines_whole
from kvpact.shared.address import join_host_port
from kvpact.shared.auth import read_token
from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY, ConfigError

EXIT_OK, EXIT_USAGE = 0, 2
PROG = "kvpact-launch"
ROUTER_BIND_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5
ROUTER_OWN_EXIT_S = 10.0  # after a worker exits while starting, how long the router has to decide
STARTUP_MARGIN_S = 30.0  # beyond router.startup_timeout_s, before the launcher gives up on the router
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start a kvpact router and its workers on a Ray cluster, from a cluster file.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="the cluster file (YAML)")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="place every worker, run its `worker --plan-only` on its bundle's node, judge the plans against "
        "the router's policies and --uniform, print the verdict table and exit 0 or 78 (1: not placed, or "
        "a worker cannot plan); no router starts, no weight is loaded (deploy/plan.py)",
    )
    scale = "scale --group NAME --replicas N [--address A] [--timeout S]"
    parser.usage = f"{PROG} --config FILE [--plan]\n       {PROG} {scale}"

    return parser


def say(message: str, *, error: bool = False) -> None:
    print(f"{PROG}: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["scale"]:
        from kvpact.deploy.scale import main as scale_main

        return scale_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        cluster = load_cluster_file(args.config)
        auth_token = read_token(cluster.router.auth_token_file)
    except ClusterFileError as exc:
        say(str(exc), error=True)
        return EXIT_USAGE
    except ConfigError as exc:
        say(f"{args.config}: router.auth_token_file: {exc}", error=True)
        return EXIT_USAGE
    if args.plan:
        from kvpact.deploy.plan import run_plan

        return run_plan(cluster)
    keep_lines_whole()  # Ray's forwarded actor output and the launcher's own lines, each line whole
    return Launch(cluster, auth_token).run()


def _reachable(bound: str) -> str:
    """HOST:PORT a router bound, with a wildcard host replaced by what other nodes can reach."""
    host, _, port = bound.rpartition(":")
    host = host.strip("[]")
    if host in _WILDCARD_HOSTS:
        host = placement.node_ip()  # what other nodes can reach, never a hostname
    return join_host_port(host, int(port))


def _what(obs: Observation) -> str:
    if obs.health is Health.DEAD:
        return f"its Ray actor is dead ({obs.detail})"
    return f"exited with code {obs.exit_code}"


def read_report(path: Path) -> dict[str, Any]:
    """The router's --report-file (router/report_file.py), or {} before it first writes it."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet (it is replaced whole, never seen half-written)
        return {}
    return document if isinstance(document, dict) else {}


class Launch:
    """One launch: what it started (to release it all), and the verdict."""

    def __init__(self, cluster: ClusterFile, auth_token: str | None = None) -> None:
        self.cluster = cluster
        self.name = f"kvpact-{uuid.uuid4().hex[:8]}"
        self.log_dir = tempfile.mkdtemp(prefix=f"{self.name}-")
        self.report_path = Path(self.log_dir) / "router-report.json"
        self.stopping = threading.Event()  # SIGINT/SIGTERM
        self.group: object | None = None
        self.router: ProcessHandle | None = None
        self.router_address = ""
        self.http_address = ""  # the OpenAI-compatible API, when the router's flags turn it on
        self.report = ""  # printed after teardown, before the verdict: the router's, failed workers' lines
        self.placed: list[PlacedWorker] = []
        self.retired: list[PlacedWorker] = []  # dead after serving, not restarted (released at teardown)
        self.restarting: dict[str, threading.Thread] = {}  # worker id -> its restart, beside supervision
        self.poller = Poller()
        self.slow_since: dict[str, float] = {}
        self.exited: dict[str, int] = {}  # worker id -> exit code, for workers that exited while starting
        self.auth_token = auth_token
        self.scaler = Scaler(self)  # groups that grow and shrink while serving (deploy/scaling.py)

    def say(self, message: str) -> None:
        say(message)

    def say_error(self, message: str) -> None:
        say(message, error=True)

    def report_status(self) -> dict[str, Any]:
        """The ClusterStatus in the router's latest report (JSON mapping), {} before it has one."""
        status = read_report(self.report_path).get("cluster_status", {})
        return status if isinstance(status, dict) else {}

    def run(self) -> int:
        try:
            code, verdict = self._run()
        except LaunchFailure as exc:
            code, verdict = EXIT_FATAL, f"FAILED (exit code 1): {exc}"
            self.report = self._worker_tails(list(self.exited))
        finally:
            self._teardown()
        # Last: a failed Ray job keeps only the tail of the driver's output.
        if self.report:
            print(self.report + "\n", file=sys.stderr, flush=True)
        say(verdict, error=code != EXIT_OK)
        return code

    def _run(self) -> tuple[int, str]:
        cluster = self.cluster
        placement.connect(cluster.ray.address)
        # After ray.init, which installs its own SIGTERM handler (sys.exit) for drivers: ours tears down.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())
        warning = stop_wait_warning(cluster, dict(os.environ))
        if warning:
            say(f"warning: {warning}", error=True)
        say(
            f"placing {cluster.num_workers} workers: {placement.describe_bundles(cluster)}, strategy "
            f"{cluster.ray.placement_strategy} (placement group {self.name}; logs in {self.log_dir})"
        )
        self.group = placement.reserve(cluster, self.name, self.stopping.is_set)
        if self.group is None:
            return EXIT_OK, "stopped while placing"
        self._start_router()
        for slot in cluster.slots():
            worker = PlacedWorker(slot, placement.start_actor(slot, self.group))
            worker.budget = RestartBudget(slot.group.max_restarts)
            self.placed.append(worker)
        if not placement.locate(self.placed, cancelled=self.stopping.is_set, progress=say):
            return EXIT_OK, "stopped while starting"
        for worker in self.placed:
            self.start_worker(worker)
        code = self._until_serving()
        if code is not None:
            return code, self._failure_verdict(code)
        self.scaler.start()  # before "SERVING": whoever reads it can run `kvpact-launch scale` at once
        table = self._cluster_table()  # first: whoever reads "SERVING" finds the table with it
        http = f"\nOpenAI API: http://{self.http_address}/v1" if self.http_address else ""
        say(f"the cluster is SERVING on {self.router_address}{http}\n{table}")
        return self._serve()

    # -- the router ------------------------------------------------------------------------------------

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "kvpact.router", *self.cluster.router_argv()]
        argv += ["--report-file", str(self.report_path)]
        self.router = start_process(argv, name="router", log_dir=self.log_dir, die_with_parent=True)
        deadline = time.monotonic() + ROUTER_BIND_TIMEOUT_S
        while not (report := read_report(self.report_path)).get("address"):
            if self.router.returncode is not None or time.monotonic() > deadline:
                what = "exited" if self.router.returncode is not None else "did not bind in time"
                output = " ".join(self.router.output(1000).split())[:400]
                raise LaunchFailure(f"the router {what}: {output}")
            time.sleep(0.05)
        self.router_address = _reachable(report["address"])
        # the report names both ports at once: the router writes it once gRPC and HTTP are bound
        self.http_address = _reachable(report["http_address"]) if report.get("http_address") else ""
        http = f", OpenAI API on http://{self.http_address}/v1" if self.http_address else ""
        say(
            f"router started on {self.router_address} (pid {self.router.pid}, --paged-attn "
            f"{self.cluster.router.paged_attn.value}, --expect-workers {self.cluster.num_workers}{http})"
        )

    def _router_code(self) -> int | None:
        return None if self.router is None else self.router.returncode

    # -- workers ---------------------------------------------------------------------------------------

    def start_worker(self, worker: PlacedWorker) -> None:
        import ray

        try:
            port = self._port_for(worker)
            worker.argv = worker_argv(
                worker.slot, router=self.router_address, host=worker.node_ip, labels=worker.labels, port=port
            )
            worker.pid = ray.get(
                worker.actor.start.remote(worker.argv, self.auth_token),
                timeout=placement.ACTOR_READY_TIMEOUT_S,
            )
        except ray.exceptions.GetTimeoutError:  # slow, not known dead: still a bounded wait
            raise LaunchFailure(
                f"worker {worker.slot.worker_id}: its Ray actor in {worker.where()} did not answer `start` "
                f"within {placement.ACTOR_READY_TIMEOUT_S:g} s (alive but stalled; see `ray status`)"
            ) from None
        except ray.exceptions.RayError as exc:
            raise LaunchFailure(placement.lost(worker, "while starting", exc)) from None
        where = f"{worker.where()} (logs in {worker.log_dir})"
        size = worker.slot.group.tensor_parallel_size
        ranks = f"; it starts its {size - 1} other tensor-parallel ranks in this bundle" if size > 1 else ""
        say(f"worker {worker.slot.worker_id} (pid {worker.pid}) started in {where}{ranks}")

    def _port_for(self, worker: PlacedWorker) -> int:
        """0 (any free port), or a free port of its group's port_range on its node (deploy/ports.py)."""
        import ray

        port_range = worker.slot.group.port_range
        if port_range is None:
            return 0
        mates = [w for w in self.placed if w.slot.group is worker.slot.group]
        index, num = node_shares([w.node_id for w in mates])[mates.index(worker)]
        candidates = port_candidates(port_range, index, num)
        if worker.added:  # shares shift as workers come and go: then any free port of the range
            low, high = port_range
            candidates += [p for p in range(low, high + 1) if p not in candidates]
        port = int(ray.get(worker.actor.free_port.remote(candidates), timeout=30))
        if not port:
            raise LaunchFailure(
                f"worker {worker.slot.worker_id} in {worker.where()}: no free port in its share of "
                f"workers[].port_range {list(port_range)} (worker {index + 1} of {num} of its group on that "
                "node); widen the range or free those ports"
            )
        return port

    def _observe(self) -> dict[str, Observation]:
        """How each worker not being restarted is (deploy/supervision.py); says when one is slow."""
        actors = {w.slot.worker_id: w.actor for w in self.placed if w.slot.worker_id not in self.restarting}
        seen = self.poller.observe(actors)
        for worker_id, obs in seen.items():
            if obs.health is Health.SLOW:
                if worker_id not in self.slow_since:
                    self.slow_since[worker_id] = time.monotonic()
                    detail = obs.detail
                    say(f"worker {worker_id}: its actor is slow to answer ({detail}); not a death, asking on")
            elif self.slow_since.pop(worker_id, None) is not None:
                say(f"worker {worker_id}: its actor answers again")
        return seen

    # -- supervision -----------------------------------------------------------------------------------

    def _until_serving(self) -> int | None:
        """None once the router's report says SERVING; else the exit code of a failed start (a router
        that failed exits by itself once it has told its workers, router --failed-linger)."""
        deadline = time.monotonic() + self.cluster.router.startup_timeout_s + STARTUP_MARGIN_S
        exited_at: dict[str, float] = {}
        while True:
            report = read_report(self.report_path)
            if report.get("state") == "serving":
                return None
            code = self._router_code()
            if code is not None:
                return code if code in (EXIT_POLICY, EXIT_FATAL) else EXIT_FATAL
            if self.stopping.is_set():
                return EXIT_OK
            states = self._observe()
            for worker in self.placed:
                obs = states[worker.slot.worker_id]
                if obs.health is Health.DEAD:
                    raise LaunchFailure(
                        f"worker {worker.slot.worker_id}: its Ray actor in {worker.where()} was lost while "
                        f"starting ({obs.detail})"
                    )
                if obs.health is Health.EXITED:
                    self.exited[worker.slot.worker_id] = int(obs.exit_code or 0)
                    first = exited_at.setdefault(worker.slot.worker_id, time.monotonic())
                    if time.monotonic() - first > ROUTER_OWN_EXIT_S and self._router_code() is None:
                        raise LaunchFailure(
                            f"worker {worker.slot.worker_id} in {worker.where()} exited with code "
                            f"{obs.exit_code} while starting and the router did not decide (its last lines "
                            "are above)"
                        )
            if time.monotonic() > deadline:
                timeout_s = self.cluster.router.startup_timeout_s
                raise LaunchFailure(
                    f"startup timeout: the router at {self.router_address} was not SERVING after "
                    f"router.startup_timeout_s {timeout_s:g} s (+{STARTUP_MARGIN_S:g})"
                )
            self.stopping.wait(POLL_INTERVAL_S)

    def _serve(self) -> tuple[int, str]:
        """Serve until a signal or the router's exit; restart workers that die, beside this loop; move
        each group toward its target size (kvpact-launch scale, deploy/scaling.py)."""
        while not self.stopping.wait(POLL_INTERVAL_S):
            code = self._router_code()
            if code == EXIT_OK:  # stopped by a signal of its own (the stop below finishes the job)
                return EXIT_OK, "stopped (the router was stopped by a signal)"
            if code is not None:
                return EXIT_FATAL, f"FAILED (exit code 1): the router exited with code {code} while serving"
            for worker_id, obs in self._observe().items():
                if obs.health in (Health.EXITED, Health.DEAD) and not self.stopping.is_set():
                    worker = next((w for w in self.placed if w.slot.worker_id == worker_id), None)
                    if worker is None:  # released meanwhile (a failed add)
                        continue
                    if not self.scaler.on_exit(worker, obs.exit_code, _what(obs)):
                        self._worker_down(worker, obs)
            if not self.stopping.is_set():
                try:
                    self.scaler.round()
                except Exception as exc:  # scaling never stops supervision; the next round tries again
                    say(f"warning: scaling round failed: {type(exc).__name__}: {exc}", error=True)
        return EXIT_OK, "stopped"

    def _worker_down(self, worker: PlacedWorker, obs: Observation) -> None:
        """A worker that exited (or whose actor Ray reports dead) after the cluster served: restart it in
        a thread of its own (supervision goes on), after its backoff, within its budget."""
        worker_id = worker.slot.worker_id
        what = _what(obs)
        # Its actor lives: what the worker printed last, from any node. Fetched (up to 10 s) in the
        # worker's own thread, so supervision of the others never waits on it.
        show_output = obs.health is Health.EXITED
        now = time.monotonic()
        budget = worker.budget
        if not budget.can_restart(now):
            say(
                f"worker {worker_id} in {worker.where()} {what}; not restarted ({budget.recent(now)} "
                f"restarts in the last {budget.window_s:g} s, workers[].max_restarts {budget.max_restarts}); "
                "the router marks it DEAD, the others keep serving"
            )
            self.placed.remove(worker)
            self.retired.append(worker)
            self.scaler.retired(worker, f"worker {worker_id} {what} and is not restarted (max_restarts)")
            if show_output:
                threading.Thread(
                    target=self._say_output, args=(worker, what), name=f"output-{worker_id}", daemon=True
                ).start()
            return
        delay = budget.delay(now)
        number = budget.record(now)
        say(
            f"worker {worker_id} in {worker.where()} {what}; restarting it in its bundle in {delay:g} s "
            f"(restart {number} of {budget.max_restarts} within {budget.window_s:g} s)"
        )
        thread = threading.Thread(
            target=self._restart,
            args=(worker, obs.health is Health.DEAD, delay, what if show_output else ""),
            name=f"restart-{worker_id}",
        )
        self.restarting[worker_id] = thread
        thread.start()

    def _say_output(self, worker: PlacedWorker, what: str) -> None:
        say(f"worker {worker.slot.worker_id} {what}; {placement.output_tails([worker])}")

    def _restart(self, worker: PlacedWorker, actor_dead: bool, delay: float, output_of: str) -> None:
        """What the worker printed last (when `output_of` names how it ended), the backoff, then: a dead
        actor is killed (for sure) and replaced in the same bundle, waiting up to ray.placement_timeout_s
        for its node; the worker is started again. A signal ends it early."""
        try:
            started = time.monotonic()
            if output_of:  # before the restart, whose output would replace it
                self._say_output(worker, output_of)
            if self.stopping.wait(max(0.0, delay - (time.monotonic() - started))):
                return
            if actor_dead:
                placement.kill_actor(worker.actor)  # never two actors for one worker
                worker.actor = placement.start_actor(worker.slot, worker.own_group or self.group)
                timeout_s = self.cluster.ray.placement_timeout_s
                if not placement.locate([worker], timeout_s, self.stopping.is_set, say):
                    return
            if not self.stopping.is_set():
                self.start_worker(worker)
        except LaunchFailure as exc:
            say(f"restart of worker {worker.slot.worker_id} failed: {exc}", error=True)
        except Exception as exc:  # a Ray error in the restart: supervision sees the worker again next round
            say(f"restart of worker {worker.slot.worker_id} failed: {type(exc).__name__}: {exc}", error=True)
        finally:
            self.restarting.pop(worker.slot.worker_id, None)

    def _failure_verdict(self, code: int) -> str:
        """The short verdict of a failed start (cause and exit code); keeps the router's report and the
        failed workers' own last lines to print before it."""
        if code == EXIT_OK:
            return "stopped while starting"
        report = read_report(self.report_path)
        failed = [
            w.get("workerId", "")
            for w in report.get("cluster_status", {}).get("workers", [])
            if w.get("state") in ("WORKER_STATE_FAILED", "WORKER_STATE_REFUSED")
        ]
        tails = self._worker_tails([*failed, *(i for i in self.exited if i not in failed)])
        self.report = "\n\n".join(part for part in (report.get("report", ""), tails) if part)
        cause = report.get("cause") or f"the router exited with code {self._router_code()}"
        return f"FAILED (exit code {code}): {cause}"

    def _worker_tails(self, worker_ids: list[str]) -> str:
        return placement.output_tails([w for w in self.placed if w.slot.worker_id in worker_ids])

    def _cluster_table(self) -> str:
        """The table of the router's ClusterStatus, from its report (no second connection to it)."""
        from google.protobuf import json_format

        from kvpact.client import render_cluster_status
        from kvpact.v1 import router_pb2

        status = read_report(self.report_path).get("cluster_status", {})
        return render_cluster_status(json_format.ParseDict(status, router_pb2.ClusterStatusResponse()))

    # -- the stop --------------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """The ordered stop: the router refuses new work and exits once its streams are done; then the
        workers drain what is left and exit; actors killed, placement group removed. Workers stop only
        after the router: a worker that drained first would refuse a call the router had already taken,
        with no other worker left to retry it on. Each step logged, nothing raised."""
        import ray

        if not ray.is_initialized():
            return
        self.stopping.set()  # restarts and adds in flight give up
        for thread in list(self.restarting.values()):
            thread.join(timeout=placement.STOP_MARGIN_S)
        if self.router is not None and self.router.returncode is None:
            self.router.popen.send_signal(signal.SIGTERM)  # again after Ray's is harmless: it drains once
            say("teardown: router told to stop (SIGTERM: new calls refused, in-flight streams go on)")
        self.scaler.stop()  # adds in flight give up; the control actor goes
        if self.router is not None:  # first: a call it took just before the stop still reaches a worker
            code = stop(self.router, grace_s=self.cluster.router.drain_timeout_s + placement.STOP_MARGIN_S)
            say(f"teardown: router stopped (exit code {code})")
        everyone = self.placed + self.retired
        for line in placement.stop_workers(everyone):
            say(f"teardown: {line}")
        for line in placement.release(everyone, self.group):
            say(f"teardown: {line}")
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
