"""Tests of the NumPy oracle itself.

Expected values are worked out by hand from the contracts in docs/ops.md
(closed forms: plain means for equal scores, the dominant member's key for a
score 100 above the rest, the two-member sigmoid), never from a kernel. The
streaming test then shows the oracle's three writers agree with one-shot
pooling of the sequence.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from mla_kpool import reference as ref
from mla_kpool._metadata import check_metadata
from mla_kpool.calls import first_pool_ids, pools_of_call

NAN = np.nan
U32_TOP = 2**32


def _arr(values, dtype=np.int64) -> np.ndarray:
    return np.array(values, dtype=dtype)


def _dominant(keys: list[float], m: int, gap: float = 100.0) -> float:
    """Closed form: member m scores `gap` above every other member."""
    others = sum(key for q, key in enumerate(keys) if q != m)
    tiny = math.exp(-gap)
    return (keys[m] + tiny * others) / (1.0 + tiny * (len(keys) - 1))


# --------------------------------------------------------------------------
# pool / pool_sequence
# --------------------------------------------------------------------------

FLOAT_DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_pool_equal_scores_give_the_plain_mean(dtype):
    keys = np.array([[1, 2], [3, -4], [8, 6]], dtype=dtype)
    ape = np.array([[1, -2], [0, 3], [-5, 0.5]], dtype=np.float32)
    # gate + ape == 7 for every member and channel.
    gates = (7.0 - ape).astype(dtype)
    got = ref.pool(keys, gates, ape)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [4.0, 4.0 / 3.0], rtol=1e-15)


@pytest.mark.parametrize("member", [0, 1, 2, 3], ids=lambda m: f"member{m}")
@pytest.mark.parametrize("via", ["gate", "ape"])
def test_pool_one_dominant_score_selects_that_members_key(member, via):
    keys = np.array([[1.0], [2.0], [3.0], [10.0]])
    gates = np.zeros((4, 1))
    ape = np.zeros((4, 1), dtype=np.float32)
    (gates if via == "gate" else ape)[member, 0] = 100.0
    got = ref.pool(keys, gates, ape)
    expected = _dominant([1.0, 2.0, 3.0, 10.0], member)
    assert got[0] == pytest.approx(expected, rel=1e-15)
    assert got[0] == pytest.approx(keys[member, 0], rel=1e-15)


@pytest.mark.parametrize("shift", [0.0, 99.0, -101.0, 1000.0, -1000.0])
def test_pool_two_members_follow_the_sigmoid_and_large_scores_stay_finite(
    shift,
):
    # Scores (shift + 1, shift): weight of member 0 is sigmoid(1) whatever the
    # shift; exp(1000) overflows unless the maximum is subtracted.
    keys = np.array([[2.0, -6.0], [5.0, 4.0]])
    gates = np.array([[shift + 1.0, shift + 1.0], [shift, shift]])
    ape = np.zeros((2, 2), dtype=np.float32)
    w0 = 1.0 / (1.0 + math.exp(-1.0))
    expected = [w0 * 2.0 + (1 - w0) * 5.0, w0 * -6.0 + (1 - w0) * 4.0]
    got = ref.pool(keys, gates, ape)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=1e-14)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_pool_gates_of_magnitude_100_in_every_dtype(dtype):
    keys = np.array([[1.0], [3.0]], dtype=dtype)
    gates = np.array([[100.0], [100.0]], dtype=dtype)
    got = ref.pool(keys, gates, np.zeros((2, 1), np.float32))
    np.testing.assert_allclose(got, [2.0], rtol=1e-15)


def test_pool_softmax_is_per_channel():
    # Channel 0 favours member 0, channel 1 member 1.
    keys = np.array([[1.0, 1.0], [9.0, 9.0]])
    gates = np.array([[100.0, 0.0], [0.0, 100.0]])
    got = ref.pool(keys, gates, np.zeros((2, 2), np.float32))
    np.testing.assert_allclose(
        got, [_dominant([1.0, 9.0], 0), _dominant([1.0, 9.0], 1)], rtol=1e-15
    )


def test_ape_row_q_goes_with_member_q_and_ablating_it_changes_the_answer():
    keys = np.array([[2.0], [10.0]])
    gates = np.zeros((2, 1))
    ape = np.array([[6.0], [0.0]], dtype=np.float32)
    e6 = math.exp(6.0)
    with_ape = ref.pool(keys, gates, ape)[0]
    swapped = ref.pool(keys, gates, ape[::-1])[0]
    ablated = ref.pool(keys, gates, np.zeros_like(ape))[0]
    assert with_ape == pytest.approx((2.0 * e6 + 10.0) / (e6 + 1.0), rel=1e-15)
    assert swapped == pytest.approx((2.0 + 10.0 * e6) / (1.0 + e6), rel=1e-15)
    assert ablated == pytest.approx(6.0, rel=1e-15)


def test_kpool_one_is_the_identity_bitwise():
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((7, 5)).astype(np.float32)
    gates = (rng.standard_normal((7, 5)) * 100).astype(np.float32)
    ape = (rng.standard_normal((1, 5)) * 100).astype(np.float32)
    got = ref.pool_sequence(keys, gates, ape, 1)
    np.testing.assert_array_equal(got, keys.astype(np.float64))


@pytest.mark.parametrize(
    ("where", "nan_channel"),
    [("gate", 0), ("ape", 1), ("key", 0), ("key", 1)],
    ids=["gate-ch0", "ape-ch1", "key-ch0", "key-ch1"],
)
def test_nan_propagates_to_its_channel_only(where, nan_channel):
    keys = np.array([[1.0, 2.0], [3.0, 4.0]])
    gates = np.zeros((2, 2))
    ape = np.zeros((2, 2), dtype=np.float32)
    {"gate": gates, "ape": ape, "key": keys}[where][1, nan_channel] = NAN
    got = ref.pool(keys, gates, ape)
    other = 1 - nan_channel
    assert np.isnan(got[nan_channel])
    assert got[other] == pytest.approx([2.0, 3.0][other], rel=1e-15)


@pytest.mark.parametrize(
    ("keys_shape", "gates_shape", "ape_shape"),
    [
        ((2, 3), (2, 4), (2, 3)),
        ((2, 3), (2, 3), (3, 3)),
        ((0, 3), (0, 3), (0, 3)),
    ],
    ids=["gates-shape", "ape-shape", "empty-pool"],
)
def test_pool_rejects_bad_shapes(keys_shape, gates_shape, ape_shape):
    with pytest.raises(ValueError):
        ref.pool(np.ones(keys_shape), np.ones(gates_shape), np.ones(ape_shape))


@pytest.mark.parametrize(
    ("length", "kpool", "expected_pools"),
    [(10, 4, 2), (8, 4, 2), (3, 4, 0), (0, 2, 0), (7, 1, 7)],
    ids=lambda v: str(v),
)
def test_pool_sequence_pools_consecutive_tokens_and_drops_the_partial_pool(
    length, kpool, expected_pools
):
    rows = np.arange(length, dtype=np.float64)
    keys = np.stack([rows, -2 * rows], axis=1)
    got = ref.pool_sequence(
        keys, np.zeros_like(keys), np.zeros((kpool, 2)), kpool
    )
    assert got.shape == (expected_pools, 2)
    # Equal scores: pool p is the mean of rows p*kpool .. p*kpool + kpool - 1.
    means = np.arange(expected_pools) * kpool + (kpool - 1) / 2
    np.testing.assert_allclose(got, np.stack([means, -2 * means], axis=1))


@pytest.mark.parametrize("kpool", [0, -1])
def test_pool_sequence_rejects_kpool_below_one(kpool):
    with pytest.raises(ValueError, match="kpool"):
        ref.pool_sequence(
            np.ones((4, 2)), np.ones((4, 2)), np.ones((1, 2)), kpool
        )


def test_kpool_must_be_an_int():
    with pytest.raises(TypeError, match="kpool"):
        ref.pool_sequence(
            np.ones((4, 2)), np.ones((4, 2)), np.ones((2, 2)), 2.0
        )


# --------------------------------------------------------------------------
# pool_row_offsets
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("c", "n", "kpool", "count"),
    [
        (0, 8, 4, 2),  # two whole pools
        (3, 5, 4, 1),  # pool 0 is ring_close's; pool 1 is ours
        (3, 1, 4, 0),  # only closes pool 0 (ring_close)
        (3, 0, 4, 0),
        (4, 4, 4, 1),
        (5, 2, 4, 0),  # floor(7/4) - ceil(5/4) = -1 -> 0
        (0, 3, 4, 0),
        (7, 5, 1, 5),
        (U32_TOP - 1, 9, 4, 2),  # 2^30 + 2 - 2^30 (c + n > 2^32)
    ],
    ids=lambda v: str(v),
)
def test_pool_row_offsets_counts_by_hand(c, n, kpool, count):
    got = ref.pool_row_offsets(
        _arr([0, n], np.uint32), _arr([c], np.uint32), kpool
    )
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [0, count])


def test_pool_row_offsets_is_the_exclusive_prefix_sum():
    # Counts 1, 0, 1, 1 worked out by hand (test_check_metadata.py, BASE).
    got = ref.pool_row_offsets(_arr([0, 5, 5, 12, 20]), _arr([3, 0, 8, 2]), 4)
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 3])


def test_pool_row_offsets_counts_bad_offsets_and_negative_cache_as_zero():
    got = ref.pool_row_offsets(
        _arr([0, 8, 4, 12], np.int32), _arr([0, 0, -4], np.int32), 4
    )
    np.testing.assert_array_equal(got, [0, 2, 2, 2])


def test_pool_row_offsets_rejects_length_mismatch():
    with pytest.raises(ValueError, match="input_row_offsets"):
        ref.pool_row_offsets(_arr([0, 4]), _arr([0, 0]), 4)


def test_index_arrays_must_be_integer():
    with pytest.raises(TypeError, match="cache_lengths"):
        ref.pool_row_offsets(_arr([0, 4]), np.array([0.0]), 4)


# --------------------------------------------------------------------------
# ring_close
# --------------------------------------------------------------------------


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
        _arr([0, 2, 3], index_dtype),
        _arr([0, 7], index_dtype),
        _arr([0, 2], index_dtype),
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
        _dominant([1, 2, 3, 10], member),
        _dominant([1, 2, 3, 6], member),
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
    meta = (_arr([0, 3, 13]), _arr([0, 5]), _arr([0, 1]))
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
    meta = (_arr([0, 3]), _arr([13]), _arr([0]))
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
    meta = (_arr([0, n]), _arr([c]), _arr([0]))
    pooled, got = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((4, 1), np.float32), *meta, 4
    )
    assert got[0] == closed
    assert pooled[0, 0] == (4.0 if closed >= 0 else 0.0)


def _two_closing_requests():
    """kpool 2, ring 2, max_slots 4, total_tokens 4, equal scores.

    Request 0: c=1, n=2, slot 3, rows 0-1. ring_close: ring index 0 [2, 4] +
    row 0 [6, 8] -> [4, 6]. seed_tail: position 2 -> index 0 from row 1.
    Request 1: c=3, n=2, slot 1, rows 2-3. ring_close: ring index 0 [1, 1] +
    row 2 [3, 5] -> [2, 3]. seed_tail: position 4 -> index 0 from row 3.
    """
    tail = np.full((4, 2, 2, 2), NAN, dtype=np.float32)
    tail[3, :, 0] = [[2, 4], [0, 0]]
    tail[1, :, 0] = [[1, 1], [0, 0]]
    k = np.array([[6, 8], [7, 9], [3, 5], [100, 100]], dtype=np.float32)
    return tail, k, dict(offsets=[0, 2, 4], cache=[1, 3], slots=[3, 1])


@dataclasses.dataclass(frozen=True)
class BadMeta:
    name: str
    field: str
    value: list[int]
    dtype: type = np.int64


BAD_REQUEST1 = [
    BadMeta("slot-eq-max", "slots", [3, 4]),
    BadMeta("slot-negative", "slots", [3, -1], np.int32),
    BadMeta("slot-huge-u32", "slots", [3, U32_TOP - 1], np.uint32),
    BadMeta("end-past-total", "offsets", [0, 2, 5]),
    BadMeta("decreasing", "offsets", [0, 2, 1]),
    BadMeta("cache-negative", "cache", [1, -1], np.int32),
]


@pytest.mark.parametrize("bad", BAD_REQUEST1, ids=lambda b: b.name)
def test_ring_close_bad_metadata_gives_minus_one_and_zero_row(bad):
    tail, k, meta = _two_closing_requests()
    meta[bad.field] = bad.value
    args = [_arr(meta[f], bad.dtype) for f in ("offsets", "cache", "slots")]
    pooled, closed = ref.ring_close(
        tail, k, np.zeros_like(k), np.zeros((2, 2), np.float32), *args, 2
    )
    np.testing.assert_array_equal(closed, [0, -1])
    np.testing.assert_allclose(pooled[0], [4.0, 6.0], rtol=1e-15)
    np.testing.assert_array_equal(pooled[1], [0.0, 0.0])


def test_ring_close_good_metadata_of_the_bad_metadata_fixture():
    tail, k, meta = _two_closing_requests()
    args = [_arr(meta[f], np.uint32) for f in ("offsets", "cache", "slots")]
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
        _arr([0, n], index_dtype),
        _arr([c], index_dtype),
        _arr([0], index_dtype),
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
        _arr([0], np.uint32),
        _arr([], np.uint32),
        _arr([], np.uint32),
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
            _arr([0, 1]),
            _arr([1]),
            _arr([0]),
            2,
        )


def test_ring_close_rejects_slot_idx_of_the_wrong_length():
    tail, k, gate, ape, (offsets, cache, _) = _decode_batch()
    with pytest.raises(ValueError, match="slot_idx"):
        ref.ring_close(tail, k, gate, ape, offsets, cache, _arr([0, 1, 2]), 4)


# --------------------------------------------------------------------------
# compress
# --------------------------------------------------------------------------


def _row_keys(total_tokens: int) -> np.ndarray:
    rows = np.arange(total_tokens, dtype=np.float32)
    return np.stack([rows, 2 * rows], axis=1)


def _compress(k, offsets, pool_offsets, cache, kpool, dtype=np.int64):
    """Runs compress with equal scores; returns (output, ambiguous-row mask)."""
    args = (
        _arr(offsets, dtype),
        _arr(pool_offsets, dtype),
        _arr(cache, dtype),
    )
    out = ref.compress(
        k,
        np.zeros_like(k),
        np.zeros((kpool, k.shape[1]), np.float32),
        *args,
        kpool,
    )
    mask = ref.compress_ambiguous_rows(*args, kpool, k.shape[0])
    return out, mask


def test_compress_places_pools_when_c_is_not_a_multiple_of_kpool():
    # kpool 2, total 11 -> 5 output rows.
    # Request 0: c=3, n=6, rows 0-5: pools ceil(3/2)=2 .. floor(9/2)=4, i.e.
    #   pool 2 = positions 4,5 = rows 1,2; pool 3 = rows 3,4 (row 5 is partial).
    # Request 1: c=0, n=5, rows 6-10: pool 0 = rows 6,7; pool 1 = rows 8,9.
    k = _row_keys(11)
    pool_offsets = ref.pool_row_offsets(_arr([0, 6, 11]), _arr([3, 0]), 2)
    np.testing.assert_array_equal(pool_offsets, [0, 2, 4])
    out, mask = _compress(k, [0, 6, 11], pool_offsets, [3, 0], 2)
    means = [1.5, 3.5, 6.5, 8.5]
    expected = [[m, 2 * m] for m in means] + [[0, 0]]
    np.testing.assert_allclose(out, expected, rtol=1e-15)
    assert out.dtype == np.float64 and not mask.any()


def test_compress_with_c_a_multiple_of_kpool():
    # kpool 4, c=4, n=8 at rows 2-9 (request 0 has 2 rows, c=1 -> no pool):
    # pools 1, 2 = rows 2-5 and 6-9. total 10 -> 2 output rows.
    k = _row_keys(10)
    out, _ = _compress(k, [0, 2, 10], [0, 0, 2], [1, 4], 4)
    np.testing.assert_allclose(out, [[3.5, 7.0], [7.5, 15.0]], rtol=1e-15)


def test_compress_member_q_gets_ape_row_q():
    # One pool of rows 0-2, kpool 3; ape favours member 2 -> key of row 2.
    k = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    ape = np.array([[0.0], [0.0], [100.0]], dtype=np.float32)
    out = ref.compress(
        k, np.zeros_like(k), ape, _arr([0, 3]), _arr([0, 1]), _arr([0]), 3
    )
    assert out[0, 0] == pytest.approx(_dominant([1, 2, 3], 2), rel=1e-15)


@dataclasses.dataclass(frozen=True)
class CompressCase:
    """Three requests, kpool 2, c=0, n=4 each (rows 0-3, 4-7, 8-11), so each
    builds 2 pools; pool means (row keys, equal gates) are by hand."""

    name: str
    pool_offsets: list[int]
    rows: dict[int, tuple[int, int]]  # output row -> (request, j); others zero
    ambiguous: tuple[int, ...] = ()
    offsets: tuple[int, ...] = (0, 4, 8, 12)
    dtype: type = np.int64


POOL_MEAN = {(b, j): 4 * b + 2 * j + 0.5 for b in range(3) for j in range(2)}

COMPRESS_CASES = [
    CompressCase(
        "correct",
        [0, 2, 4, 6],
        {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (2, 0), 5: (2, 1)},
    ),
    CompressCase(
        "spans-too-short-truncate",
        [0, 1, 4, 6],
        {0: (0, 0), 1: (1, 0), 2: (1, 1), 4: (2, 0), 5: (2, 1)},
    ),
    CompressCase(
        "gap-leaves-zero-rows",
        [0, 2, 5, 6],
        {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 5: (2, 0)},
    ),
    CompressCase(
        "past-the-output",
        [0, 2, 5, 9],
        {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 5: (2, 0)},
    ),
    CompressCase(
        "decreasing-overlap-last-wins",
        [0, 3, 1, 4],
        {0: (0, 0), 1: (2, 0), 2: (2, 1)},
        # Decreasing offsets leave every row open for the kernels.
        ambiguous=tuple(range(6)),
    ),
    CompressCase(
        "negative-first-offset-skips-row-minus-one",
        [-1, 1, 3, 5],
        {0: (0, 1), 1: (1, 0), 2: (1, 1), 3: (2, 0), 4: (2, 1)},
        dtype=np.int32,
    ),
    CompressCase(
        "huge-u32-offsets-write-nothing",
        [0, 2, U32_TOP - 2, U32_TOP - 1],
        {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)},
        dtype=np.uint32,
    ),
    CompressCase(
        "bad-input-offsets-build-nothing",
        [0, 2, 4, 6],
        {0: (0, 0), 1: (0, 1)},
        offsets=(0, 4, 13, 12),  # request 1 ends past total_tokens
    ),
]


@pytest.mark.parametrize("case", COMPRESS_CASES, ids=lambda c: c.name)
def test_compress_writes_only_inside_each_requests_span(case):
    k = _row_keys(12)
    out, mask = _compress(
        k, case.offsets, case.pool_offsets, [0, 0, 0], 2, case.dtype
    )
    expected = np.zeros((6, 2))
    for row, key in case.rows.items():
        expected[row] = [POOL_MEAN[key], 2 * POOL_MEAN[key]]
    np.testing.assert_allclose(out, expected, rtol=1e-15)
    np.testing.assert_array_equal(np.flatnonzero(mask), case.ambiguous)


@pytest.mark.parametrize("index_dtype", [np.uint32, np.int64])
def test_compress_cache_length_near_2_32(index_dtype):
    # c = 2^32 - 1, n = 5, kpool 4: pools ceil(c/4) = 2^30 .. floor((c+5)/4) =
    # 2^30 + 1, one pool: positions 2^32 .. 2^32 + 3 = rows 1-4.
    k = _row_keys(5)
    offsets, cache = _arr([0, 5], index_dtype), _arr([U32_TOP - 1], index_dtype)
    pool_offsets = ref.pool_row_offsets(offsets, cache, 4)
    np.testing.assert_array_equal(pool_offsets, [0, 1])
    out, _ = _compress(k, [0, 5], pool_offsets, [U32_TOP - 1], 4, index_dtype)
    np.testing.assert_allclose(out, [[2.5, 5.0]], rtol=1e-15)


@pytest.mark.parametrize(
    ("offsets", "cache", "kpool", "rows"),
    [
        ([0], [], 2, 0),  # empty batch, no tokens
        ([0, 3], [0], 4, 0),  # fewer tokens than kpool: no output row at all
        ([0, 6], [1], 4, 1),  # c + n = 7: tokens close pool 0 or stay partial
        ([0, 0, 5], [8, 2], 2, 2),  # n = 0, then c=2 + 5 -> pools 1, 2
    ],
    ids=["empty", "short", "close-and-partial", "n0-then-two"],
)
def test_compress_row_count_and_untouched_rows_are_zero(
    offsets, cache, kpool, rows
):
    k = _row_keys(offsets[-1])
    pool_offsets = ref.pool_row_offsets(_arr(offsets), _arr(cache), kpool)
    out, _ = _compress(k, offsets, pool_offsets, cache, kpool)
    assert out.shape == (rows, 2)
    if cache == [8, 2]:
        # Request 1: c=2, n=5 (rows 0-4): pool 1 = rows 0,1; pool 2 = rows 2,3.
        np.testing.assert_allclose(out, [[0.5, 1.0], [2.5, 5.0]], rtol=1e-15)
    else:
        assert not out.any()


# --------------------------------------------------------------------------
# seed_tail
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SeedCase:
    name: str
    c: int
    n: int
    kpool: int
    ring: int
    written: dict[
        int, int
    ]  # ring index -> offset of the row within the request
    index_dtype: type = np.int64


SEED_CASES = [
    SeedCase("prefill-partial-after-boundary", 2, 7, 4, 4, {0: 6}),
    SeedCase("decode-fills-above-c-only", 1, 2, 4, 4, {1: 0, 2: 1}),
    SeedCase("ends-on-boundary-writes-nothing", 3, 5, 4, 4, {}),
    SeedCase("fresh-request", 0, 3, 4, 4, {0: 0, 1: 1, 2: 2}),
    SeedCase("n0", 6, 0, 4, 4, {}),
    SeedCase(
        "ring-of-two-keeps-last-complete-pool",
        2,
        9,
        4,
        8,
        {4: 2, 5: 3, 6: 4, 7: 5, 0: 6, 1: 7, 2: 8},
    ),
    SeedCase("ring-of-two-never-below-c", 5, 2, 4, 8, {5: 0, 6: 1}),
    SeedCase("kpool1-ring1-nothing-pending", 4, 3, 1, 1, {}),
    SeedCase("kpool1-ring2-keeps-last-token", 4, 3, 1, 2, {0: 2}),
    SeedCase("c-near-2^32-u32", U32_TOP - 2, 3, 4, 4, {0: 2}, np.uint32),
    SeedCase(
        "c-near-2^32-u32-partial", U32_TOP - 3, 2, 4, 4, {1: 0, 2: 1}, np.uint32
    ),
]


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.name)
def test_seed_tail_writes_exactly_the_trailing_positions(case):
    # Request 0 (2 rows, slot 0, c=0, n=2) precedes; the case is request 1 in
    # slot 2 of 3, so rows start at 2 and the slot is not the batch index.
    sentinel = -7.0
    tail = np.full((3, 2, case.ring, 2), sentinel, dtype=np.float32)
    tail_before = tail.copy()
    total = 2 + case.n
    k = _row_keys(total) + 1000
    gate = -_row_keys(total)
    meta = (
        _arr([0, 2, total], case.index_dtype),
        _arr([0, case.c], case.index_dtype),
        _arr([0, 2], case.index_dtype),
    )
    got = ref.seed_tail(tail, k, gate, *meta, case.kpool)
    np.testing.assert_array_equal(tail, tail_before)  # input untouched
    # Slot 0 holds request 0's writes (only there to move request 1 off row
    # 0); slot 1 is nobody's and must stay untouched.
    np.testing.assert_array_equal(got[1], tail_before[1])
    expected = tail_before[2].copy()
    for index, offset in case.written.items():
        expected[0, index] = k[2 + offset]
        expected[1, index] = gate[2 + offset]
    np.testing.assert_array_equal(got[2], expected)


def test_seed_tail_fresh_request_by_hand():
    # kpool 4, c=0, n=2: positions 0, 1 go to ring indices 0, 1.
    tail = np.zeros((1, 2, 4, 1), dtype=np.float32)
    k = np.array([[3.0], [4.0]], dtype=np.float32)
    got = ref.seed_tail(tail, k, -k, _arr([0, 2]), _arr([0]), _arr([0]), 4)
    np.testing.assert_array_equal(got[0, 0, :, 0], [3, 4, 0, 0])
    np.testing.assert_array_equal(got[0, 1, :, 0], [-3, -4, 0, 0])


@pytest.mark.parametrize("bad", BAD_REQUEST1, ids=lambda b: b.name)
def test_seed_tail_skips_a_request_with_bad_metadata(bad):
    tail, k, meta = _two_closing_requests()
    before = tail.copy()
    meta[bad.field] = bad.value
    args = [_arr(meta[f], bad.dtype) for f in ("offsets", "cache", "slots")]
    got = ref.seed_tail(tail, k, -k, *args, 2)
    expected = before.copy()
    expected[3, 0, 0], expected[3, 1, 0] = k[1], -k[1]  # request 0 only
    np.testing.assert_array_equal(got, expected)


def test_seed_tail_good_metadata_of_the_bad_metadata_fixture():
    tail, k, meta = _two_closing_requests()
    before = tail.copy()
    args = [_arr(meta[f], np.uint32) for f in ("offsets", "cache", "slots")]
    got = ref.seed_tail(tail, k, -k, *args, 2)
    expected = before.copy()
    expected[3, 0, 0], expected[3, 1, 0] = k[1], -k[1]
    expected[1, 0, 0], expected[1, 1, 0] = k[3], -k[3]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "dtype", FLOAT_DTYPES[1:], ids=lambda d: np.dtype(d).name
)
def test_seed_tail_keeps_the_ring_dtype_and_copies_values_exactly(dtype):
    tail = np.zeros((1, 2, 2, 2), dtype=dtype)
    k = np.array([[1 / 3, 3.140625]], dtype=dtype)
    got = ref.seed_tail(tail, k, k * 2, _arr([0, 1]), _arr([0]), _arr([0]), 2)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got[0, 0, 0], k[0])
    np.testing.assert_array_equal(got[0, 1, 0], (k * 2)[0])
    assert not tail.any()


# --------------------------------------------------------------------------
# Streaming: ring_close + compress + seed_tail == one-shot pooling
# --------------------------------------------------------------------------


def _stream(rng, lengths, kpool, ring, head_dim, index_dtype):
    """Feeds each request's sequence through the writers in random chunks.

    Returns (got, keys, gates, ape): got[b] maps pool id -> pooled key; each
    pool id may appear only once.
    """
    batch = len(lengths)
    max_slots = batch + 2
    slots = rng.permutation(max_slots)[:batch]  # not the batch index
    keys = [
        rng.standard_normal((n, head_dim)).astype(np.float32) for n in lengths
    ]
    gates = [
        (rng.standard_normal((n, head_dim)) * 4).astype(np.float32)
        for n in lengths
    ]
    ape = (rng.standard_normal((kpool, head_dim)) * 4).astype(np.float32)
    # NaN everywhere a writer has not stored a member: a wrong read shows.
    tail = np.full((max_slots, 2, ring, head_dim), NAN, dtype=np.float32)
    cache = [0] * batch
    got = [{} for _ in range(batch)]
    while any(c < n for c, n in zip(cache, lengths, strict=True)):
        chunk = []
        for c, n in zip(cache, lengths, strict=True):
            left = n - c
            kind = rng.integers(4)
            size = [0, 1, int(rng.integers(0, 3 * kpool + 2)), left][kind]
            chunk.append(min(size, left))
        offsets = np.concatenate([[0], np.cumsum(chunk)]).astype(index_dtype)
        k = np.concatenate(
            [keys[b][cache[b] : cache[b] + chunk[b]] for b in range(batch)]
        )
        g = np.concatenate(
            [gates[b][cache[b] : cache[b] + chunk[b]] for b in range(batch)]
        )
        meta = (offsets, _arr(cache, index_dtype), slots.astype(index_dtype))
        pool_offsets = ref.pool_row_offsets(offsets, meta[1], kpool)
        check_metadata(
            *meta,
            total_tokens=k.shape[0],
            max_slots=max_slots,
            kpool=kpool,
            pool_row_offsets=pool_offsets,
        )

        pooled, closed = ref.ring_close(tail, k, g, ape, *meta, kpool)
        out = ref.compress(k, g, ape, offsets, pool_offsets, meta[1], kpool)
        tail = ref.seed_tail(tail, k, g, *meta, kpool)

        produced = pools_of_call(
            closed, pooled, out, pool_offsets, first_pool_ids(cache, kpool)
        )
        for b in range(batch):
            for pool_id, row in produced[b].items():
                assert pool_id not in got[b], (
                    f"pool {pool_id} of request {b} twice"
                )
                got[b][pool_id] = row.key
            cache[b] += chunk[b]
    return got, keys, gates, ape


@pytest.mark.parametrize("ring_pools", [1, 2], ids=lambda m: f"ring{m}")
@pytest.mark.parametrize("kpool", [1, 2, 3, 4], ids=lambda k: f"kpool{k}")
@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed{s}")
def test_streaming_writers_reproduce_one_shot_pooling(seed, kpool, ring_pools):
    rng = np.random.default_rng([seed, kpool, ring_pools])
    lengths = [int(n) for n in rng.integers(0, 30, size=3)]
    index_dtype = np.uint32 if seed % 2 else np.int64
    got, keys, gates, ape = _stream(
        rng, lengths, kpool, kpool * ring_pools, 3, index_dtype
    )
    for b, n in enumerate(lengths):
        expected = ref.pool_sequence(keys[b], gates[b], ape, kpool)
        msg = f"seed={seed} kpool={kpool} ring_pools={ring_pools} request {b}"
        assert sorted(got[b]) == list(range(n // kpool)), msg
        if n // kpool:
            stacked = np.stack([got[b][p] for p in range(n // kpool)])
            np.testing.assert_allclose(
                stacked, expected, rtol=1e-13, err_msg=msg
            )
            assert np.all(np.isfinite(stacked)), msg


def test_uint64_past_2_63_reads_as_negative_like_the_ops():
    """The ops read indices as signed 64-bit: a uint64 cache length of 2^63
    is the negative length -2^63, bad metadata (no pool, ring untouched),
    not a request 2^61 pools deep."""
    kpool, head_dim = 4, 2
    rng = np.random.default_rng(63)
    k = rng.standard_normal((6, head_dim)).astype(np.float32)
    gate = rng.standard_normal((6, head_dim)).astype(np.float32)
    ape = np.zeros((kpool, head_dim), np.float32)
    ring = np.full((2, 2, kpool, head_dim), 7.0, np.float32)
    offsets = np.array([0, 3, 6], np.uint64)
    slots = np.array([0, 1], np.uint64)
    wrapped = np.array([2**63 + 1, 5], np.uint64)
    negative = np.array([-(2**63) + 1, 5], np.int64)
    for cache in (wrapped, negative):
        pooled, closed = ref.ring_close(
            ring, k, gate, ape, offsets, cache, slots, kpool
        )
        # Request 1 (c 5, n 3) closes pool 1 as usual; request 0 nothing.
        np.testing.assert_array_equal(closed, [-1, 1])
        assert not pooled[0].any()
        after = ref.seed_tail(ring, k, gate, offsets, cache, slots, kpool)
        np.testing.assert_array_equal(after[0], ring[0])  # untouched
