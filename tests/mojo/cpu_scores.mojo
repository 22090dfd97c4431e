"""What the CPU scorer tests share: e4m3fn values and the score check.

Imported by `test_index_cpu_prefill.mojo` and `test_index_cpu_amx.mojo`
(no tests of its own).
"""

from std.math import abs, max
from std.testing import assert_true

from kernels.index.fp8 import decode_e4m3


def e4m3(i: Int) -> Float32:
    """A deterministic e4m3fn value (byte `i * 37 mod 256`, never NaN)."""
    var byte = (i * 37 + 11) % 256
    if byte & 0x7F == 0x7F:
        byte -= 1
    return decode_e4m3[1](SIMD[DType.uint8, 1](UInt8(byte)))[0]


def check_scores(
    got: List[Float32],
    want: List[Float32],
    count: Int,
    nan_at: Int,
    label: String,
) raises:
    """The first `count` scores agree within float32 rounding of the sums,
    candidate `nan_at` (a NaN key) scores NaN, and most are nonzero."""
    var nonzero = 0
    for x in range(count):
        var at = String(label, " x ", x)
        if x == nan_at:
            assert_true(got[x] != got[x], "a NaN key scores NaN: " + at)
            continue
        nonzero += Int(want[x] != 0)
        var scale = max(abs(want[x]), Float32(1.0))
        assert_true(
            abs(got[x] - want[x]) <= 1e-5 * scale,
            String(at, ": ", got[x], " vs ", want[x]),
        )
    assert_true(nonzero > count // 2, "the case scores mostly nonzero")
