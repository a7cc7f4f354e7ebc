"""benchmarks/router_ab.py: each load reports its figures and leaves no process behind."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from benchmarks import router_ab


def test_each_load_reports_its_figures(capsys):
    assert router_ab.main(["--seconds", "0.5", "--streams", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    by_load = {line["load"]: line for line in lines}
    assert set(by_load) == set(router_ab.LOADS)
    for load in ("token", "steps"):
        assert by_load[load]["tokens_per_s"] > 0 and by_load[load]["tokens_per_router_cpu_s"] > 0, by_load[
            load
        ]
    assert by_load["latency"]["router_p99_ms"] > 0 and by_load["latency"]["direct_p99_ms"] > 0
    assert multiprocessing.active_children() == []


def test_an_unknown_load_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        router_ab.main(["--loads", "token,bogus"])
    assert exc.value.code == 2
    assert "--loads: unknown bogus" in capsys.readouterr().err
