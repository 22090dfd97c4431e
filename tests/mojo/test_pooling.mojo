"""Unit tests of the writers' shared pooling arithmetic.

Runs without a GPU (`mojo run -I . tests/mojo/test_pooling.mojo`);
`tests/writers/test_pooling_units.py` runs it under pytest. The CPU's bfloat16
conversion in vector integer ops (`to_key_dtype`) against round to
nearest, ties to even, written here lane by lane, bit for bit, and against
the compiler's own float32 to bfloat16 cast wherever the host's cast
rounds too (not subnormals where it flushes them, as AVX512-BF16's
`vcvtneps2bf16` does, and not a NaN's payload, which such a host keeps);
and the GPU writers' element
accesses for tensors not 16-byte aligned (a view at an odd offset), which
the suite's MAX buffers never reach, against the CPU path, emulated: the
ring close's, and the fused step's scan (batches of no request to runs
of several a thread, metadata shifted off 16 bytes, uint32 and int64)
against the prefix sum written here.
"""

from std.math import iota
from std.memory import bitcast
from std.testing import TestSuite, assert_equal, assert_true

from max.gpu.host import DeviceContext

from kernels.grid.gpu_kernel import launch_kernel
from kernels.index.cpu.score import scratch
from kernels.grid.ragged import RaggedCall, Ring
from kernels.writers.pooling import to_key_dtype
from kernels.writers.ring_close import (
    RingCloseKernel,
    RingCloseOperands,
    ring_close_cpu,
)
from kernels.writers.step import StepOperands, StepScanKernel

comptime W = 16


def _nearest_even(bits: UInt32) -> UInt16:
    """float32 bits to bfloat16 bits, round to nearest, ties to even; a
    NaN the quiet NaN with its sign."""
    var sign = (bits >> 31) << 15
    var exponent = (bits >> 23) & 0xFF
    var mantissa = bits & 0x7FFFFF
    if exponent == 0xFF and mantissa != 0:
        return UInt16(sign | 0x7FC0)
    var kept = bits >> 16
    var dropped = bits & 0xFFFF
    if dropped > 0x8000 or (dropped == 0x8000 and kept & 1 == 1):
        kept += 1  # may carry into the exponent: the next binade, or inf
    return UInt16(kept)


def _check(bits: SIMD[DType.uint32, W]) raises:
    var value = bitcast[DType.float32, W](bits)
    var mine = bitcast[DType.uint16, W](to_key_dtype[DType.bfloat16, W](value))
    var theirs = bitcast[DType.uint16, W](value.cast[DType.bfloat16]())
    for lane in range(W):
        var why = String("float32 bits ", bits[lane])
        assert_equal(mine[lane], _nearest_even(bits[lane]), why)
        var exponent = (bits[lane] >> 23) & 0xFF
        if exponent == 0xFF and bits[lane] & 0x7FFFFF != 0:
            # A NaN either way (a host's cast may keep its payload).
            assert_true(theirs[lane] & 0x7FFF > 0x7F80, why)
        elif exponent != 0 or theirs[lane] & 0x7FFF != 0:
            # Where the host's cast rounds a subnormal it rounds as here.
            assert_equal(mine[lane], theirs[lane], why)


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


comptime BF16 = DType.bfloat16
comptime U32 = DType.uint32
comptime KPOOL = 4
comptime D = 128


def _values(count: Int, salt: Int) -> List[BFloat16]:
    var out = List[BFloat16](length=count, fill=0)
    for i in range(count):
        out[i] = BFloat16(Float32((i * 7919 + salt) % 2003 - 1001) / 250.0)
    return out^


def _close_both(skip: Int) raises:
    # batch 6: two pending members in the ring and two new rows each; one
    # request with too few tokens (nothing to close). `skip` elements
    # shift every bfloat16 tensor (1: 2 bytes, never 16-byte aligned).
    var batch = 6
    var tail = _values(batch * 2 * KPOOL * D + skip, 1)
    var k = _values(batch * 2 * D + skip, 2)
    var gate = _values(batch * 2 * D + skip, 3)
    var ape = List[Float32](length=KPOOL * D, fill=0.25)
    var offsets = List[UInt32]()
    var cache = List[UInt32]()
    var slots = List[UInt32]()
    for b in range(batch + 1):
        offsets.append(UInt32(b * 2 - (1 if b == batch else 0)))
    for b in range(batch):
        cache.append(UInt32(40 * KPOOL + 2))
        slots.append(UInt32(b))
    var cpu = List[BFloat16](length=batch * D + skip, fill=0)
    var gpu = List[BFloat16](length=batch * D + skip, fill=0)
    var cpu_closed = List[Int32](length=batch, fill=7)
    var gpu_closed = List[Int32](length=batch, fill=7)
    comptime Op = RingCloseOperands[BF16, U32, U32, U32, KPOOL, D, MutAnyOrigin]

    var call = RaggedCall[BF16, U32, U32, MutAnyOrigin](
        scratch(k).unsafe_offset(skip),
        scratch(gate).unsafe_offset(skip),
        scratch(offsets),
        scratch(cache),
        batch,
        batch * 2 - 1,
    )
    var ring = Ring[BF16, U32, MutAnyOrigin](
        scratch(tail).unsafe_offset(skip), scratch(slots), batch, KPOOL
    )
    ring_close_cpu(
        Op(
            scratch(cpu).unsafe_offset(skip),
            scratch(cpu_closed),
            scratch(ape),
            call,
            ring,
        )
    )
    launch_kernel[RingCloseKernel[Op], True](
        Op(
            scratch(gpu).unsafe_offset(skip),
            scratch(gpu_closed),
            scratch(ape),
            call,
            ring,
        ),
        DeviceContext(api="cpu"),
    )
    for b in range(batch):
        assert_equal(cpu_closed[b], gpu_closed[b], String("closed_pool ", b))
    assert_equal(cpu_closed[0], 40, "request 0 closes pool 40")
    assert_equal(cpu_closed[batch - 1], -1, "the last request cannot close")
    for i in range(batch * D):
        assert_equal(
            bitcast[DType.uint16, 1](cpu[skip + i]),
            bitcast[DType.uint16, 1](gpu[skip + i]),
            String("pooled element ", i, ", shift ", skip),
        )


def test_gpu_element_accesses_match_the_cpu() raises:
    _close_both(0)
    _close_both(1)


def _expected_offsets[
    dtype: DType
](offsets: List[Scalar[dtype]], cache: List[Scalar[dtype]], skip: Int) -> List[
    UInt32
]:
    """`pool_row_offsets` by the rule: request `b` counts the pools made
    only of its new rows, `(c + n) // kpool - ceil(c / kpool)` (at least
    0; 0 when `n` or `c` is negative), summed and kept modulo 2^32."""
    var batch = len(cache) - skip
    var out = List[UInt32](length=batch + 1, fill=0)
    var total = 0
    for b in range(batch):
        var n = Int(offsets[skip + b + 1]) - Int(offsets[skip + b])
        var c = Int(cache[skip + b])
        if n >= 0 and c >= 0:
            total += max((c + n) // KPOOL - (c + KPOOL - 1) // KPOOL, 0)
        out[b + 1] = UInt32(total & 0xFFFFFFFF)
    return out^


def _scan_case[dtype: DType](batch: Int, skip: Int) raises:
    # Offsets of 0 to 9 rows a request, every 7th going back by 3 (a
    # malformed span counts 0), cache lengths 0 to 12 (int64: every 5th
    # negative); `skip` shifts both (1: never 16-byte aligned) and the
    # output.
    var offsets = List[Scalar[dtype]](length=skip, fill=0)
    var cache = List[Scalar[dtype]](length=skip, fill=0)
    var at = 0
    for b in range(batch + 1):
        offsets.append(Scalar[dtype](at))
        at += (b * 5) % 10 - (3 if b % 7 == 6 else 0)
        at = max(at, 0)
    for b in range(batch):
        var c = (b * 3) % 13
        comptime if dtype.is_signed():
            if b % 5 == 4:
                c = -c - 1
        cache.append(Scalar[dtype](c))
    var rows = List[BFloat16](length=1, fill=0)
    var closed = List[Int32](length=1, fill=0)
    var ape = List[Float32](length=1, fill=0)
    var slots = List[UInt32](length=1, fill=0)
    var first_pool = List[Int64](length=1, fill=0)
    var written = List[UInt32](length=skip + batch + 1, fill=0xDEADBEEF)
    comptime Op = StepOperands[BF16, dtype, dtype, U32, KPOOL, D, MutAnyOrigin]
    var call = RaggedCall[BF16, dtype, dtype, MutAnyOrigin](
        scratch(rows),
        scratch(rows),
        scratch(offsets).unsafe_offset(skip),
        scratch(cache).unsafe_offset(skip),
        batch,
        at,
    )
    var ring = Ring[BF16, U32, MutAnyOrigin](
        scratch(rows), scratch(slots), 1, KPOOL
    )
    var close = RingCloseOperands[
        BF16, dtype, dtype, U32, KPOOL, D, MutAnyOrigin
    ](scratch(rows), scratch(closed), scratch(ape), call, ring)
    launch_kernel[StepScanKernel[Op], True](
        Op(
            close,
            scratch(rows),
            scratch(written).unsafe_offset(skip),
            scratch(first_pool),
            0,
        ),
        DeviceContext(api="cpu"),
    )
    var expected = _expected_offsets(offsets, cache, skip)
    for i in range(batch + 1):
        assert_equal(
            written[skip + i],
            expected[i],
            String(
                "pool_row_offsets[", i, "], batch ", batch, ", shift ", skip
            ),
        )


def test_the_step_scan_matches_the_rule() raises:
    # Batches: none, a partial quad, a quad a thread (4,096), two quads a
    # thread with a partial last; whole and shifted metadata.
    for batch in [0, 1, 7, 4096, 5003]:
        for skip in [0, 1]:
            _scan_case[DType.uint32](batch, skip)
    _scan_case[DType.int64](4099, 0)
    _scan_case[DType.int64](4099, 1)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
