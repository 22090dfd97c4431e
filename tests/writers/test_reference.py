"""Tests of the NumPy oracle itself.

Expected values are worked out by hand from the contracts in docs/ops.md
(closed forms: plain means for equal scores, the dominant member's key for a
score 100 above the rest, the two-member sigmoid), never from a kernel. The
streaming test then shows the oracle's three writers agree with one-shot
pooling of the sequence.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from mla_kpool import KPoolStep
from mla_kpool import reference as ref
from mla_kpool.calls import CallInputs
from support.reference_cases import (
    FLOAT_DTYPES,
    NAN,
    U32_TOP,
    arr,
    dominant,
)

# --------------------------------------------------------------------------
# pool / pool_sequence
# --------------------------------------------------------------------------


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
    expected = dominant([1.0, 2.0, 3.0, 10.0], member)
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
        got, [dominant([1.0, 9.0], 0), dominant([1.0, 9.0], 1)], rtol=1e-15
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
        arr([0, n], np.uint32), arr([c], np.uint32), kpool
    )
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [0, count])


def test_pool_row_offsets_is_the_exclusive_prefix_sum():
    # Counts 1, 0, 1, 1 worked out by hand (test_check_metadata.py, BASE).
    got = ref.pool_row_offsets(arr([0, 5, 5, 12, 20]), arr([3, 0, 8, 2]), 4)
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 3])


def test_pool_row_offsets_counts_bad_offsets_and_negative_cache_as_zero():
    got = ref.pool_row_offsets(
        arr([0, 8, 4, 12], np.int32), arr([0, 0, -4], np.int32), 4
    )
    np.testing.assert_array_equal(got, [0, 2, 2, 2])


def test_pool_row_offsets_rejects_length_mismatch():
    with pytest.raises(ValueError, match="input_row_offsets"):
        ref.pool_row_offsets(arr([0, 4]), arr([0, 0]), 4)


def test_index_arrays_must_be_integer():
    with pytest.raises(ValueError, match="cache_lengths"):
        ref.pool_row_offsets(arr([0, 4]), np.array([0.0]), 4)


# --------------------------------------------------------------------------
# check_step / pool_errors
# --------------------------------------------------------------------------

KPOOL, HEAD_DIM = 4, 8
#: The kernels' key dtypes: float32, float16, bfloat16.
KEY_DTYPES = list(ref.TOLERANCE)


def _step_case(dtype):
    """Two requests on a ring of 2 slots, R 4, kpool 4.

    Request 0 (slot 1) had 6 tokens, positions 4 and 5 in its ring rows 0
    and 1, and brings 7: ring_close closes pool 1 (ring rows 0, 1 and new
    rows 0, 1), compress makes pool 2 (new rows 2..5). Request 1 (slot 0)
    brings 9 new tokens: compress makes pools 0 and 1 (new rows 7..14).
    """
    rng = np.random.default_rng(5)
    ring = rng.standard_normal((2, 2, KPOOL, HEAD_DIM)).astype(dtype)
    k = rng.standard_normal((16, HEAD_DIM)).astype(dtype)
    gate = (3 * rng.standard_normal((16, HEAD_DIM))).astype(dtype)
    ape = rng.standard_normal((KPOOL, HEAD_DIM)).astype(np.float32)
    call = CallInputs(
        k=k,
        gate=gate,
        input_row_offsets=arr([0, 7, 16], np.uint32),
        cache_lengths=arr([6, 0], np.uint32),
        slot_idx=arr([1, 0], np.uint32),
    )
    return ring, call, ape


def _oracle_as_kernel(ring, call, ape, dtype):
    """The writers' oracle outputs in the kernel's output form."""
    ops = call.operands()
    args = (ops["k"], ops["gate"], ape, ops["input_row_offsets"])
    cache, slots = ops["cache_lengths"], ops["slot_idx"]
    ring_pooled, closed = ref.ring_close(ring, *args, cache, slots, KPOOL)
    rows = ref.pool_row_offsets(args[3], cache, KPOOL)
    pooled = ref.compress(*args, rows, cache, KPOOL)
    after = ref.seed_tail(ring, args[0], args[1], args[3], cache, slots, KPOOL)
    got = KPoolStep(
        ring_pooled.astype(dtype),
        closed,
        pooled.astype(dtype),
        rows.astype(np.uint32),
        np.array([2, 0], np.int64),  # ceil(6 / 4), ceil(0 / 4)
    )
    return got, after


@pytest.mark.parametrize("dtype", KEY_DTYPES, ids=lambda d: d.name)
def test_check_step_passes_the_oracles_own_step(dtype):
    ring, call, ape = _step_case(dtype)
    got, after = _oracle_as_kernel(ring, call, ape, dtype)
    np.testing.assert_array_equal(got.ring_closed_pool, [1, -1])
    np.testing.assert_array_equal(got.pool_row_offsets, [0, 1, 3])
    report = ref.check_step(got, ring, call, ape, KPOOL, ring_after=after)
    # ring_close's pool 1, compress's pools 2 (request 0), 0 and 1.
    assert report.pools == 4
    assert 0 <= report.worst_ratio <= 1  # rounding to the key dtype
    assert report.worst in {(0, 1), (0, 2), (1, 0), (1, 1)}


def _members_max(ring, call, b, pool):
    """Largest |k| of a pool's members, by the test's own bookkeeping."""
    if (b, pool) == (0, 1):  # positions 4..7: ring rows 0, 1, new rows 0, 1
        members = [ring[1, 0, 0], ring[1, 0, 1], call.k[0], call.k[1]]
    elif (b, pool) == (1, 1):  # positions 4..7 of request 1: rows 11..14
        members = list(call.k[11:15])
    return float(np.abs(np.float64(members)).max())


@pytest.mark.parametrize("dtype", KEY_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(
    "field, row, b, pool, message",
    [
        ("ring_pooled", 0, 0, 1, "request 0 (slot 1): pool 1 (ring_close)"),
        ("pooled", 2, 1, 1, "request 1 (slot 0): pool 1 (compress)"),
    ],
)
def test_check_step_names_the_pool_and_channel_past_the_tolerance(
    dtype, field, row, b, pool, message
):
    ring, call, ape = _step_case(dtype)
    got, after = _oracle_as_kernel(ring, call, ape, np.float64)
    allowed = ref.tolerance(dtype) * _members_max(ring, call, b, pool)
    keys = getattr(got, field)
    keys[row, 5] += 0.5 * allowed  # within the tolerance: passes
    ref.check_step(got, ring, call, ape, KPOOL, ring_after=after)
    keys[row, 5] += 1.0 * allowed  # 1.5 x the tolerance off
    with pytest.raises(
        AssertionError, match=rf"{re.escape(message)} channel 5"
    ):
        ref.check_step(got, ring, call, ape, KPOOL, ring_after=after)


def test_check_step_names_a_wrong_index_a_stray_row_and_the_ring():
    ring, call, ape = _step_case(np.float32)
    got, after = _oracle_as_kernel(ring, call, ape, np.float32)
    wrong = got._replace(ring_closed_pool=np.array([1, 0], np.int32))
    with pytest.raises(AssertionError, match=r"ring_closed_pool\[1\]=0, exp"):
        ref.check_step(wrong, ring, call, ape, KPOOL)
    stray = got.ring_pooled.copy()
    stray[1, 2] = 1e-3  # request 1 closed nothing: its row must be zero
    with pytest.raises(
        AssertionError, match="request 1: ring_pooled .* channel 2"
    ):
        ref.check_step(got._replace(ring_pooled=stray), ring, call, ape, KPOOL)
    bad_ring = after.copy()
    bad_ring[0, 1, 0, 3] += 1  # slot 0, gates, row 0 (request 1's token 8)
    with pytest.raises(
        AssertionError, match="ring slot 0 gates row 0 channel 3"
    ):
        ref.check_step(got, ring, call, ape, KPOOL, ring_after=bad_ring)


def test_pool_errors_allows_rel_times_the_members_largest_key():
    want = np.array([[1.0, -2.0], [0.5, NAN], [0.0, 0.0]])
    got = want + np.array([[0.0, 0.02], [0.0, 0.0], [0.0, 0.0]])
    got[2, 1] = NAN  # NaN where the oracle is not
    errors = ref.pool_errors(got, want, [4.0, 1.0, 1.0], 0.01)
    np.testing.assert_allclose(errors.error[:2], [0.02, 0.0])  # NaN == NaN
    assert np.isnan(errors.error[2])
    np.testing.assert_array_equal(errors.allowed, [0.04, 0.01, 0.01])
    np.testing.assert_array_equal(errors.channel, [1, 0, 1])
    np.testing.assert_array_equal(errors.bad, [2])
