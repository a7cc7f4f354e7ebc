"""The suite's processes fork Ray's GCS and raylets (ray.init, ray.cluster_utils.Cluster) while their own
gRPC channels run: gRPC's fork handlers are off, as in deploy/__init__.py (its NOTE), before grpc loads."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
