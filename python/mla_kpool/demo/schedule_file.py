"""``--schedule`` files: a workload, and maybe every call's batch, as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._argtypes import MAX_HEAD_DIM, MAX_KPOOL
from .workload import DTYPES, Request, ScheduleError

__all__ = ["load_schedule", "parse_schedule"]


@dataclass(frozen=True)
class ScheduleFile:
    """A parsed ``--schedule`` file.

    Attributes:
        requests: The requests.
        calls: Per call, ``(request, tokens)`` pairs in batch order; ``None``
            when the file leaves batching to :func:`schedule`.
        settings: The options the file fixes, by option name: ``kpool``,
            ``head_dim`` and ``max_running`` (integers), ``dtype`` (a name
            of :data:`DTYPES`).
    """

    requests: tuple[Request, ...]
    calls: tuple[tuple[tuple[int, int], ...], ...] | None
    settings: dict[str, Any]


#: Settings a file may fix that are integers ``>= 1``.
_SIZES = ("kpool", "head_dim", "max_running")


_TOP_KEYS = (*_SIZES, "dtype", "requests", "calls")


_REQUEST_KEYS = ("prompt", "generate", "cached_prefix")

#: Most tokens a request's prompt or generation may have: 16 times the
#: longest context served today, and small enough that the demo plans
#: the file in seconds before it says how long a run it would be.
MAX_REQUEST_TOKENS = 2**24

#: The settings' bounds, as the command line's options have them, with
#: their reasons.
_LIMITS = {
    "kpool": (MAX_KPOOL, "kpool is a compile-time parameter of the kernels"),
    "head_dim": (
        MAX_HEAD_DIM,
        "head_dim is a compile-time parameter of the kernels",
    ),
}


def _int(
    value: Any,
    where: str,
    minimum: int,
    maximum: int | None = None,
    why: str = "",
) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleError(
            f"{where} must be an integer >= {minimum}, got {value!r}"
        )
    if maximum is not None and value > maximum:
        raise ScheduleError(
            f"{where} must be at most {maximum:,}, got {value:,}: {why}"
        )
    return value


def _keys(obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ScheduleError(
            f"{where}: unknown key {unknown[0]!r} (allowed: "
            f"{', '.join(allowed)})"
        )


def _request(obj: Any, where: str) -> Request:
    if not isinstance(obj, dict):
        raise ScheduleError(
            f"{where} must be an object like "
            f'{{"prompt": 700, "generate": 20}}, got {obj!r}'
        )
    _keys(obj, _REQUEST_KEYS, where)
    if "prompt" not in obj:
        raise ScheduleError(f'{where} needs "prompt"')
    why = "a request's tokens are planned in memory"
    prompt = _int(obj["prompt"], f"{where}.prompt", 1, MAX_REQUEST_TOKENS, why)
    generate = _int(
        obj.get("generate", 0), f"{where}.generate", 0, MAX_REQUEST_TOKENS, why
    )
    prefix = _int(obj.get("cached_prefix", 0), f"{where}.cached_prefix", 0)
    if prefix >= prompt:
        raise ScheduleError(
            f"{where}.cached_prefix must be < prompt ({prompt}), got {prefix}"
        )
    return Request(prompt, generate, prefix)


def _call(obj: Any, where: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(obj, list):
        raise ScheduleError(
            f"{where} must be a list of [request, tokens] pairs, got {obj!r}"
        )
    pairs = []
    for j, pair in enumerate(obj):
        at = f"{where}[{j}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise ScheduleError(
                f"{at} must be a [request, tokens] pair, got {pair!r}"
            )
        pairs.append(
            (
                _int(pair[0], f"{at}[0] (request)", 0),
                _int(pair[1], f"{at}[1]", 0),
            )
        )
    return tuple(pairs)


def parse_schedule(data: Any) -> ScheduleFile:
    """Validates a decoded schedule (see :func:`load_schedule`).

    Args:
        data: The decoded JSON value.

    Returns:
        The schedule.

    Raises:
        ScheduleError: If anything is missing, unknown or out of range; the
            message names the place, e.g. ``requests[3].prompt``.
    """
    if not isinstance(data, dict):
        raise ScheduleError(
            f'the schedule must be a JSON object with "requests", got '
            f"{type(data).__name__}"
        )
    _keys(data, _TOP_KEYS, "schedule")
    if "requests" not in data:
        raise ScheduleError('the schedule needs "requests"')
    reqs = data["requests"]
    if not isinstance(reqs, list) or not reqs:
        raise ScheduleError(
            f'"requests" must be a non-empty list, got {reqs!r}'
        )
    requests = tuple(_request(r, f"requests[{i}]") for i, r in enumerate(reqs))
    calls = None
    if "calls" in data:
        if not isinstance(data["calls"], list) or not data["calls"]:
            raise ScheduleError(
                f'"calls" must be a non-empty list of calls, got '
                f"{data['calls']!r}"
            )
        calls = tuple(
            _call(c, f"calls[{i}]") for i, c in enumerate(data["calls"])
        )
    settings = {
        n: _int(data[n], n, 1, *_LIMITS.get(n, (None, "")))
        for n in _SIZES
        if n in data
    }
    if "dtype" in data:
        if data["dtype"] not in DTYPES:
            raise ScheduleError(
                f"dtype must be one of {', '.join(DTYPES)}, got "
                f"{data['dtype']!r}"
            )
        settings["dtype"] = data["dtype"]
    return ScheduleFile(requests, calls, settings)


def load_schedule(path: str | Path) -> ScheduleFile:
    """Reads and validates a JSON schedule file.

    The format (only ``requests`` is required)::

        {
          "kpool": 4, "head_dim": 128, "dtype": "bfloat16", "max_running": 16,
          "requests": [{"prompt": 700, "generate": 20, "cached_prefix": 0}],
          "calls": [[[0, 512]], [[0, 188]], [[0, 3]], ...]
        }

    Each call lists ``[request, tokens]`` pairs in batch order (requests
    are numbered from 0 in file order); without ``calls`` the demo batches
    the requests itself (:func:`schedule`).

    Args:
        path: The file.

    Returns:
        The schedule.

    Raises:
        ScheduleError: If the file cannot be read, is not JSON, or fails
            :func:`parse_schedule`; the message starts with the path.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ScheduleError(f"{path}: cannot read: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ScheduleError(
            f"{path}: not UTF-8 text (byte {err.start}): a schedule is JSON"
        ) from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ScheduleError(
            f"{path}: not valid JSON: {err.msg} (line {err.lineno}, "
            f"column {err.colno})"
        ) from err
    try:
        return parse_schedule(data)
    except ScheduleError as err:
        raise ScheduleError(f"{path}: {err}") from err
