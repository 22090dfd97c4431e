"""Unit tests of the indexer's FP8 decode and candidate ranking.

Runs without a GPU (`mojo run -I . tests/mojo/test_index_top_k.mojo`);
`tests/index/test_index_kernel_units.py` runs it under pytest. The decode is
checked against Mojo's own float8_e4m3fn conversion for all 256 bytes, the
ranking key against the float order plus the id tie-break.
"""

from std.memory import bitcast
from std.testing import TestSuite, assert_equal, assert_false, assert_true

from kernels.index.fp8 import decode_e4m3, decode_row
from kernels.index.rank import rank_key


def test_decode_matches_the_dtype_conversion_for_every_byte() raises:
    for byte in range(256):
        var pattern = SIMD[DType.uint8, 1](UInt8(byte))
        var mine = decode_e4m3[1](pattern)[0]
        var theirs = bitcast[DType.float8_e4m3fn, 1](pattern).cast[
            DType.float32
        ]()[0]
        if theirs != theirs:
            assert_true(mine != mine, String("byte ", byte, " must be NaN"))
        else:
            assert_equal(
                bitcast[DType.uint32, 1](mine),
                bitcast[DType.uint32, 1](theirs),
                String("byte ", byte),
            )


def test_decode_row_covers_full_steps_and_the_tail() raises:
    # 37 bytes: two 16-byte SIMD steps and a 5-byte scalar tail.
    var src = List[UInt8](length=37, fill=0)
    var dest = List[Float32](length=37, fill=-7.0)
    for i in range(37):
        src[i] = UInt8((i * 29 + 3) % 256)
    decode_row[37](
        src.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        dest.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
    )
    for i in range(37):
        var want = decode_e4m3[1](SIMD[DType.uint8, 1](src[i]))[0]
        if want == want:
            assert_equal(dest[i], want, String("element ", i))
        else:
            assert_true(dest[i] != dest[i], String("element ", i))


def test_rank_key_orders_by_score_then_lower_id() raises:
    assert_true(rank_key(2.0, 9) > rank_key(1.0, 0))
    assert_true(rank_key(-1.0, 9) > rank_key(-2.0, 0))
    assert_true(rank_key(0.5, 3) > rank_key(0.5, 4), "ties: lower id first")
    assert_equal(rank_key(-0.0, 5), rank_key(0.0, 5), "-0.0 ranks as 0.0")
    var inf = Float32(FloatLiteral.infinity)
    var nan = Float32(FloatLiteral.nan)
    assert_equal(rank_key(nan, 7), rank_key(-inf, 7), "NaN ranks as -inf")
    assert_true(rank_key(-3.0e38, 100) > rank_key(nan, 0))
    assert_false(rank_key(inf, 1) < rank_key(3.0e38, 0))


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
