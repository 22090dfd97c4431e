"""Deliberate corruptions behind the oracle's back, which the check must see.

A :class:`Fault` changes one ring member, one key row or one selected pool
id; :func:`place_fault` finds a call where the change must make a check
fail, so a run that passes with it would prove the check blind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .scheduling import Plan

__all__ = ["FAULT_KINDS", "Fault", "corrupt_selection", "place_fault"]


#: Fault kinds ``--inject-fault`` takes, the first the default.
FAULT_KINDS = ("ring", "key", "topk")


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

    def caught(self, problems: Sequence[str]) -> bool:
        """Whether a run reported the failure this fault must cause."""
        failure = f"pool {self.pool} "
        if self.kind == "topk":
            failure = f"call {self.call}: expand_topk row {self.pool} "
        mine = f"request {self.request} "
        return any(p.startswith(mine) and failure in p for p in problems)


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
