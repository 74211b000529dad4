"""A progress bar on stderr for long replays (only on a terminal, unless asked)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    """``update(done)`` redraws ``label [####      ] 42%`` at most ten times a second."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self._drawn = 0.0
        self._done = -1

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done == self._done or (now - self._drawn < 0.1 and done < self.total):
            return
        self._drawn, self._done = now, done
        share = min(done / self.total, 1.0)
        filled = int(share * WIDTH)
        bar = "#" * filled + " " * (WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {share:4.0%}")
        self.stream.flush()

    def close(self) -> None:
        self.update(self.total)
        self.stream.write("\n")
        self.stream.flush()
