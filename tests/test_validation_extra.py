"""Static batch sizes that disagree while ``cache_lengths`` is symbolic.

``tests/test_validation.py`` covers SPEC section 7 case by case; what it
misses is two per-request tensors whose *static* lengths disagree with each
other while ``cache_lengths`` (the reference ``check_batch`` compares
against) has a symbolic length: ``input_row_offsets`` ``[5]`` next to
``slot_idx`` ``[3]`` cannot both be right for any batch, yet neither is
provably different from ``batch + 1`` / ``batch`` alone. Such a graph builds
and fails only when it runs (the kernel's own shape check raises).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from max.dtype import DType

from test_validation import call_op, good_operands, tensor

U32 = DType.uint32


@dataclass(frozen=True)
class Disagree:
    """Per-request tensors whose static lengths cannot all be right."""

    id: str
    ops: tuple[str, ...]
    overrides: dict[str, Any]
    #: Either name may be the one the message starts with.
    names: tuple[str, ...]


CASES = [
    Disagree(
        "offsets_5_slots_3",
        ("ring_close", "seed_tail", "kpool_step"),
        {
            "input_row_offsets": tensor(U32, [5]),
            "slot_idx": tensor(U32, [3]),
        },
        ("input_row_offsets", "slot_idx"),
    ),
    Disagree(
        "offsets_4_pool_offsets_5",
        ("compress",),
        {
            "input_row_offsets": tensor(U32, [4]),
            "pool_row_offsets": tensor(U32, [5]),
        },
        ("input_row_offsets", "pool_row_offsets"),
    ),
]


@pytest.mark.parametrize(
    ("case", "op"),
    [
        pytest.param(case, op, id=f"{case.id}-{op}")
        for case in CASES
        for op in case.ops
    ],
)
def test_rejects_static_lengths_that_disagree(case: Disagree, op: str) -> None:
    operands = {**good_operands(), **case.overrides}
    # cache_lengths keeps its symbolic ["batch"] from good_operands().
    try:
        call_op(op, operands)
    except ValueError as error:
        message = str(error)
        assert message.startswith(tuple(f"{n} " for n in case.names)), message
        return
    raise AssertionError(f"{op} accepted {case.id}")


@pytest.mark.parametrize(
    ("op", "overrides"),
    [
        pytest.param(
            "ring_close",
            {
                "input_row_offsets": tensor(U32, [4]),
                "slot_idx": tensor(U32, [3]),
            },
            id="ring_close-offsets_4_slots_3",
        ),
        pytest.param(
            "compress",
            {
                "input_row_offsets": tensor(U32, [4]),
                "pool_row_offsets": tensor(U32, [4]),
            },
            id="compress-offsets_4_pool_offsets_4",
        ),
    ],
)
def test_accepts_static_lengths_that_agree(
    op: str, overrides: dict[str, Any]
) -> None:
    call_op(op, {**good_operands(), **overrides})
