"""A dependency-free progress bar for the command line (``moe-fp8 bench``, ``warmup``, ``quantize``).

On a terminal it redraws one line on stderr (``\\r``): bar, count, percent, elapsed time, ETA and the
current item. Anywhere else (a pipe, a log file, CI) it prints one plain line per step,
``[i/n] item``, so logs stay readable and ``scripts/record_gpu_check.py`` can strip them with one
regular expression. Messages printed through ``Progress.write`` never collide with the bar.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``75.3`` → ``'1:15'``; ``3725`` → ``'1:02:05'``."""
    s = max(0, round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Progress over ``total`` steps; use as a context manager so the bar line is always finished.

    ``stream`` defaults to stderr (stdout stays clean for tables and JSON); ``tty`` overrides the
    terminal detection (tests). ``enabled=False`` makes every call a no-op.
    """

    BAR_WIDTH = 24
    # A redraw costs a write syscall; 10 per second is smooth enough and cheap for fast loops.
    MIN_REDRAW_S = 0.1

    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None, tty: bool | None = None,
                 enabled: bool = True) -> None:
        self.total = max(0, int(total))
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self._isatty(self.stream) if tty is None else tty
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    @staticmethod
    def _isatty(stream: TextIO) -> bool:
        try:
            return stream.isatty()
        except (AttributeError, ValueError):  # closed or not a real file
            return False

    def __enter__(self) -> Progress:
        if self.enabled and self.tty and self.total:  # a total set later (quantize counts first) draws then
            self._draw("", force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1, item: str = "") -> None:
        """Advance by ``n`` steps; ``item`` names what just finished (shown beside the bar)."""
        self.done = min(self.total, self.done + n) if self.total else self.done + n
        if not self.enabled:
            return
        if self.tty:
            self._draw(item, force=self.done >= self.total)
        else:
            label = f"{self.label}: " if self.label else ""
            self.stream.write(f"[{self.done}/{self.total}] {label}{item}".rstrip() + "\n")
            self.stream.flush()

    def write(self, message: str) -> None:
        """Print ``message`` on its own line(s) without garbling the bar."""
        if not self.enabled:
            return
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        self.stream.write(message.rstrip("\n") + "\n")
        if self.tty and self._drawn:
            self._draw("", force=True)
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (TTY); safe to call twice."""
        if self.enabled and self.tty and self._drawn:
            self._draw("", force=True)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
        self.enabled = False

    def line(self, item: str = "") -> str:
        """The text of the bar as it would be drawn now (without the carriage return)."""
        elapsed = time.monotonic() - self.start
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.BAR_WIDTH)
        bar = "#" * filled + "." * (self.BAR_WIDTH - filled)
        eta = ""
        if 0 < self.done < self.total:
            eta = f", eta {format_seconds(elapsed / self.done * (self.total - self.done))}"
        label = f"{self.label} " if self.label else ""
        text = (f"{label}[{bar}] {self.done}/{self.total} {frac:4.0%} "
                f"{format_seconds(elapsed)}{eta}" + (f"  {item}" if item else ""))
        width = shutil.get_terminal_size((100, 20)).columns - 1
        return text if len(text) <= width else text[: max(0, width - 1)] + "…"

    def _draw(self, item: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < self.MIN_REDRAW_S:
            return
        self._last_draw = now
        self.stream.write("\r\x1b[2K" + self.line(item))
        self.stream.flush()
        self._drawn = True
