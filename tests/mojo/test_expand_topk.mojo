"""Guarded-memory fuzz of expand_topk's CPU kernel and its emulated GPU grid.

Runs without a GPU (`mojo run -I . tests/mojo/test_expand_topk.mojo`);
`tests/writers/test_expand_topk.py` runs it under pytest. A graph cannot guard
an op's output (MAX allocates it), so this calls the kernel functions directly
with the output inside a larger buffer whose guard regions hold a sentinel,
and checks, over seeded random calls with broken metadata mixed in:

- the guards are untouched (no out-of-bounds write) and every output
  element was written (none still holds the sentinel);
- the CPU kernel and the GPU kernel's threads (emulated) agree
  element for element, whatever the metadata;
- each row is packed: non-negative positions, then only `-1`.

The values themselves are checked against the NumPy oracle in Python.
"""

from max.gpu.host import DeviceContext
from std.testing import TestSuite, assert_equal, assert_true

from kernels.writers.expand_topk import (
    GPU_EXPAND_SHARED_IDS,
    ExpandTopKOperands,
    expand_topk_cpu,
    launch_expand_topk,
    row_width,
)
from kernels.grid.ragged import Ptr

comptime SENTINEL = Int32(0x5A5A5A5A)
comptime GUARD = 67
comptime U32 = DType.uint32
comptime I32 = DType.int32
comptime I64 = DType.int64


struct Rng(Movable):
    """A xorshift64* generator: seeded, no dependency on std.random."""

    var state: UInt64

    def __init__(out self, seed: Int):
        self.state = UInt64(seed) * 0x9E3779B97F4A7C15 + 1

    def next(mut self) -> Int:
        self.state ^= self.state >> 12
        self.state ^= self.state << 25
        self.state ^= self.state >> 27
        return Int((self.state * 0x2545F4914F6CDD1D) >> 33)

    def below(mut self, n: Int) -> Int:
        return self.next() % n


def _ptr[dtype: DType](values: List[Scalar[dtype]]) -> Ptr[dtype]:
    return Ptr[dtype](unsafe_from_address=Int(values.unsafe_ptr()))


def _fuzz[
    pool_dtype: DType,
    index_dtype: DType,
    kpool: Int,
    pool_topk: Int,
    always_select_tail: Bool,
](seed: Int, calls: Int) raises:
    comptime width = row_width[kpool, pool_topk, always_select_tail]()
    var ctx = DeviceContext(api="cpu")
    var rng = Rng(seed)
    var written = 0
    for call in range(calls):
        var label = String(
            "seed ", seed, " call ", call, " kpool ", kpool, " topk ", pool_topk
        )
        var batch = rng.below(6)
        var offsets = List[Scalar[index_dtype]]()
        var cache = List[Scalar[index_dtype]]()
        var total = 0
        offsets.append(0)
        for _ in range(batch):
            total += rng.below(9)
            offsets.append(Scalar[index_dtype](total))
            var c = rng.below(40)
            if rng.below(8) == 0:
                # Near the int32 position limit, or (uint32) past it.
                c = (1 << 31) - 1 - rng.below(12)
                comptime if index_dtype == U32:
                    if rng.below(2) == 0:
                        c = (1 << 32) - 1 - rng.below(12)
            cache.append(Scalar[index_dtype](c))
        var total_tokens = total + rng.below(3)
        if batch > 0 and rng.below(4) == 0:
            # Break the metadata: a decreasing or out-of-range offset.
            var b = 1 + rng.below(batch)
            offsets[b] = Scalar[index_dtype](
                rng.below(total_tokens + 6) if rng.below(2) else total + 50
            )
        var ids = List[Scalar[pool_dtype]]()
        for _ in range(total_tokens * pool_topk):
            var r = rng.below(16)
            var p = rng.below(14) - 2
            if r == 0:
                p = -1
            elif r == 1:
                p = (1 << 30) + rng.below(5)
            ids.append(Scalar[pool_dtype](p))

        var size = total_tokens * width
        var cpu = List[Int32](length=size + 2 * GUARD, fill=SENTINEL)
        var gpu = List[Int32](length=size + 2 * GUARD, fill=SENTINEL)
        comptime Op = ExpandTopKOperands[
            pool_dtype,
            index_dtype,
            index_dtype,
            kpool,
            pool_topk,
            always_select_tail,
            MutAnyOrigin,
        ]
        expand_topk_cpu(
            Op(
                _ptr(cpu).unsafe_offset(GUARD),
                _ptr(ids),
                _ptr(offsets),
                _ptr(cache),
                batch,
                total_tokens,
            )
        )

        launch_expand_topk[True](
            Op(
                _ptr(gpu).unsafe_offset(GUARD),
                _ptr(ids),
                _ptr(offsets),
                _ptr(cache),
                batch,
                total_tokens,
            ),
            ctx,
        )
        for i in range(GUARD):
            assert_equal(cpu[i], SENTINEL, String("CPU wrote before, ", label))
            assert_equal(gpu[i], SENTINEL, String("GPU wrote before, ", label))
            assert_equal(
                cpu[GUARD + size + i],
                SENTINEL,
                String("CPU wrote after, ", label),
            )
            assert_equal(
                gpu[GUARD + size + i],
                SENTINEL,
                String("GPU wrote after, ", label),
            )
        for t in range(total_tokens):
            var padding = False
            for col in range(width):
                var i = GUARD + t * width + col
                var at = String(label, " row ", t, " col ", col)
                assert_true(cpu[i] != SENTINEL, String("unwritten, ", at))
                assert_equal(cpu[i], gpu[i], String("CPU vs GPU, ", at))
                if cpu[i] < 0:
                    assert_equal(cpu[i], -1, at)
                    padding = True
                else:
                    assert_true(not padding, String("not packed, ", at))
                    written += 1
    # Most rows expand something: the fuzz is not all padding.
    assert_true(
        written > calls * width // 8 or width == 0,
        String("only ", written, " positions over ", calls, " calls"),
    )


def test_production_shape_uint32() raises:
    _fuzz[I32, U32, 4, 512, True](1, 60)


def test_kpool_1_int32() raises:
    _fuzz[I32, I32, 1, 8, True](2, 300)


def test_no_tail_int64() raises:
    _fuzz[I64, I64, 3, 5, False](3, 300)


def test_wide_pool_and_zero_width() raises:
    _fuzz[I32, U32, 128, 3, True](4, 100)
    # pool_topk 0 without the tail: rows of no columns, nothing to write.
    _fuzz[I32, U32, 2, 0, False](5, 50)


def test_rows_past_the_shared_ids() raises:
    # More ids a row than the compacting kernel holds: the warp kernel.
    _fuzz[I32, U32, 1, GPU_EXPAND_SHARED_IDS + 1, False](6, 6)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
