"""`kvpact-launch --config FILE` (or `python -m kvpact.deploy.launch`): a kvpact cluster on Ray.

    validate the cluster file (deploy/cluster_file.py; exit 2, one line, Ray never touched)
    -> connect to Ray -> one placement group, a bundle per worker (bounded by ray.placement_timeout_s)
    -> the router as this process's child, on this (the driver's) node: its exit code is the verdict
    -> one WorkerActor per bundle, each running the `worker` CLI with the GPUs Ray assigned, a port it
       binds itself on its node's IP, and labels naming its Ray node and bundle (shown in ClusterStatus)
    -> supervise until the router's health says SERVING: print the cluster table and the address, serve
       until SIGINT/SIGTERM; a worker that dies later is restarted in its bundle up to
       workers[].max_restarts times (it handshakes and is admitted again), else the router marks it DEAD
    -> teardown (always): workers stopped, actors killed, placement group removed, router stopped

Exit codes, printed LAST as a short verdict (a failed Ray job keeps only the tail of its output):
    0   stopped by SIGINT/SIGTERM (e.g. `ray job stop`)
    1   infrastructure: no Ray cluster, a placement group never granted (naming the resources), an actor
        or node lost while starting, the router's own startup timeout or another router failure
    2   the cluster file is not valid (the key and what is allowed)
    78  the --paged-attn policy cannot be honored: the router's report, then which worker and why
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence

from kvpact.deploy import placement
from kvpact.deploy.cluster_file import ClusterFile, ClusterFileError, load_cluster_file, worker_argv
from kvpact.deploy.placement import LaunchFailure, PlacedWorker
from kvpact.deploy.processes import ProcessHandle, health_status, start_process, stop, wait_for_line
from kvpact.shared.auth import read_secrets, read_token
from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY, ConfigError
from kvpact.transport import TransportParams, channel_credentials

EXIT_OK, EXIT_USAGE = 0, 2
PROG = "kvpact-launch"
ROUTER_LISTENING = r"^router listening on (\S+)$"
ROUTER_HTTP_LISTENING = r"^router http listening on (\S+)$"  # with router flags {http-listen: HOST:PORT}
ROUTER_BIND_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5
ROUTER_OWN_EXIT_S = 10.0  # after a worker exits while starting, how long the router has to decide
STARTUP_MARGIN_S = 30.0  # beyond router.startup_timeout_s, before the launcher gives up on the router
ROUTER_STOP_GRACE_S = 10.0
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start a kvpact router and its workers on a Ray cluster, from a cluster file.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="the cluster file (YAML)")
    return parser


def say(message: str, *, error: bool = False) -> None:
    print(f"{PROG}: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
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
    try:
        client_params = router_client_params(cluster)
    except ConfigError as exc:
        say(f"{args.config}: {exc}", error=True)
        return EXIT_USAGE
    return Launch(cluster, auth_token, client_params).run()


def router_client_params(cluster: ClusterFile) -> tuple[TransportParams, str | None]:
    """How the launcher itself reaches the router it starts, from the router's own flags: TLS when the
    router serves it (verified against its --tls-ca, else the system's roots, for its --tls-server-name),
    and the first key of its --api-key-file. Read once, at start."""
    from kvpact.router.cli import build_parser

    args = build_parser().parse_args(cluster.router_argv())
    transport: TransportParams = {}
    if args.tls_cert:
        transport = {"ca_file": args.tls_ca} if args.tls_ca else {"tls": True}
        transport["server_name"] = args.tls_server_name
    api_key = read_secrets(args.api_key_file, "router.flags.api-key-file")[0] if args.api_key_file else None
    return transport, api_key


class Launch:
    """One launch: what it started (to release it all), and the verdict."""

    def __init__(
        self,
        cluster: ClusterFile,
        auth_token: str | None = None,
        client_params: tuple[TransportParams, str | None] = ({}, None),
    ) -> None:
        self.cluster = cluster
        self.name = f"kvpact-{uuid.uuid4().hex[:8]}"
        self.log_dir = tempfile.mkdtemp(prefix=f"{self.name}-")
        self.stopping = threading.Event()  # SIGINT/SIGTERM
        self.group: object | None = None
        self.router: ProcessHandle | None = None
        self.router_address = ""
        self.http_address = ""  # the OpenAI-compatible API, when the router's flags turn it on
        self.report = ""  # the router's failure report, printed after teardown
        self.placed: list[PlacedWorker] = []
        self.retired: list[PlacedWorker] = []  # dead after serving, not restarted (released at teardown)
        self.auth_token = auth_token
        self.transport, self.api_key = client_params  # how the launcher itself reaches the router

    def run(self) -> int:
        try:
            code, verdict = self._run()
        except LaunchFailure as exc:
            code, verdict = EXIT_FATAL, f"FAILED (exit code 1): {exc}"
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
        say(
            f"placing {cluster.num_workers} workers: {placement.describe_bundles(cluster)}, strategy "
            f"{cluster.ray.placement_strategy} (placement group {self.name}; logs in {self.log_dir})"
        )
        self.group = placement.reserve(cluster, self.name, self.stopping.is_set)
        if self.group is None:
            return EXIT_OK, "stopped while placing"
        self._start_router()
        for slot in cluster.slots():
            self.placed.append(PlacedWorker(slot, placement.start_actor(slot, self.group)))
        placement.locate(self.placed)
        for worker in self.placed:
            self._start_worker(worker)
        code = self._until_serving()
        if code is not None:
            return code, self._failure_verdict(code)
        table = self._cluster_table()  # fetched first: whoever reads "SERVING" finds the table with it
        http = f"\nOpenAI API: http://{self.http_address}/v1" if self.http_address else ""
        say(f"the cluster is SERVING on {self.router_address}{http}\n{table}")
        return self._serve()

    # -- the router ------------------------------------------------------------------------------------

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "kvpact.router", *self.cluster.router_argv()]
        self.router = start_process(argv, name="router", log_dir=self.log_dir, die_with_parent=True)
        try:
            bound = wait_for_line(self.router, ROUTER_LISTENING, ROUTER_BIND_TIMEOUT_S).group(1)
        except Exception as exc:  # ProcessDied (a port in use, ...) or TimeoutError, with its output
            raise LaunchFailure(f"the router did not start: {' '.join(str(exc).split())[:400]}") from None
        self.router_address = _reachable(bound)
        http = ""
        if "--http-listen" in self.cluster.router.flags:
            try:
                found = wait_for_line(self.router, ROUTER_HTTP_LISTENING, ROUTER_BIND_TIMEOUT_S)
            except Exception as exc:  # its --http-listen port is in use, ...
                raise LaunchFailure(
                    f"the router's HTTP API did not start: {' '.join(str(exc).split())[:400]}"
                ) from None
            self.http_address = _reachable(found.group(1))
            http = f", OpenAI API on http://{self.http_address}/v1"
        say(
            f"router started on {self.router_address} (pid {self.router.pid}, --paged-attn "
            f"{self.cluster.router.paged_attn.value}, --expect-workers {self.cluster.num_workers}{http})"
        )

    def _router_code(self) -> int | None:
        return None if self.router is None else self.router.returncode

    # -- workers ---------------------------------------------------------------------------------------

    def _start_worker(self, worker: PlacedWorker) -> None:
        import ray

        worker.argv = worker_argv(
            worker.slot, router=self.router_address, host=worker.node_ip, labels=worker.labels
        )
        try:
            worker.pid = ray.get(
                worker.actor.start.remote(worker.argv, self.auth_token),
                timeout=placement.ACTOR_READY_TIMEOUT_S,
            )
        except ray.exceptions.RayError as exc:
            raise LaunchFailure(placement.lost(worker, "while starting", exc)) from None
        where = f"{worker.where()} (logs in {worker.log_dir})"
        say(f"worker {worker.slot.worker_id} (pid {worker.pid}) started in {where}")

    def _poll_workers(self) -> dict[str, int | BaseException | None]:
        """worker id -> its process's exit code, None while it runs, or the error of a lost actor."""
        import ray

        refs = {w.slot.worker_id: w.actor.poll.remote() for w in self.placed}
        result: dict[str, int | BaseException | None] = {}
        for worker_id, ref in refs.items():
            try:
                result[worker_id] = ray.get(ref, timeout=30)
            except ray.exceptions.RayError as exc:
                result[worker_id] = exc
        return result

    # -- supervision -----------------------------------------------------------------------------------

    def _until_serving(self) -> int | None:
        """None once the router is SERVING; else the exit code of a failed start."""
        deadline = time.monotonic() + self.cluster.router.startup_timeout_s + STARTUP_MARGIN_S
        exited_at: dict[str, float] = {}
        while True:
            code = self._router_code()
            if code is not None:
                return code if code in (EXIT_POLICY, EXIT_FATAL) else EXIT_FATAL
            credentials = channel_credentials(**self.transport)
            if health_status(self.router_address, credentials=credentials) == "SERVING":
                return None
            if self.stopping.is_set():
                return EXIT_OK
            states = self._poll_workers()
            for worker in self.placed:
                state = states[worker.slot.worker_id]
                if isinstance(state, BaseException):
                    raise LaunchFailure(placement.lost(worker, "while starting", state))
                if state is not None:
                    first = exited_at.setdefault(worker.slot.worker_id, time.monotonic())
                    if time.monotonic() - first > ROUTER_OWN_EXIT_S and self._router_code() is None:
                        raise LaunchFailure(
                            f"worker {worker.slot.worker_id} in {worker.where()} exited with code {state} "
                            f"while starting and the router did not decide; its log is in {worker.log_dir}"
                        )
            if time.monotonic() > deadline:
                timeout_s = self.cluster.router.startup_timeout_s
                raise LaunchFailure(
                    f"startup timeout: the router at {self.router_address} was not SERVING after "
                    f"router.startup_timeout_s {timeout_s:g} s (+{STARTUP_MARGIN_S:g})"
                )
            self.stopping.wait(POLL_INTERVAL_S)

    def _serve(self) -> tuple[int, str]:
        """Serve until a signal or the router's exit; restart workers that die, within their budget."""
        while not self.stopping.wait(POLL_INTERVAL_S):
            code = self._router_code()
            if code == EXIT_OK:  # `ray job stop` signals the driver and its children (the router) at once
                return EXIT_OK, "stopped (the router was stopped by a signal)"
            if code is not None:
                return EXIT_FATAL, f"FAILED (exit code 1): the router exited with code {code} while serving"
            for worker_id, state in self._poll_workers().items():
                if state is not None:
                    self._worker_down(next(w for w in self.placed if w.slot.worker_id == worker_id), state)
        return EXIT_OK, "stopped"

    def _worker_down(self, worker: PlacedWorker, state: int | BaseException) -> None:
        """A worker that exited (or whose actor was lost) after the cluster served."""
        what = (
            f"its Ray actor was lost ({state})"
            if isinstance(state, BaseException)
            else f"exited with code {state}"
        )
        budget = worker.slot.group.max_restarts
        if worker.num_restarts >= budget:
            say(
                f"worker {worker.slot.worker_id} in {worker.where()} {what}; not restarted "
                f"(workers[].max_restarts {budget}); the router marks it DEAD, the others keep serving"
            )
            self.placed.remove(worker)
            self.retired.append(worker)
            return
        worker.num_restarts += 1
        say(
            f"worker {worker.slot.worker_id} in {worker.where()} {what}; restarting it in its bundle "
            f"(restart {worker.num_restarts} of {budget})"
        )
        try:
            if isinstance(state, BaseException):
                worker.actor = placement.start_actor(worker.slot, self.group)
                placement.locate([worker])
            self._start_worker(worker)
        except LaunchFailure as exc:
            say(f"restart failed: {exc}", error=True)

    def _failure_verdict(self, code: int) -> str:
        """The short verdict of a failed start (cause and exit code); keeps the router's report to print
        before it."""
        if code == EXIT_OK:
            return "stopped while starting"
        self.report = _failure_report(self.router.stderr() if self.router is not None else "")
        cause = _report_cause(self.report) or f"the router exited with code {self._router_code()}"
        return f"FAILED (exit code {code}): {cause}"

    def _cluster_table(self) -> str:
        from kvpact.client import Client, render_cluster_status

        try:
            with Client(self.router_address, timeout=10, api_key=self.api_key, **self.transport) as client:
                return render_cluster_status(client.cluster_status())
        except Exception as exc:  # e.g. a router that wants an API key: the cluster serves all the same
            return f"(no cluster table: ClusterStatus from {self.router_address} failed: {exc})"

    # -- teardown --------------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Workers, actors, placement group, then the router; each step logged, nothing raised."""
        import ray

        if not ray.is_initialized():
            return
        for line in placement.release(self.placed + self.retired, self.group):
            say(f"teardown: {line}")
        if self.router is not None:
            code = stop(self.router, grace_s=ROUTER_STOP_GRACE_S)
            say(f"teardown: router stopped (exit code {code})")
        ray.shutdown()


_REPORT = re.compile(r"^kvpact router: the cluster FAILED.*?^exit code \d+:[^\n]*$", re.MULTILINE | re.DOTALL)


def _failure_report(router_stderr: str) -> str:
    """The router's failure report (router/report.py) out of its stderr, which also holds its log lines."""
    found = _REPORT.findall(router_stderr)
    return found[-1] if found else ""


def _report_cause(report: str) -> str:
    match = re.search(r"^cause: (.*)$", report, re.MULTILINE)
    return match.group(1) if match else ""


def _reachable(bound: str) -> str:
    """HOST:PORT a router printed, with a wildcard host replaced by what other nodes can reach."""
    host, _, port = bound.rpartition(":")
    host = host.strip("[]")
    if host in _WILDCARD_HOSTS:
        host = placement.node_ip()  # what other nodes can reach, never a hostname
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
