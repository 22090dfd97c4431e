"""Host-side check of ragged batch metadata before it reaches the writers.

The kernels tolerate bad metadata (they skip the request and never touch memory
out of bounds), which also means they hide it. :func:`check_metadata` is the
strict counterpart for callers and tests: it names the first thing wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .index_cache import PagedIndexCache

__all__ = ["check_index_metadata", "check_metadata"]


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _index_array(name: str, values: np.ndarray | Sequence[int]) -> list[int]:
    arr = np.asarray(values)
    if not isinstance(values, np.ndarray) and arr.size == 0:
        # An empty Python sequence (batch 0) has no dtype of its own; NumPy
        # would call it float64.
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be rank 1, got shape {arr.shape}")
    # Python ints: uint32 / uint64 values never wrap and int32 negatives stay
    # negative, so every comparison below is exact.
    ints = [int(v) for v in arr]
    for i, v in enumerate(ints):
        if v >= 1 << 63:
            raise ValueError(
                f"{name}[{i}]={v} is 2^63 or more, which the kernels read "
                "as a negative 64-bit value"
            )
    return ints


def _pool_count(c: int, n: int, kpool: int) -> int:
    return max(0, (c + n) // kpool - -(-c // kpool))


def check_metadata(
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    slot_idx: np.ndarray,
    *,
    total_tokens: int,
    max_slots: int,
    kpool: int | None = None,
    pool_row_offsets: np.ndarray | None = None,
) -> None:
    """Validates one call's ragged metadata; raises on the first problem found.

    Whole-array problems are checked first (dtype, rank, lengths, first
    offsets), then requests in batch order, so the message names the first
    offending request and field, with the expected and the given value::

        ValueError: request 3: input_row_offsets[4]=17 < input_row_offsets[3]=20
        (offsets must be non-decreasing)

    Rules: `input_row_offsets` starts at 0, is non-decreasing and ends at most
    at `total_tokens` (trailing unused rows of `k` are allowed);
    `cache_lengths >= 0`; `0 <= slot_idx < max_slots`; no value of 2^63 or
    more (the kernels read indices as signed 64-bit); and no two requests
    share a slot (both would write one ring slot, even a request with no new
    tokens). If `pool_row_offsets` is given it must equal the exclusive prefix
    sum of each request's pool count
    `max(0, floor((c + n) / kpool) - ceil(c / kpool))`, which needs `kpool`.
    All arithmetic is on Python ints, so uint32 `c + n` past 2^32 is exact.

    Args:
        input_row_offsets: Token row offsets `[batch + 1]`, integer dtype.
        cache_lengths: Cached-prefix lengths `[batch]`, integer dtype.
        slot_idx: Ring slot per request `[batch]`, integer dtype.
        total_tokens: Rows of `k` this call (`k.shape[0]`), `>= 0`.
        max_slots: Slots in the ring (`tail.shape[0]`), `>= 0`.
        kpool: Tokens per pool, `>= 1`; required with `pool_row_offsets`.
        pool_row_offsets: Output row offsets of `compress` `[batch + 1]`,
            integer dtype.

    Raises:
        TypeError: `kpool`, `total_tokens` or `max_slots` not an int.
        ValueError: an index array without an integer dtype, or anything
            else listed above; the message names the field (and the
            request, for per-request problems).
    """
    total_tokens = _require_int("total_tokens", total_tokens, 0)
    max_slots = _require_int("max_slots", max_slots, 0)
    if kpool is not None:
        kpool = _require_int("kpool", kpool, 1)

    offsets = _index_array("input_row_offsets", input_row_offsets)
    cache = _index_array("cache_lengths", cache_lengths)
    slots = _index_array("slot_idx", slot_idx)
    pools = None
    if pool_row_offsets is not None:
        if kpool is None:
            raise ValueError("kpool is required to check pool_row_offsets")
        pools = _index_array("pool_row_offsets", pool_row_offsets)

    batch = len(cache)
    if len(offsets) != batch + 1:
        raise ValueError(
            f"input_row_offsets has {len(offsets)} entries, expected "
            f"batch + 1 = {batch + 1} (cache_lengths has {batch})"
        )
    if len(slots) != batch:
        raise ValueError(
            f"slot_idx has {len(slots)} entries, expected batch = {batch} "
            f"(cache_lengths has {batch})"
        )
    if pools is not None and len(pools) != batch + 1:
        raise ValueError(
            f"pool_row_offsets has {len(pools)} entries, expected "
            f"batch + 1 = {batch + 1} (cache_lengths has {batch})"
        )
    if offsets[0] != 0:
        raise ValueError(
            f"input_row_offsets[0]={offsets[0]}, expected 0 (ragged offsets "
            f"start at row 0)"
        )
    if pools is not None and pools[0] != 0:
        raise ValueError(f"pool_row_offsets[0]={pools[0]}, expected 0")

    first_user: dict[int, int] = {}
    for b in range(batch):
        start, end = offsets[b], offsets[b + 1]
        c, s = cache[b], slots[b]
        where = f"request {b}: "
        if end < start:
            raise ValueError(
                f"{where}input_row_offsets[{b + 1}]={end} < "
                f"input_row_offsets[{b}]={start} "
                f"(offsets must be non-decreasing)"
            )
        if end > total_tokens:
            raise ValueError(
                f"{where}input_row_offsets[{b + 1}]={end} > "
                f"total_tokens={total_tokens}"
            )
        if c < 0:
            raise ValueError(f"{where}cache_lengths[{b}]={c} < 0")
        if s < 0:
            raise ValueError(f"{where}slot_idx[{b}]={s} < 0")
        if s >= max_slots:
            raise ValueError(
                f"{where}slot_idx[{b}]={s} >= max_slots={max_slots}"
            )
        if s in first_user:
            other = first_user[s]
            raise ValueError(
                f"{where}slot_idx[{b}]={s} duplicates slot_idx[{other}]={s} "
                f"(two requests would write one ring slot)"
            )
        first_user[s] = b
        if pools is not None:
            count = _pool_count(c, end - start, kpool)
            expected = pools[b] + count
            if pools[b + 1] != expected:
                raise ValueError(
                    f"{where}pool_row_offsets[{b + 1}]={pools[b + 1]}, "
                    f"expected {expected} "
                    f"(pool_row_offsets[{b}]={pools[b]} + {count} "
                    f"pools for c={c}, n={end - start}, kpool={kpool})"
                )


def check_index_metadata(
    input_row_offsets: np.ndarray | Sequence[int],
    cache: PagedIndexCache,
    layer_idx: int,
    *,
    total_tokens: int,
    kpool: int | None = None,
) -> None:
    """Validates one ``index_top_k`` call's metadata; raises on the first error.

    The indexer's counterpart of :func:`check_metadata`: the op gives a
    request whose metadata is bad ``-1`` rows and says nothing, so a bug
    upstream loses selections silently; this names it. Whole-array problems
    first, then requests in batch order.

    Rules: ``input_row_offsets`` has ``batch + 1`` entries (``batch`` the
    cache's ``cache_lengths``), starts at 0, is non-decreasing and ends at
    most at ``total_tokens``: a padded batch (query rows past the last
    offset, as a serving engine pads a batch to a captured graph's size) is
    allowed, and the op gives those rows ``-1``; ``kpool`` is the cache's;
    ``0 <= layer_idx < num_layers``; and each request ``b`` (``c`` cached,
    ``n`` new tokens) finds the pages its last row reads, ``ceil(rows /
    page_size)`` with ``rows = (c + n) // kpool`` pooled keys (times
    ``kpool`` in the spread layout), in both lookup tables, each naming a
    block inside its arena.

    Args:
        input_row_offsets: Token row offsets ``[batch + 1]``, integer dtype.
        cache: The :class:`mla_kpool.index_cache.PagedIndexCache` the call
            reads (its ``cache_lengths`` are the call's).
        layer_idx: The layer the call reads.
        total_tokens: Query rows this call (``q.shape[0]``), ``>= 0``.
        kpool: The call's ``kpool``; ``None`` takes the cache's.

    Raises:
        TypeError: ``layer_idx``, ``total_tokens`` or ``kpool`` not an int.
        ValueError: An index array without an integer dtype, or anything
            else listed above; the message names the field (and the
            request), the expected and the given value.
    """
    total_tokens = _require_int("total_tokens", total_tokens, 0)
    layer_idx = _require_int("layer_idx", layer_idx, 0)
    if kpool is not None and _require_int("kpool", kpool, 1) != cache.kpool:
        raise ValueError(
            f"kpool must be the cache's kpool={cache.kpool}, got {kpool}"
        )
    if layer_idx >= cache.num_layers:
        raise ValueError(
            f"layer_idx must be < num_layers={cache.num_layers}, got"
            f" {layer_idx}"
        )
    offsets = _index_array("input_row_offsets", input_row_offsets)
    lengths = _index_array("cache.cache_lengths", cache.cache_lengths)
    batch = len(lengths)
    if len(offsets) != batch + 1:
        raise ValueError(
            f"input_row_offsets has {len(offsets)} entries, expected "
            f"batch + 1 = {batch + 1} (cache.cache_lengths has {batch})"
        )
    if offsets[0] != 0:
        raise ValueError(
            f"input_row_offsets[0]={offsets[0]}, expected 0 (ragged offsets "
            f"start at row 0)"
        )
    tables = (
        ("lookup_table", cache.lookup_table, cache.num_blocks),
        ("scales_lookup_table", cache.scales_lookup_table,
         cache.num_scale_blocks),
    )  # fmt: skip
    for b in range(batch):
        start, end = offsets[b], offsets[b + 1]
        where = f"request {b}: "
        if end < start:
            raise ValueError(
                f"{where}input_row_offsets[{b + 1}]={end} < "
                f"input_row_offsets[{b}]={start} "
                f"(offsets must be non-decreasing)"
            )
        if end > total_tokens:
            raise ValueError(
                f"{where}input_row_offsets[{b + 1}]={end} > "
                f"total_tokens={total_tokens}"
            )
        c, n = lengths[b], end - start
        keys = (c + n) // cache.kpool
        rows = keys * cache.kpool if cache.spread else keys
        pages = -(-rows // cache.page_size)
        for name, table, blocks in tables:
            width = table.shape[1] if table.ndim == 2 else 0
            if pages > width:
                raise ValueError(
                    f"{where}cache.{name} must have at least {pages} pages"
                    f" per request ({keys} keys for c={c}, n={n},"
                    f" kpool={cache.kpool}, page_size={cache.page_size}),"
                    f" got {width}"
                )
            for page in range(pages):
                block = int(table[b, page])
                if block >= blocks:
                    raise ValueError(
                        f"{where}cache.{name}[{b}, {page}]={block} must be"
                        f" < {blocks} (the blocks of its arena)"
                    )
