"""argparse value types and usage errors shared by the subcommands.

``demo``, ``bench``, ``gpu-report`` and ``gpu-profile`` use them. Each
type checks its value while the command line is parsed, so a bad option
is an argparse error (exit status 2) before anything compiles, with a
message of the form "must be ..., got ...". Every number has an upper
bound as well as a lower one (:func:`int_in`), with the reason in the
message, so a run far past what a machine can do is refused in a second
rather than found out after minutes of compiling. Problems found after
parsing go through :func:`usage_error`, under the same program name.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

#: The program name when nothing set one (see :func:`program_defaults`).
PROGRAM = "python -m mla_kpool"


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


def int_in(minimum: int, maximum: int, why: str) -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]``.

    Args:
        minimum: The smallest value accepted.
        maximum: The largest value accepted.
        why: Why the upper bound, said when a value passes it (a clause
            such as ``"kpool is a compile-time parameter ..."``).
    """
    at_least = int_at_least(minimum)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"must be at most {maximum:,}, got {value:,}: {why}"
            )
        return value

    return parse


def float_in(
    minimum: float, maximum: float, why: str
) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[minimum, maximum]``.

    Args:
        minimum: The smallest value accepted.
        maximum: The largest value accepted.
        why: Why the upper bound, said when a value passes it.
    """

    def parse(text: str) -> float:
        value = _convert(text, float, "a number")
        if not minimum <= value < float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be a finite number >= {minimum:g}, got {text}"
            )
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"must be at most {maximum:g}, got {text}: {why}"
            )
        return value

    return parse


def program_defaults(parser: argparse.ArgumentParser) -> None:
    """Records the parser's program name in its parsed options.

    So that :func:`usage_error` names the program as argparse's own errors
    do (``python -m mla_kpool demo``, or ``mla-kpool demo`` for the
    console script).
    """
    parser.set_defaults(prog=parser.prog)


def usage_error(args: argparse.Namespace, message: str) -> int:
    """Reports a usage problem found after parsing; returns exit status 2.

    Prints ``<prog>: error: <message>`` to stderr, as argparse does, with
    the program name :func:`program_defaults` recorded (:data:`PROGRAM`
    when none was).

    Args:
        args: The parsed options.
        message: What is wrong, naming the option.

    Returns:
        2, the exit status of a usage error.
    """
    prog = getattr(args, "prog", PROGRAM)
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def available_memory() -> int | None:
    """Bytes of memory this machine can still give a process, or ``None``.

    ``MemAvailable`` of ``/proc/meminfo`` (Linux), else free physical
    pages times the page size, else ``None`` (unknown: no check).
    """
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


#: Largest ``kpool`` and ``head_dim`` the demo and the bench take: both
#: are compile-time parameters of every writer kernel, and expand_topk
#: unrolls its stores over ``kpool``, so a compile grows with them
#: (``--kpool 1000000`` compiled for minutes at 2 GB). kpool 1024 is 256
#: times GLM-5-Next's and the largest the demo has been run at (``demo
#: --kpool 1024 --requests 4``; at 256 about 2.5 min cold on a busy 2-core
#: VM, expand_topk 85 ms a call); head_dim 1024 is 8 times GLM-5-Next's,
#: where the GPU writers' block stops growing. What a run at such sizes
#: holds in memory is checked after planning (the demo's ``check_size``).
MAX_KPOOL = 1024
MAX_HEAD_DIM = 1024

#: argparse types of ``--kpool`` / ``--kpools`` and ``--head-dim``.
kpool_option = int_in(
    1, MAX_KPOOL, "kpool is a compile-time parameter of the kernels"
)
head_dim_option = int_in(
    1, MAX_HEAD_DIM, "head_dim is a compile-time parameter of the kernels"
)


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
