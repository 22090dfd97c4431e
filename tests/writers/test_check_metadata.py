"""Tests of :func:`mla_kpool.check_metadata`, the host-side metadata check.

First each rule, pinned by a hand-written case whose expected message is
worked out by hand from a base batch. Then the
2,000 ``ring_close`` fuzz vectors (batch 0, decreasing offsets, offsets past
the tokens or near 2^32, slots at or far past ``max_slots``, cache lengths
near 2^32, wrong ``pool_row_offsets``) go through
:func:`mla_kpool.check_metadata`, which must accept exactly the vectors a
small independent classifier calls clean and, for the others, name the
first offending request (or the whole-array field at fault).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from mla_kpool import check_metadata
from mla_kpool import reference as ref
from support.guarded import FUZZ_VECTORS, KPOOL, STREAMS, Meta, draw_meta

U32_TOP = 2**32


def _arr(values, dtype=np.int64) -> np.ndarray:
    return np.array(values, dtype=dtype)


# --------------------------------------------------------------------------
# One hand-written case per rule
# --------------------------------------------------------------------------

# Base: batch 4, total_tokens 24, max_slots 8, kpool 4.
#   request: 0      1      2      3
#   rows:    0-4    none   5-11   12-19 (rows 20-23 unused, which is allowed)
#   c:       3      0      8      2
#   pools:   1      0      1      1    -> pool_row_offsets [0, 1, 1, 2, 3]
BASE = dict(
    input_row_offsets=_arr([0, 5, 5, 12, 20]),
    cache_lengths=_arr([3, 0, 8, 2]),
    slot_idx=_arr([2, 0, 5, 1]),
    total_tokens=24,
    max_slots=8,
    kpool=4,
    pool_row_offsets=_arr([0, 1, 1, 2, 3]),
)


@dataclasses.dataclass(frozen=True)
class MetaCase:
    name: str
    changes: dict
    error: type
    message: str  # matched literally


META_CASES = [
    MetaCase(
        "offsets-decreasing",
        {"input_row_offsets": _arr([0, 5, 5, 12, 10])},
        ValueError,
        "request 3: input_row_offsets[4]=10 < input_row_offsets[3]=12",
    ),
    MetaCase(
        "offsets-negative-i32",
        {"input_row_offsets": _arr([0, -1, 5, 12, 20], np.int32)},
        ValueError,
        "request 0: input_row_offsets[1]=-1 < input_row_offsets[0]=0",
    ),
    MetaCase(
        "offsets-past-total",
        {"input_row_offsets": _arr([0, 5, 5, 12, 30])},
        ValueError,
        "request 3: input_row_offsets[4]=30 > total_tokens=24",
    ),
    MetaCase(
        "offsets-past-total-u32-wrap",
        {"input_row_offsets": _arr([0, 5, 5, 12, U32_TOP - 1], np.uint32)},
        ValueError,
        f"request 3: input_row_offsets[4]={U32_TOP - 1} > total_tokens=24",
    ),
    MetaCase(
        "offsets-nonzero-start",
        {"input_row_offsets": _arr([2, 5, 5, 12, 20])},
        ValueError,
        "input_row_offsets[0]=2, expected 0",
    ),
    MetaCase(
        "offsets-too-long",
        {"input_row_offsets": _arr([0, 5, 5, 12, 20, 24])},
        ValueError,
        "input_row_offsets has 6 entries, expected batch + 1 = 5 "
        "(cache_lengths has 4)",
    ),
    MetaCase(
        "offsets-too-short",
        {"input_row_offsets": _arr([0, 5, 5, 12])},
        ValueError,
        "input_row_offsets has 4 entries, expected batch + 1 = 5",
    ),
    MetaCase(
        "slot-idx-too-short",
        {"slot_idx": _arr([2, 0, 5])},
        ValueError,
        "slot_idx has 3 entries, expected batch = 4",
    ),
    MetaCase(
        "cache-negative-i32",
        {"cache_lengths": _arr([3, 0, -4, 2], np.int32)},
        ValueError,
        "request 2: cache_lengths[2]=-4 < 0",
    ),
    MetaCase(
        "slot-eq-max",
        {"slot_idx": _arr([2, 0, 8, 1])},
        ValueError,
        "request 2: slot_idx[2]=8 >= max_slots=8",
    ),
    MetaCase(
        "slot-negative-i32",
        {"slot_idx": _arr([2, -1, 5, 1], np.int32)},
        ValueError,
        "request 1: slot_idx[1]=-1 < 0",
    ),
    MetaCase(
        "slot-duplicate",
        {"slot_idx": _arr([2, 0, 5, 2])},
        ValueError,
        "request 3: slot_idx[3]=2 duplicates slot_idx[0]=2",
    ),
    MetaCase(
        "first-offending-request-wins",
        {
            "slot_idx": _arr([2, 9, 5, 9]),
            "input_row_offsets": _arr([0, 5, 5, 12, 40]),
        },
        ValueError,
        "request 1: slot_idx[1]=9 >= max_slots=8",
    ),
    MetaCase(
        "pool-offsets-wrong-count",
        {"pool_row_offsets": _arr([0, 1, 1, 3, 4])},
        ValueError,
        "request 2: pool_row_offsets[3]=3, expected 2",
    ),
    MetaCase(
        "pool-offsets-nonzero-start",
        {"pool_row_offsets": _arr([1, 2, 2, 3, 4])},
        ValueError,
        "pool_row_offsets[0]=1, expected 0",
    ),
    MetaCase(
        "pool-offsets-length",
        {"pool_row_offsets": _arr([0, 1, 1, 2])},
        ValueError,
        "pool_row_offsets has 4 entries, expected batch + 1 = 5",
    ),
    MetaCase(
        "pool-offsets-without-kpool",
        {"kpool": None},
        ValueError,
        "kpool is required to check pool_row_offsets",
    ),
    MetaCase(
        "offsets-float",
        {"input_row_offsets": np.array([0.0, 5, 5, 12, 20])},
        ValueError,
        "input_row_offsets must have an integer dtype, got float64",
    ),
    MetaCase(
        "slot-idx-bool",
        {"slot_idx": np.array([True, False, True, False])},
        ValueError,
        "slot_idx must have an integer dtype, got bool",
    ),
    MetaCase(
        "pool-offsets-float",
        {"pool_row_offsets": np.array([0.0, 1, 1, 2, 3])},
        ValueError,
        "pool_row_offsets must have an integer dtype",
    ),
    MetaCase(
        "cache-rank-2",
        {"cache_lengths": _arr([[3, 0, 8, 2]])},
        ValueError,
        "cache_lengths must be rank 1, got shape (1, 4)",
    ),
    MetaCase(
        "kpool-zero",
        {"kpool": 0},
        ValueError,
        "kpool must be at least 1, got 0",
    ),
    MetaCase("kpool-float", {"kpool": 4.0}, TypeError, "kpool must be an int"),
    MetaCase(
        "total-tokens-negative",
        {"total_tokens": -1},
        ValueError,
        "total_tokens must be at least 0, got -1",
    ),
    MetaCase(
        "max-slots-str",
        {"max_slots": "8"},
        TypeError,
        "max_slots must be an int",
    ),
]


@pytest.mark.parametrize("case", META_CASES, ids=lambda c: c.name)
def test_check_metadata_names_the_first_offending_field(case):
    kwargs = {**BASE, **case.changes}
    with pytest.raises(case.error, match=re.escape(case.message)):
        check_metadata(**kwargs)


def test_check_metadata_base_case_is_valid_and_matches_the_oracle():
    assert check_metadata(**BASE) is None
    np.testing.assert_array_equal(
        ref.pool_row_offsets(
            BASE["input_row_offsets"], BASE["cache_lengths"], 4
        ),
        BASE["pool_row_offsets"],
    )


@pytest.mark.parametrize(
    ("pool_offsets", "ok"),
    [([0, 1], True), ([0, 0], False)],
    ids=["one-pool", "wrapped-count"],
)
def test_check_metadata_pool_count_past_2_32_does_not_wrap(pool_offsets, ok):
    # c = 2^32 - 1, n = 5, kpool 4: one pool (2^30). With 32-bit wrap, c + n
    # would be 4 and the count would clamp to 0.
    kwargs = dict(
        input_row_offsets=_arr([0, 5], np.uint32),
        cache_lengths=_arr([U32_TOP - 1], np.uint32),
        slot_idx=_arr([0], np.uint32),
        total_tokens=5,
        max_slots=1,
        kpool=4,
        pool_row_offsets=_arr(pool_offsets, np.uint32),
    )
    if ok:
        check_metadata(**kwargs)
    else:
        with pytest.raises(
            ValueError, match=re.escape("request 0: pool_row_offsets")
        ):
            check_metadata(**kwargs)


def test_check_metadata_accepts_an_empty_batch():
    check_metadata(
        _arr([0], np.uint32),
        _arr([], np.uint32),
        _arr([], np.uint32),
        total_tokens=0,
        max_slots=0,
        kpool=2,
        pool_row_offsets=_arr([0], np.uint32),
    )


# --------------------------------------------------------------------------
# The fuzz vectors
# --------------------------------------------------------------------------


def first_problem(meta: Meta) -> str | None:
    """The start of the message check_metadata owes ``meta``, or ``None``.

    Whole-array problems first (``input_row_offsets[0]``,
    ``pool_row_offsets[0]``), then the first request with bad offsets, a
    slot outside ``[0, max_slots)`` or already used, or a
    ``pool_row_offsets`` step other than its pool count.
    """
    offsets, pools = meta.offsets, meta.pool_row_offsets()
    if offsets[0] != 0:
        return "input_row_offsets[0]="
    if pools[0] != 0:
        return "pool_row_offsets[0]="
    used: set[int] = set()
    for b, (c, s) in enumerate(zip(meta.cache, meta.slots, strict=True)):
        start, end = offsets[b], offsets[b + 1]
        count = max(0, (c + end - start) // KPOOL - -(-c // KPOOL))
        if (
            not start <= end <= meta.total_tokens
            or not 0 <= s < meta.max_slots
            or s in used
            or pools[b + 1] - pools[b] != count
        ):
            return f"request {b}: "
        used.add(s)
    return None


def test_check_metadata_on_fuzz_vectors() -> None:
    clean = rejected = 0
    for i in range(FUZZ_VECTORS):
        meta = draw_meta(STREAMS["ring_close"], i)
        arrays = meta.arrays()
        expected = first_problem(meta)
        kwargs = dict(
            total_tokens=meta.total_tokens,
            max_slots=meta.max_slots,
            kpool=KPOOL,
            pool_row_offsets=arrays["pool_row_offsets"],
        )
        args = (
            arrays["input_row_offsets"],
            arrays["cache_lengths"],
            arrays["slot_idx"],
        )
        if expected is None:
            check_metadata(*args, **kwargs)
            clean += 1
        else:
            with pytest.raises(ValueError, match=re.escape(expected)) as info:
                check_metadata(*args, **kwargs)
            assert str(info.value).startswith(expected), meta.describe()
            rejected += 1
    # Both outcomes are common enough to mean something.
    assert clean >= 200 and rejected >= 200, (clean, rejected)


def test_check_metadata_names_a_page_id_used_as_slot() -> None:
    """The reported serving bug: a physical page id passed as the slot."""
    with pytest.raises(ValueError) as info:
        check_metadata(
            np.array([0, 7, 14, 21], np.uint32),
            np.array([3, 6, 1], np.uint32),
            np.array([2, 40961, 0], np.uint32),
            total_tokens=21,
            max_slots=4,
        )
    assert str(info.value) == "request 1: slot_idx[1]=40961 >= max_slots=4"


def test_empty_batch_as_python_lists_is_accepted():
    # batch 0 is legal; [] alone would be float64 to NumPy.
    assert check_metadata([0], [], [], total_tokens=0, max_slots=2) is None


@pytest.mark.parametrize(
    "field", ["input_row_offsets", "cache_lengths", "slot_idx"]
)
def test_check_metadata_refuses_uint64_past_2_63(field):
    """The kernels read indices as signed 64-bit, so 2^63 is negative."""
    meta = {
        "input_row_offsets": np.array([0, 3], np.uint64),
        "cache_lengths": np.array([0], np.uint64),
        "slot_idx": np.array([0], np.uint64),
    }
    meta[field] = meta[field].copy()
    meta[field][-1] = 2**63
    with pytest.raises(ValueError, match=rf"{field}\[\d\]=9223372036854775808"):
        check_metadata(**meta, total_tokens=3, max_slots=1, kpool=4)
