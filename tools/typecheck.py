"""Run mypy over the `kvpact.*` namespace (and benchmarks/) as it is installed.

mypy cannot follow setuptools' editable finder (the `package-dir` mapping in pyproject.toml is applied
by an import hook, which mypy does not run). So this builds a link tree that spells the mapping out,

    build/typecheck/kvpact/{__init__.py, client.py, status_table.py, v1}  -> protos/kvpact/...
    build/typecheck/kvpact/{router, worker, shared, kernels, deploy}     -> the top-level folders

and runs mypy with `mypy_path = build/typecheck` (pyproject's [tool.mypy]). Directory links, so a new
module is seen without rebuilding; a new entry in protos/kvpact or a new part needs this script (it
rebuilds the tree on every run). Errors name the linked path, e.g. build/typecheck/kvpact/router/x.py
is router/x.py.

    python tools/typecheck.py              # what `make lint` runs
    python tools/typecheck.py -- FILES...  # not supported: mypy checks whole packages here
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir mapping: kvpact -> protos/kvpact, kvpact.router -> router, ..."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def link(target: Path, link_path: Path) -> None:
    link_path.symlink_to(os.path.relpath(target, link_path.parent), target_is_directory=target.is_dir())


def build_tree() -> Path:
    """(Re)build build/typecheck from pyproject's mapping; returns the folder to put on mypy_path."""
    dirs = package_dirs()
    root_pkg = TREE / "kvpact"
    if root_pkg.exists():
        for entry in root_pkg.iterdir():
            entry.unlink()
    root_pkg.mkdir(parents=True, exist_ok=True)
    parts = {name.split(".", 1)[1]: folder for name, folder in dirs.items() if name != "kvpact"}
    for entry in sorted(dirs["kvpact"].iterdir()):
        if entry.name not in parts and (entry.suffix == ".py" or (entry / "__init__.py").exists()):
            link(entry, root_pkg / entry.name)
    for part, folder in parts.items():
        link(folder, root_pkg / part)
    return TREE


def main(argv: list[str]) -> int:
    build_tree()
    command = [sys.executable, "-m", "mypy", "-p", "kvpact", "-p", "benchmarks", *argv]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
