"""The host model of CDNA3's FP8 MFMA against AMD's tables, and the scorer's
gfx942 code.

Without a GPU: the model's register layouts are checked entry by entry
against AMD's matrix instruction calculator for
`v_mfma_f32_16x16x32_fp8_fp8` (CDNA3, `--register-layout`): src0 / src1
lane 0 bytes 0-7 hold `A[0][0..7]`, lane 1 `A[1][0..7]`, lane 16
`A[0][8..15]`, lane 63 byte 7 `A[15][31]`; D lane 0 registers 0-3 hold
`D[0..3][0]`, lane 1 `D[0..3][1]`, lane 16 `D[4..7][0]`, lane 63 register
3 `D[15][15]`. Every D element is held exactly once, every operand element
exactly once. The e4m3fnuz decoder is checked on all 256 bytes against the
rule that relates it to e4m3fn (`0x80` NaN, `0x7F` 240, `0xFF` -240, else
the e4m3fn value halved), the scorer's `0x80`-clearing word trick on all
256 bytes in each byte position, and the model on a whole 16 x 16 x 32
product laid out by the table. The MFMA scorer's phased kernel compiles
for gfx942 (MI300X) with `v_mfma_f32_16x16x32_fp8_fp8` and no scratch.

With an MI300 GPU: one wave loads the same operands into its registers,
runs the instruction and writes every lane's registers, which must equal
the model's bit for bit (small integers: exact in any adder).
"""

from max.gpu import thread_idx
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext, get_gpu_target
from max.gpu.host.compile import _compile_code
from std.memory import bitcast
from std.sys import has_accelerator
from std.sys.info import is_amd_gpu
from std.testing import TestSuite, assert_equal, assert_true

from asm_fields import amdhsa_field

from kernels.grid.gpu_kernel import kernel_code
from kernels.index.fp8 import decode_e4m3
from kernels.index.gpu.mfma import (
    MFMA_THREADS,
    MfmaScore,
    fn_to_fnuz_words,
    mfma_chunks,
    mfma_steps,
    mfma_words,
)
from kernels.index.operands import IndexOperands
from kernels.index.gpu.emulated.mfma import (
    decode_e4m3fnuz,
    mfma_accumulator_element,
    mfma_f32_16x16x32_fp8_model,
    mfma_operand_element,
    mfma_operand_lane,
)
from kernels.grid.ragged import Ptr

comptime U32 = DType.uint32
comptime Glm = IndexOperands[
    U32, U32, U32, U32, 32, 128, 512, 4, True, True, MutAnyOrigin
]
comptime Dsv = IndexOperands[
    U32, U32, U32, U32, 64, 128, 2048, 1, True, False, MutAnyOrigin
]


def test_operand_layout_is_the_calculator_table() raises:
    var want = List[Tuple[Int, Int, Int, Int]]()
    # (lane, byte, i, k): A[i][k] (B[k][i]) from the calculator's src0 /
    # src1 register layout of v_mfma_f32_16x16x32_fp8_fp8.
    want.append((0, 0, 0, 0))
    want.append((0, 1, 0, 1))
    want.append((0, 7, 0, 7))
    want.append((1, 0, 1, 0))
    want.append((15, 3, 15, 3))
    want.append((16, 0, 0, 8))
    want.append((17, 2, 1, 10))
    want.append((31, 7, 15, 15))
    want.append((32, 0, 0, 16))
    want.append((40, 5, 8, 21))
    want.append((48, 0, 0, 24))
    want.append((63, 7, 15, 31))
    for w in want:
        var at = mfma_operand_element(w[0], w[1])
        assert_equal(at[0], w[2], "row")
        assert_equal(at[1], w[3], "k")
        var back = mfma_operand_lane(w[2], w[3])
        assert_equal(back[0], w[0], "lane")
        assert_equal(back[1], w[1], "byte")
    # Every element of a 16 x 32 operand is held exactly once, and the
    # inverse agrees everywhere.
    var seen = List[Int](length=16 * 32, fill=0)
    for lane in range(64):
        for byte in range(8):
            var at = mfma_operand_element(lane, byte)
            seen[at[0] * 32 + at[1]] += 1
            var back = mfma_operand_lane(at[0], at[1])
            assert_equal(back[0], lane)
            assert_equal(back[1], byte)
    for x in seen:
        assert_equal(x, 1)


def test_accumulator_layout_is_the_calculator_table() raises:
    var want = List[Tuple[Int, Int, Int, Int]]()
    # (lane, register, i, j): D[i][j] from the calculator's D layout.
    want.append((0, 0, 0, 0))
    want.append((0, 1, 1, 0))
    want.append((0, 2, 2, 0))
    want.append((0, 3, 3, 0))
    want.append((1, 0, 0, 1))
    want.append((15, 3, 3, 15))
    want.append((16, 0, 4, 0))
    want.append((17, 1, 5, 1))
    want.append((33, 2, 10, 1))
    want.append((47, 0, 8, 15))
    want.append((48, 0, 12, 0))
    want.append((63, 3, 15, 15))
    for w in want:
        var at = mfma_accumulator_element(w[0], w[1])
        assert_equal(at[0], w[2], "row")
        assert_equal(at[1], w[3], "column")
    var seen = List[Int](length=16 * 16, fill=0)
    for lane in range(64):
        for r in range(4):
            var at = mfma_accumulator_element(lane, r)
            seen[at[0] * 16 + at[1]] += 1
    for x in seen:
        assert_equal(x, 1)


def _same(got: Float32, want: Float32, what: String) raises:
    if want != want:
        assert_true(got != got, String(what, ": not NaN"))
    else:
        assert_equal(
            bitcast[DType.uint32, 1](got),
            bitcast[DType.uint32, 1](want),
            what,
        )


def test_fnuz_decoder_all_bytes() raises:
    for b in range(256):
        var byte = UInt8(b)
        var got = decode_e4m3fnuz(byte)
        var what = String("byte ", b)
        if b == 0x80:
            assert_true(got != got, String(what, ": not NaN"))
        elif b == 0x7F:
            _same(got, 240.0, what)
        elif b == 0xFF:
            _same(got, -240.0, what)
        else:
            var e4m3fn = decode_e4m3[1](SIMD[DType.uint8, 1](byte))[0]
            _same(got, e4m3fn / 2, what)
    # A few by hand: 1.0 is 0x40 (exponent 8), the smallest subnormal
    # 2^-10, the largest 240; no negative zero.
    _same(decode_e4m3fnuz(0x40), 1.0, "0x40")
    _same(decode_e4m3fnuz(0x01), Float32(1.0 / 1024.0), "0x01")
    _same(decode_e4m3fnuz(0xC8), -2.0, "0xC8")
    _same(decode_e4m3fnuz(0x00), 0.0, "0x00")


def test_negative_zero_clearing_every_byte_and_position() raises:
    comptime fillers = SIMD[DType.uint8, 8](
        0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81, 0x40, 0xC0
    )
    for position in range(4):
        for b in range(256):
            for f in range(8):
                var bytes = SIMD[DType.uint8, 4](fillers[f])
                bytes[position] = UInt8(b)
                var word = bitcast[DType.uint32, 1](bytes)
                var got = bitcast[DType.uint8, 4](
                    fn_to_fnuz_words[1](SIMD[DType.uint32, 1](word))
                )
                for i in range(4):
                    var want = UInt8(0) if bytes[i] == 0x80 else bytes[i]
                    assert_equal(
                        got[i],
                        want,
                        String("byte ", b, " at ", position, " filler ", f),
                    )


def _element(i: Int, k: Int, salt: Int) -> UInt8:
    """A small e4m3fnuz integer (0, +-0.5 .. +-4) for element `(i, k)`."""
    comptime codes = SIMD[DType.uint8, 8](
        0x00, 0x40, 0x48, 0x50, 0x38, 0xC0, 0xC8, 0xD0
    )
    return codes[(i * 7 + k * 3 + salt + i // 3) % 8]


def _operands(salt: Int) -> SIMD[DType.uint64, 64]:
    """Every lane's 8 bytes, placed by the ISA table (written out here)."""
    var words = SIMD[DType.uint64, 64](0)
    for i in range(16):
        for k in range(32):
            var lane = 16 * (k // 8) + i
            words[lane] |= UInt64(_element(i, k, salt)) << UInt64(8 * (k % 8))
    return words


def _model_registers() -> List[Float32]:
    var a = _operands(0)
    var b = _operands(1)
    var out = List[Float32](length=64 * 4, fill=0.0)
    for lane in range(64):
        var d = mfma_f32_16x16x32_fp8_model(
            a, b, lane, SIMD[DType.float32, 4](0.5, 0, -1, 2)
        )
        for r in range(4):
            out[lane * 4 + r] = d[r]
    return out^


def test_model_is_the_matrix_product() raises:
    var got = _model_registers()
    var c = SIMD[DType.float32, 4](0.5, 0, -1, 2)
    for lane in range(64):
        for r in range(4):
            var i = 4 * (lane // 16) + r
            var j = lane % 16
            var want = Float32(0)
            for k in range(32):
                want += decode_e4m3fnuz(_element(i, k, 0)) * decode_e4m3fnuz(
                    _element(j, k, 1)
                )
            assert_equal(got[lane * 4 + r], want + c[r])


def _check_gfx942[H: Int, D: Int](asm: String) raises:
    """MFMA present, no scratch, `mfma_words` of LDS; prints the resources.

    The head chunks are a runtime loop (unrolled or not, at the compiler's
    choice): the code holds `S` MFMAs per loop body, `chunks * S` per wave
    when unrolled.
    """
    comptime steps = mfma_steps[D]()
    comptime chunks = mfma_chunks[H]()
    var what = String("H ", H, " D ", D)
    var count = asm.count("v_mfma_f32_16x16x32_fp8_fp8")
    print(
        what,
        "gfx942: v_mfma in the code",
        count,
        "(per wave",
        chunks * steps,
        ", per 64-candidate tile",
        4 * chunks * steps,
        ") VGPRs",
        amdhsa_field(asm, "next_free_vgpr"),
        "SGPRs",
        amdhsa_field(asm, "next_free_sgpr"),
        "scratch",
        amdhsa_field(asm, "private_segment_fixed_size"),
        "LDS",
        amdhsa_field(asm, "group_segment_fixed_size"),
    )
    assert_true(
        count == steps or count == chunks * steps,
        String(what, ": ", count, " v_mfma_f32_16x16x32_fp8_fp8"),
    )
    assert_equal(
        amdhsa_field(asm, "private_segment_fixed_size"),
        0,
        String(what, ": scratch"),
    )
    assert_equal(
        amdhsa_field(asm, "group_segment_fixed_size"), 4 * mfma_words[H, D]()
    )


def test_scorer_gfx942_has_mfma_and_no_scratch() raises:
    # The op's own declaration of the launch, compiled for gfx942.
    _check_gfx942[32, 128](kernel_code[MfmaScore[Glm], "mi300x"]())
    _check_gfx942[64, 128](kernel_code[MfmaScore[Dsv], "mi300x"]())


def mfma_probe(
    a: Ptr[DType.uint64], b: Ptr[DType.uint64], regs: Ptr[DType.float32]
):
    """One wave: lane `l` loads its A and B words, one MFMA, registers out.

    A GPU body only (the host build of this module sees none of it).
    """
    comptime if is_amd_gpu():
        var lane = Int(thread_idx.x)
        var c = SIMD[DType.float32, 4](0.5, 0, -1, 2)
        var d = SIMD[DType.float32, 4](0)
        mma(
            d,
            bitcast[DType.float8_e4m3fnuz, 8](a[unsafe_offset=lane]),
            bitcast[DType.float8_e4m3fnuz, 8](b[unsafe_offset=lane]),
            c,
        )
        regs.unsafe_offset(4 * lane).unsafe_store[width=4](0, d)


def test_mfma_probe_compiles_for_gfx942() raises:
    var asm = _compile_code[mfma_probe, target=get_gpu_target["mi300x"]()]().asm
    assert_equal(asm.count("v_mfma_f32_16x16x32_fp8_fp8"), 1)


def test_hardware_equals_the_model_on_mi300() raises:
    comptime if not has_accelerator():
        raise Error("needs an MI300 GPU: main skips this test without one")
    else:
        var ctx = DeviceContext()
        if not _runs_here(ctx):
            raise Error("needs an MI300 GPU, this is ", ctx.name())
        var want = _model_registers()
        var wa = _operands(0)
        var wb = _operands(1)
        var a = ctx.enqueue_create_buffer[DType.uint64](64)
        var b = ctx.enqueue_create_buffer[DType.uint64](64)
        var out = ctx.enqueue_create_buffer[DType.float32](64 * 4)
        with a.map_to_host() as host:
            for i in range(64):
                host[i] = wa[i]
        with b.map_to_host() as host:
            for i in range(64):
                host[i] = wb[i]
        ctx.enqueue_function[mfma_probe](
            a.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            b.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            grid_dim=1,
            block_dim=64,
        )
        ctx.synchronize()
        var mismatches = 0
        with out.map_to_host() as host:
            for i in range(64 * 4):
                if host[i] != want[i]:
                    if mismatches < 8:
                        var at = mfma_accumulator_element(i // 4, i % 4)
                        print(
                            "lane",
                            i // 4,
                            "reg",
                            i % 4,
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
    """Whether this GPU is an MI300 GPU, whose registers the model is."""
    return "MI300" in ctx.name()


def main() raises:
    var here = False
    comptime if has_accelerator():
        here = _runs_here(DeviceContext())
    var suite = TestSuite.discover_tests[__functions_in_module()]()
    # Where the hardware comparison cannot run it is reported as skipped
    # (the pytest wrapper counts it so), never passed unrun.
    if not here:
        suite.skip[test_hardware_equals_the_model_on_mi300]()
    suite^.run()
