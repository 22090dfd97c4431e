"""argparse value types shared by the subcommands.

``demo``, ``bench`` and ``gpu-report`` use them. Each checks its value
while the command line is parsed, so a bad option is an argparse error
(exit status 2) before anything compiles, with a message of the form
"must be ..., got ...".
"""

from __future__ import annotations

import argparse
import os
import tempfile
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


def output_file(text: str) -> str:
    """An argparse type: a file path whose folder exists and is writable.

    Checked up front so that a long run is not lost to a typo in the path
    it writes its results to at the end: the path is opened for appending
    (a file that did not exist is removed again), which also refuses what
    ``os.access`` lets through, such as a file under ``/proc``.
    """
    if not text:
        raise argparse.ArgumentTypeError("must be a file path, got ''")
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"must be a file in an existing folder, got {text!r}"
        )
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: a folder")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: its folder is not writable"
        )
    existed = os.path.exists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: {e.strerror or e}"
        ) from None
    if not existed:
        os.remove(text)
    return text


def output_dir(text: str) -> str:
    """An argparse type: a folder that exists or can be created, writable.

    The folder itself, or else the nearest folder above it that exists,
    must be a writable directory. Checked up front, like
    :func:`output_file`, so that a typo fails before anything compiles,
    and by a try, as :func:`output_file` opens its file: the folder is
    created (with the folders above it that are missing) and a folder made
    inside it, and everything the try made is removed again. So a path
    that ``os.access`` lets through but no folder can be made at (such as
    one under ``/proc``) is refused too.
    """
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(
            f"must be a folder, got the file {text!r}"
        )
    missing = []
    existing = path
    while not os.path.exists(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(
            f"cannot create {text!r}: {existing!r} is not a folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}")
    what = "create" if missing else "write"
    try:
        os.makedirs(path, exist_ok=True)
        what = "write"
        os.rmdir(tempfile.mkdtemp(dir=path))
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot {what} {text!r}: {e.strerror or e}"
        ) from None
    finally:
        for folder in missing:  # the deepest first
            try:
                os.rmdir(folder)
            except OSError:
                pass
    return text
