"""`router`: the kvpact router process.

`router status [--address HOST:PORT] [--json] [--watch SECONDS]` prints a running cluster's table
instead (exit 0 when it is SERVING; see `router status --help`).

Exit codes: kvpact.shared.exit_codes.EXIT_CODES (rendered into `router --help`).
"""

from __future__ import annotations

import argparse
import sys

from kvpact.router.config import RouterConfig, resolve_policies
from kvpact.shared.auth import read_secrets
from kvpact.shared.cli import add_log_args
from kvpact.shared.errors import EXIT_FATAL, BindError, ConfigError
from kvpact.shared.event_loop import loop_factory, run_loop
from kvpact.shared.exit_codes import exit_codes_help
from kvpact.shared.log import configure_logging
from kvpact.shared.options import add_options, option_values
from kvpact.shared.tls import add_tls_args, tls_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router",
        description="The kvpact router: admits workers under the cluster's feature policies (--policy, "
        "--paged-attn) and "
        "serves the client-facing Generation service.",
        epilog=__doc__.split("\n\n")[1] + "\n\n" + exit_codes_help("router"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, RouterConfig)
    add_tls_args(parser, "router")
    add_log_args(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The config its options say, with the secrets their files hold and the TLS the --tls-* flags give."""
    values = option_values(RouterConfig, args)
    values["policy"], values["policies"] = resolve_policies(values["policy"], values["policies"])
    auth, keys = values["auth_token_file"], values["api_key_file"]
    return RouterConfig(
        **values,
        auth_tokens=read_secrets(auth, "--auth-token-file") if auth else (),
        api_keys=read_secrets(keys, "--api-key-file") if keys else (),
        tls=tls_from_args(args),
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
        factory = loop_factory(config.event_loop)
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
