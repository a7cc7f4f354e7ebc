"""`python -m kvpact.router` and the `router` command: gRPC's I/O chosen before grpc loads
(shared/grpc_io.py), then the CLI."""

from __future__ import annotations

import os
import sys

from kvpact.shared.grpc_io import set_grpc_io


def main() -> int:
    set_grpc_io(os.environ)
    from kvpact.router.cli import main as cli_main  # imports grpc

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
