"""check_metadata against the fuzz vectors of ``test_fuzz.py``.

``test_reference.py`` pins each rule with a hand-written case. Here the
2,000 ``ring_close`` fuzz vectors (batch 0, decreasing offsets, offsets past
the tokens or near 2^32, slots at or far past ``max_slots``, cache lengths
near 2^32, wrong ``pool_row_offsets``) go through
:func:`mla_kpool.check_metadata`, which must accept exactly the vectors a
small independent classifier calls clean and, for the others, name the
first offending request (or the whole-array field at fault).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from mla_kpool import check_metadata
from test_fuzz import FUZZ_VECTORS, KPOOL, STREAMS, Meta, draw_meta


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
