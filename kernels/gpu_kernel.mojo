"""Every GPU kernel of the package, declared once: `GpuKernel`.

A kernel's declaration is a struct of this trait, next to its body: its
operand type, name, threads per block, shared words, phases, how its grid
follows the call, and the body itself. Everything that needs those facts
reads the declaration:

- the op's `execute` launches it with `launch_kernel` (on a GPU or over
  the emulated grid);
- `gpu-report`'s compile driver and the Mojo compile tests compile it with
  `kernel_code`, and the report's manifest carries its launch facts
  (`block_threads`, `shared_words`, `phases` and the grid rule), which the
  rooflines read instead of repeating any launch arithmetic.

**The grid rule.** A launch has `ceil(rows / rows_per_block) *
ceil(columns / columns_per_block)` blocks on the x axis, `rows` and
`columns` being counts of the call that the declaration names
(`grid_rows`, `grid_columns`: `"batch"`, `"tokens"`, `"window_rows"`,
`"candidates"`, ... or `"1"`) and computes (`rows`, `columns`). A kernel
whose blocks do not share memory has `shared_words = 0` and one phase and
runs as `parallel.gpu_kernel`; the others as
`block_phases.gpu_phased_kernel`.
"""

from max.gpu.host import DeviceContext, get_gpu_target
from max.gpu.host.compile import _compile_code
from std.math import ceildiv
from std.sys import size_of

from .block_phases import Shared, gpu_phased_kernel, launch_phased
from .operands import KernelOperands
from .parallel import gpu_kernel, launch


trait GpuKernel:
    """One GPU kernel: its operands, launch shape and body."""

    comptime Operands: KernelOperands
    """The op's operand struct, the kernel's one argument."""
    comptime name: StaticString
    """Kernel name: the entry symbol's prefix, as profiles show it."""
    comptime block_threads: Int
    """Threads per block."""
    comptime shared_words: Int = 0
    """`UInt32` words of shared memory per block (0: none)."""
    comptime phases: Int = 1
    """Phases of the body, a block barrier after each (1: no barrier)."""
    comptime grid_rows: StaticString
    """What `rows` counts, for the report (`"batch"`, `"tokens"`, ...)."""
    comptime rows_per_block: Int = 1
    """Rows one block covers."""
    comptime grid_columns: StaticString = "1"
    """What `columns` counts (`"1"`: the grid has no column axis)."""
    comptime columns_per_block: Int = 1
    """Columns one block covers."""
    comptime column_flops: Int = 0
    """Flops per column the kernel computes (a scorer's per candidate), for
    the report's issue bound; 0 for kernels that only move data."""
    comptime pads_columns: Bool = False
    """Whether a block computes all its `columns_per_block` columns, past
    the call's count too (a tensor-core tile), or only the call's."""
    comptime flops_peak: StaticString = ""
    """The peak `column_flops` run at: `"fp32"` or `"fp8"`."""

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """The call's row count the grid follows (`grid_rows`)."""
        ...

    @staticmethod
    def columns(op: Self.Operands) -> Int:
        """The call's column count the grid follows (`grid_columns`); one
        unless the kernel has a column axis."""
        return 1

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """One thread's work in one phase (`s` is empty without shared words)."""
        ...


@always_inline
def is_phased[K: GpuKernel]() -> Bool:
    """Whether `K` runs as a phased kernel (shared memory or barriers)."""
    return K.shared_words > 0 or K.phases > 1


def grid_blocks[K: GpuKernel](op: K.Operands) -> Int:
    """Blocks of `K`'s launch for `op`, by the grid rule (module docstring)."""
    return ceildiv(K.rows(op), K.rows_per_block) * ceildiv(
        K.columns(op), K.columns_per_block
    )


@always_inline
def no_shared(thread: Int) -> Shared:
    """The empty view a kernel without shared memory gets (no words: its
    pointers are never read)."""
    var none = 0
    return Shared(
        Pointer[UInt32, MutAnyOrigin](unsafe_from_address=none),
        Pointer[Int64, MutAnyOrigin](unsafe_from_address=none),
        False,
        0,
        0,
        thread,
    )


def _thread[K: GpuKernel](block: Int, thread: Int, op: K.Operands):
    K.run(0, block, thread, no_shared(thread), op)


def _phase[
    K: GpuKernel
](phase: Int, block: Int, thread: Int, s: Shared, op: K.Operands):
    K.run(phase, block, thread, s, op)


def launch_kernel[
    K: GpuKernel, emulate: Bool
](op: K.Operands, ctx: DeviceContext) raises:
    """Launches `K` over its grid for `op` on `ctx`, or over the emulated grid.

    An empty grid launches nothing.

    Parameters:
        K: The kernel's declaration.
        emulate: Run on the CPU (`parallel.emulate_grid`,
            `block_phases.emulate_phases`); `ctx` is then unused.

    Args:
        op: The call's operands.
        ctx: Device context.

    Raises:
        Error: For a shape a GPU launch refuses (`parallel.check_launch`)
            or, emulated, a broken phase model.
    """
    var shape = (grid_blocks[K](op), K.block_threads)
    comptime if is_phased[K]():
        launch_phased[K.name, K.shared_words, _phase[K], emulate](
            op, shape, K.phases, ctx
        )
    else:
        launch[K.name, _thread[K], emulate](op, shape, ctx)


def kernel_code[K: GpuKernel, arch: StaticString]() raises -> String:
    """`K`'s kernel compiled for `arch` (PTX for `sm_*`, else AMDGPU asm)."""
    comptime target = get_gpu_target[arch]()
    comptime if is_phased[K]():
        comptime f = gpu_phased_kernel[
            K.name, K.Operands, K.shared_words, _phase[K]
        ]
        return String(_compile_code[f, target=target]())
    else:
        comptime f = gpu_kernel[K.name, K.Operands, _thread[K]]
        return String(_compile_code[f, target=target]())


def host_bytes[K: GpuKernel]() -> Int:
    """Bytes of `K`'s arguments on the host: the operands, and the `Int64`
    phase count of a phased kernel."""
    comptime if is_phased[K]():
        return size_of[K.Operands]() + size_of[Int64]()
    return size_of[K.Operands]()
