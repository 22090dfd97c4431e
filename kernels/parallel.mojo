"""How the writers split work: CPU core ranges, GPU launches, emulated grids.

Each op gathers one call's operands into a struct (`RingCloseOperands`,
...), written once and passed whole to its CPU driver, its thread body and
its GPU kernel. Every GPU kernel of this package is a thin shim over a
plain function of `(block, thread, operands)` that does one thread's work.
On a GPU the shim passes `block_idx.x` and `thread_idx.x`; `emulate_grid`
runs the same function on the CPU for every block and thread of the
launch, so the code that is tested without an accelerator is exactly the
code a GPU runs.
"""

from max.algorithm import sync_parallelize
from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.math import ceildiv, min
from std.sys import num_physical_cores

comptime GPU_MAX_BLOCK = 1024
"""Largest block the GPU writers launch; wider heads stride over channels."""

comptime GPU_MAX_GRID = (1 << 31) - 1
"""Largest x-dimension grid a GPU launch accepts (CUDA's and HIP's limit)."""

comptime CPU_MIN_PARALLEL_WORK = 1 << 17
"""Element-members below which one core finishes before others could wake.

Inside a MAX graph, waking the runtime's worker threads costs about as
much as pooling 100-200 pools of 4 x 128 channels on one core, so
decode-sized calls stay on the calling thread (docs/performance.md)."""


trait KernelOperands(DevicePassable, TrivialRegisterPassable):
    """One call's operands of an op: raw tensor pointers and sizes.

    A struct of this trait is built once in the op's `execute` and passed
    whole to the CPU driver, the thread body and the GPU kernel, which
    receives it as one by-value kernel argument (its bytes copied as they
    are: pointers and 64-bit integers, laid out alike on host and device).
    """

    comptime device_type: AnyType = Self
    """The kernel receives the struct itself."""

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        """Copies the struct into the kernel's argument buffer."""
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        """Name used in launch diagnostics."""
        return "mla_kpool kernel operands"


@always_inline
def gpu_block_width[head_dim: Int]() -> Int:
    """Threads per block of every GPU writer: one per channel, at most 1024.

    A wider head keeps 1024 threads, each striding over the channels.
    """
    return min(head_dim, GPU_MAX_BLOCK)


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
    if workers <= 1 or work < CPU_MIN_PARALLEL_WORK:
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

    `body(block, thread)` is the function the kernel's GPU shim calls with
    `block_idx.x` and `thread_idx.x`. Blocks run one after another and,
    within a block, threads one after another, both in descending order:
    a GPU promises no order at all, so a body that silently depends on
    launch order gives a different answer here than a CPU-ordered one.

    The emulation models no barriers, no shared memory, no warps and no
    memory ordering between threads. It is exact for kernels whose threads
    never communicate, which holds for every kernel in this package; a
    kernel that synchronizes its threads must not be emulated this way.

    Args:
        kernel: Name of the kernel, for launch-shape errors.
        grid: Blocks, as the kernel's `*_launch` helper computed them.
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
