"""`router`: the kvpact router process.

`router status [--address HOST:PORT] [--json] [--watch SECONDS]` prints a running cluster's table
instead (exit 0 when it is SERVING; see `router status --help`).

Exit codes: kvpact.shared.exit_codes.EXIT_CODES (rendered into `router --help`).
"""

from __future__ import annotations

import argparse
import sys

from kvpact.router.balancing import DEFAULT_POLICY, POLICIES
from kvpact.router.config import RouterConfig
from kvpact.router.event_loop import DEFAULT_EVENT_LOOP, EVENT_LOOPS, loop_factory, run_loop
from kvpact.shared.auth import read_secrets
from kvpact.shared.cli import add_log_args, add_paged_attn_arg, host_port, seconds
from kvpact.shared.errors import EXIT_FATAL, BindError, ConfigError
from kvpact.shared.exit_codes import exit_codes_help
from kvpact.shared.intent import PagedAttentionMode
from kvpact.shared.log import configure_logging
from kvpact.shared.tls import add_tls_args, tls_from_args

POLICY_HELP = (
    "the cluster's PagedAttention policy. auto: admit workers whatever they realized (each says why it "
    "fell back); on: every admitted worker must realize PagedAttention, or the cluster does not start "
    "(exit 78, naming each worker and reason); off: admit only workers with the eager KV cache. "
    "Default: auto."
)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router",
        description="The kvpact router: admits workers under the cluster's --paged-attn policy and "
        "serves the client-facing Generation service.",
        epilog=__doc__.split("\n\n")[1] + "\n\n" + exit_codes_help("router"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        type=host_port,
        default=("127.0.0.1", 50051),
        metavar="HOST:PORT",
        help="where clients and workers reach the router (default 127.0.0.1:50051; port 0 = free)",
    )
    add_paged_attn_arg(parser, POLICY_HELP)
    parser.add_argument(
        "--expect-workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="serving starts when N workers are admitted (default 1)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=seconds,
        default=300.0,
        metavar="SECONDS",
        help="exit 1 naming who is missing if N workers are not admitted by then (default 300)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=seconds,
        default=2.0,
        metavar="SECONDS",
        help="how often workers send heartbeats (told to them on admission; default 2)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="a worker silent this long is marked DEAD and gets no new requests (default 10)",
    )
    parser.add_argument(
        "--failed-linger",
        type=seconds,
        default=15.0,
        metavar="SECONDS",
        help="after a failed start, stay up this long at most (exit code unchanged), refusing every "
        "handshake and heartbeat with the failure, so that a worker that starts meanwhile is told before it "
        "loads; the router exits sooner once every expected worker was told (default 15)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM: health NOT_SERVING and new calls refused at once, in-flight calls finish for up "
        "to this long, then exit 0 (default 30)",
    )
    parser.add_argument(
        "--max-in-flight-per-worker",
        type=_positive_int,
        default=512,
        metavar="N",
        help="forward at most N requests to one worker at once; a request finds a worker with room, or is "
        "refused at once with RESOURCE_EXHAUSTED naming this bound (default 512)",
    )
    parser.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="workers must present a secret in this file (one per line) to register and heartbeat; "
        "re-read on SIGHUP",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="clients must send one of the keys in this file (one per line) as 'authorization: Bearer <key>' "
        "metadata, else UNAUTHENTICATED; health and reflection stay open; re-read on SIGHUP "
        "(default: no keys)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on this port (default: off)",
    )
    parser.add_argument(
        "--report-file",
        metavar="PATH",
        help="keep a JSON report of this router here (its address, state, exit code, failure report and "
        "ClusterStatus), replaced whole at each change of state; for the program that started it, e.g. "
        "kvpact-launch (default: none)",
    )
    add_tls_args(parser, "router")
    parser.add_argument(
        "--balance",
        choices=sorted(POLICIES),
        default=DEFAULT_POLICY,
        help="which worker gets a request. least-load: fewest requests in flight, then most free KV blocks; "
        "prefix-affinity: prompts that start alike go to the same worker (its prefix cache holds their "
        "shared blocks), bounded by load, else least-load (default: least-load)",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=DEFAULT_EVENT_LOOP,
        help="the event loop the router runs on: asyncio (the standard library's) or uvloop (where it is "
        "installed; measured no faster for the relay here, docs/performance.md) (default: asyncio)",
    )
    add_log_args(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    host, port = args.listen
    return RouterConfig(
        host=host,
        port=port,
        policy=PagedAttentionMode(args.paged_attn),
        num_expected_workers=args.expect_workers,
        startup_timeout_s=args.startup_timeout,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        auth_tokens=read_secrets(args.auth_token_file, "--auth-token-file") if args.auth_token_file else (),
        auth_token_file=args.auth_token_file,
        api_keys=read_secrets(args.api_key_file, "--api-key-file") if args.api_key_file else (),
        api_key_file=args.api_key_file,
        tls=tls_from_args(args),
        metrics_port=args.metrics_port,
        balance=args.balance,
        max_in_flight_per_worker=args.max_in_flight_per_worker,
        drain_timeout_s=args.drain_timeout,
        failed_linger_s=args.failed_linger,
        report_file=args.report_file,
    )


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["status"]:  # `router status ...`; anything else is the router itself, as always
        from kvpact.router.status_cli import main as status_main

        return status_main(args_in[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        factory = loop_factory(args.event_loop)
    except ConfigError as exc:
        parser.error(str(exc))
    configure_logging(args.log_format, args.log_level)
    from kvpact.router.server import serve  # grpc and the servicers only once the flags are good

    try:
        return run_loop(serve(config), factory)
    except BindError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
