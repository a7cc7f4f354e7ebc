"""The cluster file: its schema, one-line errors naming the key, flags checked by the CLIs' own parsers,
and `kvpact-launch` exiting 2 on a bad file without touching Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpact.deploy.autoscale import AutoscalePolicy
from kvpact.deploy.cluster_file import (
    ClusterFileError,
    WorkerSlot,
    load_cluster_file,
    parse_cluster_file,
    worker_argv,
)
from kvpact.shared.intent import PagedAttentionMode

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"

MINIMAL = {"workers": [{"name": "cpu", "replicas": 2}]}


def document(**sections: object) -> dict:
    base = {
        "ray": {"address": "auto", "placement_strategy": "PACK", "placement_timeout_s": 300},
        "router": {"listen": "0.0.0.0:50051", "paged_attn": "on", "startup_timeout_s": 900, "flags": {}},
        "workers": [
            {
                "name": "gpu",
                "replicas": 2,
                "resources": {"num_gpus": 1, "num_cpus": 4},
                "flags": {"paged-attn": "on", "model": "/models/llama", "pa-memory-fraction": 0.9},
            }
        ],
    }
    base.update(sections)
    return base


def error_of(doc: object) -> str:
    with pytest.raises(ClusterFileError) as info:
        parse_cluster_file(doc, "c.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_issue_shape_loads_with_its_defaults_and_command_lines():
    cluster = parse_cluster_file(document(), "c.yaml")
    assert cluster.num_workers == 2
    assert cluster.bundles() == [{"GPU": 1, "CPU": 4}, {"GPU": 1, "CPU": 4}]
    assert cluster.router_argv() == [
        "--listen", "0.0.0.0:50051", "--paged-attn", "on", "--expect-workers", "2",
        "--startup-timeout", "900",
    ]  # fmt: skip
    [first, second] = cluster.slots()
    assert (first.worker_id, second.worker_id, second.bundle_index) == ("gpu-0", "gpu-1", 1)
    argv = worker_argv(second, router="10.0.0.1:50051", host="10.0.0.7", labels={"ray.bundle": "1"})
    assert argv == [
        "--paged-attn", "on", "--model", "/models/llama", "--pa-memory-fraction", "0.9",
        "--threads", "4", "--worker-id", "gpu-1", "--router", "10.0.0.1:50051", "--listen", "10.0.0.7:0",
        "--advertise-host", "10.0.0.7", "--metrics-port", "0", "--label", "ray.bundle=1",
    ]  # fmt: skip


def test_defaults_and_the_policy_reaches_workers_that_do_not_say():
    cluster = parse_cluster_file({**MINIMAL, "router": {"paged_attn": "off"}}, "c.yaml")
    assert cluster.ray.address == "auto" and cluster.ray.placement_strategy == "PACK"
    assert cluster.router.listen == "0.0.0.0:50051" and cluster.router.startup_timeout_s == 900
    assert cluster.workers[0].flags == ("--paged-attn", "off")
    assert cluster.workers[0].resources == {"CPU": 1}
    assert cluster.workers[0].max_restarts == 0


def test_yaml_booleans_are_the_modes_on_and_off_never_something_else(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "router: {paged_attn: on, policies: {cuda-graphs: off, prefix-caching: on, cpu-kernels: auto}}\n"
        "workers:\n"
        "  - {name: a, replicas: 1, flags: {paged-attn: off, prefix-caching: off, log-prompts: true}}\n"
        "  - {name: b, replicas: 1, flags: {paged-attn: yes}}\n"
    )
    cluster = load_cluster_file(path)
    assert cluster.router.paged_attn is PagedAttentionMode.ON
    assert cluster.router_argv()[:10] == [
        "--listen", "0.0.0.0:50051", "--paged-attn", "on", "--policy", "cuda-graphs=off",
        "--policy", "prefix-caching=on", "--policy", "cpu-kernels=auto",
    ]  # fmt: skip
    assert cluster.workers[0].flags == ("--paged-attn", "off", "--prefix-caching", "off", "--log-prompts")
    assert cluster.workers[1].flags == ("--paged-attn", "on")
    path.write_text("workers:\n  - {name: a, replicas: 1, flags: {model: yes}}\n")
    with pytest.raises(ClusterFileError, match=r"workers\[0\]\.flags\.model: .*quote the value"):
        load_cluster_file(path)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            document(colour="red"),
            "c.yaml: colour: unknown key; allowed here: ray, router, workers, got 'red'",
        ),
        (
            document(ray={"adress": "auto"}),
            "c.yaml: ray.adress: unknown key; allowed here: address, placement_strategy, placement_timeout_s",
        ),
        (
            document(ray={"placement_strategy": "BEST"}),
            "c.yaml: ray.placement_strategy: expected one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD, "
            "got 'BEST'",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": -1}]},
            "c.yaml: workers[0].replicas: expected a whole number >= 1, got -1",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 2, "min_replicas": 3}]},
            "c.yaml: workers[0].min_replicas: expected at most replicas (2), got 3",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 2, "max_replicas": 1}]},
            "c.yaml: workers[0].max_replicas: expected at least replicas (2), got 1",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "min_replicas": 0}]},
            "c.yaml: workers[0].min_replicas: expected a whole number >= 1, got 0",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "max_replicas": 3, "port_range": [2000, 2001]}]},
            "c.yaml: workers[0].port_range: expected at least 3 ports (max_replicas: 3",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "autoscale": {"metric": "waiting", "target": 1}}]},
            "c.yaml: workers[0].autoscale: expected min_replicas < max_replicas (both 1): autoscaling needs "
            "room to add or remove",
        ),
        (
            {"workers": [{"name": "c", "replicas": 1, "max_replicas": 2, "autoscale": {"metric": "queue"}}]},
            "c.yaml: workers[0].autoscale.target: required",
        ),
        (
            {
                "workers": [
                    {
                        "name": "c",
                        "replicas": 1,
                        "max_replicas": 2,
                        "autoscale": {"metric": "rps", "target": 1},
                    }
                ]
            },
            "c.yaml: workers[0].autoscale.metric: expected one of waiting, kv_usage, got 'rps'",
        ),
        (
            {
                "workers": [
                    {
                        "name": "c",
                        "replicas": 1,
                        "max_replicas": 2,
                        "autoscale": {"metric": "kv_usage", "target": 1.5},
                    }
                ]
            },
            "c.yaml: workers[0].autoscale.target: expected a fraction between 0 and 1 (exclusive) for metric "
            "kv_usage, got 1.5",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "flags": {"pa-backend": "cuda"}}]},
            "c.yaml: workers[0].flags: argument --pa-backend: invalid choice: 'cuda'",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "flags": {"colour": "red"}}]},
            "c.yaml: workers[0].flags: unrecognized arguments: --colour red "
            "(flags checked by the worker CLI)",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "flags": {"pa-block-size": 0}}]},
            "c.yaml: workers[0].flags: argument --pa-block-size: expected a whole number > 0",
        ),
        (
            {"workers": [{"name": "cpu", "replicas": 1, "flags": {"router": "x:1"}}]},
            "c.yaml: workers[0].flags.router: --router is set by kvpact-launch",
        ),
        (
            {"router": {"flags": {"expect-workers": 3}}, **MINIMAL},
            "c.yaml: router.flags.expect-workers: --expect-workers is set by kvpact-launch; "
            "set the workers' replicas (their sum) instead",
        ),
        (
            {"router": {"flags": {"report-file": "r.json"}}, **MINIMAL},
            "c.yaml: router.flags.report-file: --report-file is set by kvpact-launch",
        ),
        (
            {"router": {"flags": {"heartbeat-timeout": -1}}, **MINIMAL},
            "c.yaml: router: argument --heartbeat-timeout: expected a number of seconds > 0, got '-1' "
            "(flags checked by the router CLI)",
        ),
        (
            {"router": {"paged_attn": "maybe"}, **MINIMAL},
            "c.yaml: router.paged_attn: expected auto, on or off",
        ),
        (
            {"router": {"policies": {"graphs": True}}, **MINIMAL},
            "c.yaml: router.policies.graphs: expected a feature name: paged-attn, prefix-caching",
        ),
        (
            {"router": {"policies": {"cuda-graphs": "maybe"}}, **MINIMAL},
            "c.yaml: router.policies.cuda-graphs: expected auto, on or off",
        ),
        (
            {"router": {"paged_attn": "on", "policies": {"paged-attn": False}}, **MINIMAL},
            "c.yaml: router.policies.paged-attn: expected the same mode as router.paged_attn (on)",
        ),
        (
            {"workers": [{"name": "a", "replicas": 1, "flags": {"no-prefix-caching": True}}]},
            "c.yaml: workers[0].flags: --no-prefix-caching was replaced: use --prefix-caching off",
        ),
        ({"workers": []}, "c.yaml: workers: expected a list of one or more worker groups"),
        ({"ray": {}}, "c.yaml: workers: required"),
        (
            {"workers": [{"name": "a", "replicas": 1}, {"name": "a", "replicas": 1}]},
            "c.yaml: workers[1].name: expected a name no other group has, got 'a'",
        ),
        (
            {"workers": [{"name": "a", "replicas": 1, "resources": {"num_gpus": -1}}]},
            "c.yaml: workers[0].resources.num_gpus: expected a number >= 0, got -1",
        ),
        (
            {"workers": [{"name": "a", "replicas": 1, "resources": {"GPU": 1}}]},
            "c.yaml: workers[0].resources.GPU: expected num_cpus, num_gpus, memory or a custom resource name",
        ),
    ],
)
def test_each_error_is_one_line_naming_the_key_and_what_is_allowed(doc: dict, expected: str):
    assert error_of(doc).startswith(expected)


def test_the_replica_bounds_default_to_replicas_and_say_what_is_outside_them():
    fixed, scalable = parse_cluster_file(
        {"workers": [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1, "max_replicas": 3}]}, "c.yaml"
    ).workers
    assert (fixed.min_replicas, fixed.replicas, fixed.max_replicas) == (2, 2, 2)
    assert (scalable.min_replicas, scalable.replicas, scalable.max_replicas) == (1, 1, 3)
    assert scalable.bounds_error(3) == ""
    assert scalable.bounds_error(4) == (
        "group 'b': 4 replicas is outside its bounds [1, 3] (workers[].min_replicas, workers[].max_replicas "
        "in the cluster file)"
    )
    assert fixed.bounds_error(1).startswith("group 'a': 1 replicas is outside its bounds [2, 2]")
    auto = {"metric": "kv_usage", "target": 0.8, "up_after_s": 5}
    [group] = parse_cluster_file(
        {"workers": [{"name": "a", "replicas": 1, "max_replicas": 2, "autoscale": auto}]}, "c.yaml"
    ).workers
    assert group.autoscale == AutoscalePolicy("kv_usage", 0.8, up_after_s=5, down_after_s=300)


def test_a_key_given_twice_is_refused(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("workers:\n  - {name: a, replicas: 1}\nworkers: []\n")
    with pytest.raises(ClusterFileError, match="the key 'workers' appears twice"):
        load_cluster_file(path)


@pytest.mark.parametrize("name", ["cpu.yaml", "gpu.yaml", "fail_on.yaml"])
def test_each_example_loads(name: str):
    cluster = load_cluster_file(EXAMPLES / name)
    assert cluster.num_workers >= 2
    assert cluster.router.paged_attn is PagedAttentionMode.ON


def test_the_examples_say_what_they_are_for():
    cpu = load_cluster_file(EXAMPLES / "cpu.yaml")
    assert all("GPU" not in b for b in cpu.bundles())  # runs here
    gpu = load_cluster_file(EXAMPLES / "gpu.yaml")
    assert {g.name for g in gpu.workers} == {"a100", "l4"}  # heterogeneous
    assert len({tuple(sorted(g.resources.items())) for g in gpu.workers}) == 2
    fail = load_cluster_file(EXAMPLES / "fail_on.yaml")
    triton = next(g for g in fail.workers if g.name == "triton")
    assert triton.resources.get("GPU") == 1 and "triton" in triton.flags


def test_worker_argv_keeps_an_advertise_host_the_group_chose():
    cluster = parse_cluster_file(
        {"workers": [{"name": "a", "replicas": 1, "flags": {"advertise-host": "a.example"}}]}, "c.yaml"
    )
    argv = worker_argv(cluster.slots()[0], router="r:1", host="10.0.0.7", auth_token_file="/t")
    assert argv.count("--advertise-host") == 1 and "a.example" in argv
    assert argv[-2:] == ["--auth-token-file", "/t"]


@pytest.mark.parametrize(("resources", "flags", "threads"), [
    ({"num_cpus": 0.5}, {}, "1"),  # a fractional bundle still runs one thread
    ({"num_cpus": 3, "num_gpus": 1}, {}, "3"),
    ({"num_cpus": 3}, {"threads": 2}, "2"),  # the group's own --threads wins
])  # fmt: skip
def test_a_workers_torch_threads_are_its_bundles_cpus_unless_the_group_says(resources, flags, threads):
    group = {"name": "a", "replicas": 1, "resources": resources, "flags": flags}
    cluster = parse_cluster_file({"workers": [group]}, "c.yaml")
    argv = worker_argv(cluster.slots()[0], router="r:1", host="10.0.0.7")
    assert argv.count("--threads") == 1 and argv[argv.index("--threads") + 1] == threads


def test_kvpact_launch_exits_2_with_one_line_and_never_imports_ray(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"name": "cpu", "replicas": -2}]}))
    check = (
        "import sys; from kvpact.deploy.launch import main; code = main(['--config', sys.argv[1]]); "
        "assert 'ray' not in sys.modules, 'ray was imported'; sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"kvpact-launch: {path}: workers[0].replicas: expected a whole number >= 1, got -2"
    )
    assert result.stdout == ""


def test_worker_slot_ids_follow_the_groups():
    cluster = parse_cluster_file(
        {"workers": [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}]}, "c.yaml"
    )
    assert [(s.worker_id, s.bundle_index) for s in cluster.slots()] == [("a-0", 0), ("a-1", 1), ("b-0", 2)]
    assert isinstance(cluster.slots()[0], WorkerSlot)


def test_the_routers_http_listen_is_a_router_flag_like_any_other():
    router = {"listen": "0.0.0.0:50051", "flags": {"http-listen": "0.0.0.0:8000"}}
    cluster = parse_cluster_file({**MINIMAL, "router": router}, "c.yaml")
    assert cluster.router_argv()[-2:] == ["--http-listen", "0.0.0.0:8000"]
    bad = error_of({**MINIMAL, "router": {"flags": {"http-listen": "nowhere"}}})
    assert "router" in bad and "--http-listen" in bad and "HOST:PORT" in bad


def test_a_workers_pa_flag_with_paged_attn_off_is_refused_naming_it():
    worker = {"name": "a", "replicas": 1, "flags": {"paged-attn": "off", "pa-cache-dtype": "float32"}}
    message = error_of({"workers": [worker]})
    assert (
        "workers[0].flags: --pa-cache-dtype sets the paged KV cache, and --paged-attn off builds none"
        in message
    )
    assert "drop --pa-cache-dtype, or use --paged-attn auto or on" in message


def test_a_tensor_parallel_group_reserves_one_bundle_per_worker_with_a_gpu_per_rank():
    from kvpact.deploy.placement import describe_bundles

    group = {"name": "tp", "replicas": 2, "resources": {"num_gpus": 2, "num_cpus": 8},
             "flags": {"model": "/models/llama", "tensor-parallel-size": 2}}  # fmt: skip
    cluster = parse_cluster_file(document(workers=[group]), "c.yaml")
    assert cluster.workers[0].tensor_parallel_size == 2
    assert cluster.bundles() == [{"GPU": 2, "CPU": 8}, {"GPU": 2, "CPU": 8}]  # each worker's ranks: one node
    assert describe_bundles(cluster) == "tp x2 {CPU: 8, GPU: 2} tp 2"
    on_cpu = {**group, "resources": {"num_cpus": 0.5}}  # ranks on CPU: a fraction of a core fits
    assert parse_cluster_file(document(workers=[on_cpu]), "c.yaml").bundles() == [{"CPU": 0.5}] * 2
    short = {**group, "resources": {"num_gpus": 1}}
    assert error_of(document(workers=[short])) == (
        "c.yaml: workers[0].resources.num_gpus: expected 2: a group's resources are per worker, and each of "
        "the 2 ranks of --tensor-parallel-size 2 takes one GPU (or no num_gpus: ranks on CPU), got 1"
    )


def test_router_uniform_is_a_router_flag_a_list_adds_up_and_an_unknown_name_is_refused():
    router = {"flags": {"uniform": ["model", "max-model-len"]}}
    cluster = parse_cluster_file({**MINIMAL, "router": router}, "c.yaml")
    assert cluster.router_argv()[-4:] == ["--uniform", "model", "--uniform", "max-model-len"]
    bad = error_of({**MINIMAL, "router": {"flags": {"uniform": "model,max-len"}}})
    assert bad.startswith("c.yaml: router: argument --uniform: unknown name 'max-len'"), bad
