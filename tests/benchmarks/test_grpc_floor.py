"""benchmarks/grpc_floor.py: every front it measures delivers messages to its clients, and it leaves no
process behind."""

from __future__ import annotations

import multiprocessing

import pytest

from benchmarks import grpc_floor


def test_each_mode_delivers_messages_and_stops_its_processes(capsys):
    assert (
        grpc_floor.main(
            ["--modes", ",".join(grpc_floor.MODES), "--streams", "8", "--seconds", "0.5", "--rounds", "1"]
        )
        == 0
    )
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    measured = {r[0].strip(): (float(r[2].replace(",", "")), float(r[3].replace(",", ""))) for r in rows[1:]}
    assert set(measured) == set(grpc_floor.MODES)
    assert all(wall > 0 and per_cpu > 0 for wall, per_cpu in measured.values()), measured
    assert multiprocessing.active_children() == []


def test_an_unknown_mode_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        grpc_floor.main(["--modes", "write,bogus"])
    assert exc.value.code == 2
    assert "--modes: unknown bogus" in capsys.readouterr().err
