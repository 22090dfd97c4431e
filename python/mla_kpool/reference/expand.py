"""expand_topk: the pool ids an indexer selected -> the token positions."""

from __future__ import annotations

import numpy as np

from ._checks import _batch_metadata, _check_kpool, _offsets_ok

#: A query may see at most this many positions: the newest must fit int32.
POSITION_LIMIT = 2**31


def _pool_ids(pool_ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(pool_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"pool_ids must have an integer dtype, got {ids.dtype}"
        )
    if ids.ndim != 2:
        raise ValueError(
            "pool_ids must be rank 2 [total_tokens, pool_topk], got"
            f" {ids.shape}"
        )
    return ids


def expand_topk_width(
    pool_topk: int, kpool: int, always_select_tail: bool = True
) -> int:
    """Columns of an expand_topk row: `pool_topk * kpool + tail`.

    `tail` is `kpool - 1` with `always_select_tail` (the most the pool still
    filling can hold), else 0.
    """
    kpool = _check_kpool(kpool)
    return pool_topk * kpool + (kpool - 1 if always_select_tail else 0)


def _row_owners(offsets: list[int], total_tokens: int) -> list[list[int]]:
    """Per token row, every request whose valid span holds it, in order."""
    owners: list[list[int]] = [[] for _ in range(total_tokens)]
    for b in range(len(offsets) - 1):
        start, end = offsets[b], offsets[b + 1]
        if _offsets_ok(start, end, total_tokens):
            for t in range(start, end):
                owners[t].append(b)
    return owners


def _expanded_row(
    ids: np.ndarray,
    cache_length: int,
    local: int,
    kpool: int,
    always_select_tail: bool,
    width: int,
) -> np.ndarray:
    """One packed row for the query at position `cache_length + local`.

    `ids` is the row's pool ids in selection order, any integer dtype.
    """
    row = np.full(width, -1, dtype=np.int32)
    visible = cache_length + local + 1
    if cache_length < 0 or visible > POSITION_LIMIT:
        return row
    # A complete pool the query sees: 0 <= p and (p + 1) * kpool <= visible.
    seen = ids[(ids >= 0) & (ids < visible // kpool)].astype(np.int64)
    positions = (seen[:, None] * kpool + np.arange(kpool)).ravel()
    row[: len(positions)] = positions
    if always_select_tail:
        tail = np.arange(visible - visible % kpool, visible)
        row[len(positions) : len(positions) + len(tail)] = tail
    return row


def _expand_plan(
    pool_ids: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
    always_select_tail: bool,
) -> tuple[np.ndarray, list[int], list[int], list[list[int]], int]:
    kpool = _check_kpool(kpool)
    if not isinstance(always_select_tail, (bool, np.bool_)):
        raise TypeError(
            "always_select_tail must be a bool, got "
            f"{type(always_select_tail).__name__}"
        )
    ids = _pool_ids(pool_ids)
    offsets, cache, _ = _batch_metadata(input_row_offsets, cache_lengths)
    width = expand_topk_width(ids.shape[1], kpool, bool(always_select_tail))
    return ids, offsets, cache, _row_owners(offsets, ids.shape[0]), width


def expand_topk(
    pool_ids: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
    always_select_tail: bool = True,
) -> np.ndarray:
    """Expands each token row's selected pool ids into token positions.

    Token row `t` belongs to request `b` when `b`'s span is valid
    (`0 <= start <= end <= total_tokens`) and holds it; its query sees
    `visible = c + (t - start) + 1` positions (`c = cache_lengths[b]`).
    The row is packed: for each id `p` in selection order with `p >= 0` and
    `(p + 1) * kpool <= visible` (a complete pool the query sees), the
    positions `p*kpool .. p*kpool + kpool - 1`; then, with
    `always_select_tail`, the `visible % kpool` newest positions; then `-1`.
    Other ids are skipped; a repeated id is expanded each time. A row no
    request owns, or whose request has `c < 0`, or whose `visible` exceeds
    2^31 (positions past int32), is all `-1`.

    If `input_row_offsets` decreases somewhere, valid spans can overlap;
    this oracle then expands a row for the first request holding it, while
    the kernels only promise all `-1` or some holder's expansion: see
    :func:`expand_topk_ambiguous_rows` and :func:`expand_topk_candidates`.

    Args:
        pool_ids: `[total_tokens, pool_topk]` selected pool ids, any integer
            dtype; `-1` (or any negative) where unused.
        input_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.
        always_select_tail: Append the pool still filling (`kpool - 1` more
            columns).

    Returns:
        int32 `[total_tokens, pool_topk * kpool + tail]`.

    Raises:
        TypeError: if `kpool` is not an int or `always_select_tail` is not
            a bool.
        ValueError: if an index array is not integer, on `kpool < 1` or
            inconsistent shapes.
    """
    ids, offsets, cache, owners, width = _expand_plan(
        pool_ids, input_row_offsets, cache_lengths, kpool, always_select_tail
    )
    out = np.full((ids.shape[0], width), -1, dtype=np.int32)
    for t, holders in enumerate(owners):
        if holders:
            b = holders[0]
            out[t] = _expanded_row(
                ids[t],
                cache[b],
                t - offsets[b],
                kpool,
                bool(always_select_tail),
                width,
            )
    return out


def expand_topk_ambiguous_rows(
    input_row_offsets: np.ndarray, cache_lengths: np.ndarray, total_tokens: int
) -> np.ndarray:
    """Marks `expand_topk` rows whose content the contract leaves open.

    With non-decreasing `input_row_offsets` (every real batch) each row has
    at most one owner and nothing is marked. When the offsets decrease
    somewhere, a row may lie in several valid spans (or the kernels' search
    may miss its one owner): the kernels then only promise all `-1` or the
    expansion for some request whose valid span holds the row. Every row is
    marked; tests check those rows with :func:`expand_topk_candidates`.

    Args:
        input_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        total_tokens: Rows of `pool_ids`.

    Returns:
        bool `[total_tokens]`, all False or all True.

    Raises:
        ValueError: if an index array is not integer, on inconsistent
            shapes.
    """
    offsets, _, _ = _batch_metadata(input_row_offsets, cache_lengths)
    monotone = all(
        a <= b for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    )
    return np.full(total_tokens, not monotone, dtype=bool)


def expand_topk_candidates(
    pool_ids: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
    always_select_tail: bool = True,
) -> list[np.ndarray]:
    """Every row each `expand_topk` output row may hold when ambiguous.

    Args:
        pool_ids: `[total_tokens, pool_topk]`, any integer dtype.
        input_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.
        always_select_tail: As in :func:`expand_topk`.

    Returns:
        Per token row, int32 `[candidates, width]`: row 0 all `-1`, then the
        expansion for each request whose valid span holds the row.

    Raises:
        TypeError: As :func:`expand_topk`.
        ValueError: As :func:`expand_topk`.
    """
    ids, offsets, cache, owners, width = _expand_plan(
        pool_ids, input_row_offsets, cache_lengths, kpool, always_select_tail
    )
    found = []
    for t, holders in enumerate(owners):
        row_ids = ids[t]
        rows = [np.full(width, -1, dtype=np.int32)]
        rows += [
            _expanded_row(
                row_ids,
                cache[b],
                t - offsets[b],
                kpool,
                bool(always_select_tail),
                width,
            )
            for b in holders
        ]
        found.append(np.stack(rows))
    return found
