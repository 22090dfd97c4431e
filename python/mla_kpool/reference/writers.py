"""The three writers: ring_close, compress, seed_tail (and compress's offsets).

They mirror the graph ops, in the order a serving step runs them.
"""

from __future__ import annotations

import numpy as np

from ._checks import (
    _ape,
    _batch_metadata,
    _ceil_div,
    _check_kpool,
    _index_values,
    _keys_and_gates,
    _offsets_ok,
    _pool_count,
    _ring_length,
    _slot_ok,
)
from .numerics import _pool_blocks


def pool_row_offsets(
    input_row_offsets: np.ndarray, cache_lengths: np.ndarray, kpool: int
) -> np.ndarray:
    """Computes `compress`'s `pool_row_offsets`: where each request's pools go.

    Request `b` with `c = cache_lengths[b]` cached tokens and
    `n = input_row_offsets[b+1] - input_row_offsets[b]` new ones owns
    `max(0, floor((c + n) / kpool) - ceil(c / kpool))` pools; the result is
    the exclusive prefix sum of those counts. `n < 0` or `c < 0` (bad
    metadata) counts zero pools. `total_tokens` is not known here, so offsets
    past the end of `k` are not detected (compress then clips to the span).

    Args:
        input_row_offsets: Token row offsets `[batch + 1]`, any integer dtype.
        cache_lengths: Cached-prefix lengths `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        int64 `[batch + 1]`, starting at 0.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if an index array is not integer, `kpool < 1` or the
            array lengths disagree.
    """
    kpool = _check_kpool(kpool)
    offsets, cache, _ = _batch_metadata(input_row_offsets, cache_lengths)
    result = [0]
    for b, c in enumerate(cache):
        result.append(
            result[-1] + _pool_count(c, offsets[b + 1] - offsets[b], kpool)
        )
    return np.array(result, dtype=np.int64)


def ring_close(
    tail: np.ndarray,
    k: np.ndarray,
    gate: np.ndarray,
    ape: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    slot_idx: np.ndarray,
    kpool: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Closes each request's pending pool when this call completes it.

    Per request `b`: `start = input_row_offsets[b]`,
    `end = input_row_offsets[b+1]`, `n = end - start`, `c = cache_lengths[b]`,
    `s = slot_idx[b]`, `r = c % kpool`, `p = c // kpool`. Pool `p` closes
    when `r > 0` and `c + n >= (p + 1) * kpool`: member `q < r` is absolute
    position `p*kpool + q`, read from the ring at
    `tail[s, :, (p*kpool + q) % ring]`; member `q >= r` is row
    `start + q - r` of `k` and `gate`.

    Bad metadata gives `closed_pool[b] = -1` and a zero row, like "nothing
    to close": offsets not satisfying `0 <= start <= end <= total_tokens`,
    `s` outside `[0, max_slots)`, or `c < 0`.

    Args:
        tail: Ring `[max_slots, 2, ring, head_dim]` (plane 0 keys, plane 1
            gates); `ring` is `kpool` (MAX's builtin's ring) or a multiple of
            it. Read only.
        k: This call's keys `[total_tokens, head_dim]`, any float dtype.
        gate: This call's gate scores `[total_tokens, head_dim]`.
        ape: Position embedding `[kpool, head_dim]`.
        input_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        slot_idx: `[batch]` ring slot per request, any integer dtype.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        `(pooled, closed_pool)`: float64 `[batch, head_dim]` (zero where
        nothing closed) and int32 `[batch]` pool id closed, or -1.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if an index array is not integer, on `kpool < 1` or
            inconsistent shapes (not on bad
            metadata values).
    """
    kpool = _check_kpool(kpool)
    k, gate = _keys_and_gates(k, gate)
    total_tokens, head_dim = k.shape
    ape = _ape(ape, kpool, head_dim)
    tail = np.asarray(tail)
    ring = _ring_length(tail, kpool, head_dim)
    max_slots = tail.shape[0]
    offsets, cache, slots = _batch_metadata(
        input_row_offsets, cache_lengths, slot_idx
    )

    batch = len(cache)
    pooled = np.zeros((batch, head_dim), dtype=np.float64)
    closed_pool = np.full(batch, -1, dtype=np.int32)
    for b in range(batch):
        start, end, c, s = offsets[b], offsets[b + 1], cache[b], slots[b]
        if not (
            _offsets_ok(start, end, total_tokens) and _slot_ok(s, max_slots)
        ):
            continue
        if c < 0:
            continue
        r, p = c % kpool, c // kpool
        if r == 0 or c + (end - start) < (p + 1) * kpool:
            continue
        ring_index = [(p * kpool + q) % ring for q in range(r)]
        rows = slice(start, start + kpool - r)
        keys = np.concatenate(
            [
                tail[s, 0, ring_index].astype(np.float64),
                k[rows].astype(np.float64),
            ]
        )
        gates = np.concatenate(
            [
                tail[s, 1, ring_index].astype(np.float64),
                gate[rows].astype(np.float64),
            ]
        )
        pooled[b] = _pool_blocks(keys, gates, ape)
        closed_pool[b] = p
    return pooled, closed_pool


def _claimed_rows(o_b: int, o_next: int, count: int, out_rows: int) -> range:
    """Indices `j` of the pools request b writes, at rows `o_b + j`.

    Pool `j` is written iff `j < count` and
    `0 <= o_b + j < min(o_next, out_rows)`. The range never starts below
    `-o_b`, so `o_b + j` slices are never negative.
    """
    lo = max(0, -o_b)
    hi = min(count, o_next - o_b, out_rows - o_b)
    return range(lo, max(lo, hi))


def _compress_plan(
    input_row_offsets: np.ndarray,
    pool_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
    total_tokens: int,
) -> list[tuple[int, int, int, range]]:
    """Per request: `(first_row, first_pool_row, count, written_js)`."""
    offsets, cache, _ = _batch_metadata(input_row_offsets, cache_lengths)
    out_offsets = _index_values("pool_row_offsets", pool_row_offsets)
    batch = len(cache)
    if len(out_offsets) != batch + 1:
        raise ValueError(
            f"pool_row_offsets must have batch + 1 = {batch + 1} entries, "
            f"got {len(out_offsets)}"
        )
    out_rows = total_tokens // kpool
    plan = []
    for b in range(batch):
        start, end, c = offsets[b], offsets[b + 1], cache[b]
        count = 0
        if _offsets_ok(start, end, total_tokens):
            count = _pool_count(c, end - start, kpool)
        # Row of k holding member 0 of this request's first pool.
        first_row = start + _ceil_div(c, kpool) * kpool - c
        o_b = out_offsets[b]
        js = _claimed_rows(o_b, out_offsets[b + 1], count, out_rows)
        plan.append((first_row, o_b, count, js))
    return plan


def compress(
    k: np.ndarray,
    gate: np.ndarray,
    ape: np.ndarray,
    input_row_offsets: np.ndarray,
    pool_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
) -> np.ndarray:
    """Builds every pool made entirely of this call's tokens.

    Request `b` builds pools `ceil(c / kpool) + j` for
    `0 <= j < floor((c + n) / kpool) - ceil(c / kpool)`; member `q` of pool
    `P` is row `start + P*kpool + q - c`. Pool `j` lands at row
    `pool_row_offsets[b] + j`.

    The output has `total_tokens // kpool` rows, an upper bound on the pool
    count; rows nobody writes stay zero. A request with bad offsets
    (not `0 <= start <= end <= total_tokens`) or `c < 0` builds nothing. A
    request writes pool `j` only inside its own span
    `[pool_row_offsets[b], pool_row_offsets[b+1])` and inside the output, so
    wrong `pool_row_offsets` truncate rather than overflow. If
    `pool_row_offsets` decreases somewhere, spans overlap or leave holes;
    this oracle then keeps the last claiming request's pool, while the
    kernels only promise zeros or some request's pool in each row: see
    :func:`compress_ambiguous_rows` and :func:`compress_candidates`.

    Args:
        k: Keys `[total_tokens, head_dim]`, any float dtype.
        gate: Gate scores `[total_tokens, head_dim]`.
        ape: Position embedding `[kpool, head_dim]`.
        input_row_offsets: `[batch + 1]`, any integer dtype.
        pool_row_offsets: `[batch + 1]` output row offsets, normally
            :func:`pool_row_offsets`.
        cache_lengths: `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        float64 `[total_tokens // kpool, head_dim]`.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if an index array is not integer, on `kpool < 1` or
            inconsistent shapes.
    """
    kpool = _check_kpool(kpool)
    k, gate = _keys_and_gates(k, gate)
    total_tokens, head_dim = k.shape
    ape = _ape(ape, kpool, head_dim)
    plan = _compress_plan(
        input_row_offsets, pool_row_offsets, cache_lengths, kpool, total_tokens
    )
    out = np.zeros((total_tokens // kpool, head_dim), dtype=np.float64)
    for first_row, o_b, count, js in plan:
        if not js:
            continue
        pools = _request_pools(k, gate, ape, first_row, count)
        out[o_b + js.start : o_b + js.stop] = pools[js.start : js.stop]
    return out


def _request_pools(
    k: np.ndarray, gate: np.ndarray, ape: np.ndarray, first_row: int, count: int
) -> np.ndarray:
    """The `count` consecutive pools starting at row `first_row` of `k`."""
    kpool, head_dim = ape.shape
    rows = slice(first_row, first_row + count * kpool)
    return _pool_blocks(
        k[rows].reshape(count, kpool, head_dim),
        gate[rows].reshape(count, kpool, head_dim),
        ape,
    )


def compress_ambiguous_rows(
    input_row_offsets: np.ndarray,
    pool_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
    total_tokens: int,
) -> np.ndarray:
    """Marks `compress` output rows whose content the contract leaves open.

    With non-decreasing `pool_row_offsets` every row is determined (each
    request's pools truncated to its own span, zeros elsewhere) and nothing
    is marked. When the offsets decrease somewhere, spans overlap or leave
    holes and the kernels only promise that each row holds zeros or some
    request's pool, never an out-of-bounds write: every row is marked, and
    tests check those rows with :func:`compress_candidates` instead.

    Args:
        input_row_offsets: `[batch + 1]`, any integer dtype.
        pool_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.
        total_tokens: Rows of `k` (`k.shape[0]`).

    Returns:
        bool `[total_tokens // kpool]`, all False or all True.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if an index array is not integer, on `kpool < 1` or
            inconsistent shapes.
    """
    kpool = _check_kpool(kpool)
    _compress_plan(
        input_row_offsets, pool_row_offsets, cache_lengths, kpool, total_tokens
    )
    offsets = [int(o) for o in np.asarray(pool_row_offsets).reshape(-1)]
    monotone = all(
        a <= b for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    )
    return np.full(total_tokens // kpool, not monotone, dtype=bool)


def compress_candidates(
    k: np.ndarray,
    gate: np.ndarray,
    ape: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
) -> np.ndarray:
    """Every pool any request of the call could write, plus the zero row.

    What a `compress` row may hold when :func:`compress_ambiguous_rows`
    marks it: the pools of all requests whose offsets address the call's
    rows, whatever `pool_row_offsets` says.

    Args:
        k: Keys `[total_tokens, head_dim]`, any float dtype.
        gate: Gate scores `[total_tokens, head_dim]`.
        ape: Position embedding `[kpool, head_dim]`.
        input_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        float64 `[candidates, head_dim]`; row 0 is the zero row.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if an index array is not integer, on `kpool < 1` or
            inconsistent shapes.
    """
    kpool = _check_kpool(kpool)
    k, gate = _keys_and_gates(k, gate)
    total_tokens, head_dim = k.shape
    ape = _ape(ape, kpool, head_dim)
    # Where each request's pools start and how many it has do not depend on
    # pool_row_offsets; any array of the right length serves the plan.
    batch = len(np.asarray(cache_lengths).reshape(-1))
    plan = _compress_plan(
        input_row_offsets,
        np.zeros(batch + 1, dtype=np.int64),
        cache_lengths,
        kpool,
        total_tokens,
    )
    found = [np.zeros((1, head_dim))]
    for first_row, _, count, _ in plan:
        if count:
            found.append(_request_pools(k, gate, ape, first_row, count))
    return np.concatenate(found)


def seed_tail(
    tail: np.ndarray,
    k: np.ndarray,
    gate: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    slot_idx: np.ndarray,
    kpool: int,
) -> np.ndarray:
    """Stashes each request's trailing tokens into its ring slot.

    For every position `pos` in
    `[max(c, floor((c + n) / kpool) * kpool - (ring - kpool)), c + n)`, row
    `start + pos - c` of `k` and `gate` goes to `tail[s, 0, pos % ring]` and
    `tail[s, 1, pos % ring]`. With `ring == kpool` that is the incomplete
    trailing pool; a ring of `m` pools also keeps the last `m - 1` complete
    pools. Positions below `c` are never written. A request
    with bad offsets, `s` outside `[0, max_slots)`, or `c < 0` is skipped.
    Requests are applied in batch order (two requests sharing a slot is a
    caller error).

    Args:
        tail: Ring `[max_slots, 2, ring, head_dim]`, `ring` a multiple of
            `kpool`. Not modified.
        k: Keys `[total_tokens, head_dim]`.
        gate: Gate scores `[total_tokens, head_dim]`.
        input_row_offsets: `[batch + 1]`, any integer dtype.
        cache_lengths: `[batch]`, any integer dtype.
        slot_idx: `[batch]`, any integer dtype.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        A new ring, a copy of `tail` (same dtype) with the writes applied;
        values are cast from `k`/`gate` to the ring's dtype.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if an index array is not integer, on `kpool < 1` or
            inconsistent shapes.
    """
    kpool = _check_kpool(kpool)
    k, gate = _keys_and_gates(k, gate)
    total_tokens, head_dim = k.shape
    ring = _ring_length(tail, kpool, head_dim)
    new_tail = np.array(tail, copy=True)
    max_slots = new_tail.shape[0]
    offsets, cache, slots = _batch_metadata(
        input_row_offsets, cache_lengths, slot_idx
    )
    for b, c in enumerate(cache):
        start, end, s = offsets[b], offsets[b + 1], slots[b]
        if not (
            _offsets_ok(start, end, total_tokens) and _slot_ok(s, max_slots)
        ):
            continue
        if c < 0:
            continue
        stop = c + (end - start)
        lo = max(c, (stop // kpool) * kpool - (ring - kpool))
        ring_index = [pos % ring for pos in range(lo, stop)]
        rows = slice(start + lo - c, end)
        new_tail[s, 0, ring_index] = k[rows]
        new_tail[s, 1, ring_index] = gate[rows]
    return new_tail
