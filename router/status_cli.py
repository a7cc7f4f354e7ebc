"""`router status`: a running cluster's table (or its ClusterStatus as JSON), for people, scripts and probes.

    router status [--address HOST:PORT] [--json] [--watch SECONDS] [--timeout SECONDS]
                  [--tls-ca PATH [--tls-cert PATH --tls-key PATH] [--tls-server-name NAME]]
                  [--api-key-file PATH]

The table is `kvpact.client.render_cluster_status`, the renderer `make serve` and the Python client
use. Exit codes: 0 the cluster is SERVING; 1 it is STARTING or FAILED; 2 bad flags; 69 the router did
not answer (EX_UNAVAILABLE); 77 it refused the call (no or a wrong API key: EX_NOPERM). With --watch
it prints again every SECONDS until Ctrl-C (exit: the last answer's code).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import grpc
from google.protobuf.json_format import MessageToJson

from kvpact.client import Client, KvpactRpcError, render_cluster_status
from kvpact.shared.address import join_host_port
from kvpact.shared.cli import host_port, seconds
from kvpact.v1 import router_pb2

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 69
EXIT_REFUSED = 77  # EX_NOPERM: the router wants an API key (or another one)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router status",
        description="Print a running kvpact cluster's status: one row per worker (what it was asked, what "
        "it realized and why), as `make serve` shows it.",
        epilog=__doc__.split("\n\n")[2],
    )
    parser.add_argument(
        "--address",
        type=host_port,
        default=("127.0.0.1", 50051),
        metavar="HOST:PORT",
        help="the router's --listen address (default 127.0.0.1:50051)",
    )
    parser.add_argument("--json", action="store_true", help="print ClusterStatus as JSON (proto field names)")
    parser.add_argument(
        "--watch",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="print again every SECONDS until Ctrl-C",
    )
    parser.add_argument(
        "--tls-ca", metavar="PATH", help="TLS: the PEM CA that signed the router's certificate"
    )
    parser.add_argument(
        "--tls-cert", metavar="PATH", help="TLS: a client certificate, if the router wants one"
    )
    parser.add_argument("--tls-key", metavar="PATH", help="TLS: the key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", metavar="NAME", help="TLS: the name the router's certificate carries"
    )
    parser.add_argument(
        "--api-key-file", metavar="PATH", help="a file whose first line is a client API key of the router"
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for the router's answer (default 5)",
    )
    return parser


def exit_code(status: router_pb2.ClusterStatusResponse) -> int:
    return EXIT_SERVING if status.state == router_pb2.CLUSTER_STATE_SERVING else EXIT_NOT_SERVING


def render(status: router_pb2.ClusterStatusResponse, as_json: bool) -> str:
    if as_json:
        return MessageToJson(
            status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    return render_cluster_status(status)


def show_once(client: Client, address: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    try:
        status = client.cluster_status()
    except KvpactRpcError as exc:
        if exc.code in _UNREACHABLE:
            err.write(
                f"router status: no answer from the router at {address} ({exc.code.name}: {exc.details}); "
                "is it running, and is --address its --listen address (and TLS as it expects)?\n"
            )
            code = EXIT_UNREACHABLE
        else:
            err.write(
                f"router status: the router at {address} refused the call ({exc.code.name}: {exc.details}); "
                "does it want --api-key-file?\n"
            )
            code = EXIT_REFUSED
        err.flush()
        return code
    out.write(render(status, as_json) + "\n")
    out.flush()
    return exit_code(status)


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    host, port = args.address
    address = join_host_port(host, port)
    api_key = None
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text().split()[0]
        except (OSError, IndexError):
            parser.error(f"--api-key-file {args.api_key_file}: cannot read a key from it")
    try:
        client = Client(
            address,
            timeout=args.timeout,
            api_key=api_key,
            ca_file=args.tls_ca,
            cert_file=args.tls_cert,
            key_file=args.tls_key,
            server_name=args.tls_server_name,
        )
    except (OSError, ValueError) as exc:  # an unreadable file; a certificate without its key
        parser.error(f"TLS: {exc}")
    with client:
        code = show_once(client, address, args.json, out, err)
        if args.watch is None:
            return code
        # Ctrl-C / SIGTERM end the watch between two calls (a KeyboardInterrupt raised inside grpc's
        # call machinery could leave the channel's close waiting); a call in flight is bounded by
        # --timeout.
        stopped = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopped.set())
        while not stopped.wait(args.watch):
            out.write("\n")
            code = show_once(client, address, args.json, out, err)
        return code
