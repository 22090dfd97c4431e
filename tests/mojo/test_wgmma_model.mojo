"""The host model of FP8 `wgmma` against the PTX ISA, and against an H100/H200.

Without a GPU: the model's descriptor decoding, its K-major core-matrix
addressing and its accumulator fragment are checked entry by entry against
the PTX ISA's tables (the descriptor's bit fields; "K-major, no swizzle":
core matrices of 8 rows x 16 bytes, LBO between core matrices along K, SBO
between groups of 8 rows; the `m64nNk32` D fragment figure, whose first
rows read T0: d0 d1 at (0, 0) (0, 1), d2 d3 at (8, 0) (8, 1), d4 d5 at
(0, 8) (0, 9); T1 two columns on; T4 one row down; warp 1 sixteen rows
down). The scorer's own tile layout (`wgmma.tile_byte` and
`descriptor`) is then read back through the model, which must find every
element where the scorer put it. The scorer's kernel compiles for sm_90a
with four `wgmma` e4m3 instructions for depth 128.

With an sm_90 GPU: one warpgroup stages a 64 x 64 key tile and a 32 x 64
query tile exactly as the scorer does, runs two chained
`wgmma.m64n32k32.f32.e4m3.e4m3` and writes every thread's registers. Small
integer inputs make every sum exact in any adder, so the hardware's
registers must equal both the exact products and the model's, bit for bit.
"""

from max.gpu import barrier, thread_idx
from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.host import DeviceContext, get_gpu_target
from max.gpu.host.compile import _compile_code
from max.gpu.memory import AddressSpace, fence_async_view_proxy
from std.memory import bitcast, stack_allocation
from std.sys import has_accelerator
from std.sys.info import is_nvidia_gpu
from std.testing import TestSuite, assert_equal, assert_true

from kernels.grid.block_phases import Shared, shadow_words
from kernels.index.fp8 import decode_e4m3
from kernels.index.gpu.wgmma_tiles import (
    CORE_BYTES,
    descriptor,
    tile_byte,
)
from kernels.grid.ragged import Ptr
from kernels.index.gpu.emulated.wgmma import (
    accumulator_element,
    decode_descriptor,
    kmajor_byte,
    wgmma_e4m3_model,
)

comptime KP = 64
"""Bytes of K of the test tiles (two instructions)."""
comptime N = 32
"""Query rows of the test product."""
comptime A_WORDS = 64 * KP // 4
comptime WORDS = A_WORDS + N * KP // 4


def test_descriptor_fields_are_the_isa_bits() raises:
    # start 0x1230 bytes, LBO 128, SBO 1024, base offset 5, swizzle 1.
    var desc = (
        Int64(0x1230 >> 4)
        | (Int64(128 >> 4) << 16)
        | (Int64(1024 >> 4) << 32)
        | (Int64(5) << 49)
        | (Int64(1) << 62)
    )
    var d = decode_descriptor(desc)
    assert_equal(d.start, 0x1230)
    assert_equal(d.leading, 128)
    assert_equal(d.stride, 1024)
    assert_equal(d.base_offset, 5)
    assert_equal(d.swizzle, 1)


def test_kmajor_core_matrices() raises:
    var d = decode_descriptor(descriptor(256, 128, 1024))
    assert_equal(kmajor_byte(d, 0, 0), 256)
    assert_equal(kmajor_byte(d, 1, 0), 256 + 16)  # next row of a core matrix
    assert_equal(kmajor_byte(d, 7, 15), 256 + 7 * 16 + 15)
    assert_equal(kmajor_byte(d, 0, 16), 256 + 128)  # next along K: LBO
    assert_equal(kmajor_byte(d, 8, 0), 256 + 1024)  # 8 rows down: SBO
    assert_equal(kmajor_byte(d, 9, 17), 256 + 1024 + 128 + 16 + 1)
    # Swizzled or offset layouts are not modelled.
    var swizzled = decode_descriptor(descriptor(0, 128, 1024) | (1 << 62))
    assert_equal(kmajor_byte(swizzled, 0, 0), -1)


def test_accumulator_fragment_is_the_isa_figure() raises:
    var want = List[Tuple[Int, Int, Int, Int]]()
    # (thread, register, row, column) from the m64nNk32 D fragment figure.
    want.append((0, 0, 0, 0))
    want.append((0, 1, 0, 1))
    want.append((0, 2, 8, 0))
    want.append((0, 3, 8, 1))
    want.append((0, 4, 0, 8))
    want.append((0, 5, 0, 9))
    want.append((1, 0, 0, 2))
    want.append((3, 1, 0, 7))
    want.append((4, 0, 1, 0))
    want.append((31, 3, 15, 7))
    want.append((32, 0, 16, 0))
    want.append((127, 15, 63, 31))
    want.append((127, 31, 63, 63))  # N = 64: registers 16 to 31
    for w in want:
        var at = accumulator_element(w[0], w[1])
        assert_equal(at[0], w[2], "row")
        assert_equal(at[1], w[3], "column")
    # Every (row, column) of a 64 x 32 D is held exactly once.
    var seen = List[Int](length=64 * N, fill=0)
    for t in range(128):
        for i in range(N // 2):
            var at = accumulator_element(t, i)
            seen[at[0] * N + at[1]] += 1
    for x in seen:
        assert_equal(x, 1)


def _value(row: Int, k: Int, salt: Int) -> UInt8:
    """A small e4m3fn integer (0, +-1 .. +-4) for element `(row, k)`."""
    comptime codes = SIMD[DType.uint8, 8](
        0x00, 0x38, 0x40, 0x44, 0x48, 0xB8, 0xC0, 0x00
    )
    return codes[(row * 7 + k * 3 + salt) % 8]


def _stage(mut words: List[UInt32], first: Int, rows: Int, salt: Int):
    """Lays `rows` x `KP` test bytes out as the scorer does (`tile_byte`)."""
    for r in range(rows):
        for k in range(KP):
            var at = first * 4 + tile_byte[KP](r, k)
            var shift = UInt32(8 * (at % 4))
            words[at // 4] |= UInt32(_value(r, k, salt)) << shift


def _exact(row: Int, col: Int) -> Float32:
    var sum = Float32(0)
    for k in range(KP):
        sum += (
            decode_e4m3[1](SIMD[DType.uint8, 1](_value(row, k, 0)))[0]
            * decode_e4m3[1](SIMD[DType.uint8, 1](_value(col, k, 1)))[0]
        )
    return sum


def _model_registers(mut words: List[UInt32]) -> List[Float32]:
    """Every thread's registers after the two instructions, by the model."""
    # Every word written by thread 0 in phase 0 (its stamp), read in phase 1.
    var shadow = List[Int64](length=shadow_words(WORDS), fill=0)
    for i in range(WORDS):
        shadow[i] = (Int64(1) << 32) | 1
    var s = Shared(
        words.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        shadow.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        WORDS,
        1,
        0,
    )
    var out = List[Float32](length=128 * (N // 2), fill=0.0)
    for t in range(128):
        var acc = SIMD[DType.float32, N // 2](0)
        comptime for step in range(KP // 32):
            acc = wgmma_e4m3_model[N, N // 2](
                s,
                t,
                descriptor(2 * CORE_BYTES * step, CORE_BYTES, KP * 8),
                descriptor(
                    4 * A_WORDS + 2 * CORE_BYTES * step, CORE_BYTES, KP * 8
                ),
                acc,
            )
        for i in range(N // 2):
            out[t * (N // 2) + i] = acc[i]
    _ = shadow^
    return out^


def test_the_scorer_layout_read_back_through_the_model() raises:
    var words = List[UInt32](length=WORDS, fill=0)
    _stage(words, 0, 64, 0)
    _stage(words, A_WORDS, N, 1)
    var got = _model_registers(words)
    for t in range(128):
        for i in range(N // 2):
            var at = accumulator_element(t, i)
            assert_equal(got[t * (N // 2) + i], _exact(at[0], at[1]))


def wgmma_probe(tiles: Ptr[DType.uint32], regs: Ptr[DType.float32]):
    """One warpgroup: stage the tiles, two wgmma, every register out.

    A GPU body only (the host build of this module sees none of it).
    """
    comptime if is_nvidia_gpu():
        var smem = stack_allocation[
            WORDS, UInt32, alignment=128, address_space=AddressSpace.SHARED
        ]()
        var t = Int(thread_idx.x)
        for w in range(t, WORDS, 128):
            smem[unsafe_offset=w] = tiles[unsafe_offset=w]
        fence_async_view_proxy()
        barrier()
        var base = Int(smem)
        var acc = SIMD[DType.float32, N // 2](0)
        wgmma_fence_aligned()
        comptime for step in range(KP // 32):
            acc = wgmma_async[
                64,
                N,
                32,
                DType.float32,
                N // 2,
                a_type=DType.float8_e4m3fn,
                b_type=DType.float8_e4m3fn,
            ](
                WGMMADescriptor[DType.float8_e4m3fn](
                    descriptor(base + 256 * step, CORE_BYTES, KP * 8)
                ),
                WGMMADescriptor[DType.float8_e4m3fn](
                    descriptor(
                        base + 4 * A_WORDS + 256 * step, CORE_BYTES, KP * 8
                    )
                ),
                acc,
            )
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()
        for i in range(N // 2):
            regs[unsafe_offset=t * (N // 2) + i] = acc[i]


def test_wgmma_probe_compiles_to_two_wgmma_for_sm_90a() raises:
    var asm = _compile_code[
        wgmma_probe, target=get_gpu_target["sm_90a"]()
    ]().asm
    assert_equal(asm.count("wgmma.mma_async.sync.aligned.m64n32k32"), 2)


def test_hardware_equals_the_model_on_sm_90() raises:
    comptime if not has_accelerator():
        raise Error("needs an sm_90 GPU: main skips this test without one")
    else:
        var ctx = DeviceContext()
        if not _runs_here(ctx):
            raise Error("needs an sm_90 GPU, this is ", ctx.name())
        var words = List[UInt32](length=WORDS, fill=0)
        _stage(words, 0, 64, 0)
        _stage(words, A_WORDS, N, 1)
        var want = _model_registers(words)
        var tiles = ctx.enqueue_create_buffer[DType.uint32](WORDS)
        var out = ctx.enqueue_create_buffer[DType.float32](128 * (N // 2))
        with tiles.map_to_host() as host:
            for i in range(WORDS):
                host[i] = words[i]
        ctx.enqueue_function[wgmma_probe](
            tiles.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            grid_dim=1,
            block_dim=128,
        )
        ctx.synchronize()
        var mismatches = 0
        with out.map_to_host() as host:
            for i in range(128 * (N // 2)):
                if host[i] != want[i]:
                    if mismatches < 8:
                        var at = accumulator_element(
                            i // (N // 2), i % (N // 2)
                        )
                        print(
                            "thread",
                            i // (N // 2),
                            "reg",
                            i % (N // 2),
                            "(",
                            at[0],
                            at[1],
                            ") gpu",
                            host[i],
                            "model",
                            want[i],
                        )
                    mismatches += 1
        assert_equal(mismatches, 0, "registers differing from the model")


def _runs_here(ctx: DeviceContext) raises -> Bool:
    """Whether this GPU is an sm_90 GPU, whose registers the model is."""
    return ctx.name().startswith("NVIDIA H")


def main() raises:
    var here = False
    comptime if has_accelerator():
        here = _runs_here(DeviceContext())
    var suite = TestSuite.discover_tests[__functions_in_module()]()
    # Where the hardware comparison cannot run it is reported as skipped
    # (the pytest wrapper counts it so), never passed unrun.
    if not here:
        suite.skip[test_hardware_equals_the_model_on_sm_90]()
    suite^.run()
