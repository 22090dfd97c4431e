"""The indexer's GPU scorers in machine code: what the tuning relies on.

Compiles the FP32 scorer's declaration (`score.SimtScore`) for
sm_90a and sm_100a (PTX) and gfx942 (AMDGCN) at GLM-5-Next's shape (32
heads x 128 dims, kpool 4 spread over rows of 32 bytes) and
DeepSeek-V3.2's (64 heads x 128 dims, kpool 1), both tiled, and at 128
heads x 128 dims, whose query is too large for shared memory (untiled),
no GPU needed,
and checks the PTX: no local memory (spills or a stack array), FP8 keys
decoded by the hardware's `cvt.rn.f16x2.e4m3x2`, keys read 16 bytes per
load, the tiled scorers' query read from shared memory 16 bytes per load;
and the gfx942 code: no scratch. Register counts and occupancy need
ptxas (`mla_kpool gpu-report`). Run: `mojo run -I . <this file>`.
"""

from std.memory import bitcast
from std.testing import TestSuite, assert_equal, assert_false, assert_true

from asm_fields import amdhsa_field

from kernels.grid.gpu_kernel import kernel_code
from kernels.index.fp8 import decode_e4m3
from kernels.index.gpu.score import SimtScore
from kernels.index.gpu.shape import (
    SCORE_THREADS,
    score_threads,
    tile_words,
)
from kernels.index.operands import IndexOperands

comptime U32 = DType.uint32
comptime Glm = IndexOperands[
    U32, U32, U32, U32, 32, 128, 512, 4, True, True, MutAnyOrigin
]
comptime Dsv = IndexOperands[
    U32, U32, U32, U32, 64, 128, 2048, 1, True, False, MutAnyOrigin
]
comptime Wide = IndexOperands[
    U32, U32, U32, U32, 128, 128, 2048, 1, True, False, MutAnyOrigin
]


def _scorers[arch: StaticString]() raises -> List[String]:
    """Tiled GLM, tiled DSV, untiled 128-head code for `arch`."""
    var out = List[String]()
    out.append(kernel_code[SimtScore[Glm], arch]())
    out.append(kernel_code[SimtScore[Dsv], arch]())
    out.append(kernel_code[SimtScore[Wide], arch]())
    return out^


def _check_ptx(asm: String, arch: StaticString, what: StaticString) raises:
    """The PTX facts every scorer must show."""
    var at = String(arch, " ", what)
    assert_true(String(".target ", arch) in asm, String(at, ": wrong target"))
    # Spills and stack arrays are `.local`; a scorer needs neither.
    assert_false(".local" in asm, String(at, ": local memory"))
    assert_false("ld.local" in asm, String(at, ": ld.local"))
    assert_false("st.local" in asm, String(at, ": st.local"))
    # The hardware FP8 decode, not the integer one.
    assert_true(
        "cvt.rn.f16x2.e4m3x2" in asm,
        String(at, ": no cvt.rn.f16x2.e4m3x2 (software e4m3 decode?)"),
    )
    # Aligned keys are read 16 bytes per load (byte loads remain for the
    # unaligned fallback and the query).
    assert_true(
        "ld.global.v4.b32" in asm or "ld.global.nc.v4.b32" in asm,
        String(at, ": no 16-byte key load"),
    )
    # No integer decode left: it multiplied a subnormal's mantissa by 2^-9.
    assert_false("0f3B000000" in asm, String(at, ": software decode"))


def _check_ptx_all[arch: StaticString]() raises:
    var asm = _scorers[arch]()
    _check_ptx(asm[0], arch, "tiled 32x128")
    _check_ptx(asm[1], arch, "tiled 64x128")
    _check_ptx(asm[2], arch, "untiled 128x128")
    # The tiled scorers read their query from shared memory 16 bytes per
    # load (`v4.b32` or `v2.b64`): a vector load split into scalars would
    # show 4-byte `ld.shared.f32` or `ld.shared.b32`.
    for i in range(2):
        assert_true(
            "ld.shared.v4" in asm[i] or "ld.shared.v2.b64" in asm[i],
            String(arch, ": no 16-byte ld.shared"),
        )
        for scalar in ["ld.shared.f32", "ld.shared.b32"]:
            assert_false(scalar in asm[i], String(arch, ": ", scalar))


def test_scorers_ptx_sm_90a() raises:
    _check_ptx_all["sm_90a"]()


def test_scorers_ptx_sm_100a() raises:
    _check_ptx_all["sm_100a"]()


def test_scorers_gfx942_no_scratch_and_lds() raises:
    var asm = _scorers["gfx942"]()
    for i in range(len(asm)):
        assert_equal(
            amdhsa_field(asm[i], "private_segment_fixed_size"),
            0,
            String("scorer ", i, " spills to scratch on gfx942"),
        )
    # The tiled scorers' LDS is the float32 query alone: 16 and 32 KiB,
    # with 4 and 8 waves per block (half of MI300X's 32 wave slots).
    assert_equal(amdhsa_field(asm[0], "group_segment_fixed_size"), 16384)
    assert_equal(amdhsa_field(asm[1], "group_segment_fixed_size"), 32768)


def test_score_block_threads() raises:
    # The declarations: tiled where the query fits, with its shared words.
    assert_true(SimtScore[Glm].tiled and SimtScore[Dsv].tiled)
    assert_false(SimtScore[Wide].tiled)
    assert_equal(SimtScore[Glm].block_threads, 256)
    assert_equal(SimtScore[Glm].shared_words, 32 * 128)
    assert_equal(SimtScore[Wide].block_threads, SCORE_THREADS)
    assert_equal(SimtScore[Wide].shared_words, 0)
    # A wave of 64 threads per 4 KiB of query; the untiled scorer's 128.
    assert_equal(score_threads[32, 128](), 256)
    assert_equal(score_threads[64, 128](), 512)
    assert_equal(score_threads[4, 16](), 128)
    assert_equal(score_threads[128, 16](), SCORE_THREADS)
    assert_equal(tile_words[32, 128](), 32 * 128)


def test_float8_cast_is_the_exact_decode() raises:
    # The NVIDIA path casts the bytes as float8_e4m3fn: the cast must give
    # what `decode_e4m3` gives for all 256 bytes (NaN for S.1111.111,
    # signed zeros, subnormals). Checked here on the host's cast; the PTX
    # test above checks that the GPU's compiles to the hardware cvt.
    for b in range(256):
        var byte = SIMD[DType.uint8, 1](UInt8(b))
        var cast = bitcast[DType.float8_e4m3fn, 1](byte).cast[DType.float32]()[
            0
        ]
        var want = decode_e4m3[1](byte)[0]
        if want != want:
            assert_true(cast != cast, String("byte ", b, ": not NaN"))
        else:
            assert_equal(
                bitcast[DType.uint32, 1](cast),
                bitcast[DType.uint32, 1](want),
                String("byte ", b),
            )


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
