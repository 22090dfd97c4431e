"""Unit tests of the writers' shared pooling arithmetic.

Runs without a GPU (`mojo run -I . tests/mojo/test_pooling.mojo`);
`tests/test_pooling_units.py` runs it under pytest. The CPU's bfloat16
conversion in vector integer ops (`to_key_dtype`) against the compiler's
own float32 to bfloat16 cast, bit for bit.
"""

from std.math import iota
from std.memory import bitcast
from std.testing import TestSuite, assert_equal

from kernels.writers.pooling import to_key_dtype

comptime W = 16


def _check(bits: SIMD[DType.uint32, W]) raises:
    var value = bitcast[DType.float32, W](bits)
    var mine = bitcast[DType.uint16, W](to_key_dtype[DType.bfloat16, W](value))
    var theirs = bitcast[DType.uint16, W](value.cast[DType.bfloat16]())
    if mine.eq(theirs).reduce_and():
        return
    for lane in range(W):
        assert_equal(
            mine[lane], theirs[lane], String("float32 bits ", bits[lane])
        )


def test_bfloat16_matches_the_compilers_cast() raises:
    # Every high half (signs, zeros, subnormals, normals, infinities, NaNs
    # quiet and signalling) with low halves below, at and above the
    # rounding tie, and the ties' both parities of bit 16.
    var lows = SIMD[DType.uint32, W](
        0,
        1,
        0x3FFF,
        0x7FFF,
        0x8000,
        0x8001,
        0xBFFF,
        0xFFFF,
        0x1234,
        0x5678,
        0x9ABC,
        0xDEF0,
        0x7FFE,
        0x8002,
        0x4000,
        0xC000,
    )
    for high in range(1 << 16):
        _check((UInt32(high) << 16) | lows)


def test_float32_and_float16_are_plain_casts() raises:
    var value = bitcast[DType.float32, W](
        SIMD[DType.uint32, W](0x3F800000) + iota[DType.uint32, W]() * 0x01234567
    )
    assert_equal(to_key_dtype[DType.float32, W](value), value)
    assert_equal(
        to_key_dtype[DType.float16, W](value), value.cast[DType.float16]()
    )


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
