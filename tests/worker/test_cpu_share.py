"""A worker's CPU threads: --threads wins, else the CPUs it may use split between the live workers on them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpact.worker.engine.cpu_share import CpuShare, allowed_cpus


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def lease(directory: Path, pid: int, start: str, cpus: frozenset[int], busy: bool = True) -> Path:
    path = directory / str(pid)
    path.write_text(f"{start}\n{','.join(map(str, sorted(cpus)))}\n{int(busy)}\n")
    return path


def start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def test_a_worker_alone_takes_every_cpu_it_may_run_on(tmp_path: Path, restore_threads):
    with CpuShare.acquire(None, tmp_path) as share:
        assert share.apply() == len(allowed_cpus())
        assert torch.get_num_threads() == len(allowed_cpus())
        assert [p.name for p in tmp_path.iterdir()] == [str(os.getpid())]
    assert list(tmp_path.iterdir()) == []  # the lease goes with the worker


def test_busy_workers_on_the_same_cpus_split_them_and_an_idle_one_leaves_its_share(
    tmp_path: Path, restore_threads
):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cpus = allowed_cpus()
        lease(tmp_path, other.pid, start_time(other.pid), cpus)
        with CpuShare.acquire(None, tmp_path) as share:
            assert share.num_sharing() == 2
            assert share.apply() == max(1, len(cpus) // 2)
            # the other worker's queue ran dry: this one takes every CPU at its next look
            lease(tmp_path, other.pid, start_time(other.pid), cpus, busy=False)
            share.apply(busy=False)
            assert share.apply(busy=True) == len(cpus)
            # and this one, idle, is not counted by the others
            assert (tmp_path / str(os.getpid())).read_text().splitlines()[2] == "1"
            share.apply(busy=False)
            assert (tmp_path / str(os.getpid())).read_text().splitlines()[2] == "0"
            lease(tmp_path, other.pid, start_time(other.pid), cpus)
            # a worker pinned to CPUs this one cannot use does not take a share of these
            lease(tmp_path, other.pid, start_time(other.pid), frozenset({max(cpus) + 1}))
            assert share.num_sharing() == 1
    finally:
        other.kill()
        other.wait()


def test_a_lease_left_by_a_dead_or_reused_pid_is_ignored_and_removed(tmp_path: Path, restore_threads):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = lease(tmp_path, gone.pid, "12345", allowed_cpus())
    reused = lease(tmp_path, os.getppid(), "1", allowed_cpus())  # a live pid, another start time
    with CpuShare.acquire(None, tmp_path) as share:
        assert share.num_sharing() == 1
        assert share.apply() == len(allowed_cpus())
    assert not dead.exists() and not reused.exists()


def test_threads_flag_wins_over_the_share(tmp_path: Path, restore_threads):
    with CpuShare.acquire(3, tmp_path) as share:
        assert share.apply() == 3
        assert torch.get_num_threads() == 3


def test_openmp_threads_spin_briefly_unless_the_operator_chose():
    from kvpact.worker.__main__ import SPIN_COUNT, set_openmp_waiting

    env: dict[str, str] = {}
    set_openmp_waiting(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        set_openmp_waiting(env)
        assert env == chosen
