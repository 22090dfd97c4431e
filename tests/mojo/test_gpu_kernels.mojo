"""Compiles each GPU writer to PTX and AMDGCN and checks its launch shape.

Runs without a GPU (`mojo run -I . tests/mojo/test_gpu_kernels.mojo`);
`tests/test_gpu_kernels.py` runs it under pytest. The launch shape is the
contract the kernels' indexing relies on: one block per request (ring_close,
seed_tail) or per output row (compress), `min(head_dim, 1024)` threads; the
fused step launches one thread for the scan, then a block per request and
per output row; expand_topk launches a block per token row of one warp
(fewer threads for rows narrower than 32 columns).
"""

from max.gpu.host import get_gpu_target
from max.gpu.host.compile import _compile_code
from std.testing import TestSuite, assert_equal, assert_true

from kernels.compress import (
    CompressOperands,
    compress_launch,
    compress_thread,
)
from kernels.expand_topk import (
    ExpandTopKOperands,
    expand_topk_launch,
    expand_topk_thread,
    row_width,
)
from kernels.parallel import check_launch, emulate_grid, gpu_kernel
from kernels.ring_close import (
    RingCloseOperands,
    ring_close_launch,
    ring_close_thread,
)
from kernels.seed_tail import (
    SeedTailOperands,
    seed_tail_launch,
    seed_tail_thread,
)
from kernels.step import (
    StepOperands,
    step_launch,
    step_scan_launch,
    step_scan_thread,
    step_thread,
)

comptime U32 = DType.uint32
comptime BF16 = DType.bfloat16
comptime Any = MutAnyOrigin

# The instances compiled below, and thread bodies of their exact types (what
# each op's `execute` passes to `launch`).
comptime RingClose = RingCloseOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime Compress = CompressOperands[BF16, U32, U32, U32, 128, 1088, Any]
comptime SeedTail = SeedTailOperands[DType.float16, U32, U32, U32, 16, 64, Any]
comptime Step = StepOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime WideStep = StepOperands[BF16, U32, U32, U32, 4, 1088, Any]
comptime Expand = ExpandTopKOperands[DType.int32, U32, U32, 4, 512, True, Any]


def _ring_close(block: Int, thread: Int, op: RingClose):
    ring_close_thread(block, thread, op)


def _compress(block: Int, thread: Int, op: Compress):
    compress_thread(block, thread, op)


def _seed_tail(block: Int, thread: Int, op: SeedTail):
    seed_tail_thread(block, thread, op)


def _step_scan(block: Int, thread: Int, op: Step):
    step_scan_thread(block, thread, op)


def _step(block: Int, thread: Int, op: WideStep):
    step_thread(block, thread, op)


def _expand(block: Int, thread: Int, op: Expand):
    expand_topk_thread(block, thread, op)


def _check_asm(asm: String, target: StaticString, name: StaticString) raises:
    # Entry names are the kernel name `launch` was given and a hash of the
    # instance: `kpool_ring_close_kernel_<hash>`.
    assert_true(
        String(".entry ", name) in asm,
        String("no entry ", name, "... in the ", target, " code"),
    )


def _compile_all[arch: StaticString]() raises -> List[String]:
    var out = List[String]()
    out.append(
        String(
            _compile_code[
                gpu_kernel["kpool_ring_close_kernel", RingClose, _ring_close],
                target=get_gpu_target[arch](),
            ]()
        )
    )
    out.append(
        String(
            _compile_code[
                gpu_kernel["kpool_compress_kernel", Compress, _compress],
                target=get_gpu_target[arch](),
            ]()
        )
    )
    out.append(
        String(
            _compile_code[
                gpu_kernel["kpool_seed_tail_kernel", SeedTail, _seed_tail],
                target=get_gpu_target[arch](),
            ]()
        )
    )
    out.append(
        String(
            _compile_code[
                gpu_kernel["kpool_step_scan_kernel", Step, _step_scan],
                target=get_gpu_target[arch](),
            ]()
        )
    )
    out.append(
        String(
            _compile_code[
                gpu_kernel["kpool_step_kernel", WideStep, _step],
                target=get_gpu_target[arch](),
            ]()
        )
    )
    out.append(
        String(
            _compile_code[
                gpu_kernel["kpool_expand_topk_kernel", Expand, _expand],
                target=get_gpu_target[arch](),
            ]()
        )
    )
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


def test_amdgcn_gfx942() raises:
    var asm = _compile_all["gfx942"]()
    for a in asm:
        assert_true("gfx942" in a, "not gfx942 code")


def test_launch_shapes() raises:
    # One block per request / output row; one thread per channel up to 1024.
    var rc = ring_close_launch[128](4096)
    assert_equal(rc[0], 4096)
    assert_equal(rc[1], 128)
    var wide = ring_close_launch[1088](3)
    assert_equal(wide[0], 3)
    assert_equal(wide[1], 1024)
    var narrow = seed_tail_launch[1](7)
    assert_equal(narrow[0], 7)
    assert_equal(narrow[1], 1)
    var comp = compress_launch[96](250)
    assert_equal(comp[0], 250)
    assert_equal(comp[1], 96)
    # The fused step: one thread scans, then a block per request and row.
    assert_equal(step_scan_launch()[0], 1)
    assert_equal(step_scan_launch()[1], 1)
    var step = step_launch[1088](5, 12)
    assert_equal(step[0], 17)
    assert_equal(step[1], 1024)
    # expand_topk: a block per token row, one warp (MAX's width 2051).
    var expand = expand_topk_launch[row_width[4, 512, True]()](300)
    assert_equal(expand[0], 300)
    assert_equal(expand[1], 32)
    var short = expand_topk_launch[row_width[1, 8, True]()](5)
    assert_equal(short[0], 5)
    assert_equal(short[1], 8)
    # No token rows, or rows of no columns: an empty grid, never launched.
    assert_equal(expand_topk_launch[row_width[4, 512, True]()](0)[0], 0)
    assert_equal(expand_topk_launch[row_width[1, 0, True]()](7)[0], 0)


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


def test_empty_batches_launch_empty_grids() raises:
    # What `launch` skips instead of handing to the GPU.
    assert_equal(ring_close_launch[128](0)[0], 0)
    assert_equal(seed_tail_launch[128](0)[0], 0)
    assert_equal(compress_launch[128](0)[0], 0)
    assert_equal(step_launch[128](0, 0)[0], 0)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
