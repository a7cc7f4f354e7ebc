"""Load progress on stderr, only when stderr is a terminal (logs stay clean otherwise)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """`step()` once per unit of work; `close()` ends the line. Silent unless `stream` is a TTY."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = total > 0 and self.stream.isatty()
        self.label, self.total, self.done = label, total, 0
        self._shown = -1

    def step(self) -> None:
        self.done += 1
        percent = 100 * self.done // self.total if self.total else 100
        if self.enabled and percent != self._shown:
            self._shown = percent
            self.stream.write(f"\r{self.label}: {percent:3d}% ({self.done}/{self.total})")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._shown >= 0:
            self.stream.write("\n")
            self.stream.flush()
