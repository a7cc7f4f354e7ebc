"""Spell out pyproject's package-dir mapping as a folder of links, for tools that cannot run setuptools'
editable import hook:

    DEST/kvpact/{__init__.py, client.py, status_table.py, v1}  -> protos/kvpact/...
    DEST/kvpact/{router, worker, shared, kernels, deploy}     -> the top-level folders

Directory links, so a new module is seen without rebuilding (a new part or a new file directly in
protos/kvpact needs a rebuild; every caller rebuilds on each run). With DEST on sys.path (mypy_path,
PYTHONPATH), `import kvpact.router` reads router/ of this checkout.

    python tools/link_tree.py DEST      # benchmarks/gpu_check.sh (a bare GPU image: no install)
    tools/typecheck.py                  # build/typecheck, for mypy
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir mapping: kvpact -> protos/kvpact, kvpact.router -> router, ..."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def _link(target: Path, link_path: Path) -> None:
    link_path.symlink_to(os.path.relpath(target, link_path.parent), target_is_directory=target.is_dir())


def build_tree(dest: Path) -> Path:
    """(Re)build DEST/kvpact; returns DEST (the folder to put on the path)."""
    dirs = package_dirs()
    root_pkg = dest / "kvpact"
    if root_pkg.exists():
        for entry in root_pkg.iterdir():
            entry.unlink()
    root_pkg.mkdir(parents=True, exist_ok=True)
    parts = {name.split(".", 1)[1]: folder for name, folder in dirs.items() if name != "kvpact"}
    for entry in sorted(dirs["kvpact"].iterdir()):
        if entry.name not in parts and (entry.suffix == ".py" or (entry / "__init__.py").exists()):
            _link(entry, root_pkg / entry.name)
    for part, folder in parts.items():
        _link(folder, root_pkg / part)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/link_tree.py DEST")
    print(build_tree(Path(sys.argv[1]).resolve()))
