"""The demo's progress: a bar on a terminal, else a line now and then.

:func:`progress_for` picks the display :func:`mla_kpool.demo.checked_run.serve`
updates once per call: a ``tqdm`` bar when the stream is a terminal, and
otherwise (a log file, a pipe, CI) a :class:`LineProgress`, which prints a
flushed line every :data:`LINE_INTERVAL_S` seconds at most and one when the
last call is done, so that a long run does not look hung and a log does not
fill up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LINE_INTERVAL_S", "LineProgress", "progress_for"]

#: Seconds between two progress lines when the stream is not a terminal.
LINE_INTERVAL_S = 10.0


class LineProgress:
    """Progress as plain lines, behind ``tqdm``'s methods ``serve`` calls.

    Prints ``<desc>: <done>/<total> calls, <postfix>, <s> s`` (flushed) on
    the first update after ``interval`` seconds since the start or the last
    line, and on the update that reaches ``total``; nothing otherwise.

    Args:
        total: Calls in the run.
        file: Where the lines go.
        desc: The lines' prefix.
        interval: Least seconds between two lines (the last one excepted).
        clock: Seconds, monotonic (``time.perf_counter``); tests pass their
            own.
    """

    def __init__(
        self,
        total: int,
        file: TextIO,
        desc: str = "demo",
        interval: float = LINE_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total, self.file, self.desc = total, file, desc
        self.interval, self.clock = interval, clock
        self.done = 0
        self.postfix = ""
        self.started = self.last = clock()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        """Sets what follows the count in the next line."""
        del refresh  # lines are printed on update only
        self.postfix = text

    def update(self, n: int = 1) -> None:
        """Counts ``n`` more calls; prints a line if one is due."""
        self.done += n
        now = self.clock()
        if self.done >= self.total or now - self.last >= self.interval:
            self.last = now
            postfix = f", {self.postfix}" if self.postfix else ""
            print(
                f"{self.desc}: {self.done}/{self.total} calls{postfix}, "
                f"{now - self.started:.0f} s",
                file=self.file,
                flush=True,
            )

    def close(self) -> None:
        """Nothing to close: each line was flushed."""


def progress_for(total: int, file: TextIO, enabled: bool = True) -> Any:
    """The progress display of a run of ``total`` calls, on ``file``.

    Args:
        total: Calls in the run.
        file: The stream (the demo's stderr).
        enabled: ``False`` for ``--no-progress``: a display that shows
            nothing.

    Returns:
        A ``tqdm`` bar if ``file`` is a terminal (disabled when not
        ``enabled``), else a :class:`LineProgress` (a disabled ``tqdm``
        when not ``enabled``).
    """
    is_tty = file.isatty()
    if enabled and not is_tty:
        return LineProgress(total, file)
    return tqdm(
        total=total,
        desc="demo",
        unit="call",
        file=file,
        disable=not enabled,
    )
