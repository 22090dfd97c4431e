"""argparse value types shared by the subcommands (``demo``, ``bench``).

Each checks its value while the command line is parsed, so a bad option is
an argparse error (exit status 2) before anything compiles, with a message
of the form "must be ..., got ...".
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _convert(text: str, kind: Callable[[str], Any], what: str) -> Any:
    """``kind(text)``, or an argparse error saying the text is not ``what``."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {what}, got {text!r}"
        ) from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        value = _convert(text, int, "an integer")
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be >= {minimum}, got {value}"
            )
        return value

    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number ``>= 0``."""
    value = _convert(text, float, "a number")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a finite number >= 0, got {text}"
        )
    return value
