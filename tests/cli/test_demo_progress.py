"""The demo's progress display when stderr is not a terminal.

A log or a pipe gets a flushed line now and then (at most one per
``LINE_INTERVAL_S`` seconds, and one when the last call is done), never a
bar; a terminal gets the ``tqdm`` bar; ``--no-progress`` gets nothing.
"""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from mla_kpool._progress import LINE_INTERVAL_S, LineProgress, progress_for
from mla_kpool.demo import cli as demo


class Log(io.StringIO):
    """A stream that is not a terminal and records what each flush saw."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_are_throttled_and_the_last_call_always_prints():
    now = [100.0]
    log = Log()
    progress = LineProgress(50, log, interval=10.0, clock=lambda: now[0])
    with_a_line = []
    for call in range(1, 51):
        now[0] += 1.5  # a call every 1.5 s: 75 s in all
        before = log.getvalue()
        progress.set_postfix_str(f"{call // 10}/5 requests checked")
        progress.update(1)
        if log.getvalue() != before:
            with_a_line.append(call)
    progress.close()
    # A line on the first update 10 s after the previous one (call 7 at
    # 10.5 s, then every 7 calls), and on the last call.
    assert with_a_line == [7, 14, 21, 28, 35, 42, 49, 50]
    lines = log.getvalue().splitlines()
    assert lines[0] == "demo: 7/50 calls, 0/5 requests checked, 10 s"
    assert lines[-2] == "demo: 49/50 calls, 4/5 requests checked, 74 s"
    assert lines[-1] == "demo: 50/50 calls, 5/5 requests checked, 75 s"
    # Each line was flushed as it was printed, not at the end.
    assert log.flushed[0] == lines[0] + "\n"
    assert len(log.flushed) == len(lines)


def test_a_short_run_prints_one_line():
    log = Log()
    progress = LineProgress(3, log, clock=lambda: 0.0)
    for _ in range(3):
        progress.update()
    assert log.getvalue() == "demo: 3/3 calls, 0 s\n"


def test_progress_for_each_stream():
    assert isinstance(progress_for(5, Log()), LineProgress)
    bar = progress_for(5, Terminal())
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    for stream in (Log(), Terminal()):
        quiet = progress_for(5, stream, enabled=False)
        quiet.update(5)
        quiet.close()
        assert stream.getvalue() == ""


def test_help_says_what_no_progress_turns_off(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--no-progress no progress display (a bar when stderr is a terminal,"
        f" else a line every {LINE_INTERVAL_S:.0f} s at most)" in text
    )
