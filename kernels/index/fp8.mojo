"""FP8 e4m3fn decoding for the indexer: exact, on the CPU and on GPUs.

`index_top_k`'s queries and keys are e4m3fn bytes (`uint8` on the CPU,
where MAX has no FP8 tensors). `decode_e4m3` decodes them with integer SIMD
on any target, `decode_e4m3_gpu` with the hardware's conversion where there
is one (NVIDIA), and `decode_row` decodes a row of bytes into float32 (the
CPU path's queries and keys).
"""

from std.memory import bitcast
from std.sys.info import is_nvidia_gpu

from ..grid.ragged import Ptr


comptime DECODE_WIDTH = 16
"""FP8 bytes decoded per SIMD step."""


@always_inline
def decode_e4m3[
    width: Int
](bytes: SIMD[DType.uint8, width]) -> SIMD[DType.float32, width]:
    """Decodes e4m3fn bytes to float32, exactly, with integer SIMD.

    e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
    `S.1111.111` is NaN, exponent 0 is subnormal (`m * 2^-9`). A normal
    value's exponent and mantissa bits move into float32's positions and
    its exponent gains 127 - 7 = 120.

    Parameters:
        width: Lanes.

    Args:
        bytes: The e4m3fn bit patterns.

    Returns:
        The values as float32.
    """
    var x = bytes.cast[DType.uint32]()
    var mag = x & 0x7F
    var normal = bitcast[DType.float32, width]((mag << 20) + (120 << 23))
    var subnormal = (x & 7).cast[DType.float32]() * Float32(1.0 / 512.0)
    var value = mag.ge(8).select(normal, subnormal)
    value = mag.eq(0x7F).select(
        SIMD[DType.float32, width](FloatLiteral.nan), value
    )
    return bitcast[DType.float32, width](
        bitcast[DType.uint32, width](value) | ((x & 0x80) << 24)
    )


@always_inline
def decode_e4m3_gpu[
    width: Int
](bytes: SIMD[DType.uint8, width]) -> SIMD[DType.float32, width]:
    """Decodes e4m3fn bytes to float32 exactly, in hardware where there is one.

    On NVIDIA GPUs the bytes are cast as `float8_e4m3fn`, which compiles to
    `cvt.rn.f16x2.e4m3x2` (two bytes to two float16 per instruction, sm_89
    and later) and then float16 to float32: both steps are exact, since
    every e4m3fn value, subnormals included, is a normal float16, and a
    widening conversion keeps a NaN (`S.1111.111`) a NaN. AMD's hardware
    FP8 (gfx942) is the FNUZ variant, with another bias and NaN, and the
    host emulation has none: both take `decode_e4m3`.

    Parameters:
        width: Lanes.

    Args:
        bytes: The e4m3fn bit patterns.

    Returns:
        The values as float32 (the same as `decode_e4m3`'s, up to a NaN's
        payload).
    """
    comptime if is_nvidia_gpu():
        return bitcast[DType.float8_e4m3fn, width](bytes).cast[DType.float32]()
    else:
        return decode_e4m3[width](bytes)


@always_inline
def decode_row[count: Int](src: Ptr[DType.uint8], dest: Ptr[DType.float32]):
    """Decodes `count` consecutive e4m3fn bytes into float32."""
    comptime full = count // DECODE_WIDTH
    comptime for i in range(full):
        dest.unsafe_store[width=DECODE_WIDTH](
            i * DECODE_WIDTH,
            decode_e4m3[DECODE_WIDTH](
                src.unsafe_load[width=DECODE_WIDTH](i * DECODE_WIDTH)
            ),
        )
    comptime for i in range(full * DECODE_WIDTH, count):
        dest[unsafe_offset=i] = decode_e4m3[1](
            SIMD[DType.uint8, 1](src[unsafe_offset=i])
        )[0]
