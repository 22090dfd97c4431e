"""The phased-kernel emulation: exact for barrier-separated code, and strict.

A block sum written as two phases (each thread stores its value; thread 0
adds them after the barrier) must give every block's sum. The same sum with
the barrier left out (one phase) happens to give the right answer in the
emulation's thread order, so the test asserts that the emulation refuses it
by its shared-memory stamps, naming the phase, the threads and the word.
A read of a word nobody wrote, an overwrite of a word another thread read in
the same phase, and an index past the block's words fail the same way.
Finally the phased kernel compiles for sm_90a, sm_100a and gfx942 (barrier
and static shared memory included).
"""

from max.gpu.host import get_gpu_target
from max.gpu.host.compile import _compile_code
from std.testing import TestSuite, assert_equal, assert_true

from kernels.block_phases import Shared, emulate_phases, gpu_phased_kernel
from kernels.operands import KernelOperands
from kernels.ragged import Field, Ptr

comptime BLOCK = 8


def _value(b: Int, t: Int) -> UInt32:
    return UInt32(100 * b + t * t + 1)


def _expected(b: Int) -> UInt32:
    var total: UInt32 = 0
    for t in range(BLOCK):
        total += _value(b, t)
    return total


def _sum_phase(phase: Int, b: Int, t: Int, s: Shared, sums: Ptr[DType.uint32]):
    """Phase 0: store; phase 1: thread 0 adds the block's words."""
    if phase == 0:
        s.store(t, _value(b, t))
    elif t == 0:
        var total: UInt32 = 0
        for i in range(BLOCK):
            total += s.load(i)
        sums[unsafe_offset=b] = total


def _run(phases: Int, mut out: List[UInt32], broken: Int) raises -> String:
    """Runs the block sum; `broken` selects a planted fault (0: none)."""
    var ptr = out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()

    def body(p: Int, b: Int, t: Int, s: Shared) {imm}:
        if broken == 1:  # the barrier left out: store and add in one phase
            s.store(t, _value(b, t))
            if t == 0:
                var total: UInt32 = 0
                for i in range(BLOCK):
                    total += s.load(i)
                ptr[unsafe_offset=b] = total
        elif broken == 2 and p == 1 and t == 0:  # a word nobody wrote
            _ = s.load(BLOCK)
        elif broken == 3 and p == 1:  # read and overwritten in one phase
            if t == 0:
                _ = s.load(3)
            if t == 3:
                s.store(3, 7)
        elif broken == 4 and p == 0 and t == 5:
            s.store(BLOCK + 2, 1)
        else:
            _sum_phase(p, b, t, s, ptr)

    try:
        emulate_phases("block_sum", len(out), BLOCK, phases, BLOCK + 1, body)
    except e:
        return String(e)
    return String()


def test_two_phases_sum_every_block() raises:
    var out = List[UInt32](length=5, fill=0)
    assert_equal(_run(2, out, 0), "")
    for b in range(5):
        assert_equal(out[b], _expected(b))


def test_a_missing_barrier_is_refused() raises:
    var out = List[UInt32](length=3, fill=0)
    var error = _run(1, out, 1)
    # Descending thread order ran threads 7..1 before thread 0, so the sum
    # itself came out right: only the stamps can see the race.
    assert_equal(out[2], _expected(2))
    assert_true("missing barrier" in error, error)
    assert_true(
        "block_sum: block 2 phase 0 thread 0 read shared word 1 that thread"
        " 1 used in the same phase" in error,
        error,
    )


def test_an_unwritten_word_is_refused() raises:
    var out = List[UInt32](length=2, fill=0)
    var error = _run(2, out, 2)
    assert_true(
        "block 1 phase 1 thread 0 read shared word 8 before any thread wrote it"
        in error,
        error,
    )


def test_overwriting_a_word_read_in_the_same_phase_is_refused() raises:
    var out = List[UInt32](length=1, fill=0)
    var error = _run(2, out, 3)
    # Thread 3 runs first and writes; thread 0's read then sees the race.
    assert_true("phase 1" in error and "word 3" in error, error)
    assert_true("missing barrier" in error, error)


def test_an_index_past_the_shared_words_is_refused() raises:
    var out = List[UInt32](length=1, fill=0)
    var error = _run(2, out, 4)
    assert_true(
        "block 0 phase 0 thread 5 used shared word 10 out of range" in error,
        error,
    )


struct SumOperands[origin: MutOrigin](KernelOperands):
    """The block sum's one operand, for the GPU compile."""

    var sums: Field[DType.uint32, Self.origin]


comptime Sum = SumOperands[MutAnyOrigin]


def _sum_body(p: Int, b: Int, t: Int, s: Shared, op: Sum):
    _sum_phase(p, b, t, s, op.sums)


def _compile[arch: StaticString]() raises -> String:
    return String(
        _compile_code[
            gpu_phased_kernel["block_sum_kernel", Sum, BLOCK, _sum_body],
            target=get_gpu_target[arch](),
        ]()
    )


def test_the_phased_kernel_compiles_for_nvidia() raises:
    for asm in [_compile["sm_90a"](), _compile["sm_100a"]()]:
        assert_true(".entry block_sum_kernel_" in asm, "no kernel entry")
        assert_true("bar.sync" in asm, "no barrier in the PTX")
        assert_true(".shared" in asm, "no shared memory in the PTX")


def test_the_phased_kernel_compiles_for_amd() raises:
    var asm = _compile["gfx942"]()
    assert_true("gfx942" in asm, "not gfx942 code")
    assert_true("s_barrier" in asm, "no barrier in the AMDGCN")


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
