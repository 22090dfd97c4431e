"""Tests of the NumPy oracle's compress and seed_tail, worked out by hand
from the contracts in docs/ops.md, never from a kernel; then the three
writers streamed against one-shot pooling of the sequence."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mla_kpool import reference as ref
from mla_kpool._metadata import check_metadata
from mla_kpool.calls import first_pool_ids, pools_of_call
from support.reference_cases import (
    BAD_REQUEST1,
    FLOAT_DTYPES,
    NAN,
    U32_TOP,
    arr,
    dominant,
    two_closing_requests,
)


def _row_keys(total_tokens: int) -> np.ndarray:
    rows = np.arange(total_tokens, dtype=np.float32)
    return np.stack([rows, 2 * rows], axis=1)


def _compress(k, offsets, pool_offsets, cache, kpool, dtype=np.int64):
    """Runs compress with equal scores; returns (output, ambiguous-row mask)."""
    args = (
        arr(offsets, dtype),
        arr(pool_offsets, dtype),
        arr(cache, dtype),
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
    pool_offsets = ref.pool_row_offsets(arr([0, 6, 11]), arr([3, 0]), 2)
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
        k, np.zeros_like(k), ape, arr([0, 3]), arr([0, 1]), arr([0]), 3
    )
    assert out[0, 0] == pytest.approx(dominant([1, 2, 3], 2), rel=1e-15)


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
    offsets, cache = arr([0, 5], index_dtype), arr([U32_TOP - 1], index_dtype)
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
    pool_offsets = ref.pool_row_offsets(arr(offsets), arr(cache), kpool)
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
        arr([0, 2, total], case.index_dtype),
        arr([0, case.c], case.index_dtype),
        arr([0, 2], case.index_dtype),
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
    got = ref.seed_tail(tail, k, -k, arr([0, 2]), arr([0]), arr([0]), 4)
    np.testing.assert_array_equal(got[0, 0, :, 0], [3, 4, 0, 0])
    np.testing.assert_array_equal(got[0, 1, :, 0], [-3, -4, 0, 0])


@pytest.mark.parametrize("bad", BAD_REQUEST1, ids=lambda b: b.name)
def test_seed_tail_skips_a_request_with_bad_metadata(bad):
    tail, k, meta = two_closing_requests()
    before = tail.copy()
    meta[bad.field] = bad.value
    args = [arr(meta[f], bad.dtype) for f in ("offsets", "cache", "slots")]
    got = ref.seed_tail(tail, k, -k, *args, 2)
    expected = before.copy()
    expected[3, 0, 0], expected[3, 1, 0] = k[1], -k[1]  # request 0 only
    np.testing.assert_array_equal(got, expected)


def test_seed_tail_good_metadata_of_the_bad_metadata_fixture():
    tail, k, meta = two_closing_requests()
    before = tail.copy()
    args = [arr(meta[f], np.uint32) for f in ("offsets", "cache", "slots")]
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
    got = ref.seed_tail(tail, k, k * 2, arr([0, 1]), arr([0]), arr([0]), 2)
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
        meta = (offsets, arr(cache, index_dtype), slots.astype(index_dtype))
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
