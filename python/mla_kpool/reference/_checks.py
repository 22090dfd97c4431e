"""Input checks and small index helpers shared by the oracle's ops.

Structural errors (wrong rank, dtype or length) raise; bad metadata *values*
never do: each op turns them into its documented "no result" answer.
"""

from __future__ import annotations

import numpy as np


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
    """Returns a rank-1 integer array's entries as the ops read them.

    The ops read every index as a signed 64-bit integer, so a uint64 value
    of 2^63 or more is negative (bad metadata); every other integer dtype
    converts exactly.
    """
    arr = np.asarray(values)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be rank 1, got shape {arr.shape}")
    return [int(v) for v in arr.astype(np.int64)]


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
