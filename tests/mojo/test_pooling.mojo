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
of two quads a thread, metadata on 16 bytes and off them, 4-byte, 8-byte
and mixed widths, sums past 2^32, offsets past 2^63; guard words around
the output) against the prefix sum written here.
"""

from std.math import iota
from std.sys import size_of
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


comptime GUARD = 0xDEADBEEF
"""What the scan's output holds outside `pool_row_offsets`."""


def _first_on_16_bytes[dtype: DType](mut values: List[Scalar[dtype]]) -> Int:
    """The first element of `values` that starts on 16 bytes."""
    var address = Int(scratch(values))
    return ((16 - address % 16) % 16) // size_of[dtype]()


def _place[
    dtype: DType
](mut out: List[Scalar[dtype]], values: List[Int], shift: Int) -> Int:
    """Writes `values` into `out` (8 elements longer) from its first
    element on 16 bytes plus `shift` elements (1: never on 16 bytes), as
    `dtype` holds them; returns where they start."""
    var first = _first_on_16_bytes(out) + shift
    for i in range(len(values)):
        out[first + i] = Scalar[dtype](values[i])
    return first


def _expected_offsets(offsets: List[Int], cache: List[Int]) -> List[UInt32]:
    """`pool_row_offsets` by the rule: request `b` counts the pools made
    only of its new rows, `(c + n) // kpool - ceil(c / kpool)` (at least
    0; 0 when `n` or `c` is negative), summed and kept modulo 2^32."""
    var batch = len(cache)
    var out = List[UInt32](length=batch + 1, fill=0)
    var total = 0
    for b in range(batch):
        var n = offsets[b + 1] - offsets[b]
        var c = cache[b]
        if n >= 0 and c >= 0:
            total += max((c + n) // KPOOL - (c + KPOOL - 1) // KPOOL, 0)
        out[b + 1] = UInt32(total & 0xFFFFFFFF)
    return out^


def _scan_case[
    offset_dtype: DType, length_dtype: DType
](batch: Int, shift: Int, scale: Int = 1) raises:
    # Spans of 0 to 9 rows times `scale` (past 2^32 pools in all at scale
    # 2^31; offsets past 2^63, read negative as `read_index` reads them,
    # at 2^60), every 7th span going back 3 (a malformed span counts 0);
    # cache lengths 0 to 12, every 5th negative where signed. The output
    # sits between guard words.
    var offsets = List[Int]()
    var cache = List[Int]()
    var at = 0
    for b in range(batch + 1):
        offsets.append(at)
        var span = (b * 7) % 10 - (3 if b % 7 == 6 else 0)
        at += span * scale  # wraps past 2^63 at scale 2^60
    for b in range(batch):
        var c = (b * 3) % 13
        comptime if length_dtype.is_signed():
            if b % 5 == 4:
                c = -c - 1
        cache.append(c)
    var offset_list = List[Scalar[offset_dtype]](length=batch + 9, fill=0)
    var offset_at = _place(offset_list, offsets, shift)
    var cache_list = List[Scalar[length_dtype]](length=batch + 8, fill=0)
    var cache_at = _place(cache_list, cache, shift)
    # What the kernel reads: the values as their dtype holds them.
    for b in range(batch + 1):
        offsets[b] = Int(offset_list[offset_at + b])
    for b in range(batch):
        cache[b] = Int(cache_list[cache_at + b])
    var written = List[UInt32](length=batch + 9, fill=GUARD)
    var first = _first_on_16_bytes(written) + shift
    var rows = List[BFloat16](length=1, fill=0)
    var closed = List[Int32](length=1, fill=0)
    var ape = List[Float32](length=1, fill=0)
    var slots = List[UInt32](length=1, fill=0)
    var first_pool = List[Int64](length=1, fill=0)
    comptime Op = StepOperands[
        BF16, offset_dtype, length_dtype, U32, KPOOL, D, MutAnyOrigin
    ]
    var call = RaggedCall[BF16, offset_dtype, length_dtype, MutAnyOrigin](
        scratch(rows),
        scratch(rows),
        scratch(offset_list).unsafe_offset(offset_at),
        scratch(cache_list).unsafe_offset(cache_at),
        batch,
        0,
    )
    var ring = Ring[BF16, U32, MutAnyOrigin](
        scratch(rows), scratch(slots), 1, KPOOL
    )
    var close = RingCloseOperands[
        BF16, offset_dtype, length_dtype, U32, KPOOL, D, MutAnyOrigin
    ](scratch(rows), scratch(closed), scratch(ape), call, ring)
    launch_kernel[StepScanKernel[Op], True](
        Op(
            close,
            scratch(rows),
            scratch(written).unsafe_offset(first),
            scratch(first_pool),
            0,
        ),
        DeviceContext(api="cpu"),
    )
    var expected = _expected_offsets(offsets, cache)
    var label = String(
        "batch ",
        batch,
        ", shift ",
        shift,
        ", ",
        offset_dtype,
        "/",
        length_dtype,
    )
    for i in range(len(written)):
        var want = UInt32(GUARD)
        if first <= i <= first + batch:
            want = expected[i - first]
        assert_equal(written[i], want, String("word ", i - first, ", ", label))


def test_the_step_scan_matches_the_rule() raises:
    # Batches: none, a partial quad, a quad, a quad a thread (4,096), two
    # quads a thread (8,192; 5,003 with a partial last); metadata on 16
    # bytes and off them; 4-byte, 8-byte and mixed widths.
    for batch in [0, 1, 4, 7, 4096, 5003, 8192]:
        for shift in [0, 1]:
            _scan_case[DType.uint32, DType.uint32](batch, shift)
    for shift in [0, 1]:
        _scan_case[DType.int32, DType.int32](4099, shift)
        _scan_case[DType.int64, DType.int64](4099, shift, 1 << 31)
        _scan_case[DType.uint64, DType.uint64](1027, shift, 1 << 60)
        _scan_case[DType.uint32, DType.int64](4099, shift)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
