"""The serving model: requests, scheduling, slots, and what each call produced.

Everything the demo, the example and the tests need to play a serving
engine's indexer lives here, as pure Python and NumPy, deterministic for a
given seed:

- **Requests and scheduling.** A workload is a list of requests (prompt
  length, tokens to generate, cached prefix) and a list of calls; each call
  names, in batch order, which requests bring how many new tokens.
  :func:`schedule` batches requests the way a serving engine does (a token
  budget per call, decode of running requests first, prefill chunks of the
  others, new requests admitted while a ring slot is free); a JSON file
  (:func:`load_schedule`) can give the calls explicitly.
- **Slot planning.** :func:`plan` turns either into the exact per-call
  metadata the writers get: each request's cache length and ring slot at
  every call, slots handed out at random from the free ones and reused once
  their request finishes, so a slot id is in general not the request's
  batch position.
- **Speculative decoding.** With ``spec_tokens`` in :func:`schedule`, a
  decode step is a verify step: the request's next token and
  ``spec_tokens`` drafts go through the writers, the target model keeps a
  seeded number of them (the first token always), and the request's next
  call resumes after the last token kept. An entry then records both what
  the call brought and what was kept (:attr:`Entry.rejected`).
- **What a call produced.** :func:`pools_of_call` is the one place the
  outputs of a step (``ring_closed_pool``, ``ring_pooled``, ``pooled``,
  ``pool_row_offsets``, ``first_pool``) are turned into "pool id -> row,
  which writer" per request; :meth:`mla_kpool.runner.StepResult.pools`
  and the oracle step (:func:`reference_step`) both go through it.
- **A checked run** (:func:`serve`, what ``python -m mla_kpool demo``
  runs). Every call goes through the fused step on one persistent ring;
  a request admitted with a cached prefix that ends mid-pool gets the
  prefix's pending members restored into its new slot first
  (:func:`restore_ring`). Each request's keys and gates are drawn from a
  seed of its own (:func:`request_rows`), so when it finishes the oracle
  (:func:`mla_kpool.reference.pool_sequence`) recomputes its whole
  sequence in one shot and every pool the calls produced is checked: each
  pool id exactly once (or, with speculation, the latest row of each, which
  must hold kept tokens only), none missing, none extra, each within the
  key dtype's tolerance (:func:`tolerance`) relative to the largest ``|k|``
  among the pool's members. After each step every query token of the call
  gets a seeded selection of pool ids (:func:`select_pools`), widened by
  one expand_topk call and compared row by row with
  :func:`mla_kpool.reference.expand_topk`. A :class:`Fault` corrupts one
  ring member, key or selected id behind the oracle's back.

With speculation the ring is ``mla_kpool.ring_length(kpool, N + 1)``
entries deep (``N`` drafts per verify step), so drafts never overwrite a
member of a pool that must be redone.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from . import reference
from .ring import ring_length

if TYPE_CHECKING:
    from .runner import Runner

__all__ = [
    "ACCEPTANCE",
    "COMPRESS",
    "DEFAULT_DTYPE",
    "DEFAULT_HEAD_DIM",
    "DEFAULT_KPOOL",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_POOL_TOPK",
    "DEFAULT_REQUESTS",
    "DTYPES",
    "FAULT_KINDS",
    "GATE_SCALE",
    "MAX_LISTED",
    "RING_CLOSE",
    "SKIPPED_ID_SHARE",
    "TOLERANCE",
    "Call",
    "CallInputs",
    "Config",
    "Entry",
    "Fault",
    "LiveRequest",
    "Plan",
    "PoolRecord",
    "PoolRow",
    "Request",
    "ScheduleError",
    "ScheduleFile",
    "Totals",
    "check_expansion",
    "check_request",
    "collect_pools",
    "compile_models",
    "corrupt_selection",
    "draft_rows",
    "expand_and_check",
    "first_pool_ids",
    "generate_requests",
    "keep_latest",
    "load_schedule",
    "make_ape",
    "make_plan",
    "pack_call",
    "parse_schedule",
    "place_fault",
    "plan",
    "plan_call_inputs",
    "plural",
    "pools_completed",
    "pools_of_call",
    "reference_step",
    "request_rows",
    "restore_prefix",
    "restore_ring",
    "schedule",
    "select_pools",
    "serve",
    "step_pools",
    "summarize",
    "tolerance",
]


#: Key dtypes by their command-line name.
DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


#: Tolerance against the float64 oracle (see :func:`tolerance`), relative
#: to the largest member magnitude of the pool (a pooled key is a convex
#: combination of its members, so that is the scale its rounding lives
#: on).
TOLERANCE = {
    DTYPES["float32"]: 1e-5,
    DTYPES["float16"]: 2e-3,
    DTYPES["bfloat16"]: 1.6e-2,
}


#: Gate scores spread this wide (standard deviations) so that pool members
#: get clearly different softmax weights and a wrong member shows.
GATE_SCALE = 3.0


#: Failures listed per request before the rest are only counted.
MAX_LISTED = 5


#: GLM-5-Next indexer shapes, the demo's default workload: key dtype (a
#: name of :data:`DTYPES`), tokens per pool, channels per key, requests
#: generated and ring slots.
DEFAULT_DTYPE = "bfloat16"
DEFAULT_KPOOL = 4
DEFAULT_HEAD_DIM = 128
DEFAULT_REQUESTS = 32
DEFAULT_MAX_RUNNING = 16


#: Pool ids an indexer query selects: GLM-5-Next's 512 (2051 positions per
#: row at kpool 4).
DEFAULT_POOL_TOPK = 512


#: Share of query rows whose selection gets one id that expand_topk must
#: skip (a pool not complete or not visible yet, or a negative id).
SKIPPED_ID_SHARE = 0.25


#: Fault kinds ``--inject-fault`` takes, the first the default.
FAULT_KINDS = ("ring", "key", "topk")


def tolerance(dtype: npt.DTypeLike) -> float:
    """Relative tolerance of a pooled key against the float64 oracle.

    A pooled key is a convex combination of its members, so its rounding
    error lives on the scale of the largest member magnitude: a result is
    right when ``|got - want| <= tolerance(dtype) * max |k|`` over the
    pool's members. float32 1e-5, float16 2e-3, bfloat16 1.6e-2 (about one
    bfloat16 ulp).

    Args:
        dtype: The key dtype the kernel ran in (NumPy, or
            ``ml_dtypes.bfloat16``).

    Returns:
        The relative tolerance.

    Raises:
        KeyError: If ``dtype`` is not a key dtype.
    """
    return TOLERANCE[np.dtype(dtype)]


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an ``s`` unless ``count`` is 1."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


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
        abort_at: If given, the client aborts the request once it holds
            this many tokens (``cached_prefix < abort_at < length``): the
            engine stops feeding it and frees its slot, so its pools end
            at ``abort_at // kpool``.
    """

    prompt: int
    generate: int = 0
    cached_prefix: int = 0
    abort_at: int | None = None

    @property
    def length(self) -> int:
        """Tokens in the whole sequence, ``prompt + generate``."""
        return self.prompt + self.generate

    @property
    def end(self) -> int:
        """Tokens the request reaches: ``abort_at``, else ``length``."""
        return self.length if self.abort_at is None else self.abort_at

    @property
    def new_tokens(self) -> int:
        """Tokens the calls must bring, ``end - cached_prefix``."""
        return self.end - self.cached_prefix


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
    min_spec_tokens: int | None = None,
    idle_prob: float = 0.0,
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
        min_spec_tokens: If given, each verify step drafts a seeded number
            of tokens from ``min_spec_tokens`` to ``spec_tokens`` instead
            (a drafter that stops early when unsure).
        idle_prob: Chance that a running request still in prefill sits in
            the batch with no tokens (a row with ``n = 0``).

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
            left = r.end - seen
            if seen >= r.prompt and spec_tokens:
                drafts = spec_tokens
                if min_spec_tokens is not None:
                    drafts = int(
                        rng.integers(
                            min_spec_tokens, spec_tokens, endpoint=True
                        )
                    )
                n = min(drafts + 1, budget)
                if n:
                    kept = 1
                    while kept < n and rng.random() < acceptance:
                        kept += 1
                    decodes.append((i, n, min(kept, left)))
            elif seen >= r.prompt:
                n = min(int(rng.integers(1, max_decode + 1)), left, budget)
                if n:
                    decodes.append((i, n))
            elif idle_prob and rng.random() < idle_prob:
                n = 0
                decodes.append((i, 0, 0) if spec_tokens else (i, 0))
            else:
                n = min(chunk, min(r.prompt, r.end) - seen, budget)
                if n:
                    prefills.append((i, n, n) if spec_tokens else (i, n))
            budget -= n
        while waiting and len(running) < max_running and budget > 0:
            i = waiting.pop(0)
            r = requests[i]
            n = min(chunk, min(r.prompt, r.end) - r.cached_prefix, budget)
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
    slots: Mapping[int, int] | None = None,
) -> Plan:
    """Resolves every call's cache lengths and ring slots.

    A request takes a ring slot, drawn at random from the free ones (or the
    one ``slots`` names for it), in its first call, keeps it while it runs,
    and frees it after the call that keeps its last token.

    Args:
        requests: The workload.
        calls: Per call, in batch order, ``(request, tokens)`` pairs, or
            ``(request, tokens, kept)`` triples for verify steps whose
            trailing ``tokens - kept`` drafts were rejected.
        max_slots: Ring slots, ``>= 1``.
        rng: Random source for the slot choice.
        slots: Request -> the ring slot it must take, for the requests
            whose slot is fixed; the others draw one.

    Returns:
        The plan.

    Raises:
        ScheduleError: If a call names an unknown or finished request, names
            one twice, keeps more tokens than the request has left (or more
            than it brings, or none of a verify step's), needs a slot when
            all are held (or the slot ``slots`` names is held), or the
            calls leave a request short of its end.
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
                if slots is not None and i in slots:
                    slot = slots[i]
                    if slot not in free:
                        raise ScheduleError(
                            f"{at}: request {i} needs ring slot {slot}, "
                            f"which is not free"
                        )
                else:
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


# --------------------------------------------------------------------------
# What a call produced
# --------------------------------------------------------------------------

#: Writer names, as :attr:`PoolRow.writer` gives them.
RING_CLOSE = "ring_close"
COMPRESS = "compress"


@dataclass(frozen=True)
class PoolRow:
    """One pooled key a call produced.

    Attributes:
        key: ``[head_dim]`` pooled key, in the key dtype.
        writer: :data:`RING_CLOSE` (closed from the ring) or
            :data:`COMPRESS` (built from this call's tokens).
    """

    key: np.ndarray
    writer: str


def pools_completed(cache_length: int, tokens: int, kpool: int) -> range:
    """Pool ids a call completes for one request.

    Pool ``p`` completes when its last member ``(p + 1) * kpool - 1`` is
    among the call's positions ``[cache_length, cache_length + tokens)``.

    Args:
        cache_length: Tokens the request had before the call.
        tokens: Tokens the call brings, drafts included.
        kpool: Tokens per pool.

    Returns:
        ``range(cache_length // kpool, (cache_length + tokens) // kpool)``.
    """
    return range(cache_length // kpool, (cache_length + tokens) // kpool)


def first_pool_ids(cache_lengths: npt.ArrayLike, kpool: int) -> np.ndarray:
    """Pool id of each request's first compress row: ``ceil(c / kpool)``.

    Args:
        cache_lengths: ``[batch]`` tokens each request had before the call.
        kpool: Tokens per pool.

    Returns:
        ``[batch]`` int64.
    """
    c = np.asarray(cache_lengths, dtype=np.int64)
    return -(-c // kpool)


def pools_of_call(
    ring_closed_pool: np.ndarray,
    ring_pooled: np.ndarray,
    pooled: np.ndarray,
    pool_row_offsets: np.ndarray,
    first_pool: np.ndarray,
) -> list[dict[int, PoolRow]]:
    """Every pool one step call produced, per request, with its writer.

    Request ``b`` gets ``ring_pooled[b]`` as pool ``ring_closed_pool[b]``
    when that is not ``-1``, and the compress rows
    ``pool_row_offsets[b] .. pool_row_offsets[b + 1] - 1`` of ``pooled`` as
    pools ``first_pool[b]``, ``first_pool[b] + 1``, ...

    Args:
        ring_closed_pool: ``[batch]`` int32 pool ring_close closed, or -1.
        ring_pooled: ``[batch, head_dim]`` its pooled key.
        pooled: ``[rows, head_dim]`` compress output.
        pool_row_offsets: ``[batch + 1]`` row of request b's first pool.
        first_pool: ``[batch]`` pool id of that row
            (:func:`first_pool_ids`).

    Returns:
        Per request, ``{pool_id: PoolRow}``.

    Raises:
        ValueError: If a request's rows ``pool_row_offsets[b:b + 2]`` are
            decreasing or outside ``pooled``, or a pool id comes out twice
            for one request; the message names the batch row.
    """
    batch = len(ring_closed_pool)
    rows = pooled.shape[0]
    out: list[dict[int, PoolRow]] = [{} for _ in range(batch)]
    for b in range(batch):
        closed = int(ring_closed_pool[b])
        if closed >= 0:
            out[b][closed] = PoolRow(ring_pooled[b], RING_CLOSE)
        lo, hi = int(pool_row_offsets[b]), int(pool_row_offsets[b + 1])
        if not 0 <= lo <= hi <= rows:
            raise ValueError(
                f"batch row {b}: pool_row_offsets[{b}:{b + 2}] = [{lo}, "
                f"{hi}] is outside the {rows} output rows"
            )
        first = int(first_pool[b])
        for j in range(hi - lo):
            if first + j in out[b]:
                raise ValueError(
                    f"batch row {b}: pool {first + j} from both ring_close "
                    f"and compress"
                )
            out[b][first + j] = PoolRow(pooled[lo + j], COMPRESS)
    return out


def reference_step(
    ring: np.ndarray,
    k: np.ndarray,
    gate: np.ndarray,
    ape: np.ndarray,
    input_row_offsets: npt.ArrayLike,
    cache_lengths: npt.ArrayLike,
    slot_idx: npt.ArrayLike,
    kpool: int,
) -> tuple[list[dict[int, PoolRow]], np.ndarray]:
    """One step on the float64 oracle: close, compress, then seed.

    The NumPy counterpart of :meth:`mla_kpool.runner.Runner.step`, in the
    writers' serving order (ring_close reads the ring before seed_tail
    writes it).

    Args:
        ring: Host ring ``[max_slots, 2, R, head_dim]``; not modified.
        k: ``[total_tokens, head_dim]`` keys.
        gate: ``[total_tokens, head_dim]`` gate scores.
        ape: ``[kpool, head_dim]`` float32 position embedding.
        input_row_offsets: ``[batch + 1]`` token row offsets.
        cache_lengths: ``[batch]`` tokens seen before this call.
        slot_idx: ``[batch]`` ring slots.
        kpool: Tokens per pool.

    Returns:
        ``(pools, ring)``: per request ``{pool_id: PoolRow}`` (float64
        keys), and the ring after seed_tail.
    """
    meta = (input_row_offsets, cache_lengths)
    ring_pooled, closed = reference.ring_close(
        ring, k, gate, ape, *meta, slot_idx, kpool
    )
    offsets = reference.pool_row_offsets(*meta, kpool)
    rows = reference.compress(
        k, gate, ape, input_row_offsets, offsets, cache_lengths, kpool
    )
    ring = reference.seed_tail(ring, k, gate, *meta, slot_idx, kpool)
    pools = pools_of_call(
        closed,
        ring_pooled,
        rows,
        offsets,
        first_pool_ids(cache_lengths, kpool),
    )
    return pools, ring


# --------------------------------------------------------------------------
# A serving run: its configuration, data, faults and checks
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What one serving run does.

    Attributes:
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        device: ``"cpu"``, ``"gpu"`` or ``"gpu-emulated"``.
        seed: Seed of the workload, the keys and the slot choice.
        token_budget: Most tokens per call (generated batching only).
        max_running: Ring slots: most requests in flight.
        chunk: Prefill chunk (generated batching only).
        schedule: The ``--schedule`` file, if any.
        spec_tokens: Drafts per verify step; 0 without speculation.
        pool_topk: Pool ids each query token selects for expand_topk.
    """

    dtype: np.dtype
    kpool: int
    head_dim: int
    device: str
    seed: int
    token_budget: int
    max_running: int
    chunk: int
    schedule: str | None
    spec_tokens: int = 0
    pool_topk: int = DEFAULT_POOL_TOPK

    @property
    def ring_len(self) -> int:
        """Ring entries per slot: ``kpool``, deeper with speculation."""
        return ring_length(self.kpool, self.spec_tokens + 1)


def make_plan(
    config: Config,
    requests: int | Sequence[Request],
    calls: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> Plan:
    """The plan of a run: requests, batching and slots, from the seed.

    One random stream, seeded ``[config.seed, 0]``, draws in turn the
    requests (when only their count is given), the batching (when
    ``calls`` is ``None``; :func:`schedule` with the config's token budget,
    ring slots, chunk and speculative tokens) and the slots (:func:`plan`).

    Args:
        config: The run's configuration.
        requests: The requests, or how many to generate
            (:func:`generate_requests`).
        calls: Per call, ``(request, tokens)`` pairs in batch order; ``None``
            to batch with :func:`schedule`.

    Returns:
        The plan, on ``config.max_running`` ring slots.

    Raises:
        ScheduleError: As :func:`plan`.
    """
    rng = np.random.default_rng([config.seed, 0])
    if isinstance(requests, int):
        requests = generate_requests(
            rng, requests, config.kpool, chunk=config.chunk
        )
    if calls is None:
        calls = schedule(
            requests,
            rng,
            token_budget=config.token_budget,
            max_running=config.max_running,
            chunk=config.chunk,
            spec_tokens=config.spec_tokens,
        )
    return plan(requests, calls, config.max_running, rng)


def request_rows(
    seed: int, index: int, length: int, head_dim: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The keys and gates of request ``index``'s whole sequence.

    Drawn from a seed of their own, so the oracle can recompute them and a
    request's data does not depend on how it is batched.

    Returns:
        ``(k, gate)``, each ``[length, head_dim]`` in ``dtype``.
    """
    rng = np.random.default_rng([seed, 1, index])
    k = rng.standard_normal((length, head_dim)).astype(dtype)
    gate = GATE_SCALE * rng.standard_normal((length, head_dim))
    return k, gate.astype(dtype)


def draft_rows(
    seed: int,
    index: int,
    call: int,
    count: int,
    true_k: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and gates of the drafts a verify step rejects.

    Args:
        seed: The run's seed.
        index: The request.
        call: The call (each verify step drafts afresh).
        count: Drafts rejected.
        true_k: ``[m, head_dim]`` true keys of the drafts' positions,
            ``m < count`` where the drafts run past the request's end.
        dtype: Key dtype.

    Returns:
        ``(k, gate)``, each ``[count, head_dim]``; no draft key equals the
        true key of its position (a key equal to the truth would be
        accepted).
    """
    rng = np.random.default_rng([seed, 3, index, call])
    head_dim = true_k.shape[1]
    k = rng.standard_normal((count, head_dim)).astype(dtype)
    gate = (GATE_SCALE * rng.standard_normal((count, head_dim))).astype(dtype)
    m = len(true_k)
    same = np.flatnonzero(np.all(k[:m] == true_k, axis=1))
    k[same] = (k[same].astype(np.float64) + 1.0).astype(dtype)
    return k, gate


def make_ape(seed: int, kpool: int, head_dim: int) -> np.ndarray:
    """The float32 within-pool position embedding ``[kpool, head_dim]``."""
    rng = np.random.default_rng([seed, 2])
    return rng.standard_normal((kpool, head_dim)).astype(np.float32)


@dataclass(frozen=True)
class Fault:
    """One deliberate corruption the oracle does not know about.

    Attributes:
        kind: ``"ring"``: a ring member's key is changed just before the
            call that closes its pool; ``"key"``: one row of ``k`` is
            changed in the call that brings it; ``"topk"``: one selected
            pool id of one query token is changed in the ``pool_ids`` sent
            to expand_topk.
        call: The call it happens in.
        entry: The request's batch position in that call.
        request: The request.
        position: The token position whose key is changed, or (``"topk"``)
            the position of the query whose selection is changed.
        pool: The pool that must then fail the check; for ``"topk"``, the
            token row (in the call) that must fail.
        slot: The request's ring slot in that call.
    """

    kind: str
    call: int
    entry: int
    request: int
    position: int
    pool: int
    slot: int

    def describe(self) -> str:
        """A one-line account of the fault."""
        if self.kind == "topk":
            return (
                f"pool id selected by the query at position {self.position}"
                f" as sent to expand_topk, request {self.request}, call "
                f"{self.call}: token row {self.pool} must fail"
            )
        where = (
            f"ring member at position {self.position} (slot {self.slot}), "
            f"read by ring_close"
            if self.kind == "ring"
            else f"key row of position {self.position} as sent to the step"
        )
        return (
            f"{where}, request {self.request}, call {self.call}: pool "
            f"{self.pool} must fail"
        )

    def caught_by(self, problem: str) -> bool:
        """Whether a reported problem is the failure this fault must cause."""
        if not problem.startswith(f"request {self.request} "):
            return False
        if self.kind == "topk":
            return f"call {self.call}: expand_topk row {self.pool} " in problem
        return f"pool {self.pool} " in problem

    def caught(self, problems: Sequence[str]) -> bool:
        """Whether any of a run's problems is this fault's failure."""
        return any(self.caught_by(p) for p in problems)


def place_fault(plan_: Plan, kind: str, kpool: int) -> Fault | None:
    """Finds where to inject a fault that the check must see.

    Calls are searched from the middle of the run on, then from the start.

    Args:
        plan_: The run.
        kind: ``"ring"`` (a call where ring_close closes a pending pool),
            ``"key"`` (a call bringing a token of a complete pool) or
            ``"topk"`` (a call whose last token of a request sees at least
            two complete pools, so a selected id can be swapped for another
            valid one).
        kpool: Tokens per pool.

    Returns:
        The fault, or ``None`` if the run offers no such place.
    """
    count = len(plan_.calls)
    for c in [*range(count // 2, count), *range(count // 2)]:
        row = 0
        for b, e in enumerate(plan_.calls[c]):
            length = plan_.requests[e.request].length
            cl, n = e.cache_length, e.tokens
            row += n
            if kind == "ring":
                pending = cl // kpool
                if cl % kpool and cl + n >= (pending + 1) * kpool:
                    pos = pending * kpool
                    return Fault(kind, c, b, e.request, pos, pending, e.slot)
            elif kind == "topk":
                if n and (cl + n) // kpool >= 2:
                    pos = cl + n - 1
                    return Fault(kind, c, b, e.request, pos, row - 1, e.slot)
            elif n and cl < length // kpool * kpool:
                return Fault(kind, c, b, e.request, cl, cl // kpool, e.slot)
    return None


# --------------------------------------------------------------------------
# Running and checking
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolRecord:
    """The row kept for one pool id: the latest call's output.

    Attributes:
        key: The pooled key.
        call: The call that produced it.
        writer: ``"ring_close"`` or ``"compress"``.
        accepted: Whether every member was a kept token (not a rejected
            draft); only such a row is final.
    """

    key: np.ndarray
    call: int
    writer: str
    accepted: bool = True


def keep_latest(
    kept: dict[int, PoolRecord],
    produced: Mapping[int, PoolRow],
    call: int,
    accepted_end: int,
    kpool: int,
) -> tuple[int, list[int]]:
    """Files one call's pools of one request, keeping each id's latest row.

    A pipeline that stores pool rows keeps, per pool id, the row of the
    latest call that produced it: a verify step may produce a pool with
    rejected drafts among its members, and a later call produces the same
    id again from kept tokens. A row whose members were all kept is final;
    producing its id again is a bug.

    Args:
        kept: The request's rows so far, ``pool id -> PoolRecord``; updated
            in place.
        produced: This call's pools of the request (:func:`pools_of_call`).
        call: The call's number.
        accepted_end: Position after the request's last kept token of this
            call (``cache_length + accepted``); a pool is kept tokens only
            when ``(pool + 1) * kpool <= accepted_end``.
        kpool: Tokens per pool.

    Returns:
        ``(rewritten, twice)``: how many rows replaced a row holding a
        rejected draft, and the pool ids produced again although their row
        was final (those keep the earlier row).
    """
    rewritten, twice = 0, []
    for pool, row in produced.items():
        before = kept.get(pool)
        if before is not None and before.accepted:
            twice.append(pool)
            continue
        rewritten += before is not None
        accepted = (pool + 1) * kpool <= accepted_end
        kept[pool] = PoolRecord(row.key, call, row.writer, accepted)
    return rewritten, twice


def step_pools(result: Any) -> list[dict[int, PoolRow]]:
    """:func:`pools_of_call` of a :class:`mla_kpool.runner.StepResult`.

    Args:
        result: Anything with the step's five outputs as attributes
            (``ring_closed_pool``, ``ring_pooled``, ``pooled``,
            ``pool_row_offsets``, ``first_pool``).

    Returns:
        Per request, ``{pool_id: PoolRow}``.

    Raises:
        ValueError: As :func:`pools_of_call`.
    """
    return pools_of_call(
        result.ring_closed_pool,
        result.ring_pooled,
        result.pooled,
        result.pool_row_offsets,
        result.first_pool,
    )


@dataclass
class LiveRequest:
    """What the demo tracks for a request in flight."""

    slot: int
    k: np.ndarray
    gate: np.ndarray
    #: pool id -> the row kept for it: the latest call that produced it
    pools: dict[int, PoolRecord] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass
class Totals:
    """Counts, errors, timings and problems of a served plan (:func:`serve`).

    Attributes:
        ring_close: Pool rows ring_close produced.
        compress: Pool rows compress produced.
        max_abs_error: Largest error of a final pool row against the oracle.
        worst_ratio: Largest error over its allowed error.
        checked_pools: Final pool rows checked against the oracle.
        rewritten: Pool rows that replaced a row holding a rejected draft.
        expand_rows: expand_topk rows produced.
        expand_checked: expand_topk rows compared with the oracle.
        expand_mismatches: expand_topk rows that differ from the oracle.
        expand_skipped_ids: Selected ids expand_topk must skip.
        expand_seconds: Seconds of each expand_topk call.
        dropped: Pool ids past a request's end holding drafts only.
        problems: Every failed check, one line each.
        call_seconds: Seconds of each step call.
    """

    ring_close: int = 0
    compress: int = 0
    max_abs_error: float = 0.0
    worst_ratio: float = 0.0
    checked_pools: int = 0
    rewritten: int = 0
    expand_rows: int = 0
    expand_checked: int = 0
    expand_mismatches: int = 0
    expand_skipped_ids: int = 0
    expand_seconds: list[float] = field(default_factory=list)
    dropped: int = 0
    problems: list[str] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)


def check_request(
    index: int,
    request: Request,
    live: LiveRequest,
    ape: np.ndarray,
    kpool: int,
    tolerance: float,
) -> tuple[float, float, int, list[str]]:
    """Checks one finished request's pools against the one-shot oracle.

    The row checked for a pool id is the last one a call produced for it.
    Pool ids past the request's end whose row holds rejected drafts are
    dropped (a pipeline discards them with the request); a pool id of the
    request whose last row holds a rejected draft is a problem.

    Args:
        index: The request's number (for messages).
        request: The request.
        live: Its keys, gates and the pools the calls produced.
        ape: The position embedding.
        kpool: Tokens per pool.
        tolerance: Relative tolerance of the key dtype.

    Returns:
        ``(max_abs_error, worst error / allowed error, pools checked,
        problems)``; ``problems`` is empty when the request passed.
    """
    name = f"request {index} (slot {live.slot})"
    problems = list(live.problems)
    first = request.cached_prefix // kpool
    last = request.end // kpool  # exclusive
    expected = reference.pool_sequence(live.k, live.gate, ape, kpool)
    extra = sorted(
        p
        for p, row in live.pools.items()
        if not first <= p < last and (row.accepted or p < first)
    )
    missing = [p for p in range(first, last) if p not in live.pools]
    for p in extra:
        row = live.pools[p]
        problems.append(
            f"{name}: pool {p} from {row.writer} in call {row.call} does not "
            f"exist (the request owns pools {first}..{last - 1})"
        )
    for p in range(first, last):
        row = live.pools.get(p)
        if row is not None and not row.accepted:
            problems.append(
                f"{name}: pool {p}'s last row ({row.writer}, call "
                f"{row.call}) holds a rejected draft; no later call "
                f"produced it again"
            )
    if missing:
        shown = ", ".join(map(str, missing[:10]))
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        problems.append(
            f"{name}: {plural(len(missing), 'pool')} never came out: "
            f"{shown}{more}"
        )
    ids = [p for p in range(first, last) if p in live.pools]
    if not ids:
        return 0.0, 0.0, 0, problems
    got = np.stack([live.pools[p].key for p in ids]).astype(np.float64)
    want = expected[ids]
    members = np.abs(live.k[: last * kpool].astype(np.float64))
    scale = members.reshape(last, kpool, -1).max(axis=(1, 2))[ids]
    allowed = tolerance * np.maximum(scale, np.finfo(np.float64).tiny)
    err = np.abs(got - want).max(axis=1)
    ratio = err / allowed
    bad = np.flatnonzero(~(err <= allowed))  # NaN counts as bad
    for j in bad[:MAX_LISTED]:
        p = ids[j]
        row = live.pools[p]
        problems.append(
            f"{name}: pool {p} (positions {p * kpool}..{(p + 1) * kpool - 1}"
            f", {row.writer}, call {row.call}) differs from the oracle: "
            f"max |err| {err[j]:.4g} > {allowed[j]:.4g} ({tolerance:g} x "
            f"max |k| {scale[j]:.4g})"
        )
    if len(bad) > MAX_LISTED:
        problems.append(
            f"{name}: {plural(len(bad) - MAX_LISTED, 'more pool')} differ"
            f"{'s' if len(bad) - MAX_LISTED == 1 else ''} from the oracle"
        )
    max_err = float(np.nanmax(err)) if not np.isnan(err).all() else np.nan
    worst = float(np.max(ratio)) if not np.isnan(ratio).any() else np.inf
    return max_err, worst, len(ids), problems


def select_pools(
    seed: int,
    call_index: int,
    call: Sequence[Entry],
    pool_topk: int,
    kpool: int,
) -> tuple[np.ndarray, int]:
    """A seeded indexer selection for every query token of one call.

    Token row ``t`` is the query at position ``c + local`` of its request
    (``c`` the entry's cache length), which sees ``visible = c + local + 1``
    positions and so ``visible // kpool`` complete pools. Its row holds
    ``min(pool_topk, complete)`` distinct complete pool ids in a random
    order, then ``-1``. In about :data:`SKIPPED_ID_SHARE` of the rows one
    column (at random) is then replaced by an id the op must skip: the
    pool still filling, a pool in the query's future (up to ``2^31 - 1``)
    or a negative id other than ``-1``.

    Args:
        seed: The run's seed.
        call_index: The call (each call draws afresh).
        call: The call's entries, in batch order.
        pool_topk: Columns per row.
        kpool: Tokens per pool.

    Returns:
        ``(pool_ids, skipped)``: int32 ``[tokens, pool_topk]`` and how many
        ids other than ``-1`` padding the op must skip.
    """
    rng = np.random.default_rng([seed, 4, call_index])
    total = sum(e.tokens for e in call)
    ids = np.full((total, pool_topk), -1, dtype=np.int32)
    skipped = 0
    t = 0
    for e in call:
        for local in range(e.tokens):
            complete = (e.cache_length + local + 1) // kpool
            m = min(pool_topk, complete)
            ids[t, :m] = rng.choice(complete, m, replace=False)
            if rng.random() < SKIPPED_ID_SHARE:
                kind = rng.integers(3)
                if kind == 0:
                    bad = complete
                elif kind == 1:
                    bad = rng.integers(complete + 1, 2**31, endpoint=False)
                else:
                    bad = -rng.integers(2, 2**31, endpoint=True)
                ids[t, rng.integers(pool_topk)] = bad
                skipped += 1
            t += 1
    return ids, skipped


def corrupt_selection(ids: np.ndarray, row: int, complete: int) -> None:
    """Changes one id of ``ids[row]`` so that the row's expansion differs.

    The first valid id is swapped for another complete pool; a row with no
    valid id gets pool 0 in its first column.
    """
    valid = np.flatnonzero((ids[row] >= 0) & (ids[row] < complete))
    if len(valid):
        j = int(valid[0])
        ids[row, j] = (int(ids[row, j]) + 1) % complete
    else:
        ids[row, 0] = 0


def check_expansion(
    c: int,
    call: Sequence[Entry],
    got: np.ndarray,
    want: np.ndarray,
) -> tuple[int, list[str]]:
    """Compares one call's expand_topk rows with the oracle's.

    Args:
        c: The call's number (for messages).
        call: Its entries, in batch order (token rows follow them).
        got: ``[tokens, width]`` int32 rows from the op.
        want: ``[tokens, width]`` int32 rows from
            :func:`mla_kpool.reference.expand_topk`.

    Returns:
        ``(rows that differ, problems)``; a row is named by its request,
        slot, call, token row and query position.
    """
    if got.shape != want.shape:
        return len(want), [
            f"call {c}: expand_topk gave shape {got.shape}, the oracle "
            f"{want.shape}"
        ]
    bad = np.flatnonzero((got != want).any(axis=1))
    owner = np.repeat(np.arange(len(call)), [e.tokens for e in call])
    starts = np.cumsum([0] + [e.tokens for e in call])
    problems = []
    for t in bad[:MAX_LISTED]:
        e = call[owner[t]]
        position = e.cache_length + int(t - starts[owner[t]])
        col = int(np.flatnonzero(got[t] != want[t])[0])
        problems.append(
            f"request {e.request} (slot {e.slot}): call {c}: expand_topk "
            f"row {t} (query position {position}) differs from the oracle "
            f"at column {col}: got {int(got[t, col])}, want "
            f"{int(want[t, col])}"
        )
    if len(bad) > MAX_LISTED:
        problems.append(
            f"call {c}: "
            f"{plural(len(bad) - MAX_LISTED, 'more expand_topk row')} differ"
            f"{'s' if len(bad) - MAX_LISTED == 1 else ''} from the oracle"
        )
    return len(bad), problems


def restore_prefix(
    ring: np.ndarray,
    slot: int,
    cache_length: int,
    k: np.ndarray,
    gate: np.ndarray,
    kpool: int,
) -> None:
    """Puts a cached prefix's pending members back into a host ring.

    A prefix cache keeps the complete pools of a prefix, but the members
    of a partial last pool live only in the ring, so an engine admitting a
    request whose cached prefix ends mid-pool must restore them into the
    request's new slot: positions ``[cache_length // kpool * kpool,
    cache_length)``, member ``pos`` at ring index ``pos % R``.

    Args:
        ring: Host ring ``[max_slots, 2, R, head_dim]``, written in place.
        slot: The request's ring slot.
        cache_length: Length of the cached prefix.
        k: ``[>= cache_length, head_dim]`` the request's keys from
            position 0.
        gate: Its gate scores, same shape.
        kpool: Tokens per pool.
    """
    positions = np.arange(cache_length // kpool * kpool, cache_length)
    index = positions % ring.shape[2]
    ring[slot, 0, index] = k[positions]
    ring[slot, 1, index] = gate[positions]


@dataclass(frozen=True)
class CallInputs:
    """The operands of one step call besides the ring and ``ape``.

    Attributes:
        k: ``[total_tokens, head_dim]`` keys, batch rows in order.
        gate: ``[total_tokens, head_dim]`` gate scores.
        input_row_offsets: ``[batch + 1]`` uint32.
        cache_lengths: ``[batch]`` uint32.
        slot_idx: ``[batch]`` uint32.
    """

    k: np.ndarray
    gate: np.ndarray
    input_row_offsets: np.ndarray
    cache_lengths: np.ndarray
    slot_idx: np.ndarray

    def operands(self) -> dict[str, np.ndarray]:
        """The fields by the step's argument names, for ``**`` calls."""
        return {
            "k": self.k,
            "gate": self.gate,
            "input_row_offsets": self.input_row_offsets,
            "cache_lengths": self.cache_lengths,
            "slot_idx": self.slot_idx,
        }


def pack_call(
    rows: Sequence[tuple[Sequence[np.ndarray], Sequence[np.ndarray], int, int]],
    head_dim: int,
    dtype: npt.DTypeLike,
) -> CallInputs:
    """Packs a call's batch rows into the step's ragged operands.

    Args:
        rows: Per batch row ``(k_parts, gate_parts, cache_length, slot)``:
            the row's keys and gate scores as consecutive pieces (for a
            verify step, the kept tokens then the drafts), each
            ``[m, head_dim]``.
        head_dim: Channels per key (for an empty call).
        dtype: Key dtype.

    Returns:
        The operands.
    """
    empty = np.zeros((0, head_dim), dtype=dtype)
    counts = [sum(len(part) for part in k) for k, _, _, _ in rows]
    offsets = np.zeros(len(rows) + 1, np.uint32)
    offsets[1:] = np.cumsum(counts)
    return CallInputs(
        k=np.concatenate([empty, *(p for k, _, _, _ in rows for p in k)]),
        gate=np.concatenate([empty, *(p for _, g, _, _ in rows for p in g)]),
        input_row_offsets=offsets,
        cache_lengths=np.array([c for _, _, c, _ in rows], np.uint32),
        slot_idx=np.array([s for _, _, _, s in rows], np.uint32),
    )


def plan_call_inputs(
    seed: int,
    call_index: int,
    call: Sequence[Entry],
    sequences: Mapping[int, tuple[np.ndarray, np.ndarray]],
    head_dim: int,
    dtype: npt.DTypeLike,
) -> CallInputs:
    """The step operands of one planned call.

    Each entry brings its request's kept tokens ``[cache_length,
    cache_length + accepted)`` from the request's sequence, then, for a
    verify step, its rejected drafts (:func:`draft_rows`, drawn from
    ``seed``, the request and the call).

    Args:
        seed: The run's seed (for the drafts).
        call_index: The call's number (each verify step drafts afresh).
        call: The call's entries, in batch order.
        sequences: Request -> ``(k, gate)`` of its whole sequence, each
            ``[length, head_dim]``.
        head_dim: Channels per key.
        dtype: Key dtype.

    Returns:
        The operands.
    """
    rows = []
    for e in call:
        k, gate = sequences[e.request]
        kept = slice(e.cache_length, e.cache_length + e.accepted)
        k_parts, gate_parts = [k[kept]], [gate[kept]]
        if e.rejected:
            drafted = slice(kept.stop, kept.stop + e.rejected)
            dk, dg = draft_rows(
                seed, e.request, call_index, e.rejected, k[drafted], dtype
            )
            k_parts.append(dk)
            gate_parts.append(dg)
        rows.append((k_parts, gate_parts, e.cache_length, e.slot))
    return pack_call(rows, head_dim, dtype)


def restore_ring(
    runner: Runner,
    ring: Any,
    restores: list[tuple[Entry, LiveRequest]],
    fault: tuple[int, int, float] | None,
    kpool: int,
) -> Any:
    """Writes cached-prefix members (and a ring fault) into the ring.

    The engine's restore on admission (:func:`restore_prefix`), done
    host-side: read, patch, upload.
    """
    host = runner.read(ring)
    ring_len = host.shape[2]
    for e, live in restores:
        restore_prefix(host, e.slot, e.cache_length, live.k, live.gate, kpool)
    if fault is not None:
        slot, pos, delta = fault
        member = host[slot, 0, pos % ring_len].astype(np.float64)
        host[slot, 0, pos % ring_len] = (member + delta).astype(host.dtype)
    return runner.to_device(host)


def serve(
    config: Config,
    plan_: Plan,
    runner: Runner,
    fault: Fault | None,
    progress: Any,
) -> Totals:
    """Runs every call of the plan through the step and checks each request.

    Args:
        config: The run's configuration.
        plan_: The calls.
        runner: Where the step runs.
        fault: A fault to inject, or ``None``.
        progress: Progress display (a ``tqdm`` bar or anything with its
            ``set_postfix_str``, ``update`` and ``close``).

    Returns:
        Counts, errors, timings and problems.
    """
    kpool, head_dim, dtype = config.kpool, config.head_dim, config.dtype
    ape = make_ape(config.seed, kpool, head_dim)
    rel_tol = tolerance(dtype)
    ring = runner.new_ring(plan_.max_slots, config.ring_len, head_dim, dtype)
    live: dict[int, LiveRequest] = {}
    totals = Totals()
    finished = 0
    for c, call in enumerate(plan_.calls):
        for e in call:
            if e.admitted:
                length = plan_.requests[e.request].length
                k, gate = request_rows(
                    config.seed, e.request, length, head_dim, dtype
                )
                live[e.request] = LiveRequest(e.slot, k, gate)
        here = fault if fault is not None and fault.call == c else None
        delta = 0.0
        if here is not None:
            rows = live[here.request].k.astype(np.float64)
            delta = 8.0 * max(1.0, float(np.abs(rows).max()))
        restores = [
            (e, live[e.request])
            for e in call
            if e.admitted and e.cache_length % kpool
        ]
        ring_fault = None
        if here is not None and here.kind == "ring":
            ring_fault = (here.slot, here.position, delta)
        if restores or ring_fault:
            ring = restore_ring(runner, ring, restores, ring_fault, kpool)

        sequences = {
            e.request: (live[e.request].k, live[e.request].gate) for e in call
        }
        inputs = plan_call_inputs(
            config.seed, c, call, sequences, head_dim, dtype
        )
        if here is not None and here.kind == "key":
            row = int(inputs.input_row_offsets[here.entry])
            k_row = inputs.k[row].astype(np.float64)
            inputs.k[row] = (k_row + delta).astype(dtype)

        start = time.perf_counter()
        out = runner.step(ring, ape=ape, kpool=kpool, **inputs.operands())
        totals.call_seconds.append(time.perf_counter() - start)

        collect_pools(c, call, out, live, totals, kpool)
        expand_and_check(config, c, call, runner, here, totals)
        for e in call:
            if not e.finished:
                continue
            state = live.pop(e.request)
            err, ratio, checked, problems = check_request(
                e.request,
                plan_.requests[e.request],
                state,
                ape,
                kpool,
                rel_tol,
            )
            totals.max_abs_error = max(totals.max_abs_error, err)
            totals.worst_ratio = max(totals.worst_ratio, ratio)
            totals.checked_pools += checked
            totals.dropped += sum(
                1
                for p in state.pools
                if p >= plan_.requests[e.request].end // kpool
                and not state.pools[p].accepted
            )
            totals.problems += problems
            finished += 1
        progress.set_postfix_str(
            f"{finished}/{len(plan_.requests)} requests checked", refresh=False
        )
        progress.update(1)
    progress.close()
    return totals


def expand_and_check(
    config: Config,
    c: int,
    call: Sequence[Entry],
    runner: Runner,
    fault: Fault | None,
    totals: Totals,
) -> None:
    """Expands a seeded selection for the call's queries and checks it.

    The kernel gets the selection (with the ``"topk"`` fault applied, if
    it is this call's); the oracle gets the selection as drawn.
    """
    ids, skipped = select_pools(
        config.seed, c, call, config.pool_topk, config.kpool
    )
    sent = ids
    if fault is not None and fault.kind == "topk":
        sent = ids.copy()
        corrupt_selection(
            sent, fault.pool, (fault.position + 1) // config.kpool
        )
    offsets = np.zeros(len(call) + 1, np.uint32)
    offsets[1:] = np.cumsum([e.tokens for e in call])
    cache = np.array([e.cache_length for e in call], np.uint32)
    start = time.perf_counter()
    got = runner.expand_topk(sent, offsets, cache, config.kpool)
    totals.expand_seconds.append(time.perf_counter() - start)
    want = reference.expand_topk(ids, offsets, cache, config.kpool)
    mismatches, problems = check_expansion(c, call, got, want)
    totals.expand_rows += len(ids)
    totals.expand_checked += len(want) if got.shape == want.shape else 0
    totals.expand_mismatches += mismatches
    totals.expand_skipped_ids += skipped
    totals.problems += problems


def collect_pools(
    c: int,
    call: Sequence[Entry],
    out: Any,
    live: dict[int, LiveRequest],
    totals: Totals,
    kpool: int,
) -> None:
    """Files one call's pools under their requests, noting duplicates.

    A pool id produced again replaces its row only if the earlier row held
    a rejected draft (counted as rewritten); a row of kept tokens produced
    twice is a problem.
    """
    try:
        rows = step_pools(out)
    except ValueError as err:
        totals.problems.append(f"call {c}: {err}")
        return
    for e, got in zip(call, rows, strict=True):
        state = live[e.request]
        writers = [row.writer for row in got.values()]
        totals.ring_close += writers.count(RING_CLOSE)
        totals.compress += writers.count(COMPRESS)
        earlier = {p: state.pools[p] for p in got if p in state.pools}
        rewritten, twice = keep_latest(
            state.pools, got, c, e.cache_length + e.accepted, kpool
        )
        totals.rewritten += rewritten
        for pool in twice:
            state.problems.append(
                f"request {e.request} (slot {e.slot}): pool {pool} came out "
                f"twice: {earlier[pool].writer} in call {earlier[pool].call}, "
                f"{got[pool].writer} in call {c}"
            )


def compile_models(runner: Runner, config: Config) -> float:
    """Compiles (or loads from MAX's cache) the models :func:`serve` uses.

    The fused step on a ``config.ring_len`` ring and expand_topk at
    ``config.pool_topk``, both with uint32 index operands, so the first
    call is not charged with compiling.

    Args:
        runner: Where they run.
        config: The run's dtype, kpool, head_dim, ring and top-k.

    Returns:
        The seconds it took.
    """
    from .runner import model_key

    start = time.perf_counter()
    runner.model(
        model_key(
            "step",
            config.kpool,
            dtype=config.dtype,
            head_dim=config.head_dim,
            ring_len=config.ring_len,
        )
    )
    runner.model(
        model_key(
            "expand_topk",
            config.kpool,
            dtype=np.int32,
            pool_topk=config.pool_topk,
        )
    )
    return time.perf_counter() - start


def summarize(
    config: Config,
    plan_: Plan,
    totals: Totals,
    compile_s: float,
    wall_s: float,
    fault: str | None,
) -> dict[str, Any]:
    """The run's numbers, as the demo prints them and writes with ``--json``.

    Args:
        config: The run's configuration.
        plan_: Its plan.
        totals: What :func:`serve` counted.
        compile_s: Seconds spent compiling the models.
        wall_s: Seconds the whole run took.
        fault: The injected fault's description, or ``None``.

    Returns:
        A JSON-ready dict: configuration, token, call and pool counts, the
        worst error against the oracle, expand_topk counts, timings, the
        problems, and (with speculation) verify-step counts.
    """
    reqs = plan_.requests
    prefill = decode = 0
    for call in plan_.calls:
        for e in call:
            prompt = reqs[e.request].prompt
            end = e.cache_length + e.accepted
            prefill += max(0, min(end, prompt) - e.cache_length)
            decode += max(0, end - max(e.cache_length, prompt))
    tokens = prefill + decode
    step_s = sum(totals.call_seconds)
    calls = len(plan_.calls)
    summary = {
        "ok": not totals.problems,
        "config": {
            "dtype": config.dtype.name,
            "kpool": config.kpool,
            "head_dim": config.head_dim,
            "device": config.device,
            "seed": config.seed,
            "token_budget": None if config.schedule else config.token_budget,
            "max_running": config.max_running,
            "chunk": None if config.schedule else config.chunk,
            "schedule": config.schedule,
            "pool_topk": config.pool_topk,
        },
        "requests": len(reqs),
        "requests_with_cached_prefix": sum(r.cached_prefix > 0 for r in reqs),
        "tokens": tokens,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "cached_prefix_tokens": sum(r.cached_prefix for r in reqs),
        "calls": calls,
        "max_batch": max(len(call) for call in plan_.calls),
        "max_call_tokens": max(
            sum(e.tokens for e in call) for call in plan_.calls
        ),
        "slot_reuses": plan_.slot_reuses,
        "pools": totals.ring_close + totals.compress,
        "pools_expected": sum(
            r.end // config.kpool - r.cached_prefix // config.kpool
            for r in reqs
        ),
        "pools_ring_close": totals.ring_close,
        "pools_compress": totals.compress,
        "pools_checked": totals.checked_pools,
        "max_abs_error": totals.max_abs_error,
        "max_error_over_tolerance": totals.worst_ratio,
        "tolerance": tolerance(config.dtype),
        "expand_topk": {
            "rows_expanded": totals.expand_rows,
            "rows_checked": totals.expand_checked,
            "mismatches": totals.expand_mismatches,
            "skipped_ids": totals.expand_skipped_ids,
            "mean_call_seconds": (
                statistics.fmean(totals.expand_seconds)
                if totals.expand_seconds
                else None
            ),
        },
        "mean_call_seconds": step_s / calls,
        "median_call_seconds": statistics.median(totals.call_seconds),
        "tokens_per_second": tokens / step_s if step_s > 0 else None,
        "compile_seconds": compile_s,
        "wall_seconds": wall_s,
        "fault": fault,
        "problems": totals.problems,
    }
    if config.spec_tokens:
        verify = [
            e
            for call in plan_.calls
            for e in call
            if e.cache_length >= reqs[e.request].prompt
        ]
        drafts = sum(e.tokens - 1 for e in verify)
        accepted = sum(e.accepted - 1 for e in verify)
        summary["speculative"] = {
            "spec_tokens": config.spec_tokens,
            "ring_len": config.ring_len,
            "verify_steps": len(verify),
            "draft_tokens": drafts,
            "accepted_drafts": accepted,
            "rejected_drafts": drafts - accepted,
            "verify_steps_all_rejected": sum(
                e.accepted == 1 < e.tokens for e in verify
            ),
            "verify_steps_all_accepted": sum(
                e.accepted == e.tokens > 1 for e in verify
            ),
            "pools_rewritten": totals.rewritten,
            "pools_dropped": totals.dropped,
        }
    return summary
