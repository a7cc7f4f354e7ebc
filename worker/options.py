"""What the `worker` command decided beyond the spec: where it listens, which router it joins, how it
drains and logs. One field per option (shared/options.py); read once at start.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvpact.shared.cli import host_port, port_or_zero, seconds
from kvpact.shared.event_loop import DEFAULT_EVENT_LOOP, EVENT_LOOPS
from kvpact.shared.options import UINT32_MAX, check_options, option
from kvpact.shared.spec import MODEL, WorkerSpec
from kvpact.shared.tls import TlsConfig
from kvpact.worker.engine.engine import DEFAULT_MAX_WAITING

SERVING = "serving"  # the --help group of `worker` these options are shown in
DEFAULT_ROUTER_TIMEOUT_S = 60.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _label(value: str) -> tuple[str, str]:
    key, sep, label = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key.strip(), label


def _address(value: str) -> str:
    return "{}:{}".format(*host_port(value))


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Everything the CLI decided; read once at start."""

    spec: WorkerSpec
    worker_id: str = option(
        flag="--worker-id", help="this worker's name in the cluster (default HOSTNAME-PID)", group=SERVING
    )
    model_name: str | None = option(  # None = the engine's
        None, "--model-name", "the name clients use for this model (default: from the model)", group=MODEL
    )
    listen_host: str = option(
        "127.0.0.1",
        "--listen",
        "where the Worker service listens (default 127.0.0.1:0, a free port)",
        type=host_port,
        metavar="HOST:PORT",
        group=SERVING,
        into=("listen_host", "listen_port"),
        cli_default=("127.0.0.1", 0),
    )
    listen_port: int = 0  # set by --listen
    advertise_host: str | None = option(  # None = the listen host (a wildcard: this machine's hostname)
        None,
        "--advertise-host",
        "the host (name or IP) the router reaches this worker at, with the port it bound (default: the "
        "--listen host; a wildcard --listen advertises this machine's hostname). kvpact-launch sets the "
        "node's IP as Ray reports it, since other nodes may not resolve a hostname",
        metavar="HOST",
        group=SERVING,
    )
    labels: tuple[tuple[str, str], ...] = option(  # Handshake.labels (e.g. its Ray node and bundle)
        (),
        "--label",
        "shown with this worker in the router's ClusterStatus and failure report; repeatable "
        "(kvpact-launch sets ray.node, ray.node_ip and ray.bundle)",
        type=_label,
        action="append",
        metavar="KEY=VALUE",
        convert=tuple,
        group=SERVING,
    )
    router: str | None = option(  # HOST:PORT; None = standalone
        None,
        "--router",
        "register with this router (default: serve standalone)",
        type=_address,
        metavar="HOST:PORT",
        group=SERVING,
    )
    router_timeout_s: float = option(
        DEFAULT_ROUTER_TIMEOUT_S,
        "--router-timeout",
        "retry the handshake this long before giving up with exit 1; also how long the router may be "
        f"unreachable before a warning (default {DEFAULT_ROUTER_TIMEOUT_S:.0f})",
        type=seconds,
        metavar="SECONDS",
        group=SERVING,
    )
    auth_token_file: str | None = option(
        None,
        "--auth-token-file",
        "file holding the router's shared secret (the first line is sent; re-read on SIGHUP)",
        group=SERVING,
    )
    metrics_port: int | None = option(  # 0 = a free port; None = off
        None,
        "--metrics-port",
        "serve Prometheus metrics (kvpact_worker_*) at http://HOST:PORT/metrics on the --listen host "
        "(0 = a free port, printed at startup; default: off)",
        type=port_or_zero,
        metavar="PORT",
        group=SERVING,
    )
    max_waiting: int = option(
        DEFAULT_MAX_WAITING,
        "--max-waiting",
        "at most N requests accepted and not yet running (being tokenized, queued or waiting for a "
        "place in the batch); past it a new request is refused at once with RESOURCE_EXHAUSTED naming "
        f"this flag (default {DEFAULT_MAX_WAITING})",
        metavar="N",
        minimum=1,
        maximum=UINT32_MAX,
        group=SERVING,
    )
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S,
        "--drain-timeout",
        "on SIGTERM, let in-flight requests finish this long (new ones are refused and the router "
        f"shows DRAINING), then deregister and exit 0 (default {DEFAULT_DRAIN_TIMEOUT_S:.0f})",
        type=seconds,
        metavar="SECONDS",
        group=SERVING,
    )
    event_loop: str = option(
        DEFAULT_EVENT_LOOP,
        "--event-loop",
        "the event loop the worker serves on: uvloop (about 19%% less CPU per token on the worker's "
        "serving threads at one sequence a step, docs/performance.md) or asyncio (the standard "
        f"library's) (default: {DEFAULT_EVENT_LOOP})",
        choices=tuple(EVENT_LOOPS),
        group=SERVING,
    )
    plan_only: bool = option(  # worker/plan_only.py: print the plan and exit, no router, no weights
        False,
        "--plan-only",
        "print the pre-load plan for every feature (what it will realize and why) and exit: 0 when the "
        "intent can be met, 78 when not; no router, no weight read (the config and file headers only)",
        action="store_true",
    )
    plan_json: bool = option(
        False, "--json", "with --plan-only: print the plan as one JSON object", action="store_true"
    )
    log_prompts: bool = option(  # prompt text in the request log line (never otherwise)
        False,
        "--log-prompts",
        "put each request's prompt in its `request` log line (DEBUG); without it no prompt text is "
        "ever logged",
        action="store_true",
    )
    tls: TlsConfig | None = None  # --tls-* (shared/tls.py); None = plaintext (loopback)
    log_format: str = "auto"  # --log-format, --log-level (shared/cli.py)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        check_options(self)
