"""How the writers split work: CPU core ranges, GPU launches, emulated grids.

Each op gathers one call's operands into a struct (`RingCloseOperands`,
...), built once and passed whole to its CPU driver and to its GPU thread
body, a plain function of `(block, thread, operands)` that does one
thread's work. `launch` runs a thread body over a grid: on a GPU as
`gpu_kernel`, the kernel of every thread body (instantiated per op and
named after it, so a profile says which op ran), which calls the body with
`block_idx.x` and `thread_idx.x`; emulated, through `emulate_grid`, which
calls the same body on the CPU for every block and thread of the launch.
Kernels whose threads cooperate (phases, shared memory, collectives) run
as `gpu_kernel.gpu_block_kernel` and `gpu_kernel.emulate_kernel` instead;
an op launches either through its kernel's declaration
(`gpu_kernel.launch_kernel`).
Emulation therefore tests each thread's indexing and arithmetic, but not
how the operands reach a GPU (a by-value copy of the struct's bytes into
the kernel's argument buffer, which `KernelOperands` constrains at compile
time), nor real block scheduling, memory ordering or the GPU compiler's
code.
"""

from max.algorithm import sync_parallelize
from max.gpu import block_idx, thread_idx
from max.gpu.host import DeviceContext
from std.math import ceildiv, min
from std.sys import num_physical_cores

from .operands import KernelOperands, check_kernel_layout

comptime GPU_MAX_BLOCK = 1024
"""Largest block a GPU launch accepts; a writer's row wider than this many
threads' channels strides (`writers/gpu_rows`)."""

comptime GPU_MAX_GRID = (1 << 31) - 1
"""Largest x-dimension grid a GPU launch accepts (CUDA's and HIP's limit)."""

comptime CPU_MIN_PARALLEL_MEMBERS = 1 << 17
"""Element-members below which one core finishes before others could wake.

Inside a MAX graph, waking the runtime's worker threads costs about as
much as pooling 100-200 pools of 4 x 128 channels on one core, so
decode-sized calls stay on the calling thread (docs/performance.md)."""


def cpu_for_each_range[
    F: def(Int, Int) -> None
](count: Int, work: Int, body: F):
    """Runs `body(lo, hi)` over `[0, count)`, split across the cores.

    Contiguous ranges, one per physical core; the whole range on the
    calling thread when `work` (element-members touched) is too small to
    pay for waking the others.

    Args:
        count: Items (requests, output rows).
        work: Total work, in element-members, to decide whether to split.
        body: Called with each half-open item range.
    """
    var workers = min(num_physical_cores(), count)
    if workers <= 1 or work < CPU_MIN_PARALLEL_MEMBERS:
        body(0, count)
        return
    var per_worker = ceildiv(count, workers)

    def share(w: Int) {imm}:
        body(w * per_worker, min((w + 1) * per_worker, count))

    sync_parallelize(share, workers)


def check_launch(kernel: StaticString, grid: Int, block: Int) raises:
    """Refuses a launch shape that a GPU would refuse.

    A real launch with an empty grid, a block over 1024 threads or a grid
    past 2^31 - 1 blocks fails in the driver, far from the kernel that
    asked for it; an op must guard those shapes (an empty batch, say)
    before it launches.

    Args:
        kernel: Name of the kernel, for the message.
        grid: Blocks (x dimension).
        block: Threads per block (x dimension).

    Raises:
        Error: Naming the kernel and the offending dimension.
    """
    if grid < 1:
        raise Error(
            kernel, ": empty grid (grid_dim=", grid, "); guard it before launch"
        )
    if grid > GPU_MAX_GRID:
        raise Error(kernel, ": grid_dim=", grid, " exceeds 2^31 - 1 blocks")
    if block < 1 or block > GPU_MAX_BLOCK:
        raise Error(
            kernel, ": block_dim=", block, " outside 1..", GPU_MAX_BLOCK
        )


def emulate_grid[
    F: def(Int, Int) -> None
](kernel: StaticString, grid: Int, block: Int, body: F) raises:
    """Runs a GPU kernel body for every block and thread, on the CPU.

    `body(block, thread)` is what `gpu_kernel` runs with `block_idx.x`
    and `thread_idx.x`. Blocks run one after another and,
    within a block, threads one after another, both in descending order:
    a GPU promises no order at all, so a body that silently depends on
    launch order gives a different answer here than a CPU-ordered one.

    The emulation models no barriers, no shared memory, no warps and no
    memory ordering between threads. It is exact for kernels whose threads
    never communicate, which holds for every writer in this package; a
    kernel whose threads share memory is written as phases and emulated
    by `gpu_kernel.emulate_kernel` instead.

    Args:
        kernel: Name of the kernel, for launch-shape errors.
        grid: Blocks, as the kernel's grid rule gives them.
        block: Threads per block, likewise.
        body: One thread's work, `body(block, thread)`.

    Raises:
        Error: If `(grid, block)` is a shape a GPU launch refuses (see
            `check_launch`).
    """
    check_launch(kernel, grid, block)
    for b in reversed(range(grid)):
        for t in reversed(range(block)):
            body(b, t)


@__name(t"{name}")
def gpu_kernel[
    name: StaticString,
    Operands: KernelOperands,
    body: def(Int, Int, Operands) thin -> None,
](op: Operands):
    """Every GPU kernel of this package: `body` at this block and thread.

    The symbol is `name` plus a hash of the instance, so a profiler trace
    names the op (`kpool_ring_close_kernel_<hash>`).

    Parameters:
        name: Kernel name.
        Operands: The op's operand struct, passed by value.
        body: One thread's work, `body(block, thread, op)`.

    Args:
        op: The call's operands.
    """
    body(Int(block_idx.x), Int(thread_idx.x), op)


def launch[
    Operands: KernelOperands,
    //,
    name: StaticString,
    body: def(Int, Int, Operands) thin -> None,
    emulate: Bool,
](op: Operands, shape: Tuple[Int, Int], ctx: DeviceContext) raises:
    """Runs `body` over a `(grid, block)` launch on `ctx`, or emulated.

    An empty grid launches nothing (a GPU refuses one). On a GPU this
    enqueues `gpu_kernel[name, Operands, body]`; with `emulate` it runs
    the same body through `emulate_grid` on the CPU instead (the operands
    are then host memory and `ctx` is unused).

    `body` must take exactly `Operands`: a thread function over an alias
    with open parameters (`RingClose`) does not convert to that type, so
    each op passes a local `def` over `type_of(op)` that calls it.

    Parameters:
        Operands: The op's operand struct (inferred).
        name: Kernel name, for profiles and launch-shape errors.
        body: One thread's work, `body(block, thread, op)`.
        emulate: Run over an emulated grid on the CPU.

    Args:
        op: The call's operands.
        shape: `(grid, block)`: blocks (at least 0) and threads per block,
            both x dimension (`gpu_kernel.grid_blocks`, the declared
            `block_threads`).
        ctx: Device context.

    Raises:
        Error: If `(grid, block)` is a shape a GPU launch refuses (see
            `check_launch`).
    """
    check_kernel_layout[Operands]()
    var grid = shape[0]
    var block = shape[1]
    if grid == 0:
        return
    comptime if emulate:

        def thread_work(b: Int, t: Int) {imm}:
            body(b, t, op)

        emulate_grid(name, grid, block, thread_work)
    else:
        check_launch(name, grid, block)
        ctx.enqueue_function[gpu_kernel[name, Operands, body]](
            op, grid_dim=grid, block_dim=block
        )
