"""The benchmark's progress bar on stderr (rank 0)."""

from __future__ import annotations

import sys
import time

from .common import KiB


class Progress:
    """A progress bar on ``stream`` (stderr): redrawn in place on a terminal; on anything
    else (a log file, a pipe) one plain line per 10 % so that logs stay readable.

    Work is counted in weights (about proportional to time: iterations x (S + 32 KiB)).
    """

    WIDTH = 28

    def __init__(self, total: float, enabled: bool = True, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total, self.done, self.start = max(total, 1e-9), 0.0, time.monotonic()
        self._decile = -1
        self._shown = False

    @staticmethod
    def weight(size_bytes: int, warmup: int, iters: int) -> float:
        return (warmup + iters) * (size_bytes + 32 * KiB)

    def advance(self, weight: float, label: str) -> None:
        if not self.enabled:
            return
        self.done = min(self.total, self.done + weight)
        frac = self.done / self.total
        elapsed = time.monotonic() - self.start
        eta = f", ~{elapsed * (1 - frac) / frac:.0f} s left" if 0.02 < frac < 1 else ""
        if self.tty:
            filled = int(frac * self.WIDTH)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            line = f"[{bar}] {frac * 100:5.1f}% {elapsed:5.0f} s{eta}  {label}"
            self.stream.write("\r" + line[:110].ljust(110))
            self._shown = True
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._decile:
                self._decile = decile
                self.stream.write(f"progress: {frac * 100:3.0f}% after {elapsed:.0f} s{eta} "
                                  f"({label})\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\r" + " " * 110 + "\r")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (e.g. a phase that is not counted in the bar)."""
        if self.enabled:
            self.close()
            self.stream.write(text + "\n")
            self.stream.flush()
