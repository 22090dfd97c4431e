"""Serving workloads for the demo: requests, batching, ring slots.

A workload is a list of requests (prompt length, tokens to generate, cached
prefix) and a list of calls; each call names, in batch order, which requests
bring how many new tokens. :func:`schedule` batches requests the way a
serving engine does (a token budget per call, decode of running requests
first, prefill chunks of the others, new requests admitted while a ring slot
is free); a JSON file (:func:`load_schedule`) can give the calls explicitly.
:func:`plan` then turns either into the exact per-call metadata the writers
get: each request's cache length and ring slot at every call, slots handed
out at random from the free ones and reused once their request finishes, so
a slot id is in general not the request's batch position.

With speculative decoding (``spec_tokens`` in :func:`schedule`), a decode
step is a verify step: the request's next token and ``spec_tokens`` drafts
go through the writers, the target model keeps a seeded number of them (the
first token always), and the request's next call resumes after the last
token kept. An entry then records both what the call brought and what was
kept (:attr:`Entry.rejected`).

Everything here is pure Python and NumPy, deterministic for a given seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Call",
    "Entry",
    "Plan",
    "Request",
    "ScheduleError",
    "ScheduleFile",
    "generate_requests",
    "load_schedule",
    "parse_schedule",
    "plan",
    "schedule",
]

#: Key dtypes a schedule file may name.
DTYPES = ("float32", "bfloat16", "float16")


class ScheduleError(ValueError):
    """A workload or schedule that cannot run; the message says where."""


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Attributes:
        prompt: Prompt tokens, cached prefix included, ``>= 1``.
        generate: Tokens generated after the prompt, ``>= 0``.
        cached_prefix: Leading prompt tokens processed before the workload
            starts (a prefix-cache hit), ``0 <= cached_prefix < prompt``.
            Their complete pools are not produced again; a partial last
            pool's members must be restored into the ring on admission.
    """

    prompt: int
    generate: int = 0
    cached_prefix: int = 0

    @property
    def length(self) -> int:
        """Tokens in the whole sequence, ``prompt + generate``."""
        return self.prompt + self.generate

    @property
    def new_tokens(self) -> int:
        """Tokens the calls must bring, ``length - cached_prefix``."""
        return self.length - self.cached_prefix


@dataclass(frozen=True)
class Entry:
    """One request's part of one call.

    Attributes:
        request: Index into the workload's requests.
        slot: Ring slot the request holds (``slot_idx``).
        cache_length: Tokens of the request seen before this call.
        tokens: New tokens this call brings (``n``), ``>= 0``; drafts of
            a verify step included.
        admitted: Whether this is the request's first call.
        finished: Whether the request's last token is kept in this call.
        rejected: Trailing drafts of ``tokens`` that the verify step
            rejected (0 for prefill and plain decode); the request keeps
            the first ``tokens - rejected``.
    """

    request: int
    slot: int
    cache_length: int
    tokens: int
    admitted: bool
    finished: bool
    rejected: int = 0

    @property
    def accepted(self) -> int:
        """Tokens the request keeps: its next call starts this far on."""
        return self.tokens - self.rejected


#: A call: its entries in batch order.
Call = tuple[Entry, ...]

#: Chance that the target model accepts a draft, given that it accepted
#: every draft before it (speculative decoding, :func:`schedule`).
ACCEPTANCE = 0.7


@dataclass(frozen=True)
class Plan:
    """A workload with every call's metadata resolved.

    Attributes:
        requests: The requests.
        calls: Every call's entries, in batch order.
        max_slots: Ring slots (most requests in flight at once).
        slot_reuses: Admissions into a slot an earlier request had used.
    """

    requests: tuple[Request, ...]
    calls: tuple[Call, ...]
    max_slots: int
    slot_reuses: int


@dataclass(frozen=True)
class ScheduleFile:
    """A parsed ``--schedule`` file.

    Attributes:
        requests: The requests.
        calls: Per call, ``(request, tokens)`` pairs in batch order; ``None``
            when the file leaves batching to :func:`schedule`.
        kpool: Tokens per pool, if the file fixes it.
        head_dim: Channels per key, if the file fixes it.
        dtype: Key dtype name, if the file fixes it.
        max_running: Ring slots, if the file fixes it.
    """

    requests: tuple[Request, ...]
    calls: tuple[tuple[tuple[int, int], ...], ...] | None
    kpool: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    max_running: int | None = None


# --------------------------------------------------------------------------
# Generated workloads
# --------------------------------------------------------------------------


def generate_requests(
    rng: np.random.Generator,
    count: int,
    kpool: int,
    *,
    chunk: int = 512,
    max_prompt: int = 6000,
    max_generate: int = 256,
    cached_fraction: float = 0.25,
) -> list[Request]:
    """Draws a seeded mix of short and long requests.

    Prompt lengths are log-uniform between 2 and ``max_prompt``, so most
    are a few hundred tokens and some are thousands; four requests at random
    positions get edge lengths instead (1 token, ``kpool - 1`` tokens,
    exactly one chunk, two chunks plus ``kpool + 1``). About
    ``cached_fraction`` of the requests start with a cached prefix of random
    length (mid-pool in general, so the ring must be restored).

    Args:
        rng: Random source.
        count: Requests to draw, ``>= 1``.
        kpool: Tokens per pool (for the edge lengths).
        chunk: Prefill chunk size (for the edge lengths).
        max_prompt: Longest drawn prompt.
        max_generate: Most generated tokens per request.
        cached_fraction: Share of requests with a cached prefix.

    Returns:
        ``count`` requests.
    """
    prompts = np.exp(rng.uniform(math.log(2), math.log(max_prompt), count))
    prompts = [int(round(p)) for p in prompts]
    edges = [1, kpool - 1, chunk, 2 * chunk + kpool + 1]
    edges = [e for e in edges if e >= 1]
    where = rng.choice(count, size=min(len(edges), count), replace=False)
    for i, e in zip(where, edges, strict=False):
        prompts[int(i)] = e
    generate = rng.integers(0, max_generate + 1, count)
    cached = rng.random(count) < cached_fraction
    requests = []
    for i, prompt in enumerate(prompts):
        prefix = int(rng.integers(1, prompt)) if cached[i] and prompt > 1 else 0
        requests.append(Request(prompt, int(generate[i]), prefix))
    return requests


def schedule(
    requests: Sequence[Request],
    rng: np.random.Generator,
    *,
    token_budget: int = 2048,
    max_running: int = 16,
    chunk: int = 512,
    max_decode: int = 4,
    spec_tokens: int = 0,
    acceptance: float = ACCEPTANCE,
) -> list[list[tuple[int, ...]]]:
    """Batches requests into calls the way a serving engine does.

    Requests arrive at once and are admitted first come, first served. Each
    call spends at most ``token_budget`` tokens: first every running request
    that has finished its prompt decodes 1 to ``max_decode`` tokens (seeded;
    think of accepted speculative tokens), then running requests still in
    prefill get their next chunk of at most ``chunk`` tokens, then waiting
    requests are admitted with a first chunk while fewer than
    ``max_running`` are in flight and budget is left. A request leaves after
    the call that brings its last token, freeing its place for the next
    call.

    With ``spec_tokens = d > 0`` a decode is a verify step instead: it
    brings ``d + 1`` tokens (fewer if the budget is short), the request's
    next token and ``d`` drafts, and the request keeps the first token plus
    the drafts before the first rejected one, each accepted with chance
    ``acceptance`` (never past the request's end; drafts may run past it).

    Args:
        requests: The workload.
        rng: Random source for the decode step sizes and acceptances.
        token_budget: Most tokens per call, ``>= 1``.
        max_running: Most requests in flight at once, ``>= 1``.
        chunk: Most prefill tokens per request per call, ``>= 1``.
        max_decode: Most decode tokens per request per call, ``>= 1``
            (without ``spec_tokens``).
        spec_tokens: Drafts per verify step; 0 for plain decode.
        acceptance: Chance a draft is accepted after accepted ones.

    Returns:
        Per call, in batch order (decodes first, then prefill chunks),
        ``(request, tokens)`` pairs, or with ``spec_tokens`` ``(request,
        tokens, kept)`` triples.
    """
    done = [0] * len(requests)  # tokens brought so far, beyond the prefix
    waiting = list(range(len(requests)))
    running: list[int] = []
    calls: list[list[tuple[int, ...]]] = []
    while waiting or running:
        budget = token_budget
        decodes: list[tuple[int, ...]] = []
        prefills: list[tuple[int, ...]] = []
        for i in running:
            r = requests[i]
            seen = r.cached_prefix + done[i]
            left = r.length - seen
            if seen >= r.prompt and spec_tokens:
                n = min(spec_tokens + 1, budget)
                if n:
                    kept = 1
                    while kept < n and rng.random() < acceptance:
                        kept += 1
                    decodes.append((i, n, min(kept, left)))
            elif seen >= r.prompt:
                n = min(int(rng.integers(1, max_decode + 1)), left, budget)
                if n:
                    decodes.append((i, n))
            else:
                n = min(chunk, r.prompt - seen, budget)
                if n:
                    prefills.append((i, n, n) if spec_tokens else (i, n))
            budget -= n
        while waiting and len(running) < max_running and budget > 0:
            i = waiting.pop(0)
            r = requests[i]
            n = min(chunk, r.prompt - r.cached_prefix, budget)
            running.append(i)
            prefills.append((i, n, n) if spec_tokens else (i, n))
            budget -= n
        call = decodes + prefills
        for i, *counts in call:
            done[i] += counts[-1]
        running = [i for i in running if done[i] < requests[i].new_tokens]
        calls.append(call)
    return calls


# --------------------------------------------------------------------------
# Slots and cache lengths
# --------------------------------------------------------------------------


def plan(
    requests: Sequence[Request],
    calls: Sequence[Sequence[tuple[int, ...]]],
    max_slots: int,
    rng: np.random.Generator,
) -> Plan:
    """Resolves every call's cache lengths and ring slots.

    A request takes a ring slot, drawn at random from the free ones, in its
    first call, keeps it while it runs, and frees it after the call that
    keeps its last token.

    Args:
        requests: The workload.
        calls: Per call, in batch order, ``(request, tokens)`` pairs, or
            ``(request, tokens, kept)`` triples for verify steps whose
            trailing ``tokens - kept`` drafts were rejected.
        max_slots: Ring slots, ``>= 1``.
        rng: Random source for the slot choice.

    Returns:
        The plan.

    Raises:
        ScheduleError: If a call names an unknown or finished request, names
            one twice, keeps more tokens than the request has left (or more
            than it brings, or none of a verify step's), needs a slot when
            all are held, or the calls leave a request unfinished.
    """
    if not requests:
        raise ScheduleError("the workload has no requests")
    done = [0] * len(requests)
    slot_of: dict[int, int] = {}
    free = set(range(max_slots))
    used: set[int] = set()
    reuses = 0
    out: list[Call] = []
    for c, call in enumerate(calls):
        where = f"calls[{c}]"
        if not call:
            raise ScheduleError(f"{where} is empty (a call needs a request)")
        entries: list[Entry] = []
        seen_here: set[int] = set()
        for j, (i, n, *kept_) in enumerate(call):
            at = f"{where}[{j}]"
            kept = kept_[0] if kept_ else n
            if not (0 <= kept <= n and (kept >= 1 or n == 0)):
                raise ScheduleError(
                    f"{at}: request {i} keeps {kept} of the {n} tokens it "
                    f"brings (a verify step keeps 1 to all of them)"
                )
            if not 0 <= i < len(requests):
                raise ScheduleError(
                    f"{at}: request {i} does not exist (the workload has "
                    f"{len(requests)} requests, numbered from 0)"
                )
            if i in seen_here:
                raise ScheduleError(f"{at}: request {i} is already in {where}")
            seen_here.add(i)
            r = requests[i]
            left = r.new_tokens - done[i]
            if left == 0:
                raise ScheduleError(f"{at}: request {i} has already finished")
            if kept > left:
                raise ScheduleError(
                    f"{at}: request {i} brings {kept} tokens but has {left} "
                    f"left (prompt {r.prompt} + generate {r.generate} - "
                    f"cached_prefix {r.cached_prefix} = {r.new_tokens}, "
                    f"{done[i]} brought before)"
                )
            admitted = i not in slot_of
            if admitted:
                if not free:
                    raise ScheduleError(
                        f"{at}: request {i} needs a ring slot but all "
                        f"{max_slots} are held by unfinished requests "
                        f"(raise max_running)"
                    )
                slot = int(rng.choice(sorted(free)))
                free.discard(slot)
                reuses += slot in used
                used.add(slot)
                slot_of[i] = slot
            entries.append(
                Entry(
                    request=i,
                    slot=slot_of[i],
                    cache_length=r.cached_prefix + done[i],
                    tokens=n,
                    admitted=admitted,
                    finished=kept == left,
                    rejected=n - kept,
                )
            )
            done[i] += kept
        for e in entries:
            if e.finished:
                free.add(slot_of[e.request])
        out.append(tuple(entries))
    for i, r in enumerate(requests):
        if done[i] != r.new_tokens:
            raise ScheduleError(
                f"request {i} gets {done[i]} of its {r.new_tokens} new tokens "
                f"(prompt {r.prompt} + generate {r.generate} - cached_prefix "
                f"{r.cached_prefix}); the calls must finish every request"
            )
    return Plan(tuple(requests), tuple(out), max_slots, reuses)


# --------------------------------------------------------------------------
# Schedule files
# --------------------------------------------------------------------------

_TOP_KEYS = ("kpool", "head_dim", "dtype", "max_running", "requests", "calls")
_REQUEST_KEYS = ("prompt", "generate", "cached_prefix")


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(
            f"{where} must be an integer >= {minimum}, got {value!r}"
        )
    if value < minimum:
        raise ScheduleError(f"{where} must be >= {minimum}, got {value}")
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
    prompt = _int(obj["prompt"], f"{where}.prompt", 1)
    generate = _int(obj.get("generate", 0), f"{where}.generate", 0)
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
    dtype = data.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ScheduleError(
            f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}"
        )

    def optional(name: str) -> int | None:
        return None if name not in data else _int(data[name], name, 1)

    return ScheduleFile(
        requests=requests,
        calls=calls,
        kpool=optional("kpool"),
        head_dim=optional("head_dim"),
        dtype=dtype,
        max_running=optional("max_running"),
    )


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
        text = Path(path).read_text()
    except OSError as err:
        raise ScheduleError(f"{path}: cannot read: {err.strerror}") from err
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
