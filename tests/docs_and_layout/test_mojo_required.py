"""CI cannot pass without ``mojo``: the Mojo tests fail there, never skip.

Every test that runs ``mojo`` carries ``kpool_cases.needs_mojo``, which
skips it only where ``mojo`` is missing and ``MLA_KPOOL_REQUIRE_MOJO`` is
unset; ``.ci/run`` sets it, so a CI image without ``mojo`` fails those tests
(``require_mojo``) instead of passing with a score of them skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import kpool_cases
from support.kpool_cases import REQUIRE_MOJO

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


@pytest.mark.parametrize(
    "value, found, skips",
    [
        (None, False, True),
        ("0", False, True),
        ("1", False, False),
        (None, True, False),
        ("1", True, False),
    ],
)
def test_a_missing_mojo_skips_only_where_it_is_not_required(
    monkeypatch, value, found, skips
):
    if value is None:
        monkeypatch.delenv(REQUIRE_MOJO, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_MOJO, value)
    mojo = "/usr/bin/mojo" if found else None
    monkeypatch.setattr(kpool_cases, "mojo_command", lambda: mojo)
    assert kpool_cases.skip_without_mojo() is skips


def test_a_required_missing_mojo_fails_the_test(monkeypatch):
    monkeypatch.setenv(REQUIRE_MOJO, "1")
    monkeypatch.setattr(kpool_cases, "mojo_command", lambda: None)
    with pytest.raises(pytest.fail.Exception, match="mojo command is not"):
        kpool_cases.require_mojo()
    with pytest.raises(pytest.fail.Exception):
        kpool_cases.run_mojo_file("tests/mojo/test_operands.mojo")


def test_ci_requires_mojo_for_its_test_run():
    ci = (ROOT / ".ci" / "run").read_text()
    export = ci.find(f"export {REQUIRE_MOJO}=1\n")
    run = ci.find('"$VENV/bin/python" -m pytest')
    assert 0 <= export < run


def test_no_test_skips_on_its_own_mojo_lookup():
    # needs_mojo is the only rule: a test file's own skipif on a missing
    # mojo (or its own lookup) would skip in CI too.
    own = {
        p.name
        for p in TESTS.rglob("*.py")
        if p.name != "kpool_cases.py"
        and re.search(
            r"mojo_command\(\) is None|which\(\"mojo\"\)", p.read_text()
        )
    }
    assert own == set()
