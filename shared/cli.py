"""Command-line pieces the router and the worker share."""

from __future__ import annotations

import argparse
import math

from kvpact.shared.intent import PAGED_ATTN_HELP, PagedAttentionMode
from kvpact.shared.log import LOG_FORMATS


def add_paged_attn_arg(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, help_text: str = PAGED_ATTN_HELP
) -> None:
    parser.add_argument(
        "--paged-attn",
        choices=[m.value for m in PagedAttentionMode],
        default=PagedAttentionMode.AUTO.value,
        help=help_text,
    )


def add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="auto",
        help="log line format; auto: $KVPACT_LOG_FORMAT, else JSON when stderr is not a TTY, else console",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")


def host_port(value: str) -> tuple[str, int]:
    """Parse HOST:PORT (port 0 = a free port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def seconds(value: str) -> float:
    """A duration in seconds: a finite number > 0 (nan and inf would make a timeout never fire)."""
    try:
        parsed = float(value)
    except ValueError:
        parsed = math.nan
    if not (math.isfinite(parsed) and parsed > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return parsed


def port_or_zero(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535] (0 = a free one), got {text!r}")
    return int(text)


def tcp_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}")
    return int(text)
