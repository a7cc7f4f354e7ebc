"""benchmarks/grpc_one_stream.py: each transport delivers every message at full speed and paced, and it
leaves no process behind."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from benchmarks import grpc_one_stream


def test_each_transport_and_gap_delivers_its_messages_and_stops_its_server(capsys):
    argv = ["--gaps", "0,5", "--transports", "tcp,unix", "--seconds", "0.2", "--rounds", "1"]
    before = os.environ.get("GRPC_EXPERIMENTS")
    assert grpc_one_stream.main(argv) == 0
    assert os.environ.get("GRPC_EXPERIMENTS") == before  # set only while its processes were spawned
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    measured = {(r[0].strip(), float(r[1])): [float(v) for v in r[3:]] for r in rows[1:]}
    assert set(measured) == {("tcp", 0), ("tcp", 5), ("unix", 0), ("unix", 5)}
    assert all(client > 0 and server > 0 for client, server, _ in measured.values()), measured
    assert measured[("tcp", 5)][2] >= 4000  # a paced message's wall is about its gap (µs; ms timers)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--transports", "tcp,pipe"], "--transports: unknown pipe"),
        (["--gaps", "0,ten"], "--gaps: '0,ten' is not a list of milliseconds"),
        (
            ["--gaps", "500", "--seconds", "0.2"],
            "--gaps: each gap must be 0 to --seconds (0.2 s) in ms, got 500",
        ),
        (["--gaps", "-1"], "--gaps: each gap must be 0 to --seconds"),
    ],
)
def test_an_unknown_transport_or_gap_is_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        grpc_one_stream.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
