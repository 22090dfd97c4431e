"""One call's operands and what it produced.

A serving step runs the writers once per call: :class:`CallInputs` holds
what changes from call to call (the batch's new keys and gates and its
per-request metadata), and :func:`pools_of_call` turns the step's outputs
back into "pool id -> key, which writer" per request. Both are pure NumPy
and import nothing else of this package, so the runner, the oracle, the
demo and the tests can all share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "COMPRESS",
    "RING_CLOSE",
    "CallInputs",
    "PoolRow",
    "first_pool_ids",
    "pack_call",
    "pools_completed",
    "pools_of_call",
]


@dataclass(frozen=True)
class CallInputs:
    """The operands of one call of the writers, as a scheduler makes them.

    The ring and ``ape`` are not in it: the ring is state that outlives the
    call (a device buffer for :class:`mla_kpool.runner.Runner`, a host
    array for the oracle, which returns a new one), and ``ape`` is a
    weight of the layer, the same for every call. What is here is what a
    scheduler decides anew for each call.

    Attributes:
        k: ``[total_tokens, head_dim]`` keys, batch rows in order.
        gate: ``[total_tokens, head_dim]`` gate scores, same dtype.
        input_row_offsets: ``[batch + 1]`` token row offsets, uint32 (any
            integer dtype).
        cache_lengths: ``[batch]`` tokens each request had before the call.
        slot_idx: ``[batch]`` ring slot of each request.
    """

    k: np.ndarray
    gate: np.ndarray
    input_row_offsets: np.ndarray
    cache_lengths: np.ndarray
    slot_idx: np.ndarray

    def operands(self) -> dict[str, np.ndarray]:
        """The fields by the ops' argument names, for ``**`` calls."""
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
    """Packs a call's batch rows into ragged operands.

    Args:
        rows: Per batch row ``(k_parts, gate_parts, cache_length, slot)``:
            the row's keys and gate scores as consecutive pieces (for a
            verify step, the kept tokens then the drafts), each
            ``[m, head_dim]``.
        head_dim: Channels per key (for an empty call).
        dtype: Key dtype.

    Returns:
        The operands, index operands uint32.
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


#: Writer names, as :attr:`PoolRow.writer` gives them.
RING_CLOSE = "ring_close"
COMPRESS = "compress"


@dataclass(frozen=True)
class PoolRow:
    """One pooled key a call produced.

    Attributes:
        key: ``[head_dim]`` pooled key, in the key dtype (float64 from the
            oracle).
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
