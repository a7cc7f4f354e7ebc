"""The router's configuration, read once from the command line (router/cli.py): one field per `router`
option, its flag, help, default and bounds declared on the field (shared/options.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvpact.router.balancing import BALANCES, DEFAULT_BALANCE
from kvpact.shared.cli import host_port, seconds, tcp_port
from kvpact.shared.errors import ConfigError
from kvpact.shared.event_loop import DEFAULT_EVENT_LOOP, EVENT_LOOPS
from kvpact.shared.features import FEATURES, FeatureMode
from kvpact.shared.fingerprint import FIELDS, UNIFORM_DEFAULT, merge_uniform, parse_uniform
from kvpact.shared.intent import PagedAttentionMode
from kvpact.shared.options import check_options, option
from kvpact.shared.tls import TlsConfig

POLICY_HELP = (
    "the cluster's PagedAttention policy. auto: admit workers whatever they realized (each says why it "
    "fell back); on: every admitted worker must realize PagedAttention, or the cluster does not start "
    "(exit 78, naming each worker and reason); off: admit only workers with the eager KV cache. "
    "Default: auto."
)

POLICIES_HELP = (
    "a feature's cluster policy, repeatable; NAME is one of "
    + ", ".join(FEATURES)
    + ". auto: admit whatever it realized; on: every admitted worker must realize it, or the cluster does "
    "not start (exit 78, naming each worker, feature and reason), and a later worker without it is refused; "
    "off: admit only workers without it. --paged-attn X is short for --policy paged-attn=X. Default: auto."
)


def parse_policy(value: str) -> tuple[str, FeatureMode]:
    """`NAME=MODE` (the argparse type of --policy)."""
    name, sep, mode = value.partition("=")
    if not sep or name not in FEATURES or mode not in {m.value for m in FeatureMode}:
        raise argparse.ArgumentTypeError(
            f"expected NAME=auto|on|off with NAME one of {', '.join(FEATURES)}, got {value!r}"
        )
    return name, FeatureMode(mode)


def resolve_policies(
    paged_attn: PagedAttentionMode | None, given: tuple[tuple[str, FeatureMode], ...]
) -> tuple[PagedAttentionMode, tuple[tuple[str, FeatureMode], ...]]:
    """--paged-attn and every --policy -> (the paged-attn policy, every other feature's, in FEATURES
    order). Two values for one feature that disagree are a ConfigError naming both."""
    seen: dict[str, FeatureMode] = {}
    said: dict[str, str] = {}
    for name, mode in given:
        if name in seen and seen[name] is not mode:
            raise ConfigError(
                f"{said[name]} and --policy {name}={mode.value} disagree; give the {name} policy once"
            )
        seen[name], said[name] = mode, f"--policy {name}={mode.value}"
    if paged_attn is not None:
        if seen.get("paged-attn", paged_attn) is not paged_attn:
            raise ConfigError(
                f"--paged-attn {paged_attn.value} and {said['paged-attn']} disagree; "
                "--paged-attn is short for "
                "--policy paged-attn=MODE: give one"
            )
        seen["paged-attn"] = paged_attn
    others = tuple((n, seen.get(n, FeatureMode.AUTO)) for n in FEATURES if n != "paged-attn")
    return seen.get("paged-attn", FeatureMode.AUTO), others


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = option(
        "127.0.0.1",
        "--listen",
        "where clients and workers reach the router (default 127.0.0.1:50051; port 0 = free)",
        type=host_port,
        metavar="HOST:PORT",
        into=("host", "port"),
        cli_default=("127.0.0.1", 50051),
    )
    port: int = 50051  # set by --listen; 0 = a free port (the bound one is logged)
    policy: PagedAttentionMode = option(  # the paged-attn policy (--paged-attn, or --policy paged-attn=)
        PagedAttentionMode.AUTO,
        "--paged-attn",
        POLICY_HELP,
        choices=tuple(m.value for m in PagedAttentionMode),
        convert=PagedAttentionMode,
        cli_default=None,  # not given: --policy paged-attn=, else auto (router/cli.py resolves the two)
    )
    policies: tuple[tuple[str, FeatureMode], ...] = option(  # every other feature's; absent = auto
        (),
        "--policy",
        POLICIES_HELP,
        type=parse_policy,
        action="append",
        metavar="NAME=MODE",
        convert=tuple,
    )
    uniform: tuple[str, ...] = option(  # the fingerprint fields that must agree (shared/fingerprint.py)
        UNIFORM_DEFAULT,
        "--uniform",
        "what the workers serving one model name must agree on, a comma list of "
        + ", ".join(FIELDS)
        + " (or none); replaces the default, "
        + ",".join(UNIFORM_DEFAULT)
        + ". A worker that differs from those already serving its model name is refused, both values named; "
        "while the cluster starts, that fails it (exit 78). Repeatable (the lists add up)",
        type=parse_uniform,
        action="append",
        metavar="LIST",
        convert=merge_uniform,
    )
    num_expected_workers: int = option(
        1,
        "--expect-workers",
        "serving starts when N workers are admitted (default 1)",
        metavar="N",
        minimum=1,
    )
    startup_timeout_s: float = option(
        300.0,
        "--startup-timeout",
        "exit 1 naming who is missing if N workers are not admitted by then (default 300)",
        type=seconds,
        metavar="SECONDS",
    )
    heartbeat_interval_s: float = option(
        2.0,
        "--heartbeat-interval",
        "how often workers send heartbeats (told to them on admission; default 2)",
        type=seconds,
        metavar="SECONDS",
    )
    heartbeat_timeout_s: float = option(
        10.0,
        "--heartbeat-timeout",
        "a worker silent this long is marked DEAD and gets no new requests (default 10)",
        type=seconds,
        metavar="SECONDS",
    )
    # After a failed start the router stays up this long at most, refusing every handshake (a plan
    # included) and heartbeat with the failure, so a worker that starts meanwhile is told before it loads;
    # it exits sooner once every expected worker has been told.
    failed_linger_s: float = option(
        15.0,
        "--failed-linger",
        "after a failed start, stay up this long at most (exit code unchanged), refusing every "
        "handshake and heartbeat with the failure, so that a worker that starts meanwhile is told before it "
        "loads; the router exits sooner once every expected worker was told (default 15)",
        type=seconds,
        metavar="SECONDS",
    )
    drain_timeout_s: float = option(  # SIGTERM: in-flight calls get this long to finish
        30.0,
        "--drain-timeout",
        "on SIGTERM: health NOT_SERVING and new calls refused at once, in-flight calls finish for up "
        "to this long, then exit 0 (default 30)",
        type=seconds,
        metavar="SECONDS",
    )
    max_in_flight_per_worker: int = (
        option(  # requests forwarded to one worker at once, then RESOURCE_EXHAUSTED
            512,
            "--max-in-flight-per-worker",
            "forward at most N requests to one worker at once; a request finds a worker with room, or is "
            "refused at once with RESOURCE_EXHAUSTED naming this bound (default 512)",
            metavar="N",
            minimum=1,
        )
    )
    http_listen: tuple[str, int] | None = option(  # the OpenAI-compatible front (router/http/); None = off
        None,
        "--http-listen",
        "also serve the OpenAI-compatible HTTP API here (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health; docs/openai.md), with the same keys, TLS and limits (default: off; port 0 = "
        "free)",
        type=host_port,
        metavar="HOST:PORT",
    )
    auth_token_file: str | None = option(
        None,
        "--auth-token-file",
        "workers must present a secret in this file (one per line) to register and heartbeat; "
        "re-read on SIGHUP",
        metavar="PATH",
    )
    api_key_file: str | None = option(
        None,
        "--api-key-file",
        "clients must send one of the keys in this file (one per line) as 'authorization: Bearer <key>' "
        "metadata, else UNAUTHENTICATED; health and reflection stay open; re-read on SIGHUP "
        "(default: no keys)",
        metavar="PATH",
    )
    metrics_port: int | None = option(
        None,
        "--metrics-port",
        "serve Prometheus metrics on this port (default: off)",
        type=tcp_port,
        metavar="PORT",
    )
    report_file: str | None = option(  # router/report_file.py
        None,
        "--report-file",
        "keep a JSON report of this router here (its address, state, exit code, failure report and "
        "ClusterStatus), replaced whole at each change of state; for the program that started it, e.g. "
        "kvpact-launch (default: none)",
        metavar="PATH",
    )
    balance: str = option(  # a name in router/balancing's BALANCES
        DEFAULT_BALANCE,
        "--balance",
        "which worker gets a request. least-load: fewest requests in flight, then most free KV blocks; "
        "prefix-affinity: prompts that start alike go to the same worker (its prefix cache holds their "
        "shared blocks), bounded by load, else least-load (default: least-load)",
        choices=tuple(sorted(BALANCES)),
    )
    event_loop: str = option(
        DEFAULT_EVENT_LOOP,
        "--event-loop",
        "the event loop the router runs on: uvloop (about 10%% more tokens per CPU-second on the relay, "
        f"docs/performance.md) or asyncio (the standard library's) (default: {DEFAULT_EVENT_LOOP})",
        choices=tuple(EVENT_LOOPS),
    )
    tls: TlsConfig | None = None  # --tls-* (shared/tls.py); None = plaintext (loopback)
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)  # --auth-token-file's; re-read on SIGHUP
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # --api-key-file's; re-read on SIGHUP
    shutdown_timeout_s: float = 0.8  # bound on telling the workers to stop when the cluster fails

    def __post_init__(self) -> None:
        check_options(self)

    def feature_policies(self) -> dict[str, FeatureMode]:
        """Every feature's cluster policy but paged-attn's (`policy`), absent ones auto."""
        given = dict(self.policies)
        return {n: given.get(n, FeatureMode.AUTO) for n in FEATURES if n != "paged-attn"}

    def all_policies(self) -> dict[str, FeatureMode]:
        return {"paged-attn": self.policy, **self.feature_policies()}
