"""The operand shape checks every op's `execute` runs, and their messages.

Runs without a GPU (`mojo run -I . tests/mojo/test_operands.mojo`);
`tests/writers/test_validation.py` runs it under pytest.
"""

from std.testing import TestSuite, assert_equal, assert_true
from std.utils.index import IndexList

from kernels.grid.operands import (
    ANY,
    dims,
    expect_pool_rows,
    expect_ring_length,
    expect_shape,
)

comptime OP = "mo.mla.kpool.ring_close"


def _message_of_shape[
    rank: Int
](got: IndexList[rank], names: StaticString, want: IndexList[rank]) -> String:
    """The error `expect_shape` raises for `ape`, or "" if it passes."""
    try:
        expect_shape(OP, "ape", got, names, want)
    except e:
        return String(e)
    return ""


def test_matching_shapes_pass() raises:
    assert_equal(
        _message_of_shape(dims(4, 128), "kpool, head_dim", dims(4, 128)), ""
    )
    # ANY skips a dimension whatever its size.
    assert_equal(
        _message_of_shape(
            dims(9, 2, 8, 64),
            "max_slots, 2, ring_len, head_dim",
            dims(ANY, 2, ANY, 64),
        ),
        "",
    )


def test_message_names_operand_and_both_shapes() raises:
    assert_equal(
        _message_of_shape(dims(8, 128), "kpool, head_dim", dims(4, 128)),
        (
            "mo.mla.kpool.ring_close: ape must be [kpool=4, head_dim=128],"
            " got [8, 128]"
        ),
    )


def test_message_prints_unchecked_and_literal_dimensions_by_name() raises:
    assert_equal(
        _message_of_shape(
            dims(9, 3, 8, 64),
            "max_slots, 2, ring_len, head_dim",
            dims(ANY, 2, ANY, 64),
        ),
        (
            "mo.mla.kpool.ring_close: ape must be [max_slots, 2, ring_len,"
            " head_dim=64], got [9, 3, 8, 64]"
        ),
    )


def test_each_dimension_is_checked() raises:
    # The last dimension alone differs: still refused.
    assert_true(
        _message_of_shape(dims(5), "batch + 1", dims(4)).endswith(
            "must be [batch + 1=4], got [5]"
        )
    )
    assert_true(
        _message_of_shape(dims(4, 127), "kpool, head_dim", dims(4, 128)) != ""
    )


def _ring_message[kpool: Int](ring_len: Int) -> String:
    try:
        expect_ring_length[kpool](OP, ring_len)
    except e:
        return String(e)
    return ""


def test_ring_length_multiple_of_kpool() raises:
    assert_equal(_ring_message[4](4), "")
    assert_equal(_ring_message[4](12), "")
    assert_equal(
        _ring_message[4](6),
        (
            "mo.mla.kpool.ring_close: tail's ring length (dimension 2) must"
            " be a positive multiple of kpool=4, got 6"
        ),
    )
    assert_true(_ring_message[4](0) != "")
    assert_true(_ring_message[4](2) != "")


def _rows_message[kpool: Int](rows: Int, total_tokens: Int) -> String:
    try:
        expect_pool_rows[kpool](OP, "pooled", dims(rows, 8), 8, total_tokens)
    except e:
        return String(e)
    return ""


def test_pool_rows_at_most_total_tokens_over_kpool() raises:
    assert_equal(_rows_message[4](2, 11), "")
    assert_equal(_rows_message[4](0, 3), "")
    assert_equal(
        _rows_message[4](3, 11),
        (
            "mo.mla.kpool.ring_close: pooled must have at most total_tokens"
            " // kpool = 2 rows, got 3"
        ),
    )
    # The shape is checked too: `[rows, head_dim]`.
    try:
        expect_pool_rows[4](OP, "pooled", dims(2, 7), 8, 11)
    except e:
        assert_equal(
            String(e),
            (
                "mo.mla.kpool.ring_close: pooled must be [rows, head_dim=8],"
                " got [2, 7]"
            ),
        )
        return
    raise Error("expect_pool_rows accepted head_dim 7 for 8")


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
