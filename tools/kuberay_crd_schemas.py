"""Extract the openAPIV3Schema of KubeRay's RayJob and RayCluster CRDs (version v1) for
tests/deploy/test_kuberay.py, which validates the manifests in deploy/kuberay against them.

    python tools/kuberay_crd_schemas.py TAG ray.io_rayjobs.yaml ray.io_rayclusters.yaml

The CRDs come from ray-project/kuberay at TAG (ray-operator/config/crd/bases/); descriptions are dropped
(they are most of the 2 MB and no part of validation), the rest is kept as is and written, gzipped JSON,
to tests/deploy/kuberay_crds/<kind>.json.gz with the tag beside it.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "deploy" / "kuberay_crds"


def strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(argv: list[str]) -> int:
    tag, *paths = argv
    OUT.mkdir(parents=True, exist_ok=True)
    for path in paths:
        crd = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        kind = crd["spec"]["names"]["kind"]
        [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = {"kuberay": tag, "schema": strip(version["schema"]["openAPIV3Schema"])}
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        (OUT / f"{kind}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"{kind}: {len(text)} bytes of schema from kuberay {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
