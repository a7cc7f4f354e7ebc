"""kvpact-launch and its Ray actors (deploy/launch.py), `make serve` (deploy/local.py).

NOTE: gRPC's fork handlers are switched off here, before anything imports grpc: grpcio >= 1.81 runs a
child's post-fork handler that can abort a forked child before it execs (SIGABRT, "epoll_wait error: Bad
file descriptor"; grpc/grpc#43055), and Ray starts its GCS and raylets (`ray.address: local`) by fork with
a preexec_fn. kvpact never uses gRPC in a forked child, so nothing needs the handlers; our own children
start without fork handlers anyway (shared/child_process.py). An operator's own value is kept.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
