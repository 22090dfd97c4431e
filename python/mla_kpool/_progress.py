"""Progress of the demo and the bench: a bar on a terminal, else lines.

:func:`progress_for` picks the display that
:func:`mla_kpool.demo.checked_run.serve` updates once per call and the
bench once per configuration: a ``tqdm`` bar when the stream is a
terminal, and otherwise (a log file, a pipe, CI) a :class:`LineProgress`,
which prints a flushed line every :data:`LINE_INTERVAL_S` seconds while
the work goes on (also while one item, such as a first graph compile,
takes longer than that) and one when the last item is done, so that a long
run does not look hung and a log does not fill up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LINE_INTERVAL_S", "LineProgress", "progress_for"]

#: Seconds between two progress lines when the stream is not a terminal.
LINE_INTERVAL_S = 10.0


class LineProgress:
    """Progress as plain lines, behind ``tqdm``'s methods the callers use.

    Prints ``<desc>: <done>/<total> <unit>, <postfix>, <s> s`` (flushed)
    on the first update after ``interval`` seconds since the start or the
    last line, and on the update that reaches ``total``; with
    ``heartbeat``, also every ``interval`` seconds that pass with no
    update (a background thread, stopped by :meth:`close`).

    Args:
        total: Items in the run.
        file: Where the lines go.
        desc: The lines' prefix.
        unit: What an item is, plural (``"calls"``).
        interval: Least seconds between two lines (the last one excepted).
        clock: Seconds, monotonic (``time.perf_counter``); tests pass their
            own.
        heartbeat: Whether to print a line every ``interval`` seconds of
            real time with no update.
    """

    def __init__(
        self,
        total: int,
        file: TextIO,
        desc: str = "demo",
        interval: float = LINE_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
        *,
        unit: str = "calls",
        heartbeat: bool = False,
    ) -> None:
        self.total, self.file, self.desc = total, file, desc
        self.unit, self.interval, self.clock = unit, interval, clock
        self.done = 0
        self.postfix = ""
        self.started = self.last = clock()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._beat = None
        if heartbeat:
            self._beat = threading.Thread(target=self._beat_loop, daemon=True)
            self._beat.start()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        """Sets what follows the count in the next line."""
        del refresh  # lines are printed on update only
        self.postfix = text

    def update(self, n: int = 1) -> None:
        """Counts ``n`` more items; prints a line if one is due."""
        with self._lock:
            self.done += n
            self._line_if_due(self.done >= self.total)

    def close(self) -> None:
        """Stops the heartbeat; every line was flushed already."""
        self._closed.set()
        if self._beat is not None:
            self._beat.join()

    def _line_if_due(self, last: bool) -> None:
        """Prints a line if ``last`` or ``interval`` seconds have passed."""
        now = self.clock()
        if last or now - self.last >= self.interval:
            self.last = now
            postfix = f", {self.postfix}" if self.postfix else ""
            print(
                f"{self.desc}: {self.done}/{self.total} {self.unit}{postfix}, "
                f"{now - self.started:.0f} s",
                file=self.file,
                flush=True,
            )

    def _beat_loop(self) -> None:
        """The heartbeat: a line whenever ``interval`` passes unannounced."""
        while not self._closed.wait(self.interval / 4):
            with self._lock:
                if self.done < self.total:
                    self._line_if_due(False)


def progress_for(
    total: int,
    file: TextIO,
    enabled: bool = True,
    *,
    desc: str = "demo",
    unit: str = "calls",
) -> Any:
    """The progress display of a run of ``total`` items, on ``file``.

    Args:
        total: Items in the run.
        file: The stream (the command's stderr).
        enabled: ``False`` for ``--no-progress``: a display that shows
            nothing.
        desc: The display's label.
        unit: What an item is, plural.

    Returns:
        A ``tqdm`` bar if ``file`` is a terminal (disabled when not
        ``enabled``), else a :class:`LineProgress` with a heartbeat (a
        disabled ``tqdm`` when not ``enabled``).
    """
    is_tty = file.isatty()
    if enabled and not is_tty:
        return LineProgress(total, file, desc, unit=unit, heartbeat=True)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit.removesuffix("s"),
        file=file,
        disable=not enabled,
    )
