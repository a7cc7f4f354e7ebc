"""What `pip install kvpact` really installs: one top-level name, the .proto files, and a client and router
that work without torch (the worker's dependencies are the `worker` extra).

Builds the wheel from this checkout (`pip wheel --no-deps`), installs it without extras into a fresh venv
(its dependencies from the index, pinned by constraints.txt) and runs the client import and `router --help`
there, from a directory outside the repository. About 30 s.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def run(*command: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The venv's setuptools when it has one (no download); else pip fetches the build backend.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", out, ROOT, cwd=out)
    assert built.returncode == 0, built.stdout + built.stderr
    [path] = out.glob("kvpact-*.whl")
    return path


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("client-venv")
    created = run(sys.executable, "-m", "venv", venv, cwd=venv)
    assert created.returncode == 0, created.stderr
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    installed = run(*pip, "-c", ROOT / "constraints.txt", wheel, cwd=venv)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def test_the_wheel_holds_one_top_level_name_and_the_protos(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvpact", wheel.name.split("-py3")[0] + ".dist-info"}
    protos = sorted(p.name for p in (ROOT / "protos" / "kvpact" / "v1").glob("*.proto"))
    assert protos and sorted(n.rsplit("/", 1)[1] for n in names if n.endswith(".proto")) == protos
    assert "kvpact/v1/py.typed" in names
    for part in ("router", "worker", "shared", "kernels", "deploy", "client"):
        assert f"kvpact/{part}/__init__.py" in names
    assert "kvpact/client/transport.py" in names
    assert not [n for n in names if n.startswith("kvpact/shared/client")]


def package_name(folder: Path) -> str:
    """The import name setuptools gives a folder: the deepest package-dir entry that holds it, plus the
    rest of the path (shared/client is `kvpact.client`, not `kvpact.shared.client`)."""
    holders = [(n, ROOT / f) for n, f in SETUPTOOLS["package-dir"].items() if folder.is_relative_to(ROOT / f)]
    name, base = max(holders, key=lambda item: len(item[1].parts))
    return ".".join((name, *folder.relative_to(base).parts))


def test_pyproject_lists_every_subpackage():
    """setuptools installs only the listed packages: a new folder with an __init__.py must be added."""
    on_disk = set()
    for folder in SETUPTOOLS["package-dir"].values():
        on_disk |= {package_name(init.parent) for init in (ROOT / folder).rglob("__init__.py")}
    assert {"kvpact.v1", "kvpact.worker.kv", "kvpact.client"} <= on_disk
    assert "kvpact.shared.client" not in on_disk
    missing = sorted(on_disk - set(SETUPTOOLS["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_a_client_only_install_needs_no_torch(client_venv: Path, tmp_path: Path):
    python = client_venv / "bin" / "python"
    client = run(
        python, "-c", "from kvpact.client import Client, render_cluster_status; print('ok')", cwd=tmp_path
    )
    assert client.returncode == 0 and client.stdout.strip() == "ok", client.stderr
    router = run(client_venv / "bin" / "router", "--help", cwd=tmp_path, timeout=60)
    assert router.returncode == 0 and "--paged-attn" in router.stdout, router.stderr
    torch = run(python, "-c", "import torch", cwd=tmp_path)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    where = run(python, "-c", "import kvpact.router; print(kvpact.router.__file__)", cwd=tmp_path)
    assert str(client_venv) in where.stdout, "the installed package, not the checkout, was imported"
