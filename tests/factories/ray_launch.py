"""Helpers for tests that run `kvpact-launch` against a Ray cluster on this machine.

    cluster = cluster_file(tmp_path, workers=[cpu_group(model, "cpu", 2)])
    with launched(cluster, ray_address) as launch:
        address = wait_serving(launch)

The launcher runs as a real process (`python -m kvpact.deploy.launch`), joining the test's Ray cluster
through $RAY_ADDRESS, and is stopped by pid. Token authentication is set explicitly (RAY_AUTH_MODE): Ray
2.59+ turns it on by default for local clusters.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvpact.deploy.processes import ProcessHandle, running, wait_for_line

T = TypeVar("T")

# The cluster's Ray processes (raylet, GCS) take unix sockets under the temp dir: keep the path short.
RAY_AUTH = {"RAY_AUTH_MODE": "disabled"}
# Not anchored at a line's start: Ray forwards an actor's output from a thread of the launcher's process,
# writing a line's text and its newline apart, so a launcher line can land right after an actor's text
# (seen in CI: "...serving tiny on 192.0.2.2:38091kvpact-launch: the cluster is SERVING on ...").
SERVING_LINE = r"kvpact-launch: the cluster is SERVING on (\S+)$"
PLACEMENT_GROUP_LINE = r"\(placement group (kvpact-[0-9a-f]+);"
MAX_MODEL_LEN = 256


@contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in this process's environment for the block (an in-process Ray reads them), restored after."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ray_auth_env() -> AbstractContextManager[None]:
    return scoped_env(RAY_AUTH)


def short_temp_dir(prefix: str = "kvr-") -> str:
    """A new directory for Ray's session files, under TMPDIR while that path is short, else under /tmp.

    Ray's unix socket paths (under the session dir) are limited to 107 bytes."""
    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=prefix, dir=base if len(base) <= 48 else "/tmp")


def tried_twice(start: Callable[[], T | str], what: str) -> T:
    """What `start()` started, trying once more when it returns a failure's text instead.

    Ray waits a hard-coded 30 s for its GCS and raylet to come up ("The current node timed out during
    startup", "Timed out waiting for file .../gcs_server_port_..."); a CI machine stalled for those seconds
    fails the start, not the test. Raises naming both failures."""
    failures: list[str] = []
    for _ in range(2):
        got = start()
        if not isinstance(got, str):
            return got
        failures.append(got)
    raise RuntimeError(f"{what} did not start, twice:\n" + "\n---\n".join(failures))


def start_local_ray(**init_kwargs: Any) -> Any:
    """`ray.init(**init_kwargs)` in a new short session dir, tried twice when Ray's start times out (shut
    down in between; the failure's text carries the tail of the raylet's and GCS's logs)."""
    import ray

    def start() -> Any:
        temp_dir = short_temp_dir()
        try:
            return ray.init(**init_kwargs, _temp_dir=temp_dir)
        except Exception as exc:
            if "timed out" not in str(exc).lower():
                raise
            ray.shutdown()
            return f"{exc}\n{_session_logs_tail(temp_dir)}"

    return tried_twice(start, "ray")


def _session_logs_tail(temp_dir: str, chars: int = 2000) -> str:
    logs = sorted(Path(temp_dir).glob("session_*/logs/*"))
    picked = [log for log in logs if log.name.startswith(("raylet", "gcs_server")) and log.is_file()]
    return "\n".join(f"{log.name}: {log.read_text(errors='replace')[-chars:]}" for log in picked)


@contextmanager
def private_ray_temp_dir() -> Iterator[str]:
    """A short temp dir that is also Ray's default temp root ($RAY_TMPDIR) for the block, yielded as the
    session root to pass on (`temp_dir`/`_temp_dir`). `ray.cluster_utils.Cluster` writes its address file
    to `$RAY_TMPDIR/ray/ray_current_cluster` without creating the folder: a machine where Ray never ran has
    no /tmp/ray, and a shared one would hand this test's address to every other `ray.init()` there."""
    root = short_temp_dir()
    os.makedirs(os.path.join(root, "ray"))
    try:
        with scoped_env({"RAY_TMPDIR": root}):
            yield os.path.join(root, "ray")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def worker_group(
    model: Path, name: str, replicas: int, *, resources: Mapping[str, float] | None = None, **flags: Any
) -> dict[str, Any]:
    """A workers[] entry running the tiny model on CPU (paged, torch backend unless flags say)."""
    return {
        "name": name,
        "replicas": replicas,
        "resources": dict(resources or {"num_cpus": 1}),
        "flags": {
            "model": str(model),
            "model-name": "tiny",
            "device": "cpu",
            "pa-backend": "torch",
            "max-model-len": MAX_MODEL_LEN,
            "log-format": "json",
            "router-timeout": 60,
            **{key.replace("_", "-"): value for key, value in flags.items()},
        },
    }


def cluster_file(
    directory: Path,
    *,
    workers: list[dict[str, Any]],
    policy: str = "on",
    strategy: str = "PACK",
    placement_timeout_s: float = 120,
    startup_timeout_s: float = 150,
    listen: str = "127.0.0.1:0",
    auth_token_file: Path | None = None,
    router_flags: Mapping[str, Any] | None = None,
    name: str = "cluster.yaml",
) -> Path:
    document = {
        "ray": {
            "address": "auto",
            "placement_strategy": strategy,
            "placement_timeout_s": placement_timeout_s,
        },
        "router": {
            "listen": listen,
            "paged_attn": policy,
            "startup_timeout_s": startup_timeout_s,
            "auth_token_file": str(auth_token_file) if auth_token_file else None,
            "flags": {"log-format": "json", **(router_flags or {})},
        },
        "workers": workers,
    }
    path = directory / name
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def launch_argv(config: Path, *args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "kvpact.deploy.launch", "--config", str(config), *args]


@contextmanager
def launched(
    config: Path, ray_address: str, *, log_dir: Path, name: str = "launch", args: tuple[str, ...] = ()
) -> Iterator[ProcessHandle]:
    """The launcher joining the cluster at `ray_address` (`args`: e.g. ("--plan",)); stopped (SIGTERM, then
    SIGKILL) on the way out."""
    env = {**RAY_AUTH, "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1"}
    argv = launch_argv(config, *args)
    with running(argv, name=name, env=env, log_dir=log_dir, grace_s=60) as handle:
        yield handle


def wait_serving(handle: ProcessHandle, timeout_s: float = 240) -> str:
    """The router's address, once the launcher says the cluster serves."""
    return wait_for_line(handle, SERVING_LINE, timeout_s).group(1)


def placement_group_name(handle: ProcessHandle, timeout_s: float = 60) -> str:
    return wait_for_line(handle, PLACEMENT_GROUP_LINE, timeout_s).group(1)
