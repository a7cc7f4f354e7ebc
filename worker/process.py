"""A worker process from start to exit: bind, probe, plan, ask the router, load, serve, drain, stop.

NOTE: the router hears every verdict before a weight is read. The pre-load plan (and any failure) goes
to the router first, and the worker loads no weight before the router acknowledged the plan; a failure is one
line on stderr and an exit code (78: the configuration cannot be honored; 1: anything else; 0: told to
stop), never a stack trace. The steps, drain and exit codes: docs/worker-startup.md.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from kvpact.shared.address import join_host_port
from kvpact.shared.auth import read_token
from kvpact.shared.describe import realized_table
from kvpact.shared.errors import (
    EXIT_FATAL,
    EXIT_POLICY,
    BindError,
    ConfigError,
    FeatureRequiredError,
    KvpactError,
    ModelLoadError,
    PagedAttentionRequiredError,
)
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode
from kvpact.shared.handshake_pb import (
    failure_to_pb,
    fingerprint_to_pb,
    mode_from_pb,
    plan_to_pb,
    realized_to_pb,
    spec_to_pb,
)
from kvpact.shared.log import configure_logging
from kvpact.shared.tls import describe_tls, plaintext_warning
from kvpact.v1 import worker_pb2
from kvpact.worker.engine.cpu_share import CpuShare, allowed_cpus
from kvpact.worker.engine.engine import Engine
from kvpact.worker.generate_pb import capabilities_to_pb
from kvpact.worker.loader import model_name, resolve_model_path
from kvpact.worker.metrics import WorkerMetrics
from kvpact.worker.options import WorkerOptions
from kvpact.worker.parallel.ranks import claim_gpus
from kvpact.worker.registration import RegistrationError, RouterLink
from kvpact.worker.service import WorkerServer, WorkerService
from kvpact.worker.startup.device import probe_device
from kvpact.worker.startup.engine_setup import WorkerPlan, build_engine, plan_startup

log = structlog.get_logger(__name__)

EXIT_OK = 0
STOP_GRACE_S = 5.0  # in-flight streams get this long to finish when the worker stops
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0  # when the Admission does not say
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")

T = TypeVar("T")


class PlanRefused(Exception):
    """The router refused this worker's pre-load plan: it exits 78 without loading."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Stop:
    """Why and with which exit code the worker stops. The first request wins."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = ""
        self.exit_code = EXIT_OK

    def request(self, reason: str, exit_code: int = EXIT_OK) -> None:
        if not self.event.is_set():
            self.reason, self.exit_code = reason, exit_code
            self.event.set()


def classify_failure(exc: BaseException) -> tuple[StartupFailure, int]:
    """A startup exception -> what the router is told, and the exit code."""
    if isinstance(exc, PagedAttentionRequiredError):
        return StartupFailure(
            StartupFailureCode.PAGED_ATTENTION_REQUIRED, exc.reason, exc.component, exc.feature
        ), EXIT_POLICY
    if isinstance(exc, FeatureRequiredError):
        return StartupFailure(
            StartupFailureCode.FEATURE_REQUIRED, exc.reason, exc.component, exc.feature
        ), EXIT_POLICY
    if isinstance(exc, ConfigError):
        return StartupFailure(StartupFailureCode.INVALID_CONFIG, str(exc), "config"), EXIT_POLICY
    if isinstance(exc, ModelLoadError):
        return StartupFailure(StartupFailureCode.MODEL_LOAD, str(exc), "loader"), EXIT_FATAL
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
        return StartupFailure(StartupFailureCode.OUT_OF_MEMORY, str(exc), "memory"), EXIT_FATAL
    return StartupFailure(StartupFailureCode.INTERNAL, f"{type(exc).__name__}: {exc}", ""), EXIT_FATAL


def _default_model_name(model: str) -> str:
    """The model's name before it is loaded, so a failure report names it too."""
    try:
        return model_name(resolve_model_path(model or None))
    except KvpactError:
        return model or "the default model"


def _say(message: str, *, error: bool = False) -> None:
    print(message, file=sys.stderr if error else sys.stdout, flush=True)


async def run_worker(options: WorkerOptions) -> int:
    """Run a worker until it is stopped; return the process exit code."""
    configure_logging(options.log_format, options.log_level, fields={"worker_id": options.worker_id})
    return await WorkerProcess(options).run()


class WorkerProcess:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.worker_id = options.worker_id
        self.stop = _Stop()
        self.service = WorkerService(
            self.worker_id, request_shutdown=self.stop.request, log_prompts=options.log_prompts
        )
        self.server: WorkerServer | None = None
        self.link: RouterLink | None = None
        self.engine: Engine | None = None
        self.metrics = WorkerMetrics(self.worker_id, options.spec.cache.mode)
        self._health_task: asyncio.Task[None] | None = None
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S  # the router's, once admitted
        self.handshake = worker_pb2.Handshake(
            worker_id=self.worker_id, spec=spec_to_pb(options.spec), labels=dict(options.labels)
        )
        self._drain_task: asyncio.Task[None] | None = None
        threads, size = options.spec.threads, options.spec.tensor_parallel_size
        if (
            size > 1
        ):  # the worker's threads are split between its ranks; rank 0 takes its part (worker/parallel/)
            threads = max(1, (threads or len(allowed_cpus())) // size)
        self.cpu_share = CpuShare.acquire(threads)  # released in _close
        self.visible_gpus = claim_gpus(size)  # before CUDA is touched: one GPU per rank, rank 0's here

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig.name)
        loop.add_signal_handler(signal.SIGHUP, self._reload_token)
        heartbeats: asyncio.Task[None] | None = None
        try:
            code = await self._start()
            if code is not None:
                return code
            if self.link is not None:
                heartbeats = asyncio.create_task(self._heartbeats(), name="heartbeats")
            await self.stop.event.wait()
            log.info("stopping", reason=self.stop.reason, exit_code=self.stop.exit_code)
            return self.stop.exit_code
        finally:
            for task in (heartbeats, self._drain_task):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await self._close()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def _start(self) -> int | None:
        """Everything up to serving (and admitted, with a router). An exit code if it ends here."""
        options = self.options
        try:
            token = read_token(options.auth_token_file)
        except ConfigError as exc:
            _say(f"worker {self.worker_id}: {exc}", error=True)
            return EXIT_POLICY
        if options.router:
            self.link = RouterLink(
                options.router,
                worker_id=self.worker_id,
                auth_token=token,
                timeout_s=options.router_timeout_s,
                tls=options.tls,
            )
        try:
            self.server = WorkerServer(self.service, options.listen_host, options.listen_port, options.tls)
        except BindError as exc:
            _say(f"worker {self.worker_id}: {exc}", error=True)
            return EXIT_FATAL
        await self.server.start()
        self.handshake.address = self._advertised_address(self.server.port)
        self.handshake.model_name = options.model_name or _default_model_name(options.spec.model)
        _say(f"worker {self.worker_id} listening on {self.handshake.address}")
        log.info("listening", address=self.handshake.address, tls=describe_tls(options.tls))
        warning = plaintext_warning(options.listen_host, options.tls)
        if warning:
            log.warning("plaintext_listener", address=self.handshake.address, hint=warning)
        if options.metrics_port is not None:
            try:
                port = self.metrics.serve(options.listen_host, options.metrics_port)
            except OSError:
                error = BindError("--metrics-port", join_host_port(options.listen_host, options.metrics_port))
                _say(f"worker {self.worker_id}: {error}", error=True)
                return EXIT_FATAL
            self.handshake.metrics_address = self._advertised_address(port)
            _say(f"worker {self.worker_id} metrics on http://{self.handshake.metrics_address}/metrics")

        try:
            engine = await self._until_stopped(self._build_engine())
        except PlanRefused as exc:
            log.error("plan refused", router=options.router, reason=exc.reason)
            _say(
                f"worker {self.worker_id}: router {options.router} refused its plan before loading: "
                f"{exc.reason}",
                error=True,
            )
            return EXIT_POLICY
        except (
            RegistrationError
        ) as exc:  # the token was rejected, or the id is taken, while announcing the plan
            _say(f"worker {self.worker_id}: {exc}", error=True)
            return EXIT_FATAL
        except Exception as exc:
            return await self._fail(exc)
        if engine is None:
            return self.stop.exit_code
        self.engine = engine
        engine.max_waiting = options.max_waiting
        loop = asyncio.get_running_loop()
        engine.step_loop.on_fatal = lambda reason: loop.call_soon_threadsafe(self._engine_stopped, reason)
        served_name = options.model_name or engine.model_name
        self.handshake.model_name = served_name
        self.handshake.ready.CopyFrom(realized_to_pb(engine.realized))
        if options.metrics_port is not None:
            self.metrics.attach(engine, served_name)
        self.server.attach(engine, served_name)
        log.info("serving", address=self.handshake.address, model_name=served_name)
        _say(f"worker {self.worker_id} serving {served_name} on {self.handshake.address}")
        _say(realized_table(engine.realized))
        if self.link is None:
            await self._ready()
            return None
        try:
            admission = await self._until_stopped(self.link.register(self.handshake))
        except RegistrationError as exc:
            _say(f"worker {self.worker_id}: {exc}", error=True)
            return EXIT_FATAL
        if admission is None:
            return self.stop.exit_code
        code = self._admitted(admission)
        if code is None:
            await self._ready()
        return code

    async def _ready(self) -> None:
        assert self.server is not None
        if self.stop.event.is_set():
            return
        # What startup left (the model, the cache, the servers) lives as long as the process: collect the
        # loader's garbage once, then keep the rest out of the collector's generations, so a collection
        # while serving walks only what requests allocate.
        gc.collect()
        gc.freeze()
        self.metrics.set_state("serving")
        await self.server.set_ready(True)

    def _engine_stopped(self, reason: str) -> None:
        """The engine loop stopped on an internal error: never green again, then exit 1."""
        self.metrics.set_state("stopping")
        if self.server is not None:
            self._health_task = asyncio.get_running_loop().create_task(self.server.set_ready(False))
        self.stop.request(reason, EXIT_FATAL)

    def _admitted(self, admission: worker_pb2.Admission) -> int | None:
        policy = mode_from_pb(admission.cluster_policy).value
        if not admission.admitted:
            _say(
                f"worker {self.worker_id}: router {self.options.router} refused it: {admission.reason}",
                error=True,
            )
            return EXIT_POLICY
        self.heartbeat_interval_s = admission.heartbeat_interval_ms / 1000 or DEFAULT_HEARTBEAT_INTERVAL_S
        log.info(
            "admitted",
            router=self.options.router,
            cluster_policy=policy,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        _say(f"worker {self.worker_id} admitted by router {self.options.router} (cluster policy: {policy})")
        return None

    async def _build_engine(self) -> Engine:
        """The startup sequence proper, in startup/engine_setup.py: the device probe (its capabilities go into
        every handshake from then on, a failed one too), the pre-load verdict (it logs how long that
        took), then weights, cache and scheduler. All run in a thread, so health answers meanwhile."""
        started = time.monotonic()
        spec = self.options.spec
        probe = await _in_daemon_thread(probe_device, spec.device, spec.device_map)
        self.handshake.capabilities.CopyFrom(capabilities_to_pb(probe))
        plan = await _in_daemon_thread(
            plan_startup, spec, probe=probe, with_ranks=True, visible_gpus=self.visible_gpus
        )
        self.handshake.fingerprint.CopyFrom(fingerprint_to_pb(plan.fingerprint))  # every handshake from now
        try:
            await self._announce(plan)
        except BaseException:
            if plan.ranks is not None:  # refused before loading: the other ranks stop too
                plan.ranks.close()
            raise
        engine = await _in_daemon_thread(build_engine, plan, cpu_share=self.cpu_share)
        log.info("engine ready", seconds=round(time.monotonic() - started, 3))
        return engine

    async def _announce(self, plan: WorkerPlan) -> None:
        """With a router: tell it the plan before loading, and load only once it answered. Raises PlanRefused
        if the plan cannot meet the cluster policy (or the cluster failed), RegistrationError if the router
        cannot be reached within --router-timeout."""
        if self.link is None:
            return
        announced = LoadingPlan(
            features=plan.features, backend=plan.backend, verdict_seconds=plan.verdict_seconds
        )
        self.handshake.loading.CopyFrom(plan_to_pb(announced))
        admission = await self.link.announce(self.handshake)
        if not admission.admitted and not admission.pending:
            raise PlanRefused(admission.reason)
        log.info(
            "plan announced", router=self.options.router, pending=admission.pending, reason=admission.reason
        )

    async def _fail(self, exc: Exception) -> int:
        failure, code = classify_failure(exc)
        if failure.code is StartupFailureCode.INTERNAL:
            log.exception("startup failed", code=failure.code.value)
        else:
            log.error(
                "startup failed", code=failure.code.value, component=failure.component, reason=failure.reason
            )
        rank = getattr(exc, "rank", None)  # a tensor-parallel rank's refusal or failure (worker/parallel/)
        who = f"worker {self.worker_id}" + (f" rank {rank}" if rank is not None else "")
        _say(f"{who}: startup failed: {exc}", error=True)
        if self.link is not None:
            self.handshake.failed.CopyFrom(failure_to_pb(failure))
            try:
                await self._until_stopped(self.link.register(self.handshake))
            except RegistrationError as report_error:
                log.warning("could not report the startup failure to the router", error=str(report_error))
        return code

    async def _heartbeats(self) -> None:
        assert self.link is not None and self.engine is not None
        engine = self.engine

        async def reregister() -> None:
            code = self._admitted(await self.link.register(self.handshake))  # type: ignore[union-attr]
            if code is not None:
                self.stop.request("the router refused this worker when it registered again", code)

        try:
            reason = await self.link.heartbeats(
                self.heartbeat_interval_s,
                engine.stats,
                reregister,
                on_drain=self._router_drain,
                features=lambda: engine.realized.features,  # what it realizes as it serves (drift)
            )
        except RegistrationError as exc:  # the token was rejected, or re-registering failed
            _say(f"worker {self.worker_id}: {exc}", error=True)
            self.stop.request(str(exc), EXIT_FATAL)
        except Exception as exc:  # a bug: never serve on silently without heartbeats
            log.exception("heartbeats failed")
            self.stop.request(f"heartbeats failed: {type(exc).__name__}: {exc}", EXIT_FATAL)
        else:
            self.stop.request(reason)

    def _reload_token(self) -> None:
        """SIGHUP: re-read --auth-token-file; an unreadable file keeps the current token."""
        if self.link is None or not self.options.auth_token_file:
            return
        try:
            self.link.set_token(read_token(self.options.auth_token_file))
        except ConfigError as exc:
            log.error("token_reload_failed", error=str(exc))
            return
        log.info("token_reloaded")

    def _on_signal(self, name: str) -> None:
        """The first SIGTERM/SIGINT once serving drains; a second one, or one before serving, stops."""
        if self.engine is None or self.server is None or self._drain_task is not None:
            self.stop.request(f"signal {name}")
            return
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(f"signal {name}"))

    def _router_drain(self, reason: str) -> None:
        """A heartbeat reply with `drain` (e.g. kvpact-launch scaling down): exactly the SIGTERM drain,
        then exit 0. Ignored once a drain or a stop is under way."""
        if self._drain_task is not None or self.stop.event.is_set():
            return
        _say(f"worker {self.worker_id}: the router asked it to drain ({reason}); draining, then exiting 0")
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(f"router drain: {reason}"))

    async def _drain(self, why: str) -> None:
        assert self.engine is not None and self.server is not None
        engine, started = self.engine, time.monotonic()
        await self.server.set_draining()
        if self.link is not None:
            await self.link.start_draining(engine.stats())
        timeout_s = self.options.drain_timeout_s
        log.info("draining", reason=why, in_flight=engine.num_in_flight(), timeout_s=timeout_s)
        deadline = started + timeout_s
        while engine.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        unfinished = engine.num_in_flight()
        if self.link is not None:
            await self.link.deregister(f"{why}: drained")
        seconds = round(time.monotonic() - started, 2)
        log.info("drained", seconds=seconds, unfinished=unfinished)
        self.stop.request(f"{why}; drained in {seconds} s ({unfinished} requests cut off by --drain-timeout)")

    async def _until_stopped(self, awaitable: Awaitable[T]) -> T | None:
        """Await `awaitable`, or give up on it (None) as soon as a stop is requested."""
        task = asyncio.ensure_future(awaitable)
        stopped = asyncio.create_task(self.stop.event.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        log.info("startup interrupted", reason=self.stop.reason)
        return None

    async def _close(self) -> None:
        self.metrics.set_state("stopping")
        if self.server is not None:
            await self.server.stop(STOP_GRACE_S)
        if self.engine is not None:
            self.engine.close()
        if self.link is not None:
            await self.link.close()
        self.metrics.close()
        self.cpu_share.release()

    def _advertised_address(self, port: int) -> str:
        host = self.options.advertise_host or self.options.listen_host
        if host in _WILDCARD_HOSTS:
            host = socket.gethostname()  # a wildcard bind is reached through the host's name
        return join_host_port(host, port)


async def _in_daemon_thread(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run blocking `fn` in a daemon thread, so a worker stopped mid-load can exit without waiting for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result, exc = fn(*args, **kwargs), None
        except BaseException as error:  # handed to the awaiting task
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop closed while we ran: nobody is waiting
            pass

    threading.Thread(target=target, name=f"worker-{fn.__name__}", daemon=True).start()
    return await future
