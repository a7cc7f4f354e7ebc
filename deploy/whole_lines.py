"""The launcher's stdout and stderr write whole lines: no thread's text lands inside another's line.

Ray forwards every actor's output in the launcher's process (a thread of its own calling print), and
print writes a line's text and its newline as two writes; the launcher's own lines, printed from another
thread, then landed in between ("(WorkerActor pid=..) worker w0 listening ...kvpact-launch: the cluster is
SERVING on ..."), which an operator or a log scraper reading `kvpact-launch` (or `ray job logs`) saw as one
line. `keep_lines_whole()` wraps both streams: each thread's text is held until its newline, then the
whole line is written under one lock. A partial line is written by `flush()` (or at exit).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

_LOCK = threading.Lock()  # one for both streams: a terminal shows stdout and stderr interleaved


class WholeLines:
    """A text stream over `stream` that writes only whole lines (or what `flush` is asked to write)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._pending = threading.local()

    def write(self, text: str) -> int:
        held = getattr(self._pending, "text", "") + text
        cut = held.rfind("\n") + 1
        self._pending.text = held[cut:]
        if cut:
            with _LOCK:
                self.stream.write(held[:cut])
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        held = getattr(self._pending, "text", "")
        self._pending.text = ""
        with _LOCK:
            if held:
                self.stream.write(held)
            self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


def keep_lines_whole() -> None:
    """Wrap sys.stdout and sys.stderr (once) so every thread's lines stay whole."""
    if not isinstance(sys.stdout, WholeLines):
        sys.stdout = WholeLines(sys.stdout)
    if not isinstance(sys.stderr, WholeLines):
        sys.stderr = WholeLines(sys.stderr)
