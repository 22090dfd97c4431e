"""One step of the writers on the oracle: close, compress, then seed."""

from __future__ import annotations

import numpy as np

from ..calls import CallInputs, PoolRow, first_pool_ids, pools_of_call
from .writers import compress, pool_row_offsets, ring_close, seed_tail


def step(
    ring: np.ndarray, call: CallInputs, ape: np.ndarray, kpool: int
) -> tuple[list[dict[int, PoolRow]], np.ndarray]:
    """One step on the float64 oracle: close, compress, then seed.

    The NumPy counterpart of :meth:`mla_kpool.runner.Runner.step` (the
    fused ``mla_kpool.step`` op), in the writers' serving order: ring_close
    reads the ring before seed_tail writes it.

    Args:
        ring: Host ring ``[max_slots, 2, R, head_dim]``; not modified.
        call: The call's keys, gates and per-request metadata.
        ape: ``[kpool, head_dim]`` float32 position embedding.
        kpool: Tokens per pool.

    Returns:
        ``(pools, ring)``: per request ``{pool_id: PoolRow}`` (float64
        keys), and the ring after seed_tail.

    Raises:
        TypeError, ValueError: As the writers, for malformed operands.
    """
    k, gate = call.k, call.gate
    offsets, cache = call.input_row_offsets, call.cache_lengths
    ring_pooled, closed = ring_close(
        ring, k, gate, ape, offsets, cache, call.slot_idx, kpool
    )
    rows_at = pool_row_offsets(offsets, cache, kpool)
    rows = compress(k, gate, ape, offsets, rows_at, cache, kpool)
    ring = seed_tail(ring, k, gate, offsets, cache, call.slot_idx, kpool)
    pools = pools_of_call(
        closed, ring_pooled, rows, rows_at, first_pool_ids(cache, kpool)
    )
    return pools, ring
