"""deploy/kuberay cannot run here (no Kubernetes): parse the manifests and the Dockerfile and check they
agree with the launcher (its console script and flags), the cluster-file schema, each other, and KubeRay's
own CRD schemas (tests/deploy/kuberay_crds, from tools/kuberay_crd_schemas.py), validated strictly: a key
the CRD does not define is an error, as `kubectl apply --validate=strict` makes it."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvpact.deploy.cluster_file import parse_cluster_file
from kvpact.deploy.launch import build_parser
from kvpact.deploy.stop import stop_budget_s
from kvpact.shared.intent import PagedAttentionMode

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
MANIFESTS = ["rayjob.yaml", "raycluster.yaml"]
CRDS = Path(__file__).resolve().parent / "kuberay_crds"
IMAGE = "${KVPACT_IMAGE}"  # substituted at apply time (envsubst), the image the Dockerfile's comment builds


def documents(name: str) -> dict[str, dict]:
    """kind -> document (one of each kind per file)."""
    docs = [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), f"{name}: one document of each kind"
    return by_kind


def strict(schema: Any) -> Any:
    """The CRD's OpenAPI v3 schema as JSON Schema that refuses unknown keys: every object that lists its
    properties, and neither allows more nor preserves unknown fields, gets additionalProperties: false."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf")
           else v for k, v in schema.items()}  # fmt: skip
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def crd_schema(kind: str) -> dict:
    document = json.loads(gzip.decompress((CRDS / f"{kind}.json.gz").read_bytes()))
    return strict(document["schema"])


def ray_pin() -> str:
    [pin] = re.findall(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    return pin


def cluster_spec(docs: dict[str, dict]) -> dict:
    return docs["RayJob"]["spec"].get("rayClusterSpec") or docs["RayCluster"]["spec"]


def containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_job_runs_the_launcher_on_the_mounted_cluster_file(name: str):
    docs = documents(name)
    job = docs["RayJob"]["spec"]
    argv = shlex.split(job["entrypoint"])
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[argv[0]] == "kvpact.deploy.launch:main"
    args = build_parser().parse_args(argv[1:])  # the launcher's own parser takes the entrypoint's flags
    assert job["backoffLimit"] == 0  # a cluster that fails under `on` fails the RayJob once

    config_path = Path(args.config)
    head = cluster_spec(docs)["headGroupSpec"]["template"]["spec"]
    [mount] = [m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    [volume] = [v for v in head["volumes"] if v["name"] == mount["name"]]
    config_map = docs["ConfigMap"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    cluster = parse_cluster_file(
        yaml.safe_load(config_map["data"][config_path.name]), f"{name}: cluster.yaml"
    )
    assert cluster.router.paged_attn is PagedAttentionMode.ON
    assert cluster.ray.address == "auto"  # the cluster the job runs in

    # The router listens on the port the head exposes (and the Service targets, where there is one).
    port = int(cluster.router.listen.rpartition(":")[2])
    assert port in [p["containerPort"] for p in head["containers"][0]["ports"]]
    if "Service" in docs:
        service = docs["Service"]["spec"]
        assert [p["targetPort"] for p in service["ports"]] == [port]
        assert service["selector"]["ray.io/node-type"] == "head"
        assert service["selector"]["ray.io/cluster"] == docs["RayCluster"]["metadata"]["name"]
        assert docs["RayJob"]["spec"]["clusterSelector"] == {
            "ray.io/cluster": docs["RayCluster"]["metadata"]["name"]
        }

    # Enough GPUs in the worker groups for the workers' bundles, on the same image and Ray version.
    spec = cluster_spec(docs)
    num_gpus = sum(
        g["replicas"]
        * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in spec["workerGroupSpecs"]
    )
    assert num_gpus >= sum(b.get("GPU", 0) for b in cluster.bundles())
    assert spec["rayVersion"] == ray_pin()
    assert len({c["image"] for c in containers(spec)}) == 1


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_kuberay_resource_is_valid_against_its_crd_schema_strictly(name: str):
    for kind in ("RayJob", "RayCluster"):
        document = documents(name).get(kind)
        if document is not None:
            jsonschema.validate(document, crd_schema(kind))


def test_the_strict_schema_refuses_a_key_the_crd_does_not_have():
    job = copy.deepcopy(documents("rayjob.yaml")["RayJob"])
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"] = {"num-gpus": 0}  # not a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd_schema("RayJob"))
    job = copy.deepcopy(documents("rayjob.yaml")["RayJob"])
    job["spec"]["shutdownAfterJobFinish"] = True  # a typo: KubeRay would drop it silently
    with pytest.raises(jsonschema.ValidationError) as error:
        jsonschema.validate(job, crd_schema("RayJob"))
    assert "shutdownAfterJobFinish" in error.value.message


def test_the_two_manifests_can_share_a_namespace():
    names: dict[tuple[str, str], str] = {}
    for name in MANIFESTS:
        for kind, document in documents(name).items():
            key = (kind, document["metadata"]["name"])
            assert key not in names, f"{kind} {key[1]} is in {names.get(key)} and {name}"
            names[key] = name


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_head_waits_for_the_ordered_stop_and_every_pod_runs_the_parameterized_image(name: str):
    docs = documents(name)
    spec = cluster_spec(docs)
    assert {c["image"] for c in containers(spec)} == {IMAGE}
    head = spec["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in head["containers"][0].get("env", [])}
    cluster = parse_cluster_file(yaml.safe_load(docs["ConfigMap"]["data"]["cluster.yaml"]), name)
    # Ray SIGKILLs a stopped job's driver this long after its SIGTERM: longer than the launcher's stop.
    assert float(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= stop_budget_s(cluster)
    assert head["terminationGracePeriodSeconds"] > float(env["RAY_JOB_STOP_WAIT_TIME_S"])


def test_the_rayjob_deletes_its_cluster_when_the_job_ends():
    job = documents("rayjob.yaml")["RayJob"]["spec"]
    assert job["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in job


def test_the_dockerfile_installs_kvpact_with_worker_and_ray_dependencies_and_no_dev_tools():
    text = (KUBERAY / "Dockerfile").read_text()
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\S+)$", text, re.MULTILINE)
    assert base is not None and base.group(1).startswith(f"{ray_pin()}-py311")
    installs = re.findall(r"pip install [^\n&]*", text)
    assert any('-c constraints.txt ".[ray]"' in line for line in installs), installs
    assert not any("dev" in line for line in installs), installs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "kvpact[worker]" in extras["ray"] and any(d.startswith("ray[default]") for d in extras["ray"])
    # Every part of the package is copied in (the top-level folders pyproject maps packages from).
    package_dirs = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    dirs = {d.split("/")[0] for d in package_dirs}
    copied = set(re.findall(r"^COPY \S+ (\S+) \./\1$", text, re.MULTILINE))
    assert dirs <= copied, dirs - copied
    assert '-t "$KVPACT_IMAGE" .' in text  # the build command names the image the manifests run
    # One CUDA stack (torch's wheels), checked at build time; the base is Ray's CPU image.
    assert not base.group(1).endswith("-gpu") and "torch.version.cuda" in text
    assert "KVPACT_CLUSTER_FILE" not in text  # nothing reads it


def test_docker_build_context_leaves_out_the_virtualenv_and_build_outputs():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", "build", "*.egg-info", "**/__pycache__", ".git"):
        assert path in ignored, path
    copied = set(re.findall(r"^COPY \S+ (\S+) ", (KUBERAY / "Dockerfile").read_text(), re.MULTILINE))
    assert not copied & set(ignored)  # nothing the image needs is left out
