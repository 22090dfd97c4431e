"""The operand structs' layout check, on the real structs and on made-up ones.

Runs without a GPU (`mojo run -I . tests/mojo/test_operand_layout.mojo`);
`tests/writers/test_operand_layout.py` runs it under pytest, and also builds
`operand_layout_refused.mojo`, whose struct with a 4-byte field must fail
the build.
"""

from max.gpu.host import DeviceContext
from std.sys import size_of
from std.testing import TestSuite, assert_equal

from kernels.writers.compress import CompressOperands
from kernels.writers.expand_topk import ExpandTopKOperands
from kernels.grid.operands import KernelOperands, kernel_words
from kernels.grid.parallel import launch
from kernels.grid.ragged import Field
from kernels.writers.ring_close import RingCloseOperands
from kernels.writers.seed_tail import SeedTailOperands
from kernels.writers.step import StepOperands

comptime U32 = DType.uint32
comptime I64 = DType.int64
comptime BF16 = DType.bfloat16
comptime Any = MutAnyOrigin


@fieldwise_init
struct WideOperands[origin: MutOrigin](KernelOperands):
    """A pointer, an `Int` and an `Int64`: accepted."""

    var out: Field[DType.float32, Self.origin]
    """Output `[count]`."""
    var count: Int
    """Entries."""
    var scale: Int64
    """Written to every entry."""


@fieldwise_init
struct Padded:
    """An `Int` and a `Bool`: 16 bytes, but not 8-byte words."""

    var n: Int
    var flag: Bool


@fieldwise_init
struct Nested:
    """A nested `Padded` and an `Int32`: its leaves are not all 8 bytes."""

    var pair: Padded
    var halves: SIMD[DType.int32, 1]


def test_real_operand_structs_are_all_words() raises:
    # Pointers and sizes, each one 8-byte word (the step nests ring_close's
    # 13 words and adds three pointers and a row count).
    comptime RC = RingCloseOperands[BF16, U32, U32, I64, 4, 128, Any]
    assert_equal(kernel_words[RC](), 13)
    assert_equal(size_of[RC](), 13 * 8)
    comptime C = CompressOperands[BF16, U32, U32, U32, 4, 128, Any]
    assert_equal(kernel_words[C](), 10)
    assert_equal(size_of[C](), 10 * 8)
    comptime S = SeedTailOperands[DType.float16, U32, I64, U32, 16, 64, Any]
    assert_equal(kernel_words[S](), 10)
    assert_equal(size_of[S](), 10 * 8)
    comptime E = ExpandTopKOperands[DType.int32, U32, U32, 4, 512, True, Any]
    assert_equal(kernel_words[E](), 6)
    assert_equal(size_of[E](), 6 * 8)
    comptime St = StepOperands[BF16, U32, U32, U32, 4, 128, Any]
    assert_equal(kernel_words[St](), 17)
    assert_equal(size_of[St](), 17 * 8)


def test_narrow_fields_are_not_words() raises:
    assert_equal(kernel_words[WideOperands[Any]](), 3)
    assert_equal(kernel_words[Int32](), -1)
    assert_equal(kernel_words[Padded](), -1)
    assert_equal(kernel_words[Nested](), -1)


def _fill(block: Int, thread: Int, op: WideOperands[Any]):
    if block < op.count:
        op.out[unsafe_offset=block] = Float32(op.scale + Int64(thread))


def test_an_all_word_struct_launches() raises:
    # The positive twin of operand_layout_refused.mojo: same launch, Int64.
    var out = List[Float32](length=3, fill=-1)
    var op = WideOperands[Any](
        Field[DType.float32, Any](unsafe_from_address=Int(out.unsafe_ptr())),
        2,
        7,
    )
    launch["wide_kernel", _fill, True](op, (3, 1), DeviceContext(api="cpu"))
    assert_equal(out[0], 7)
    assert_equal(out[1], 7)
    assert_equal(out[2], -1)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
