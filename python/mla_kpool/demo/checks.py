"""Checking what the calls produced against the oracle.

Every pool a call produces is filed under its request (:func:`keep_latest`:
each pool id exactly once or, with speculation, the latest row of each,
which must hold kept tokens only). When a request finishes, the oracle
(:func:`mla_kpool.reference.pool_sequence`) recomputes its whole sequence in
one shot and :func:`check_request` compares: none missing, none extra, each
within the key dtype's tolerance relative to the largest ``|k|`` among the
pool's members (:func:`mla_kpool.reference.pool_errors`). Each call's
indexer selection (:mod:`mla_kpool.demo.indexing`) is widened by
expand_topk and compared row by row (:func:`check_expansion`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import reference
from ..calls import PoolRow
from .scheduling import Entry
from .workload import Request

__all__ = [
    "LiveRequest",
    "PoolRecord",
    "Totals",
    "check_expansion",
    "check_request",
    "keep_latest",
    "plural",
]


#: Failures listed per request before the rest are only counted.
MAX_LISTED = 5


def plural(count: int, noun: str, grouped: bool = False) -> str:
    """``count`` and ``noun``, with an ``s`` unless ``count`` is 1.

    Args:
        count: How many.
        noun: The singular noun.
        grouped: Whether ``count`` is written with thousands separators.
    """
    number = f"{count:,}" if grouped else f"{count}"
    return f"{number} {noun}{'' if count == 1 else 's'}"


def _unlisted(where: str, bad: int, noun: str) -> list[str]:
    """The line counting the ``bad`` failures past the first listed."""
    more = bad - MAX_LISTED
    if more <= 0:
        return []
    differ = "differs" if more == 1 else "differ"
    return [f"{where}: {plural(more, 'more ' + noun)} {differ} from the oracle"]


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
        index_rows: index_top_k rows produced.
        index_checked: index_top_k rows checked against the oracle.
        index_selections: Of those, rows with more visible pools than
            ``top_k`` (where the op chose).
        index_worst_margin: Smallest margin at the k-th score over the
            selections, in score units (``inf``: none).
        index_failures: Calls with a wrong index_top_k row.
        index_seconds: Seconds of each index_top_k call.
        expand_rows: expand_topk rows produced.
        expand_checked: expand_topk rows compared with the oracle.
        expand_mismatches: expand_topk rows that differ from the oracle.
        expand_skipped_ids: Selected ids expand_topk must skip (pools not
            complete and visible to the query: with the null mask, a
            prefill row's selection may name the call's later pools).
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
    index_rows: int = 0
    index_checked: int = 0
    index_selections: int = 0
    index_worst_margin: float = float("inf")
    index_failures: int = 0
    index_seconds: list[float] = field(default_factory=list)
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
    got = np.stack([live.pools[p].key for p in ids])
    members = np.abs(live.k[: last * kpool].astype(np.float64))
    scale = members.reshape(last, kpool, -1).max(axis=(1, 2))[ids]
    err, allowed, _, bad = reference.pool_errors(
        got, expected[ids], scale, tolerance
    )
    ratio = err / allowed
    for j in bad[:MAX_LISTED]:
        p = ids[j]
        row = live.pools[p]
        problems.append(
            f"{name}: pool {p} (positions {p * kpool}..{(p + 1) * kpool - 1}"
            f", {row.writer}, call {row.call}) differs from the oracle: "
            f"max |err| {err[j]:.4g} > {allowed[j]:.4g} ({tolerance:g} x "
            f"max |k| {scale[j]:.4g})"
        )
    problems += _unlisted(name, len(bad), "pool")
    max_err = float(np.nanmax(err)) if not np.isnan(err).all() else np.nan
    worst = float(np.max(ratio)) if not np.isnan(ratio).any() else np.inf
    return max_err, worst, len(ids), problems


def check_expansion(
    c: int, call: Sequence[Entry], got: np.ndarray, want: np.ndarray
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
    problems += _unlisted(f"call {c}", len(bad), "expand_topk row")
    return len(bad), problems
