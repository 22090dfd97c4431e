"""mla_kpool.ring_length: the bound, rounding and argument errors."""

from __future__ import annotations

import pytest

import mla_kpool


@pytest.mark.parametrize(
    ("kpool", "max_new_tokens", "expected"),
    [
        # kpool + max_new_tokens - 1, rounded up to a multiple of kpool.
        (4, 1, 4),  # one token per call: the documented ring suffices
        (4, 2, 8),  # 5 -> 8
        (4, 5, 8),  # 8 exactly
        (4, 6, 12),  # 9 -> 12
        (4, 8, 12),  # 7 drafts + 1: 11 -> 12 (vLLM's kpool 4, 7 drafts)
        (1, 5, 5),
        (128, 1, 128),
        (128, 130, 384),  # 257 -> 384
    ],
)
def test_ring_length_values(kpool, max_new_tokens, expected):
    assert mla_kpool.ring_length(kpool, max_new_tokens) == expected


@pytest.mark.parametrize(
    ("args", "error", "name"),
    [
        ((0, 4), ValueError, "kpool"),
        ((4, 0), ValueError, "max_new_tokens"),
        ((4.0, 8), TypeError, "kpool"),
        ((True, 8), TypeError, "kpool"),
        ((4, "8"), TypeError, "max_new_tokens"),
    ],
)
def test_ring_length_rejects_bad_arguments(args, error, name):
    with pytest.raises(error, match=f"^{name} "):
        mla_kpool.ring_length(*args)
