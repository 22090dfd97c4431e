"""NumPy oracle for the k-pooled indexer writers, from docs/ops.md's contracts.

Each pool of ``kpool`` consecutive tokens collapses to one key, per channel::

    s[q, ch]    = gate[q, ch] + ape[q, ch]
    w[q, ch]    = exp(s[q, ch] - max_q s[q, ch])
    pooled[ch]  = sum_q w[q, ch] * key[q, ch] / sum_q w[q, ch]

Everything here runs in float64 (the kernels compute in float32; tests compare
with a tolerance derived from the output dtype). Subtracting the per-channel
maximum keeps gates of magnitude 100 or more finite, and ``np.max`` propagates
NaN, so a NaN score poisons its channel exactly as a softmax would.

The three writers mirror the graph ops, in the order a serving step runs them:

1. :func:`ring_close` closes each request's pending pool (the one the tail ring
   partly holds) when this call brings enough new tokens.
2. :func:`compress` builds every pool made entirely of this call's tokens.
3. :func:`seed_tail` stashes the trailing incomplete tokens into the ring.

:func:`expand_topk` mirrors the op that reads the pools back: it widens the
pool ids an indexer selected for each query token into the token positions
attention reads.

Index values are read one by one as Python ``int`` so that ``c + n`` never
wraps, whatever the index dtype (uint32 by MAX convention). Bad runtime
metadata (offsets out of order or past ``total_tokens``, a slot outside the
ring, a negative cache length) never raises here: it gives the documented
"no result" answer for that request, as the kernels must.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "compress",
    "compress_ambiguous_rows",
    "compress_candidates",
    "expand_topk",
    "expand_topk_ambiguous_rows",
    "expand_topk_candidates",
    "expand_topk_width",
    "pool",
    "pool_row_offsets",
    "pool_sequence",
    "ring_close",
    "seed_tail",
]


# --------------------------------------------------------------------------
# Input checking (structural errors only; bad metadata *values* never raise)
# --------------------------------------------------------------------------


def _check_kpool(kpool: int) -> int:
    """``kpool`` as an ``int``, checked positive, in the graph API's words.

    A deliberate copy of ``mla_kpool._validate.check_kpool``: the oracle
    imports nothing from the graph layer it checks.
    """
    if isinstance(kpool, bool) or not isinstance(kpool, (int, np.integer)):
        raise TypeError(f"kpool must be an int, got {type(kpool).__name__}")
    if kpool < 1:
        raise ValueError(f"kpool must be at least 1, got {kpool}")
    return int(kpool)


def _index_values(name: str, values: np.ndarray) -> list[int]:
    """Returns a rank-1 integer array's entries as Python ints (never wraps)."""
    arr = np.asarray(values)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be rank 1, got shape {arr.shape}")
    return [int(v) for v in arr]


def _batch_metadata(
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    slot_idx: np.ndarray | None = None,
) -> tuple[list[int], list[int], list[int] | None]:
    offsets = _index_values("input_row_offsets", input_row_offsets)
    cache = _index_values("cache_lengths", cache_lengths)
    batch = len(cache)
    if len(offsets) != batch + 1:
        raise ValueError(
            f"input_row_offsets must have batch + 1 = {batch + 1} entries "
            f"(cache_lengths has {batch}), got {len(offsets)}"
        )
    slots = None
    if slot_idx is not None:
        slots = _index_values("slot_idx", slot_idx)
        if len(slots) != batch:
            raise ValueError(
                f"slot_idx must have batch = {batch} entries, got {len(slots)}"
            )
    return offsets, cache, slots


def _keys_and_gates(
    k: np.ndarray, gate: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    k = np.asarray(k)
    gate = np.asarray(gate)
    if k.ndim != 2:
        raise ValueError(
            f"k must be rank 2 [total_tokens, head_dim], got {k.shape}"
        )
    if gate.shape != k.shape:
        raise ValueError(
            f"gate must have the shape of k {k.shape}, got {gate.shape}"
        )
    return k, gate


def _ape(ape: np.ndarray, kpool: int, head_dim: int) -> np.ndarray:
    ape = np.asarray(ape, dtype=np.float64)
    if ape.shape != (kpool, head_dim):
        raise ValueError(
            f"ape must be [kpool, head_dim] = {(kpool, head_dim)}, "
            f"got {ape.shape}"
        )
    return ape


def _ring_length(tail: np.ndarray, kpool: int, head_dim: int) -> int:
    tail = np.asarray(tail)
    if tail.ndim != 4 or tail.shape[1] != 2 or tail.shape[3] != head_dim:
        raise ValueError(
            f"tail must be [max_slots, 2, ring, head_dim={head_dim}], "
            f"got {tail.shape}"
        )
    ring = tail.shape[2]
    if ring < kpool or ring % kpool != 0:
        raise ValueError(
            f"tail ring length must be a positive multiple of kpool={kpool}, "
            f"got {ring}"
        )
    return ring


def _offsets_ok(start: int, end: int, total_tokens: int) -> bool:
    return 0 <= start <= end <= total_tokens


def _slot_ok(slot: int, max_slots: int) -> bool:
    return 0 <= slot < max_slots


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pool_count(c: int, n: int, kpool: int) -> int:
    """Counts pools made only of ``n`` new tokens after ``c`` cached ones."""
    if c < 0 or n < 0:
        return 0
    return max(0, (c + n) // kpool - _ceil_div(c, kpool))


# --------------------------------------------------------------------------
# Pooling math
# --------------------------------------------------------------------------


def _pool_blocks(
    keys: np.ndarray, gates: np.ndarray, ape: np.ndarray
) -> np.ndarray:
    """Pools along axis -2: `[..., kpool, head_dim]` -> `[..., head_dim]`."""
    scores = np.asarray(gates, dtype=np.float64) + ape
    weights = np.exp(scores - np.max(scores, axis=-2, keepdims=True))
    weighted = weights * np.asarray(keys, dtype=np.float64)
    return weighted.sum(axis=-2) / weights.sum(axis=-2)


def pool(keys: np.ndarray, gates: np.ndarray, ape: np.ndarray) -> np.ndarray:
    """Collapses one pool's members to one key (per-channel softmax pooling).

    ``pooled[ch] = sum_q softmax_q(gates[q, ch] + ape[q, ch]) * keys[q, ch]``
    with the per-channel maximum subtracted before ``exp``.

    Args:
        keys: Member keys `[kpool, head_dim]`, any float dtype (float32,
            float16, ml_dtypes.bfloat16, float64).
        gates: Member gate scores `[kpool, head_dim]`, any float dtype.
        ape: Within-pool position embedding `[kpool, head_dim]`; row `q` is
            added to member `q`'s gate.

    Returns:
        float64 `[head_dim]`. A NaN score or key makes its channel NaN.

    Raises:
        ValueError: if the shapes are not all `[kpool, head_dim]` with
            `kpool >= 1`.
    """
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.shape[0] < 1:
        raise ValueError(
            f"keys must be [kpool >= 1, head_dim], got {keys.shape}"
        )
    if np.shape(gates) != keys.shape:
        raise ValueError(
            f"gates must have the shape of keys {keys.shape}, "
            f"got {np.shape(gates)}"
        )
    ape = _ape(ape, keys.shape[0], keys.shape[1])
    return _pool_blocks(keys, gates, ape)


def pool_sequence(
    keys: np.ndarray, gates: np.ndarray, ape: np.ndarray, kpool: int
) -> np.ndarray:
    """Pools a whole sequence in one shot.

    Pool `p` is tokens `[p*kpool, (p+1)*kpool)`.

    This is what the three streaming writers must reproduce, pool for pool,
    however the sequence is split across calls.

    Args:
        keys: Keys `[length, head_dim]`, any float dtype.
        gates: Gate scores `[length, head_dim]`, any float dtype.
        ape: Position embedding `[kpool, head_dim]`.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        float64 `[length // kpool, head_dim]`; a trailing incomplete pool is
        not emitted.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if `kpool < 1` or the shapes disagree.
    """
    kpool = _check_kpool(kpool)
    keys, gates = _keys_and_gates(keys, gates)
    head_dim = keys.shape[1]
    ape = _ape(ape, kpool, head_dim)
    count = keys.shape[0] // kpool
    used = count * kpool
    return _pool_blocks(
        keys[:used].reshape(count, kpool, head_dim),
        gates[:used].reshape(count, kpool, head_dim),
        ape,
    )


# --------------------------------------------------------------------------
# The three writers
# --------------------------------------------------------------------------


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
        TypeError: if an index array is not integer or `kpool` is not an int.
        ValueError: if `kpool < 1` or the array lengths disagree.
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
        TypeError: if an index array is not integer or `kpool` is not an int.
        ValueError: on `kpool < 1` or inconsistent shapes (not on bad
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
        TypeError: if an index array is not integer or `kpool` is not an int.
        ValueError: on `kpool < 1` or inconsistent shapes.
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
        TypeError: if an index array is not integer or `kpool` is not an int.
        ValueError: on `kpool < 1` or inconsistent shapes.
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
        TypeError: if an index array is not integer or `kpool` is not an int.
        ValueError: on `kpool < 1` or inconsistent shapes.
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
        TypeError: if an index array is not integer or `kpool` is not an int.
        ValueError: on `kpool < 1` or inconsistent shapes.
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


# --------------------------------------------------------------------------
# expand_topk: selected pool ids -> token positions
# --------------------------------------------------------------------------

#: A query may see at most this many positions: the newest must fit int32.
POSITION_LIMIT = 2**31


def _pool_ids(pool_ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(pool_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"pool_ids must have an integer dtype, got {ids.dtype}")
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
    ids: list[int],
    cache_length: int,
    local: int,
    kpool: int,
    always_select_tail: bool,
    width: int,
) -> np.ndarray:
    """One packed row for the query at position `cache_length + local`."""
    row = np.full(width, -1, dtype=np.int32)
    visible = cache_length + local + 1
    if cache_length < 0 or visible > POSITION_LIMIT:
        return row
    positions: list[int] = []
    for p in ids:
        if p >= 0 and (p + 1) * kpool <= visible:
            positions.extend(range(p * kpool, (p + 1) * kpool))
    if always_select_tail:
        positions.extend(range(visible - visible % kpool, visible))
    row[: len(positions)] = positions
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
        TypeError: if an index array is not integer, `kpool` is not an int
            or `always_select_tail` is not a bool.
        ValueError: on `kpool < 1` or inconsistent shapes.
    """
    ids, offsets, cache, owners, width = _expand_plan(
        pool_ids, input_row_offsets, cache_lengths, kpool, always_select_tail
    )
    out = np.full((ids.shape[0], width), -1, dtype=np.int32)
    for t, holders in enumerate(owners):
        if holders:
            b = holders[0]
            out[t] = _expanded_row(
                [int(p) for p in ids[t]],
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
        TypeError: if an index array is not integer.
        ValueError: on inconsistent shapes.
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
        row_ids = [int(p) for p in ids[t]]
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
