"""Tests of the NumPy oracle's ring_close, worked out by hand from the
contract in docs/ops.md, never from a kernel."""

from __future__ import annotations

import numpy as np
import pytest

from mla_kpool import reference as ref
from support.reference_cases import (
    BAD_REQUEST1,
    NAN,
    U32_TOP,
    arr,
    dominant,
    two_closing_requests,
)


def _decode_batch(index_dtype=np.int64):
    """kpool 4, head_dim 2. Request 0: c=0, n=2 (rows 0-1), slot 0, nothing
    pending. Request 1: c=7 (r=3, p=1), n=1 (row 2), slot 2: members 0-2 from
    ring indices 0-2 (positions 4-6), member 3 from row 2. Ring index 3 is
    NaN, so reading it would show."""
    tail = np.full((3, 2, 4, 2), NAN, dtype=np.float32)
    tail[2, 0, :3] = [[1, 1], [2, 2], [3, 3]]
    tail[2, 1, :3] = 0.0
    k = np.array([[50, 50], [60, 60], [10, 6]], dtype=np.float32)
    gate = np.zeros((3, 2), dtype=np.float32)
    meta = (
        arr([0, 2, 3], index_dtype),
        arr([0, 7], index_dtype),
        arr([0, 2], index_dtype),
    )
    return tail, k, gate, np.zeros((4, 2), np.float32), meta


def test_ring_close_decode_closes_with_ring_and_new_member():
    tail, k, gate, ape, meta = _decode_batch()
    tail_before = tail.copy()
    pooled, closed = ref.ring_close(tail, k, gate, ape, *meta, 4)
    assert closed.dtype == np.int32 and pooled.dtype == np.float64
    np.testing.assert_array_equal(closed, [-1, 1])
    np.testing.assert_array_equal(pooled[0], [0, 0])
    # Equal scores: (1 + 2 + 3 + 10) / 4 and (1 + 2 + 3 + 6) / 4.
    np.testing.assert_allclose(pooled[1], [4.0, 3.0], rtol=1e-15)
    np.testing.assert_array_equal(tail, tail_before)  # read only


@pytest.mark.parametrize("member", [0, 1, 2, 3], ids=lambda m: f"member{m}")
@pytest.mark.parametrize("via", ["gate", "ape"])
def test_ring_close_member_q_gets_ape_row_q(member, via):
    tail, k, gate, ape, meta = _decode_batch()
    if via == "ape":
        ape[member] = 100.0
    elif member < 3:
        tail[2, 1, member] = 100.0
    else:
        gate[2] = 100.0
    pooled, closed = ref.ring_close(tail, k, gate, ape, *meta, 4)
    assert closed[1] == 1
    expected = [
        dominant([1, 2, 3, 10], member),
        dominant([1, 2, 3, 6], member),
    ]
    np.testing.assert_allclose(pooled[1], expected, rtol=1e-15)


def test_ring_close_mid_prefill_takes_rows_from_the_request_start():
    # kpool 4. Request 0: 3 rows, c=0 (nothing pending). Request 1: c=5 (r=1,
    # p=1), n=10, rows 3..12, slot 1: member 0 = ring index 0 (position 4),
    # members 1-3 = rows 3, 4, 5.
    tail = np.full((2, 2, 4, 2), NAN, dtype=np.float32)
    tail[1, :, 0] = [[8, -8], [0, 0]]
    rows = np.arange(13, dtype=np.float32)
    k = np.stack([rows, -rows], axis=1)
    meta = (arr([0, 3, 13]), arr([0, 5]), arr([0, 1]))
    pooled, closed = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((4, 2), np.float32), *meta, 4
    )
    np.testing.assert_array_equal(closed, [-1, 1])
    np.testing.assert_allclose(
        pooled[1], [5.0, -5.0], rtol=1e-15
    )  # (8+3+4+5)/4


def test_ring_close_ring_of_two_pools_reads_position_mod_ring():
    # kpool 4, ring 8, c=13 (r=1, p=3): member 0 is position 12 -> index 4,
    # not 0. Index 0 holds a different finite key so a wrong mapping shows.
    tail = np.full((1, 2, 8, 1), NAN, dtype=np.float32)
    tail[0, :, 0] = [[1000.0], [0.0]]
    tail[0, :, 4] = [[7.0], [0.0]]
    k = np.array([[1.0], [2.0], [6.0]], dtype=np.float32)
    meta = (arr([0, 3]), arr([13]), arr([0]))
    pooled, closed = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((4, 1), np.float32), *meta, 4
    )
    assert closed[0] == 3
    assert pooled[0, 0] == pytest.approx(4.0, rel=1e-15)  # (7+1+2+6)/4


@pytest.mark.parametrize(
    ("c", "n", "closed"),
    [
        (1, 3, 0),  # c + n == (p + 1) * kpool: closes
        (1, 2, -1),  # one short
        (1, 0, -1),  # n == 0
        (0, 9, -1),  # r == 0: nothing pending, however many tokens
        (8, 4, -1),  # r == 0 again
        (6, 7, 1),  # more than enough: closes pool 1 only
    ],
    ids=["exact", "one-short", "n0", "r0", "r0-later", "surplus"],
)
def test_ring_close_closes_only_when_pending_and_complete(c, n, closed):
    tail = np.zeros((1, 2, 4, 1), dtype=np.float32)
    tail[0, 0, :, 0] = [4, 4, 4, 4]
    k = np.full((max(n, 1), 1), 4.0, dtype=np.float32)
    meta = (arr([0, n]), arr([c]), arr([0]))
    pooled, got = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((4, 1), np.float32), *meta, 4
    )
    assert got[0] == closed
    assert pooled[0, 0] == (4.0 if closed >= 0 else 0.0)


@pytest.mark.parametrize("bad", BAD_REQUEST1, ids=lambda b: b.name)
def test_ring_close_bad_metadata_gives_minus_one_and_zero_row(bad):
    tail, k, meta = two_closing_requests()
    meta[bad.field] = bad.value
    args = [arr(meta[f], bad.dtype) for f in ("offsets", "cache", "slots")]
    pooled, closed = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((2, 2), np.float32), *args, 2
    )
    np.testing.assert_array_equal(closed, [0, -1])
    np.testing.assert_allclose(pooled[0], [4.0, 6.0], rtol=1e-15)
    np.testing.assert_array_equal(pooled[1], [0.0, 0.0])


def test_ring_close_good_metadata_of_the_bad_metadata_fixture():
    tail, k, meta = two_closing_requests()
    args = [arr(meta[f], np.uint32) for f in ("offsets", "cache", "slots")]
    pooled, closed = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((2, 2), np.float32), *args, 2
    )
    np.testing.assert_array_equal(closed, [0, 1])
    np.testing.assert_allclose(pooled, [[4.0, 6.0], [2.0, 3.0]], rtol=1e-15)


@pytest.mark.parametrize("index_dtype", [np.uint32, np.int64, np.uint64])
@pytest.mark.parametrize(
    ("c", "n", "closed"),
    [
        (U32_TOP - 1, 1, 2**30 - 1),  # c + n == 2^32 exactly: closes
        (U32_TOP - 2, 2, 2**30 - 1),
        (U32_TOP - 2, 1, -1),  # c + n == 2^32 - 1: one short
        (U32_TOP - 3, 3, 2**30 - 1),  # c + n wraps to 0 in 32 bits
    ],
    ids=["2^32-1+1", "2^32-2+2", "2^32-2+1", "2^32-3+3"],
)
def test_ring_close_cache_length_near_2_32_never_wraps(
    index_dtype, c, n, closed
):
    kpool = 4
    r = c % kpool
    tail = np.full((1, 2, 4, 1), NAN, dtype=np.float32)
    # Positions (2^30 - 1) * 4 + q for q < r live at ring index q.
    tail[0, 0, :r, 0] = 5.0
    tail[0, 1, :r, 0] = 0.0
    k = np.full((n, 1), 5.0, dtype=np.float32)
    meta = (
        arr([0, n], index_dtype),
        arr([c], index_dtype),
        arr([0], index_dtype),
    )
    pooled, got = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((4, 1), np.float32), *meta, kpool
    )
    assert got[0] == closed
    assert pooled[0, 0] == (5.0 if closed >= 0 else 0.0)


def test_ring_close_empty_batch():
    pooled, closed = ref.ring_close(
        np.zeros((1, 2, 2, 3), np.float32),
        np.zeros((0, 3), np.float32),
        np.zeros((0, 3), np.float32),
        np.zeros((2, 3), np.float32),
        arr([0], np.uint32),
        arr([], np.uint32),
        arr([], np.uint32),
        2,
    )
    assert pooled.shape == (0, 3) and closed.shape == (0,)


@pytest.mark.parametrize(
    "tail_shape",
    [(1, 2, 3, 2), (1, 2, 2, 3), (1, 3, 2, 2), (2, 2, 2)],
    ids=["ring-not-multiple", "head-dim", "planes", "rank"],
)
def test_ring_close_rejects_bad_tail_shapes(tail_shape):
    with pytest.raises(ValueError, match="tail"):
        ref.ring_close(
            np.zeros(tail_shape, np.float32),
            np.zeros((1, 2), np.float32),
            np.zeros((1, 2), np.float32),
            np.zeros((2, 2), np.float32),
            arr([0, 1]),
            arr([1]),
            arr([0]),
            2,
        )


def test_ring_close_rejects_slot_idx_of_the_wrong_length():
    tail, k, gate, ape, (offsets, cache, _) = _decode_batch()
    with pytest.raises(ValueError, match="slot_idx"):
        ref.ring_close(tail, k, gate, ape, offsets, cache, arr([0, 1, 2]), 4)


# --------------------------------------------------------------------------
