"""Deliberate corruptions behind the oracle's back, which the check must see.

A :class:`Fault` changes one ring member, one key row, one selected pool id
sent to expand_topk, one head weight of one indexer query, or the bound of
one request's indexer rows (one pool too many, as a kernel with ``<=`` for
``<`` would read); :func:`place_fault` finds a call where the change must
make a check fail, so a run that passes with it would prove the check
blind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .scheduling import Plan

__all__ = [
    "FAULT_KINDS",
    "INDEX_FAULTS",
    "Fault",
    "corrupt_selection",
    "corrupt_weight",
    "place_fault",
]


#: Fault kinds ``--inject-fault`` takes, the first the default.
FAULT_KINDS = ("ring", "key", "topk", "head", "bound")

#: Faults of the indexer's operands (the oracle gets the true ones).
INDEX_FAULTS = ("head", "bound")


@dataclass(frozen=True)
class Fault:
    """One deliberate corruption the oracle does not know about.

    Attributes:
        kind: ``"ring"``: a ring member's key is changed just before the
            call that closes its pool; ``"key"``: one row of ``k`` is
            changed in the call that brings it; ``"topk"``: one selected
            pool id of one query token is changed in the ``pool_ids`` sent
            to expand_topk; ``"head"``: the weight (``qs``) of one head of
            one indexer query is changed (the query's largest, negated and
            scaled by 8, so another head's order wins) as sent to
            index_top_k; ``"bound"``: index_top_k sees the request's cache
            length plus ``kpool``, so each of its rows sees one pool more.
        call: The call it happens in.
        entry: The request's batch position in that call.
        request: The request.
        position: The token position whose key is changed, or the
            position of the query whose selection or weight is changed
            (``"bound"``: of the first query that must fail).
        pool: The pool that must then fail the check; for the other kinds,
            the token row (in the call) that must fail.
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
        if self.kind == "head":
            return (
                f"weight of one head of the indexer query at position "
                f"{self.position} as sent to index_top_k, request "
                f"{self.request}, call {self.call}: token row {self.pool} "
                f"must fail"
            )
        if self.kind == "bound":
            return (
                f"cache length of request {self.request} as sent to "
                f"index_top_k in call {self.call} one pool longer (every row"
                f" sees one pool past its bound): token row {self.pool} "
                f"(position {self.position}) must fail"
            )
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

    def caught(self, problems: Sequence[str]) -> bool:
        """Whether a run reported the failure this fault must cause."""
        failure = f"pool {self.pool} "
        if self.kind == "topk":
            failure = f"call {self.call}: expand_topk row {self.pool} "
        if self.kind in INDEX_FAULTS:
            failure = f"call {self.call}: index_top_k row {self.pool} "
        mine = f"request {self.request} "
        return any(p.startswith(mine) and failure in p for p in problems)


def place_fault(
    plan_: Plan, kind: str, kpool: int, top_k: int = 512, causal: bool = False
) -> Fault | None:
    """Finds where to inject a fault that the check must see.

    Calls are searched from the middle of the run on, then from the start.

    Args:
        plan_: The run.
        kind: ``"ring"`` (a call where ring_close closes a pending pool),
            ``"key"`` (a call bringing a token of a complete pool),
            ``"topk"`` (a call whose last token of a request sees at least
            two complete pools, so a selected id can be swapped for another
            valid one), ``"head"`` (a request's last query of a call that
            sees more than ``top_k`` pools, so a weight changes the set) or
            ``"bound"`` (a request's first query of a call that sees fewer
            than ``top_k`` pools, so one more must show in its row).
        kpool: Tokens per pool.
        top_k: Ids per indexer row.
        causal: The indexer's mask (``bound`` of a row depends on it).

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
            elif kind in ("topk", "head"):
                least = top_k if kind == "head" else 1  # pools seen, exclusive
                if n and (cl + n) // kpool > least:
                    pos = cl + n - 1
                    return Fault(kind, c, b, e.request, pos, row - 1, e.slot)
            elif kind == "bound":
                first = (cl + n - (n - 1) * causal) // kpool
                if n and first < top_k:
                    return Fault(kind, c, b, e.request, cl, row - n, e.slot)
            elif n and cl < length // kpool * kpool:
                return Fault(kind, c, b, e.request, cl, cl // kpool, e.slot)
    return None


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


def corrupt_weight(qs: np.ndarray, row: int) -> None:
    """Changes one head weight of ``qs[row]``.

    The largest in magnitude is negated and scaled by 8, so that head's
    order dominates the row.
    """
    h = int(np.argmax(np.abs(qs[row])))
    qs[row, h] = -8 * qs[row, h]
