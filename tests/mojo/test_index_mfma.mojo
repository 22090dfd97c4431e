"""The MFMA scorer's phases on the emulated grid, exact.

Two query rows of one request score 70 and 40 candidates (the last tile
partly empty) through `emulate_phases`, every shared-memory access
checked, at two shapes: 40 heads (three head chunks, the last 8 heads
padding) of depth 48 (two instructions per chunk, lane groups 2 and 3
partly and wholly padding), and 16 heads of depth 132 (five
instructions; keys at odd candidates unaligned, so the byte loads run).
Inputs are small integers in e4m3fn, `0x80` (-0, e4m3fnuz's NaN) among
them, and the weights and scales small powers of two, so every score is
exact in float32 whatever the order of the sums, and each must equal the
host's product over the e4m3fn values exactly: the e4m3fn -> e4m3fnuz
byte mapping (halved values, times 4, `0x80` cleared) included.
"""

from std.testing import TestSuite, assert_equal

from kernels.block_phases import Shared, emulate_phases
from kernels.index_fp8 import decode_e4m3
from kernels.index_mfma import (
    MFMA_THREADS,
    index_mfma_phase,
    mfma_phases,
    mfma_tiles,
    mfma_words,
)
from kernels.index_operands import IndexOperands

comptime PAGE = 256
comptime CANDIDATES = 70
comptime U32 = DType.uint32


def _byte(i: Int, salt: Int) -> UInt8:
    """A small e4m3fn integer (0, -0, +-1 .. +-4)."""
    comptime codes = SIMD[DType.uint8, 8](
        0x00, 0x38, 0x40, 0x44, 0x48, 0xB8, 0xC0, 0x80
    )
    return codes[(i * 5 + salt * 3 + i // 7) % 8]


def _f(b: UInt8) -> Float32:
    return decode_e4m3[1](SIMD[DType.uint8, 1](b))[0]


def _scores_are_exact[H: Int, D: Int]() raises:
    comptime T = 2
    comptime Op = IndexOperands[
        U32, U32, U32, U32, H, D, 16, 1, True, False, MutAnyOrigin
    ]
    var q = List[UInt8](length=T * H * D, fill=0)
    for i in range(len(q)):
        q[i] = _byte(i, 1)
    var qs = List[Float32](length=T * H, fill=0.0)
    for i in range(len(qs)):
        qs[i] = Float32(1 << (i % 3)) * Float32(1 if i % 5 else -1)
    var keys = List[UInt8](length=PAGE * D, fill=0)
    for i in range(len(keys)):
        keys[i] = _byte(i, 2)
    var scales = List[Float32](length=PAGE, fill=0.0)
    for j in range(PAGE):
        scales[j] = 0.5 if j % 2 else 1.0
    var offsets: List[UInt32] = [0, UInt32(T)]
    var lengths: List[UInt32] = [UInt32(CANDIDATES - 1)]
    var table: List[UInt32] = [0]
    var output = List[Int32](length=T * 16, fill=-1)
    var plan: List[Int64] = [0, CANDIDATES, 0, 40]
    var scores = List[Float32](length=T * CANDIDATES, fill=-1.0)
    var op = Op(
        output.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        q.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        qs.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        offsets.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        keys.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        lengths.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        table.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        scales.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        table.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        T,
        1,
        PAGE,
        1,
        1,
        1,
        1,
        PAGE * D,
        PAGE,
        0,
        0,
        plan.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        scores.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        CANDIDATES,
        0,
    )

    def body(p: Int, b: Int, t: Int, s: Shared) {imm}:
        index_mfma_phase(p, b, t, s, op)

    emulate_phases(
        "test_mfma",
        T * mfma_tiles(op),
        MFMA_THREADS,
        mfma_phases[H](),
        mfma_words[H, D](),
        body,
    )
    for t in range(T):
        var bound = Int(plan[2 * t + 1])
        for j in range(CANDIDATES):
            var got = scores[t * CANDIDATES + j]
            if j >= bound:
                assert_equal(got, -1.0, "a score past the bound was written")
                continue
            var want = Float32(0)
            for h in range(H):
                var dot = Float32(0)
                for d in range(D):
                    dot += _f(q[(t * H + h) * D + d]) * _f(keys[j * D + d])
                want += (Float32(0) if dot < 0 else dot) * qs[t * H + h]
            assert_equal(
                got,
                want * scales[j],
                String("H ", H, " D ", D, " row ", t, " id ", j),
            )
    _ = output^
    _ = q^
    _ = qs^
    _ = keys^
    _ = scales^
    _ = offsets^
    _ = lengths^
    _ = table^
    _ = plan^


def test_scores_are_exact_three_head_chunks() raises:
    _scores_are_exact[40, 48]()


def test_scores_are_exact_five_steps_unaligned_keys() raises:
    _scores_are_exact[16, 132]()


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
