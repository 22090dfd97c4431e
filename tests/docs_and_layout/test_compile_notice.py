"""The suite's notices on the terminal: a cold run compiles, a test is slow.

Each case runs pytest in a subprocess on a file of two tests, one that
sleeps past a tiny ``still_running_after``, with
``tests/support/compile_notice.py`` as its only plugin of this suite:
nothing compiles, a case takes seconds.
The slow test passes, so its captured output is never shown: a line that
capture swallowed would be missing here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.compile_notice import start_line

#: The suite's root, which holds the plugin's package (support).
TESTS = Path(__file__).resolve().parents[1]

SLOW_FILE = """
import contextlib
import io
import time


def test_slow():
    print("captured, never shown")
    # A test's own redirect of stdout survives the lines written meanwhile.
    mine = io.StringIO()
    with contextlib.redirect_stdout(mine):
        time.sleep(1.6)
        print("kept")
    assert mine.getvalue() == "kept\\n"


def test_fast():
    pass
"""


@pytest.fixture(autouse=True)
def plugin_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The subprocess imports ``support.compile_notice`` from the suite."""
    path = [str(TESTS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


@pytest.mark.parametrize(
    "workers",
    [pytest.param(["-n", "0"], id="n0"), pytest.param(["-n", "2"], id="xdist")],
)
def test_start_line_and_still_running_line(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    workers: list[str],
) -> None:
    monkeypatch.setenv("MODULAR_CACHE_DIR", "/some/cache")
    pytester.makepyfile(test_slow=SLOW_FILE)
    result = pytester.runpytest_subprocess(
        "-p",
        "support.compile_notice",
        "-q",
        *workers,
        "-o",
        "still_running_after=0.3",
        "-o",
        "still_running_every=0.5",
    )
    result.assert_outcomes(passed=2)
    out = result.stdout.lines
    assert out.count(start_line(0.3)) == 1, result.stdout.str()
    assert "in /some/cache (MODULAR_CACHE_DIR) and later" in start_line(0.3)
    still = [line for line in out if line.startswith("still running")]
    # After 0.3 s and every 0.5 s after: 2 or 3 lines in a 1.6 s test.
    assert len(still) >= 2, result.stdout.str()
    assert all(
        line.startswith("still running test_slow.py::test_slow after ")
        and line.endswith(
            " s: compiling its graph cold; later runs load it from MAX's cache"
        )
        for line in still
    ), still
    assert "captured, never shown" not in result.stdout.str()


def test_quiet_under_the_threshold(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MODULAR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere/xdg")
    pytester.makepyfile(test_slow=SLOW_FILE)
    result = pytester.runpytest_subprocess(
        "-p", "support.compile_notice", "-q", "-n", "0"
    )
    result.assert_outcomes(passed=2)
    lines = result.stdout.lines
    assert not [line for line in lines if "still running" in line]
    assert lines.count(start_line(30)) == 1, result.stdout.str()
    assert "in /elsewhere/xdg/modular (MODULAR_CACHE_DIR if set)" in (
        start_line(30)
    )
