"""Compiles each GPU writer to PTX and AMDGCN and checks its launch shape.

Runs without a GPU (`mojo run -I . tests/mojo/test_gpu_kernels.mojo`);
`tests/grid/test_gpu_kernels.py` runs it under pytest. The launch shape is the
contract the kernels' indexing relies on: ring_close, seed_tail and compress
give a thread 16 bytes of a row's channels and pack whole rows into blocks
of 64 threads (a row of more than 1024 threads' channels strides); the
fused step launches one block of 1024 threads for the scan, then its
requests and output rows the same way; expand_topk launches a block per
token row, an id a thread up to 256 threads in whole 64-thread groups, and
a warp per row past 8,192 ids.
"""

from max.gpu.host import DeviceContext
from std.testing import TestSuite, assert_equal, assert_true

from kernels.grid.block_phases import Shared
from kernels.writers.compress import CompressKernel, CompressOperands
from kernels.writers.expand_topk import (
    GPU_EXPAND_SHARED_IDS,
    ExpandTopKKernel,
    ExpandTopKOperands,
    ExpandTopKWarpKernel,
    row_width,
)
from kernels.grid.gpu_kernel import (
    GpuKernel,
    grid_blocks,
    kernel_code,
    launch_kernel,
)
from kernels.grid.operands import KernelOperands
from kernels.grid.parallel import check_launch, emulate_grid
from kernels.writers.ring_close import RingCloseKernel, RingCloseOperands
from kernels.writers.seed_tail import SeedTailKernel, SeedTailOperands
from kernels.writers.step import StepKernel, StepOperands, StepScanKernel

comptime U32 = DType.uint32
comptime BF16 = DType.bfloat16
comptime Any = MutAnyOrigin

# The instances compiled below: each op's own declaration at these types.
comptime RingClose = RingCloseOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime Compress = CompressOperands[BF16, U32, U32, U32, 128, 1088, Any]
comptime SeedTail = SeedTailOperands[DType.float16, U32, U32, U32, 16, 64, Any]
comptime Step = StepOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime WideStep = StepOperands[BF16, U32, U32, U32, 4, 1088, Any]
comptime Expand = ExpandTopKOperands[DType.int32, U32, U32, 4, 512, True, Any]
comptime ExpandWide = ExpandTopKOperands[
    DType.int32, U32, U32, 1, GPU_EXPAND_SHARED_IDS + 1, False, Any
]


def _check_asm(asm: String, target: StaticString, name: StaticString) raises:
    # Entry names are the declaration's kernel name and a hash of the
    # instance: `kpool_ring_close_kernel_<hash>`.
    assert_true(
        String(".entry ", name) in asm,
        String("no entry ", name, "... in the ", target, " code"),
    )


def _compile_all[arch: StaticString]() raises -> List[String]:
    var out = List[String]()
    out.append(kernel_code[RingCloseKernel[RingClose], arch]())
    out.append(kernel_code[CompressKernel[Compress], arch]())
    out.append(kernel_code[SeedTailKernel[SeedTail], arch]())
    out.append(kernel_code[StepScanKernel[Step], arch]())
    out.append(kernel_code[StepKernel[WideStep], arch]())
    out.append(kernel_code[ExpandTopKKernel[Expand], arch]())
    out.append(kernel_code[ExpandTopKWarpKernel[ExpandWide], arch]())
    return out^


def test_ptx_sm_90a() raises:
    var asm = _compile_all["sm_90a"]()
    for a in asm:
        assert_true(".target sm_90a" in a, "not sm_90a PTX")
    _check_asm(asm[0], "sm_90a", "kpool_ring_close_kernel_")
    _check_asm(asm[1], "sm_90a", "kpool_compress_kernel_")
    _check_asm(asm[2], "sm_90a", "kpool_seed_tail_kernel_")
    _check_asm(asm[3], "sm_90a", "kpool_step_scan_kernel_")
    _check_asm(asm[4], "sm_90a", "kpool_step_kernel_")
    _check_asm(asm[5], "sm_90a", "kpool_expand_topk_kernel_")
    _check_asm(asm[6], "sm_90a", "kpool_expand_topk_warp_kernel_")


def test_the_gpu_build_records_nothing() raises:
    # The writers' global accesses go through the thread's view, recorded
    # only by a profiled emulation: a GPU build has no call, nothing of the
    # profile, and still its plain global loads and stores.
    for a in _compile_all["sm_90a"]():
        assert_true("call" not in a, a)
        assert_true("LaunchProfile" not in a and "record" not in a, a)
        assert_true("ld.global" in a and "st.global" in a, a)


def test_ptx_sm_100a() raises:
    var asm = _compile_all["sm_100a"]()
    for a in asm:
        assert_true(".target sm_100a" in a, "not sm_100a PTX")
    _check_asm(asm[0], "sm_100a", "kpool_ring_close_kernel_")
    _check_asm(asm[1], "sm_100a", "kpool_compress_kernel_")
    _check_asm(asm[2], "sm_100a", "kpool_seed_tail_kernel_")
    _check_asm(asm[3], "sm_100a", "kpool_step_scan_kernel_")
    _check_asm(asm[4], "sm_100a", "kpool_step_kernel_")
    _check_asm(asm[5], "sm_100a", "kpool_expand_topk_kernel_")
    _check_asm(asm[6], "sm_100a", "kpool_expand_topk_warp_kernel_")


def test_amdgcn_gfx942() raises:
    var asm = _compile_all["gfx942"]()
    for a in asm:
        assert_true("gfx942" in a, "not gfx942 code")


def test_block_threads() raises:
    # 4 channels a thread (16 bytes of float32 ape), rows packed into
    # blocks of 64 threads, a row over 1024 threads' channels strides.
    assert_equal(RingCloseKernel[RingClose].block_threads, 64)
    assert_equal(RingCloseKernel[RingClose].rows_per_block, 2)
    comptime Wide = RingCloseKernel[
        RingCloseOperands[BF16, U32, U32, U32, 4, 1088, Any]
    ]
    assert_equal(Wide.block_threads, 272)
    assert_equal(Wide.rows_per_block, 1)
    comptime OddWide = RingCloseKernel[
        RingCloseOperands[DType.float32, U32, U32, U32, 4, 2049, Any]
    ]
    assert_equal(OddWide.block_threads, 1024)
    assert_equal(OddWide.rows_per_block, 1)
    comptime Single = SeedTailKernel[
        SeedTailOperands[BF16, U32, U32, U32, 1, 1, Any]
    ]
    assert_equal(Single.block_threads, 64)
    assert_equal(Single.rows_per_block, 64)
    # float16 x 96: 4 channels a thread, 24 threads a row, 2 rows a block.
    comptime F16Rows = CompressKernel[
        CompressOperands[DType.float16, U32, U32, U32, 4, 96, Any]
    ]
    assert_equal(F16Rows.block_threads, 48)
    assert_equal(F16Rows.rows_per_block, 2)
    # The fused step: one block of 1024 threads scans (a block prefix sum,
    # so whole warps), then rows of requests and pools.
    assert_equal(StepScanKernel[Step].block_threads, 1024)
    assert_equal(StepKernel[WideStep].block_threads, 272)
    assert_equal(StepKernel[Step].rows_per_block, 2)
    # expand_topk: a block per token row, an id a thread up to 256 threads,
    # whole 64-thread groups; past the shared ids' limit a warp per row.
    assert_equal(row_width[4, 512, True](), 2051)
    assert_equal(ExpandTopKKernel[Expand].block_threads, 256)
    assert_equal(ExpandTopKKernel[Expand].shared_words, 513)
    assert_equal(
        ExpandTopKKernel[
            ExpandTopKOperands[DType.int32, U32, U32, 1, 8, True, Any]
        ].block_threads,
        64,
    )
    assert_equal(ExpandTopKWarpKernel[ExpandWide].block_threads, 32)


@fieldwise_init
struct _Counts[origin: MutOrigin](KernelOperands):
    """A test kernel's operands: a counter per (block, thread)."""

    var hits: Pointer[Int, Self.origin]
    var rows: Int
    var columns: Int


struct _Tiled(GpuKernel):
    """A kernel of 4 threads over `ceil(rows / 3) * ceil(columns / 2)`
    blocks, counting each thread's runs."""

    comptime Operands = _Counts[MutAnyOrigin]
    comptime name = "test_tiled_kernel"
    comptime block_threads = 4
    comptime grid_rows = "rows"
    comptime rows_per_block = 3
    comptime grid_columns = "columns"
    comptime columns_per_block = 2

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        return op.rows

    @staticmethod
    def columns(op: Self.Operands) -> Int:
        return op.columns

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        op.hits[unsafe_offset=block * 4 + thread] += 1


def _run_tiled(rows: Int, columns: Int, want_blocks: Int) raises:
    var hits = List[Int](length=64, fill=0)
    var op = _Counts[MutAnyOrigin](
        hits.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](), rows, columns
    )
    assert_equal(grid_blocks[_Tiled](op), want_blocks)
    launch_kernel[_Tiled, True](op, DeviceContext(api="cpu"))
    for i in range(64):
        assert_equal(hits[i], 1 if i < 4 * want_blocks else 0, String(i))


def test_grid_rule() raises:
    # ceil(rows / rows_per_block) * ceil(columns / columns_per_block).
    _run_tiled(7, 3, 6)
    _run_tiled(3, 2, 1)
    _run_tiled(1, 5, 3)
    # An empty batch (no rows, or no columns) launches nothing: a GPU
    # refuses an empty grid.
    _run_tiled(0, 5, 0)
    _run_tiled(4, 0, 0)


def test_emulator_runs_every_thread_once_in_descending_order() raises:
    var counts = List[Int](length=15, fill=0)
    var order = List[Int]()
    var counts_ptr = counts.unsafe_ptr()
    var order_ptr = UnsafePointer(to=order)

    def body(block: Int, thread: Int) {imm}:
        counts_ptr[unsafe_offset=block * 5 + thread] += 1
        order_ptr[].append(block * 5 + thread)

    emulate_grid("test_kernel", 3, 5, body)
    for i in range(15):
        assert_equal(counts[i], 1)
    assert_equal(order[0], 14)
    assert_equal(order[14], 0)


def _refused(grid: Int, block: Int, message: StaticString) raises:
    var ran = List[Int](length=1, fill=0)
    var ran_ptr = ran.unsafe_ptr()

    def body(block: Int, thread: Int) {imm}:
        ran_ptr[unsafe_offset=0] += 1

    try:
        emulate_grid("test_kernel", grid, block, body)
    except e:
        assert_true(message in String(e), String(e))
        assert_equal(ran[0], 0)
        return
    raise Error("emulate_grid accepted grid=", grid, " block=", block)


def test_emulator_refuses_what_a_gpu_launch_refuses() raises:
    _refused(0, 128, "test_kernel: empty grid")
    _refused(4, 1025, "block_dim=1025")
    _refused(4, 0, "block_dim=0")
    _refused(1 << 31, 1, "exceeds 2^31 - 1")
    # The largest legal shapes pass the check (nothing is run for them).
    check_launch("test_kernel", (1 << 31) - 1, 1024)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
