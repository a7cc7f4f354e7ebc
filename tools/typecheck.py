"""Run mypy over the `kvpact.*` namespace (and benchmarks/) as it is installed.

mypy cannot follow setuptools' editable finder (the `package-dir` mapping in pyproject.toml is applied
by an import hook, which mypy does not run). So this builds the link tree of tools/link_tree.py in
build/typecheck (build/typecheck/kvpact/router -> router/, ...) and runs mypy with
`mypy_path = build/typecheck` (pyproject's [tool.mypy]). Errors name the linked path:
build/typecheck/kvpact/router/x.py is router/x.py.

    python tools/typecheck.py [MYPY_ARGS...]   # what `make lint` runs
"""

from __future__ import annotations

import subprocess
import sys

from link_tree import ROOT, build_tree


def main(argv: list[str]) -> int:
    build_tree(ROOT / "build" / "typecheck")
    command = [sys.executable, "-m", "mypy", "-p", "kvpact", "-p", "benchmarks", *argv]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
