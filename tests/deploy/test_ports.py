"""deploy/ports.py and the cluster file's workers[].port_range: which ports each worker may take."""

from __future__ import annotations

import pytest

from kvpact.deploy.cluster_file import ClusterFileError, parse_cluster_file
from kvpact.deploy.ports import node_shares, port_candidates


def test_workers_of_a_group_on_one_node_split_the_range_and_never_share_a_port():
    shares = node_shares(["a", "b", "a", "a"])
    assert shares == [(0, 3), (0, 1), (1, 3), (2, 3)]
    on_a = [
        port_candidates((7000, 7008), *share)
        for share, node in zip(shares, "abaa", strict=True)
        if node == "a"
    ]
    assert on_a == [[7000, 7003, 7006], [7001, 7004, 7007], [7002, 7005, 7008]]
    assert port_candidates((7000, 7008), 0, 1) == list(range(7000, 7009))  # alone on node b: the whole range


def document(*groups: dict) -> dict:
    return {"workers": [{"name": f"g{i}", "replicas": 2, **g} for i, g in enumerate(groups)]}


def test_a_port_range_is_read_per_group():
    cluster = parse_cluster_file(document({"port_range": [7000, 7010]}, {}), "c.yaml")
    assert [g.port_range for g in cluster.workers] == [(7000, 7010), None]


BOUNDS = "expected [LOW, HIGH], whole numbers with 1024 <= LOW <= HIGH <= 65535"


@pytest.mark.parametrize(
    ("port_range", "message"),
    [
        ([7010, 7000], f"{BOUNDS}, got [7010, 7000]"),
        ([80, 90], f"{BOUNDS}, got [80, 90]"),
        ([7000], f"{BOUNDS}, got [7000]"),
        ("7000-7010", f"{BOUNDS}, got '7000-7010'"),
        ([7000, 7000], "expected at least 2 ports (max_replicas: 2, who may all share one node)"),
    ],
)
def test_a_bad_port_range_names_the_key_and_what_is_allowed(port_range: object, message: str):
    with pytest.raises(ClusterFileError) as error:
        parse_cluster_file(document({"port_range": port_range}), "c.yaml")
    assert str(error.value).startswith(f"c.yaml: workers[0].port_range: {message}")


def test_two_groups_cannot_share_ports():
    with pytest.raises(ClusterFileError) as error:
        parse_cluster_file(document({"port_range": [7000, 7010]}, {"port_range": [7010, 7020]}), "c.yaml")
    assert str(error.value) == (
        "c.yaml: workers[1].port_range: expected a range that does not overlap workers[0].port_range "
        "[7000, 7010], got [7010, 7020]"
    )


def test_kvpact_launch_exits_2_on_a_bad_port_range(tmp_path, capsys):
    from kvpact.deploy.launch import main

    config = tmp_path / "cluster.yaml"
    config.write_text("workers:\n  - {name: cpu, replicas: 1, port_range: [9000, 8000]}\n")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"kvpact-launch: {config}: workers[0].port_range: expected [LOW, HIGH], whole numbers with "
        "1024 <= LOW <= HIGH <= 65535, got [9000, 8000]"
    )
