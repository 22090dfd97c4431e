"""Every GPU kernel of the package, declared once: `GpuKernel`.

A kernel's declaration is a struct of this trait, next to its body: its
operand type, name, threads per block, shared words, phase table
(`phases.Phases`: each phase's name and the collective after it), how its
grid follows the call, and the body itself. Everything that needs those facts
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
whose threads do not cooperate has `shared_words = 0` and one phase and
runs as `parallel.gpu_kernel`; the others as `gpu_block_kernel` (phases
unrolled at compile time, per-thread `State`, collectives, static or
dynamic shared memory; `gpu_bounded_block_kernel` for blocks of 1,024
threads), emulated by `emulate_kernel` (docs/kernels.md says how to
write one).
"""

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    barrier,
    block_idx,
    thread_idx,
)
from max.gpu.host import DeviceContext, FuncAttribute, get_gpu_target
from max.gpu.host.compile import _compile_code
from max.gpu.memory import AddressSpace, external_memory
from std.math import ceildiv, max
from std.memory import stack_allocation
from std.sys import size_of
from std.utils import StaticTuple

from .block_phases import (
    NO_COLLECTIVE,
    PROFILE_BUILD,
    no_profile,
    REPORT_WORDS,
    Lane,
    Shared,
    block_order,
    check_lanes,
    collective_scratch_words,
    emulate_collective,
    gpu_collective,
    is_block_collective,
    scratch_start,
    shadow_words,
    violation,
)
from .operands import KernelOperands, check_kernel_layout
from .phases import Phase, Phases
from .profile import LaunchProfile
from .parallel import check_launch, gpu_kernel, launch

comptime STATIC_SHARED_BYTES = 48 * 1024
"""The most static shared memory a block may declare (both targets)."""

comptime PORTABLE_SHARED_BYTES = 64 * 1024
"""The most shared memory a block may use on every target: an MI300X
workgroup's LDS (an H100 or H200 allows 227 KiB)."""


struct NoState(Copyable, Defaultable, TrivialRegisterPassable):
    """The per-thread state of a kernel that keeps none across barriers."""

    def __init__(out self):
        """No state."""
        pass


trait GpuKernel:
    """One GPU kernel: its operands, launch shape and body."""

    comptime Operands: KernelOperands
    """The op's operand struct, the kernel's one argument."""
    comptime State: Copyable & Defaultable & Deinitable = NoState
    """What a thread keeps across barriers (in registers on a GPU, in a
    per-thread array emulated); starts as `State()` in every block. A
    kernel with a `phase_table` whose `run_phase` names `Self.State`
    declares it, `NoState` too: Mojo 1.2 reports the default as a
    recursive reference there."""
    comptime name: StaticString
    """Kernel name: the entry symbol's prefix, as profiles show it."""
    comptime block_threads: Int
    """Threads per block."""
    comptime shared_words: Int = 0
    """`UInt32` words of shared memory per block (0: none); with
    `dynamic_shared`, the most a launch asks (`launch_shared_words`)."""
    comptime dynamic_shared: Bool = False
    """Whether shared memory is sized at launch (`launch_shared_words`),
    past the 48 KiB of static shared memory where the GPU allows."""
    comptime phase_table: Phases = Phases(Phase("run"))
    """The body's phases in order, each with its name and the collective
    after it (`phases.Phases`), a block barrier after each but the last
    (one phase: no barrier). `phase_count` says how many."""
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
    comptime padded_tile: Int = 0
    """Columns a block computes whole, past a row's count too (a
    tensor-core tile of candidates), or 0: only the row's."""
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
    def launch_shared_words(op: Self.Operands) -> Int:
        """Shared words this call's blocks use: `shared_words` unless the
        kernel sizes them at launch (`dynamic_shared`), then at most that."""
        return Self.shared_words

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """One thread's work in one phase (`s` is empty without shared
        words), for a kernel with no per-thread state or collectives."""
        pass

    @staticmethod
    def run_phase[
        phase: Int
    ](
        block: Int,
        thread: Int,
        mut state: Self.State,
        mut lane: Lane,
        s: Shared,
        op: Self.Operands,
    ):
        """One thread's work in phase `phase` (its name:
        `phase_table.name(phase)`): `run` unless the kernel keeps state
        across barriers or ends a phase with a collective."""
        Self.run(phase, block, thread, s, op)


@always_inline
def phase_count[K: GpuKernel]() -> Int:
    """Phases of `K`: its phase table's length."""
    comptime n = K.phase_table.count()
    return n


@always_inline
def is_phased[K: GpuKernel]() -> Bool:
    """Whether `K` runs as a phased kernel (shared memory or barriers)."""
    return K.shared_words > 0 or phase_count[K]() > 1


comptime BOUNDED_THREADS = 1024
"""Blocks of this many threads are launched through
`gpu_bounded_block_kernel`: a thread of them may have at most 64
registers, which ptxas keeps to only when told the block's size."""


@always_inline
def is_bounded[K: GpuKernel]() -> Bool:
    """Whether `K`'s blocks are launched with their size declared
    (`gpu_bounded_block_kernel`): blocks of `BOUNDED_THREADS`."""
    return K.block_threads >= BOUNDED_THREADS


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
        0,
        0,
        thread,
    )


def _thread[K: GpuKernel](block: Int, thread: Int, op: K.Operands):
    K.run(0, block, thread, no_shared(thread), op)


def scratch_words[K: GpuKernel]() -> Int:
    """Shared words `K`'s block collectives use after its own (0 if it has
    none): `block_phases.collective_scratch_words`."""
    comptime for p in range(phase_count[K]()):
        comptime if is_block_collective(K.phase_table.collective(p)):
            return collective_scratch_words(K.block_threads)
    return 0


def block_shared_words[K: GpuKernel]() -> Int:
    """The most shared words a block of `K` uses: its own and the scratch
    of its block collectives (what occupancy reads)."""
    return K.shared_words + scratch_words[K]()


def _check_declaration[K: GpuKernel]():
    comptime for p in range(phase_count[K]()):
        comptime if K.phase_table.collective(p) != NO_COLLECTIVE:
            comptime assert K.block_threads % 64 == 0, (
                "a kernel with collectives needs block_threads a multiple of"
                " 64 (whole warps on every target)"
            )
            comptime assert (
                p + 1 < phase_count[K]()
            ), "a collective runs between phases: none after the last"
    comptime assert (
        K.dynamic_shared or 4 * block_shared_words[K]() <= STATIC_SHARED_BYTES
    ), "static shared memory stops at 48 KiB: declare dynamic_shared"
    comptime assert (
        4 * block_shared_words[K]() <= PORTABLE_SHARED_BYTES
    ), "a block's shared memory must fit an MI300X workgroup's 64 KiB"


def launch_words[K: GpuKernel](op: K.Operands) raises -> Int:
    """`K.launch_shared_words(op)`, checked against the declared most.

    Raises:
        Error: Naming the kernel, if the launch asks for fewer than 0 or
            more than `K.shared_words` words (on a GPU as emulated).
    """
    var size = K.launch_shared_words(op)
    if size < 0 or size > K.shared_words:
        raise Error(
            K.name,
            ": launch_shared_words=",
            size,
            " outside 0..",
            K.shared_words,
            " (the declared shared_words)",
        )
    return size


def emulate_kernel[K: GpuKernel](op: K.Operands, grid: Int) raises:
    """Runs a phased kernel for every block, phase and thread, on the CPU.

    Blocks run one after another in `block_phases.block_order` (a fixed
    shuffle); within a block, phase `p` runs for every thread (descending)
    before its collective, then phase `p + 1`, as the barrier between them
    makes a GPU do. Each thread's `State` lives in a per-thread array across
    the phases. Each block's shared words start as `0xDEADBEEF` with no
    writer; every access and collective is checked (`block_phases`), and
    each lane's offers and reads against the phase table (`check_lanes`).

    Parameters:
        K: The kernel's declaration.

    Args:
        op: The call's operands (host memory).
        grid: Blocks.

    Raises:
        Error: For a launch shape a GPU refuses (`check_launch`), shared
            words past the declared most, or after the first phase with an
            access or collective that breaks the model, naming the block,
            phase, thread(s) and word; an offer where the phase table has
            no collective after the phase, or a read of a result where
            the phase before has none, naming the kernel and the phase.
    """
    _emulate[K](op, grid, no_profile(), 0)


def profile_kernel[
    K: GpuKernel
](
    op: K.Operands, grid: Int, warp: Int, sample: Int = 0
) raises -> LaunchProfile:
    """Emulates a phased kernel as `emulate_kernel` does, recording every
    shared access (`profile.LaunchProfile`).

    Parameters:
        K: The kernel's declaration.

    Args:
        op: The call's operands (host memory).
        grid: Blocks of the launch.
        warp: Lanes per warp of the target profiled (32 NVIDIA, 64 AMD).
        sample: Emulate only this many blocks (the first of the shuffled
            order) when the grid has more; 0 for every block. The others
            do not run, so the launch's outputs are incomplete.

    Returns:
        The profile: per shared-memory site, requests, wavefronts and
        ways; per phase, the critical path; blocks emulated.

    Raises:
        Error: As `emulate_kernel`.
    """
    comptime assert PROFILE_BUILD, (
        "profile_kernel records only in a build with -D MLA_KPOOL_PROFILE"
        " (block_phases.PROFILE_BUILD)"
    )
    var profile = LaunchProfile(
        String(K.name),
        warp,
        phase_count[K](),
        grid,
        K.block_threads,
        4 * (launch_words[K](op) + scratch_words[K]()),
    )
    var at = Pointer(to=profile).unsafe_origin_cast[MutAnyOrigin]()
    _emulate[K](op, grid, at, sample)
    return profile^


def _emulate[
    K: GpuKernel
](
    op: K.Operands,
    grid: Int,
    profile: Pointer[LaunchProfile, MutAnyOrigin],
    sample: Int,
) raises:
    """`emulate_kernel`, recording into `profile` (address 0: none) and
    running the first `sample` blocks of the shuffled order (0: all)."""
    _check_declaration[K]()
    check_kernel_layout[K.Operands]()
    comptime threads = K.block_threads
    check_launch(K.name, grid, threads)
    var size = launch_words[K](op)
    var words = List[UInt32](length=max(size, 1), fill=0)
    var shadow = List[Int64](length=shadow_words(size), fill=0)
    var word_ptr = words.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var shadow_ptr = shadow.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var report = shadow_ptr.unsafe_offset(shadow_words(size) - REPORT_WORDS)
    var states = List[K.State](length=threads, fill=K.State())
    var lanes = List[Lane](length=threads, fill=Lane())
    var order = block_order(grid)
    if sample > 0 and sample < grid:
        order.resize(sample, 0)
    for b in order:
        for i in range(size):
            words[i] = 0xDEADBEEF
        for i in range(len(shadow)):
            shadow[i] = 0
        for t in range(threads):
            states[t] = K.State()
            lanes[t] = Lane()
        comptime for p in range(phase_count[K]()):
            for t in reversed(range(threads)):
                K.run_phase[p](
                    b,
                    t,
                    states[t],
                    lanes[t],
                    Shared(word_ptr, shadow_ptr, size, p, t, profile),
                    op,
                )
            if report[unsafe_offset=0] != 0:
                raise Error(violation(K.name, b, report))
            if Int(profile) != 0:
                profile[].close_phase(p)
            comptime kind = K.phase_table.collective(p)
            comptime name = K.phase_table.name(p)
            check_lanes(K.name, b, p, name, kind, lanes)
            comptime if kind != NO_COLLECTIVE:
                emulate_collective(K.name, kind, b, p, name, lanes)
        if Int(profile) != 0:
            profile[].close_block()
    # The views point into these lists: they must outlive every body call.
    _ = words^
    _ = shadow^


@always_inline
def _run_block[K: GpuKernel](op: K.Operands):
    """The body of `gpu_block_kernel` and `gpu_bounded_block_kernel`."""
    var words: Pointer[UInt32, MutAnyOrigin]
    var size: Int
    comptime if K.dynamic_shared:
        words = (
            external_memory[
                UInt32, address_space=AddressSpace.SHARED, alignment=16
            ]()
            .unsafe_address_space_cast[AddressSpace.GENERIC]()
            .unsafe_origin_cast[MutAnyOrigin]()
        )
        size = K.launch_shared_words(op)
    else:
        words = (
            stack_allocation[
                max(block_shared_words[K](), 1),
                UInt32,
                alignment=128,
                address_space=AddressSpace.SHARED,
            ]()
            .unsafe_address_space_cast[AddressSpace.GENERIC]()
            .unsafe_origin_cast[MutAnyOrigin]()
        )
        size = K.shared_words
    var b = Int(block_idx.x)
    var t = Int(thread_idx.x)
    var state = K.State()
    var lane = Lane()
    comptime for p in range(phase_count[K]()):
        K.run_phase[p](
            b,
            t,
            state,
            lane,
            Shared(words, words.unsafe_bitcast[Int64](), size, p, t),
            op,
        )
        comptime kind = K.phase_table.collective(p)
        comptime if kind != NO_COLLECTIVE:
            gpu_collective[kind](
                lane,
                t,
                K.block_threads,
                words.unsafe_offset(scratch_start(size)),
            )
        comptime if p + 1 < phase_count[K]():
            barrier()


@__name(t"{name}")
def gpu_block_kernel[name: StaticString, K: GpuKernel](op: K.Operands):
    """A phased kernel on a GPU: each phase, its collective, a barrier.

    The phases are unrolled at compile time, so each is straight-line code
    and the thread's `State` stays in registers across the barriers.
    Shared memory is static (`K.shared_words`) or, with `K.dynamic_shared`,
    the launch's (`K.launch_shared_words(op)` words); the scratch of the
    block collectives follows it.

    Parameters:
        name: Kernel name (the symbol is this plus a hash).
        K: The kernel's declaration.

    Args:
        op: The call's operands.
    """
    _run_block[K](op)


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(K.block_threads))
)
@__name(t"{name}")
def gpu_bounded_block_kernel[name: StaticString, K: GpuKernel](op: K.Operands):
    """`gpu_block_kernel` with the block's size declared to the compiler
    (CUDA's `__launch_bounds__`), for blocks of `BOUNDED_THREADS`: without
    it ptxas may give a thread more registers than such a block can have,
    and the launch fails. Smaller blocks go without: declared on every
    kernel, it moved the registers of 39 of 77 (some up, some to spills).

    Parameters:
        name: Kernel name (the symbol is this plus a hash).
        K: The kernel's declaration.

    Args:
        op: The call's operands.
    """
    _run_block[K](op)


def _dynamic_bytes[K: GpuKernel](op: K.Operands) raises -> Int:
    """Bytes of dynamic shared memory `K`'s launch for `op` asks for."""
    return 4 * (launch_words[K](op) + scratch_words[K]())


def launch_kernel[
    K: GpuKernel, emulate: Bool
](op: K.Operands, ctx: DeviceContext) raises:
    """Launches `K` over its grid for `op` on `ctx`, or over the emulated grid.

    An empty grid launches nothing.

    Parameters:
        K: The kernel's declaration.
        emulate: Run on the CPU (`parallel.emulate_grid`, `emulate_kernel`);
            `ctx` is then unused.

    Args:
        op: The call's operands.
        ctx: Device context.

    Raises:
        Error: For a shape a GPU launch refuses (`parallel.check_launch`)
            or, emulated, a broken phase model.
    """
    _check_declaration[K]()
    var grid = grid_blocks[K](op)
    comptime if not is_phased[K]():
        launch[K.name, _thread[K], emulate](op, (grid, K.block_threads), ctx)
        return
    check_kernel_layout[K.Operands]()
    if grid == 0:
        return
    comptime if emulate:
        emulate_kernel[K](op, grid)
    else:
        check_launch(K.name, grid, K.block_threads)
        comptime if is_bounded[K]():
            _enqueue_block[K, gpu_bounded_block_kernel[K.name, K]](
                op, grid, ctx
            )
        else:
            _enqueue_block[K, gpu_block_kernel[K.name, K]](op, grid, ctx)


def _enqueue_block[
    K: GpuKernel, f: def(K.Operands) thin -> None
](op: K.Operands, grid: Int, ctx: DeviceContext) raises:
    """Enqueues `f`, `K`'s block kernel, over `grid` blocks."""
    comptime if K.dynamic_shared:
        # The attribute is the kernel's declared most, the same for
        # every launch; each launch asks only for what it uses.
        comptime most = 4 * block_shared_words[K]()
        ctx.enqueue_function[f](
            op,
            grid_dim=grid,
            block_dim=K.block_threads,
            shared_mem_bytes=_dynamic_bytes[K](op),
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(
                UInt32(most)
            ),
        )
    else:
        ctx.enqueue_function[f](op, grid_dim=grid, block_dim=K.block_threads)


def kernel_code[K: GpuKernel, arch: StaticString]() raises -> String:
    """`K`'s kernel compiled for `arch` (PTX for `sm_*`, else AMDGPU asm)."""
    _check_declaration[K]()
    comptime target = get_gpu_target[arch]()
    comptime if is_phased[K]() and is_bounded[K]():
        comptime f = gpu_bounded_block_kernel[K.name, K]
        return String(_compile_code[f, target=target]())
    elif is_phased[K]():
        comptime f = gpu_block_kernel[K.name, K]
        return String(_compile_code[f, target=target]())
    else:
        comptime f = gpu_kernel[K.name, K.Operands, _thread[K]]
        return String(_compile_code[f, target=target]())


def host_bytes[K: GpuKernel]() -> Int:
    """Bytes of `K`'s arguments on the host: the operands."""
    return size_of[K.Operands]()
