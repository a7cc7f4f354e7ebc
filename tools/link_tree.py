"""Spell out pyproject's package-dir mapping as a folder of links, for tools that cannot run setuptools'
editable import hook:

    DEST/kvpact/{__init__.py, v1}                    -> protos/kvpact/...
    DEST/kvpact/{router, worker, kernels, deploy}    -> the top-level folders
    DEST/kvpact/shared/{*.py}, DEST/kvpact/client    -> shared/*.py, shared/client

Directory links, so a new module is seen without rebuilding. A folder that holds another mapped folder
(protos/kvpact holds the parts; shared/ holds shared/client, which is `kvpact.client`, not
`kvpact.shared.client`) becomes a real folder of per-entry links that leaves the nested one out, so each
file has one module name; a new file directly in such a folder needs a rebuild (every caller rebuilds
on each run). With DEST on sys.path (mypy_path,
PYTHONPATH), `import kvpact.router` reads router/ of this checkout.

    python tools/link_tree.py DEST      # benchmarks/gpu_check.sh (a bare GPU image: no install)
    tools/typecheck.py                  # build/typecheck, for mypy
"""

from __future__ import annotations

import os
import shutil
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
    if (dest / "kvpact").exists():
        shutil.rmtree(dest / "kvpact")  # links and folders of links only: never follows a link
    for name in sorted(dirs, key=lambda n: n.count(".")):  # parents first
        folder, link_path = dirs[name], dest.joinpath(*name.split("."))
        nested = {other for other in dirs.values() if other != folder and other.is_relative_to(folder)}
        children = {other.rsplit(".", 1)[1] for other in dirs if other.rpartition(".")[0] == name}
        if not nested and not children:
            _link(folder, link_path)
            continue
        link_path.mkdir(parents=True)
        for entry in sorted(folder.iterdir()):
            mapped_elsewhere = entry in nested or entry.name in children
            if not mapped_elsewhere and (entry.suffix == ".py" or (entry / "__init__.py").exists()):
                _link(entry, link_path / entry.name)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/link_tree.py DEST")
    print(build_tree(Path(sys.argv[1]).resolve()))
