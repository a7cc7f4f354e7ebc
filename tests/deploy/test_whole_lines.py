"""deploy/whole_lines.py: lines printed by several threads at once (Ray's forwarding thread and the
launcher's own) come out whole, each once."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path
from typing import TextIO

from kvpact.deploy.whole_lines import WholeLines

LINES = 3000
WHO = ("ray", "launcher")


def _unbuffered(path: Path) -> TextIO:
    """A stream like a Ray job's stdout (PYTHONUNBUFFERED): every write is its own system call."""
    return io.TextIOWrapper(open(path, "wb", buffering=0), write_through=True)  # noqa: SIM115


def _print_from_threads(stream: TextIO) -> None:
    def say(who: str) -> None:
        for n in range(LINES):
            print(f"{who} line {n}", file=stream)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=say, args=(who,)) for who in WHO]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    stream.flush()


def test_lines_printed_by_two_threads_at_once_stay_whole(tmp_path: Path):
    path = tmp_path / "out"
    with _unbuffered(path) as out:
        _print_from_threads(WholeLines(out))  # type: ignore[arg-type]
    lines = path.read_text().splitlines()
    assert sorted(lines) == sorted(f"{who} line {n}" for who in WHO for n in range(LINES))


def test_a_partial_line_is_written_on_flush():
    out = io.StringIO()
    stream = WholeLines(out)
    stream.write("no newline yet")
    assert out.getvalue() == ""
    stream.flush()
    assert out.getvalue() == "no newline yet"
