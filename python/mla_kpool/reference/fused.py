"""One step of the writers on the oracle, and the check of a kernel's step.

:func:`step` runs close, compress, then seed; :func:`check_step` compares
a kernel's outputs of that step with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..calls import (
    RING_CLOSE,
    CallInputs,
    PoolRow,
    first_pool_ids,
    pools_of_call,
)
from .numerics import pool_errors, tolerance
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


@dataclass(frozen=True)
class StepReport:
    """What :func:`check_step` checked.

    Attributes:
        pools: Pooled keys checked against the oracle (both writers).
        max_error: Largest ``|got - want|`` over them (0 when none).
        worst_ratio: Largest error over its allowed error (0 when none);
            at most 1 for a passing check.
        worst: ``(request, pool)`` of ``worst_ratio``, or ``None``.
    """

    pools: int
    max_error: float
    worst_ratio: float
    worst: tuple[int, int] | None


class _Row(NamedTuple):
    """One output row :func:`check_step` compares with the oracle."""

    where: str  # the row, for the message
    pool: tuple[int, int] | None  # (request, pool id); None: must be zero
    got: np.ndarray
    want: np.ndarray
    scale: float  # largest |k| of its members (0: must be zero)


def _member_scale(
    ring: np.ndarray, call: CallInputs, b: int, pool: int, kpool: int
) -> float:
    """Largest ``|k|`` among pool ``pool``'s members for request ``b``.

    Positions before the cache length are in the ring (slot ``slot_idx[b]``,
    row ``position % R``), the rest are this call's rows of ``k``.
    """
    c = int(call.cache_lengths[b])
    start = int(call.input_row_offsets[b])
    slot, length = int(call.slot_idx[b]), ring.shape[2]
    members = []
    for position in range(pool * kpool, (pool + 1) * kpool):
        if position < c:
            members.append(ring[slot, 0, position % length])
        else:
            members.append(call.k[start + position - c])
    return float(np.abs(np.asarray(members, dtype=np.float64)).max())


def _exact(name: str, got: object, want: np.ndarray) -> None:
    """Raises naming the first entry where ``got`` is not ``want``."""
    got = np.asarray(got)
    if got.shape != want.shape:
        raise AssertionError(
            f"{name} must be {list(want.shape)}, got {list(got.shape)}"
        )
    diff = np.flatnonzero(got.astype(np.int64) != want.astype(np.int64))
    if diff.size:
        i = int(diff[0])
        raise AssertionError(
            f"{name}[{i}]={int(got[i])}, expected {int(want[i])}"
        )


def check_step(
    got: Any,
    ring: np.ndarray,
    call: CallInputs,
    ape: np.ndarray,
    kpool: int,
    *,
    ring_after: np.ndarray | None = None,
) -> StepReport:
    """Checks one step's outputs against the float64 oracle (:func:`step`).

    The indices must be the oracle's exactly (``ring_closed_pool``,
    ``pool_row_offsets``, ``first_pool``); every pooled key, from
    ring_close or compress, must be within :func:`tolerance` of the key
    dtype times the largest ``|k|`` among the pool's members (from the
    ring or this call's ``k``); a ``ring_pooled`` row of a request that
    closed nothing, and a ``pooled`` row no request owns, must be zero;
    and ``ring_after``, if given, must equal the oracle's ring bit for bit
    (seed_tail copies keys and gates).

    Args:
        got: The kernel's outputs as host arrays: a
            :class:`mla_kpool.KPoolStep` of NumPy arrays or a
            :class:`mla_kpool.runner.StepResult` (``ring_pooled``,
            ``ring_closed_pool``, ``pooled``, ``pool_row_offsets``,
            ``first_pool``).
        ring: The host ring ``[max_slots, 2, R, head_dim]`` *before* the
            step.
        call: The call's keys, gates and metadata.
        ape: ``[kpool, head_dim]`` float32 position embedding.
        kpool: Tokens per pool.
        ring_after: The kernel's ring after the step, same shape.

    Returns:
        A :class:`StepReport`.

    Raises:
        AssertionError: On the first output that is off, naming it: the
            request and entry of an index, the request, pool, writer and
            channel of a pooled key (got, want and the allowed error), or
            the ring's slot, half, row and channel.
        TypeError, ValueError: As :func:`step`, for malformed operands,
            and :func:`tolerance` for a ``k`` that is not float32, float16
            or bfloat16.
    """
    rel = tolerance(np.asarray(call.k).dtype)
    ring = np.asarray(ring)
    want_pools, want_ring = step(ring, call, ape, kpool)
    cache = np.asarray(call.cache_lengths)
    _exact("ring_closed_pool", got.ring_closed_pool, _closed_of(want_pools))
    want_rows = pool_row_offsets(call.input_row_offsets, cache, kpool)
    _exact("pool_row_offsets", got.pool_row_offsets, want_rows)
    _exact("first_pool", got.first_pool, first_pool_ids(cache, kpool))
    head_dim = np.shape(call.k)[1]
    ring_pooled = np.asarray(got.ring_pooled)
    pooled = np.asarray(got.pooled)
    if ring_pooled.shape != (len(cache), head_dim):
        raise AssertionError(
            f"ring_pooled must be {[len(cache), head_dim]}, got"
            f" {list(ring_pooled.shape)}"
        )
    if pooled.shape != (np.shape(call.k)[0] // kpool, head_dim):
        raise AssertionError(
            f"pooled must be {[np.shape(call.k)[0] // kpool, head_dim]}, got"
            f" {list(pooled.shape)}"
        )
    produced = pools_of_call(
        got.ring_closed_pool, ring_pooled, pooled, want_rows,
        got.first_pool,
    )  # fmt: skip
    rows: list[_Row] = []
    owned = np.zeros(len(pooled), dtype=bool)
    for b, want in enumerate(want_pools):
        for pool, row in want.items():
            scale = _member_scale(ring, call, b, pool, kpool)
            where = (
                f"request {b} (slot {int(call.slot_idx[b])}): pool {pool}"
                f" ({row.writer})"
            )
            rows.append(
                _Row(where, (b, pool), produced[b][pool].key, row.key, scale)
            )
        owned[int(want_rows[b]) : int(want_rows[b + 1])] = True
        if int(got.ring_closed_pool[b]) < 0:
            zero = np.zeros(head_dim)
            where = f"request {b}: ring_pooled (it closed nothing)"
            rows.append(_Row(where, None, ring_pooled[b], zero, 0.0))
    for r in np.flatnonzero(~owned):
        where = f"pooled row {r} (no request's pool)"
        rows.append(_Row(where, None, pooled[r], np.zeros(head_dim), 0.0))
    shape = (len(rows), head_dim)
    errors = pool_errors(
        np.array([row.got for row in rows], np.float64).reshape(shape),
        np.array([row.want for row in rows], np.float64).reshape(shape),
        [row.scale for row in rows],
        rel,
    )
    if errors.bad.size:
        i = int(errors.bad[0])
        row, ch = rows[i], int(errors.channel[i])
        why = (
            "it must be zero"
            if row.pool is None
            else f"|err| {errors.error[i]:.4g} > {errors.allowed[i]:.4g} ="
            f" {rel:g} x max |k| {row.scale:.4g} of the pool's members"
        )
        raise AssertionError(
            f"{row.where} channel {ch}: got {float(row.got[ch])!r}, want"
            f" {float(row.want[ch])!r} ({why})"
        )
    if ring_after is not None:
        _same_ring(np.asarray(ring_after), want_ring)
    checked = [i for i, row in enumerate(rows) if row.pool is not None]
    if not checked:
        return StepReport(0, 0.0, 0.0, None)
    ratio = errors.error[checked] / errors.allowed[checked]
    worst = checked[int(np.argmax(ratio))]
    return StepReport(
        len(checked),
        float(errors.error[checked].max()),
        float(ratio.max()),
        rows[worst].pool,
    )


def _closed_of(pools: list[dict[int, PoolRow]]) -> np.ndarray:
    """``ring_closed_pool`` of per-request pools: the ring_close id or -1."""
    out = np.full(len(pools), -1, dtype=np.int64)
    for b, produced in enumerate(pools):
        for pool, row in produced.items():
            if row.writer == RING_CLOSE:
                out[b] = pool
    return out


def _same_ring(got: np.ndarray, want: np.ndarray) -> None:
    """Raises naming the first ring entry where ``got`` is not ``want``."""
    if got.shape != want.shape:
        raise AssertionError(
            f"ring_after must be {list(want.shape)}, got {list(got.shape)}"
        )
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    differ = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    if differ.any():
        slot, half, row, ch = (int(i) for i in np.argwhere(differ)[0])
        part = ("keys", "gates")[half]
        raise AssertionError(
            f"ring slot {slot} {part} row {row} channel {ch}: got"
            f" {g[slot, half, row, ch]!r}, want {w[slot, half, row, ch]!r}"
            " (seed_tail copies them exactly)"
        )
