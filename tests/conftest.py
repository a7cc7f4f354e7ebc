"""The suite's processes fork Ray's GCS and raylets (ray.init, ray.cluster_utils.Cluster) while their own
gRPC channels run: kvpact.deploy switches gRPC's fork handlers off (its NOTE), imported here before any
test module loads grpc."""

import kvpact.deploy  # noqa: F401
