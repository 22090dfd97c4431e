"""Batching requests into calls, and giving each call its metadata.

:func:`schedule` batches requests the way a serving engine does (a token
budget per call, decode of running requests first, prefill chunks of the
others, new requests admitted while a ring slot is free). :func:`plan` turns
those calls (or a schedule file's) into the exact per-call metadata the
writers get: each request's cache length and ring slot at every call, slots
handed out at random from the free ones and reused once their request
finishes, so a slot id is in general not the request's batch position.
:func:`plan_call_inputs` packs one planned call into the step's operands.

With ``spec_tokens`` in :func:`schedule`, a decode step is a verify step:
the request's next token and ``spec_tokens`` drafts go through the writers,
the target model keeps a seeded number of them (the first token always), and
the request's next call resumes after the last token kept. An entry then
records both what the call brought and what was kept
(:attr:`Entry.rejected`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..calls import CallInputs, pack_call
from .workload import Request, ScheduleError, draft_rows

__all__ = ["Call", "Entry", "Plan", "plan", "plan_call_inputs", "schedule"]


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
