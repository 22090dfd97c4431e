"""A host model of Hopper's `wgmma.mma_async` for FP8 (e4m3 x e4m3 -> f32).

The emulated grid runs the tensor-core scorer's own tile code on the CPU;
where the GPU issues `wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3`,
the emulation calls `wgmma_e4m3_model` instead. The model is written from
NVIDIA's PTX ISA ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate
Instructions": the matrix descriptor format, the shared-memory matrix
layouts and the register fragments of `.m64nNk32`), never from the scorer,
so a scorer whose tiles, descriptors or fragment reading disagree with the
hardware's gives wrong scores under emulation too: `decode_descriptor`,
`kmajor_byte` and `accumulator_element` hold the formats it reads.

The model sums each step's 32 products in float32 in ascending `k` and adds
the sum to the register: an exact FP32 model, not the hardware's
accumulator (which keeps fewer fraction bits and truncates). Tests compare
the emulated scorer with the oracle within the tensor-core bound, so the
difference is accounted for there. Swizzled layouts and base offsets are
not modelled: a descriptor that uses them yields NaN, so a scorer that
starts using them fails its emulated tests until the model grows.
"""

from ....grid.block_phases import Shared
from ...fp8 import decode_e4m3


comptime WGMMA_FP8_K = 32
"""Bytes of K one FP8 `wgmma` consumes (`.k32`)."""


@fieldwise_init
struct WgmmaDescriptor(Copyable, TrivialRegisterPassable):
    """The fields of a `wgmma` shared-memory matrix descriptor, in bytes."""

    var start: Int
    """Start address (bytes, a multiple of 16)."""
    var leading: Int
    """Leading dimension byte offset (LBO)."""
    var stride: Int
    """Stride dimension byte offset (SBO)."""
    var base_offset: Int
    """Matrix base offset (swizzled layouts only)."""
    var swizzle: Int
    """0: none, 1: 128-byte, 2: 64-byte, 3: 32-byte swizzle."""


def decode_descriptor(desc: Int64) -> WgmmaDescriptor:
    """The fields of a 64-bit descriptor (PTX ISA's matrix descriptor format).

    **Descriptor** (64 bits): start address bits 0-13, leading dimension
    byte offset (LBO) bits 16-29, stride dimension byte offset (SBO) bits
    32-45, each a byte value shifted right by 4; base offset bits 49-51;
    swizzle mode bits 62-63 (0: none, 1: 128-byte, 2: 64-byte, 3: 32-byte).

    Args:
        desc: The descriptor as the instruction receives it.

    Returns:
        Its start address, LBO and SBO in bytes, base offset and swizzle
        mode.
    """
    var d = UInt64(desc)
    return WgmmaDescriptor(
        Int((d & 0x3FFF) << 4),
        Int(((d >> 16) & 0x3FFF) << 4),
        Int(((d >> 32) & 0x3FFF) << 4),
        Int((d >> 49) & 0x7),
        Int((d >> 62) & 0x3),
    )


def kmajor_byte(desc: WgmmaDescriptor, row: Int, k: Int) -> Int:
    """Shared byte of element `(row, k)` of a K-major, unswizzled operand.

    **K-major layout without swizzle**: the matrix is made of *core
    matrices* of 8 rows x 16 bytes, each stored as 128 contiguous bytes (row
    `r` of the core matrix at byte `16 * r`). The core matrix holding row
    `r` and byte `k` of a row sits `(r / 8) * SBO + (k / 16) * LBO` bytes past
    the start address.

    Args:
        desc: The operand's descriptor fields.
        row: Row of the operand (M for A, N for B).
        k: Byte along K (one FP8 element per byte).

    Returns:
        The byte's shared address, or -1 for a layout the model does not
        cover (swizzled, or with a base offset).
    """
    if desc.swizzle != 0 or desc.base_offset != 0:
        return -1
    return (
        desc.start
        + (row // 8) * desc.stride
        + (k // 16) * desc.leading
        + (row % 8) * 16
        + k % 16
    )


def accumulator_element(thread: Int, register: Int) -> Tuple[Int, Int]:
    """`(row, column)` of `D` that `register` of warpgroup `thread` holds.

    The `m64nNk*` float32 accumulator fragment (PTX ISA, "Matrix Fragments
    for wgmma .m64nNk32").

    **Accumulator fragment of `m64nNk32`**: thread `T` of the warpgroup
    (`w = T / 32`, lane `l = T % 32`, `g = l / 4`, `q = l % 4`) holds `N / 2`
    float32 registers; register `i` is element `(16 w + g + 8 ((i / 2) % 2),
    8 (i / 4) + 2 q + i % 2)` of `D` (row of A, column of B).

    Args:
        thread: Thread of the warpgroup, 0 to 127.
        register: Accumulator register, 0 to `N / 2 - 1`.
    """
    var lane = thread % 32
    return (
        16 * (thread // 32) + lane // 4 + 8 * ((register // 2) % 2),
        8 * (register // 4) + 2 * (lane % 4) + register % 2,
    )


@always_inline
def shared_byte(s: Shared, address: Int) -> UInt8:
    """Byte `address` of the block's shared words (little-endian words)."""
    return UInt8(
        (s.tensor_operand_load(address // 4) >> UInt32(8 * (address % 4)))
        & 0xFF
    )


def wgmma_e4m3_model[
    n: Int, width: Int
](
    s: Shared,
    thread: Int,
    desc_a: Int64,
    desc_b: Int64,
    acc: SIMD[DType.float32, width],
) -> SIMD[DType.float32, width]:
    """One `wgmma.m64nNk32.f32.e4m3.e4m3` as thread `thread` sees it.

    `D = A x B^T + D` with A `[64, 32]` and B `[n, 32]` e4m3fn bytes in
    shared memory, both K-major (their descriptors), D in the caller's
    accumulator fragment. Reads go through `s`, so the emulation's phase
    checks see them: an operand staged in the same phase (no barrier or
    fence between) is reported as a race.

    Parameters:
        n: The instruction's N (a multiple of 8, at most 256).
        width: Registers per thread, `n / 2`.

    Args:
        s: The block's shared memory.
        thread: Thread of the warpgroup.
        desc_a: A's descriptor.
        desc_b: B's descriptor.
        acc: The thread's accumulator registers.

    Returns:
        The registers after the instruction.
    """
    comptime assert width * 2 == n and n % 8 == 0 and n <= 256
    var a = decode_descriptor(desc_a)
    var b = decode_descriptor(desc_b)
    var out = acc
    for i in range(width):
        var at = accumulator_element(thread, i)
        var sum = Float32(0)
        for k in range(WGMMA_FP8_K):
            var x = kmajor_byte(a, at[0], k)
            var y = kmajor_byte(b, at[1], k)
            if x < 0 or y < 0:
                sum = Float32(FloatLiteral.nan)  # a layout not modelled
                break
            var xa = decode_e4m3[1](SIMD[DType.uint8, 1](shared_byte(s, x)))
            var yb = decode_e4m3[1](SIMD[DType.uint8, 1](shared_byte(s, y)))
            sum += xa[0] * yb[0]
        out[i] += sum
    return out
