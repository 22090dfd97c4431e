"""What the suite says while it compiles: a pytest plugin.

A cold run spends minutes compiling the Mojo kernels and MAX graphs,
most of it in the first tests of each file, with nothing on the terminal.
This plugin says so once at the start of a session and, while a test runs
for longer than ``still_running_after`` seconds (an ini option, 30 by
default), names it, and again every ``still_running_every`` seconds (60).

Both go to a copy of the terminal's file descriptor taken before any test
runs, so they show under ``-q``, with ``-s`` or without, and never touch
the capture a running test may depend on. Under pytest-xdist only the
controller writes: the workers'
``pytest_runtest_logstart`` and ``pytest_runtest_logfinish`` reach it as
the same hooks, so it times every worker's current test. The plugin
imports nothing from MAX, so it costs the suite nothing to load.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

#: Seconds a test runs before the first "still running" line.
AFTER_S = 30.0
#: Seconds between later lines about the same test.
EVERY_S = 60.0


def cache_folder() -> str:
    """MAX's cache folder, where compiled kernels and graphs are kept.

    ``$MODULAR_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/modular``, else
    ``~/.cache/modular`` (written with ``~``), and what chose it.
    """
    if chosen := os.environ.get("MODULAR_CACHE_DIR"):
        return f"{chosen} (MODULAR_CACHE_DIR)"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    root = str(Path(cache, "modular"))
    home = str(Path.home())
    if root.startswith(home + os.sep):
        root = "~" + root[len(home) :]
    return f"{root} (MODULAR_CACHE_DIR if set)"


def start_line(after: float) -> str:
    """The line the controller writes once, at the session's start."""
    return (
        "mla-kpool: a first run compiles the Mojo kernels and MAX graphs for "
        f"minutes (a test past {after:g} s is named while it runs); MAX caches "
        f"them in {cache_folder()} and later runs load them from there"
    )


def still_line(nodeid: str, seconds: float) -> str:
    """The line about a test that has run for ``seconds``."""
    digits = 0 if seconds >= 10 else 1
    return (
        f"still running {nodeid} after {seconds:.{digits}f} s: compiling its "
        "graph cold; later runs load it from MAX's cache"
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "still_running_after",
        "seconds a test runs before the suite names it (default 30)",
        default=str(AFTER_S),
    )
    parser.addini(
        "still_running_every",
        "seconds between later lines about the same test (default 60)",
        default=str(EVERY_S),
    )


class Notice:
    """Times the running tests from one thread and names the long ones."""

    def __init__(
        self, config: pytest.Config, after: float, every: float
    ) -> None:
        self.config = config
        self.after = after
        self.every = every
        #: nodeid -> (start, when the next line is due)
        self.running: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self.watch, name="still-running", daemon=True
        )
        #: The terminal's descriptor, copied while capture is suspended.
        self.fd: int | None = None
        try:
            self.fd = os.dup(sys.__stdout__.fileno())
        except (AttributeError, OSError, ValueError):
            self.fd = None

    def write(self, line: str) -> None:
        """Writes ``line`` to the terminal, whatever the capture is doing.

        Through a copy of the terminal's file descriptor taken when the
        notice was made (capture is suspended then), never by suspending
        capture: this runs on the timer's thread while a test may have
        redirected ``sys.stdout`` itself, which a capture resumed from
        here would replace. Without a descriptor (an in-process pytest run
        of a test), through the terminal reporter.
        """
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        writer = getattr(reporter, "_tw", None)
        # Under -q the progress dots leave the line open: end it first.
        lead = (
            "\n" if writer is not None and writer.width_of_current_line else ""
        )
        if self.fd is not None:
            try:
                os.write(self.fd, f"{lead}{line}\n".encode())
                return
            except OSError:
                pass
        if reporter is not None:
            reporter.write(lead)
            reporter.write_line(line)
            reporter.flush()

    def watch(self) -> None:
        tick = min(1.0, self.after / 2)
        while not self.done.wait(tick):
            now = time.monotonic()
            due = []
            with self.lock:
                for nodeid, (start, at) in self.running.items():
                    if now >= at:
                        self.running[nodeid] = (start, now + self.every)
                        due.append((nodeid, now - start))
            for nodeid, seconds in due:
                self.write(still_line(nodeid, seconds))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.write(start_line(self.after))
        self.thread.start()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.running[nodeid] = (now, now + self.after)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        with self.lock:
            self.running.pop(nodeid, None)

    def pytest_sessionfinish(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def pytest_configure(config: pytest.Config) -> None:
    """Registers the notice on the process that owns the terminal."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller writes
        return
    notice = Notice(
        config,
        after=float(config.getini("still_running_after")),
        every=float(config.getini("still_running_every")),
    )
    config.pluginmanager.register(notice, "compile_notice_timer")
