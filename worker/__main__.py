"""`python -m kvpact.worker` and the `worker` command: OpenMP's waiting set before torch loads and gRPC's
I/O before grpc loads (shared/grpc_io.py), then the CLI.

torch's CPU ops run on OpenMP (libgomp), whose threads spin at every barrier for GOMP_SPINCOUNT iterations
(300,000 by default) before they sleep. On a machine whose cores are shared (two workers, a router and its
clients on two cores) a spinning thread holds the core its sibling needs, and each parallel region can cost
a whole time slice. Measured on the 2-core machine (router + workers + client, 6 x 48 tokens;
docs/performance.md "Workers sharing a machine"): under load one worker ran 3-8x faster with short spins;
two workers deliver 1.15-1.27x one alone with 1,000 spins but 0.52-0.83x with 300,000. The price: one
worker alone on an idle machine is ~20% slower (wakes instead of spins); an operator who runs one worker
per machine can set GOMP_SPINCOUNT=300000. The library reads the setting once, when it loads, so it is set
here, before anything imports torch. An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from kvpact.shared.grpc_io import set_grpc_io

SPIN_COUNT = "1000"  # iterations a waiting OpenMP thread spins before it sleeps (a few microseconds)


def set_openmp_waiting(env: MutableMapping[str, str]) -> None:
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT


def main() -> None:
    set_openmp_waiting(os.environ)
    set_grpc_io(os.environ)
    from kvpact.worker.cli import main as cli_main  # imports torch and grpc

    cli_main()


if __name__ == "__main__":
    main()
