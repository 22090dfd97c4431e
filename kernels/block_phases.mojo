"""Block-cooperative GPU kernels as phases, with an emulation that checks them.

The writers' GPU kernels are thread bodies whose threads never communicate
(`parallel.launch`). A kernel whose threads share data through the block's
shared memory (a tile decoded once for the block, a reduction, a select)
is written here as phases instead: `body(phase, block, thread, shared,
op)`, run for `phase` in `0 ..< phases`. On a GPU every thread of the block
runs phase `p`, then the block meets at a barrier, then phase `p + 1`
begins (`gpu_phased_kernel`); values a thread keeps from one phase to the
next live in shared memory (or global memory), never in its locals.

`emulate_phases` runs the same body on the CPU: for each block, phase `p`
for every thread (in descending order) before phase `p + 1`, which is
exact for barrier-separated code. A missing barrier (a thread reading a
shared word another thread writes in the same phase) would still give
the right answer in some thread order, so the emulation does not rely on
order: it stamps every shared word with its last writer and readers
(phase, thread) and fails the launch on

- a read of a word another thread wrote in the same phase,
- a write to a word another thread read or wrote in the same phase,
- a read of a word no phase of this block has written (shared memory
  starts undefined on a GPU), or
- an index outside the block's shared words.

Shared memory is `UInt32` words; 32-bit values of other types are stored
by bit pattern (`load_f32` / `store_f32`). The race check idea is the one
of GPU race detectors (NVIDIA's compute-sanitizer racecheck): shadow state
per shared word, checked at each access between two barriers.
"""

from max.gpu import barrier, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.memory import AddressSpace
from std.math import max
from std.memory import bitcast, stack_allocation

from .operands import KernelOperands, check_kernel_layout
from .parallel import check_launch

comptime Shared = BlockShared[MutAnyOrigin]
"""The view a phased body receives."""

comptime _NONE: Int64 = 0
"""A stamp no access has set."""

comptime _MANY: Int64 = 0xFFFFFFFF
"""The thread field of a read stamp that several threads set."""

comptime _KIND_READ_RACE = 1
comptime _KIND_WRITE_RACE = 2
comptime _KIND_UNWRITTEN = 3
comptime _KIND_OUT_OF_RANGE = 4

comptime _REPORT_WORDS = 5
"""Words after the stamps that hold the first violation: kind, word,
thread, the other thread, phase."""


@always_inline
def _stamp(phase: Int, thread: Int) -> Int64:
    """`(phase + 1) << 32 | (thread + 1)`: never `_NONE`."""
    return (Int64(phase + 1) << 32) | Int64(thread + 1)


@always_inline
def _stamp_phase(stamp: Int64) -> Int:
    return Int(stamp >> 32) - 1


@always_inline
def _stamp_thread(stamp: Int64) -> Int:
    return Int(stamp & 0xFFFFFFFF) - 1


struct BlockShared[origin: MutOrigin](TrivialRegisterPassable):
    """One thread's view of its block's shared memory in one phase.

    On a GPU, `words` is the block's shared memory and `checked` is false:
    loads and stores are plain (one uniform branch each). Emulated,
    `shadow` holds each word's last write stamp, then its read stamp, then
    the report; an access that breaks the phase model is recorded there
    (the first one) and the launch fails after the phase.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin` in kernels, as
            `Shared`).
    """

    var words: Pointer[UInt32, Self.origin]
    var shadow: Pointer[Int64, Self.origin]
    var checked: Bool
    var size: Int
    var phase: Int
    var thread: Int

    def __init__(
        out self,
        words: Pointer[UInt32, Self.origin],
        shadow: Pointer[Int64, Self.origin],
        checked: Bool,
        size: Int,
        phase: Int,
        thread: Int,
    ):
        """A view of `size` words; `shadow` is read only when `checked`."""
        self.words = words
        self.shadow = shadow
        self.checked = checked
        self.size = size
        self.phase = phase
        self.thread = thread

    def _report(self, kind: Int, word: Int, other: Int):
        var report = self.shadow.unsafe_offset(2 * self.size)
        if report[unsafe_offset=0] != 0:
            return
        report[unsafe_offset=0] = Int64(kind)
        report[unsafe_offset=1] = Int64(word)
        report[unsafe_offset=2] = Int64(self.thread)
        report[unsafe_offset=3] = Int64(other)
        report[unsafe_offset=4] = Int64(self.phase)

    def _in_range(self, i: Int) -> Bool:
        if 0 <= i < self.size:
            return True
        self._report(_KIND_OUT_OF_RANGE, i, -1)
        return False

    def _check_read(self, i: Int):
        var written = self.shadow[unsafe_offset=i]
        if written == _NONE:
            self._report(_KIND_UNWRITTEN, i, -1)
        elif (
            _stamp_phase(written) == self.phase
            and _stamp_thread(written) != self.thread
        ):
            self._report(_KIND_READ_RACE, i, _stamp_thread(written))
        var read = self.shadow[unsafe_offset=self.size + i]
        var mine = _stamp(self.phase, self.thread)
        if read == _NONE or _stamp_phase(read) != self.phase:
            self.shadow[unsafe_offset=self.size + i] = mine
        elif read != mine:
            self.shadow[unsafe_offset=self.size + i] = (
                Int64(self.phase + 1) << 32
            ) | _MANY

    def _check_write(self, i: Int):
        var written = self.shadow[unsafe_offset=i]
        if (
            written != _NONE
            and _stamp_phase(written) == self.phase
            and _stamp_thread(written) != self.thread
        ):
            self._report(_KIND_WRITE_RACE, i, _stamp_thread(written))
        var read = self.shadow[unsafe_offset=self.size + i]
        if (
            read != _NONE
            and _stamp_phase(read) == self.phase
            and _stamp_thread(read) != self.thread
        ):
            self._report(_KIND_WRITE_RACE, i, _stamp_thread(read))
        self.shadow[unsafe_offset=i] = _stamp(self.phase, self.thread)

    @always_inline
    def load(self, i: Int) -> UInt32:
        """Word `i` (0 if the emulation refused the access)."""
        if self.checked:
            if not self._in_range(i):
                return 0
            self._check_read(i)
        return self.words[unsafe_offset=i]

    @always_inline
    def store(self, i: Int, value: UInt32):
        """Sets word `i` (dropped if the emulation refused the access)."""
        if self.checked:
            if not self._in_range(i):
                return
            self._check_write(i)
        self.words[unsafe_offset=i] = value

    @always_inline
    def load_f32(self, i: Int) -> Float32:
        """Word `i` as a float32 bit pattern."""
        return bitcast[DType.float32, 1](self.load(i))

    @always_inline
    def load_f32x[width: Int](self, i: Int) -> SIMD[DType.float32, width]:
        """Words `i ..< i + width` as float32 lanes, one vector load on a GPU.

        Parameters:
            width: Lanes (a power of two); `i` must be a multiple of it.
        """
        if self.checked:
            var lanes = SIMD[DType.float32, width]()
            comptime for w in range(width):
                lanes[w] = self.load_f32(i + w)
            return lanes
        return (
            self.words.unsafe_offset(i)
            .unsafe_bitcast[Float32]()
            .unsafe_load[width=width](0)
        )

    @always_inline
    def store_f32(self, i: Int, value: Float32):
        """Stores `value`'s bit pattern in word `i`."""
        self.store(i, bitcast[DType.uint32, 1](value))


def _violation(
    kernel: StaticString, block: Int, report: Pointer[Int64, MutAnyOrigin]
) -> String:
    """The emulation's message for the recorded violation."""
    var kind = Int(report[unsafe_offset=0])
    var place = String(
        kernel,
        ": block ",
        block,
        " phase ",
        report[unsafe_offset=4],
        " thread ",
        report[unsafe_offset=2],
    )
    if kind == _KIND_OUT_OF_RANGE:
        return String(
            place,
            " used shared word ",
            report[unsafe_offset=1],
            " out of range",
        )
    if kind == _KIND_UNWRITTEN:
        return String(
            place,
            " read shared word ",
            report[unsafe_offset=1],
            " before any thread wrote it",
        )
    var what = "read" if kind == _KIND_READ_RACE else "wrote"
    return String(
        place,
        " ",
        what,
        " shared word ",
        report[unsafe_offset=1],
        " that thread ",
        report[unsafe_offset=3],
        " used in the same phase (a missing barrier)",
    )


def emulate_phases[
    F: def(Int, Int, Int, Shared) -> None
](
    kernel: StaticString,
    grid: Int,
    block: Int,
    phases: Int,
    shared_words: Int,
    body: F,
) raises:
    """Runs a phased kernel body for every block, phase and thread, on the CPU.

    Blocks run one after another in descending order; within a block,
    phase `p` runs for every thread (descending) before phase `p + 1`, as
    the barrier between them makes a GPU do. Each block's shared words
    start as `0xDEADBEEF` with no writer; every access is checked (module
    docs).

    Args:
        kernel: Name of the kernel, for messages.
        grid: Blocks.
        block: Threads per block.
        phases: Phases of the body.
        shared_words: `UInt32` words of shared memory per block.
        body: `body(phase, block, thread, shared)`.

    Raises:
        Error: For a launch shape a GPU refuses (`check_launch`), or after
            the first phase with an access that breaks the phase model,
            naming the block, phase, thread(s) and word.
    """
    check_launch(kernel, grid, block)
    var words = List[UInt32](length=max(shared_words, 1), fill=0)
    var shadow = List[Int64](length=2 * shared_words + _REPORT_WORDS, fill=0)
    var word_ptr = words.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var shadow_ptr = shadow.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var report = shadow_ptr.unsafe_offset(2 * shared_words)
    for b in reversed(range(grid)):
        for i in range(shared_words):
            words[i] = 0xDEADBEEF
        for i in range(len(shadow)):
            shadow[i] = 0
        for p in range(phases):
            for t in reversed(range(block)):
                body(
                    p,
                    b,
                    t,
                    Shared(word_ptr, shadow_ptr, True, shared_words, p, t),
                )
            if report[unsafe_offset=0] != 0:
                raise Error(_violation(kernel, b, report))
    # The views point into these lists: they must outlive every body call.
    _ = words^
    _ = shadow^


@__name(t"{name}")
def gpu_phased_kernel[
    name: StaticString,
    Operands: KernelOperands,
    shared_words: Int,
    body: def(Int, Int, Int, Shared, Operands) thin -> None,
](op: Operands, phases: Int64):
    """A phased kernel on a GPU: each phase, then a barrier.

    Parameters:
        name: Kernel name (the symbol is this plus a hash).
        Operands: The op's operand struct, passed by value.
        shared_words: `UInt32` words of static shared memory per block.
        body: `body(phase, block, thread, shared, op)`.

    Args:
        op: The call's operands.
        phases: Phases to run (the same for every thread; `Int64`, since
            `Int` is not a kernel argument type).
    """
    var words = stack_allocation[
        shared_words, UInt32, alignment=128, address_space=AddressSpace.SHARED
    ]()
    var generic = words.unsafe_address_space_cast[
        AddressSpace.GENERIC
    ]().unsafe_origin_cast[MutAnyOrigin]()
    var b = Int(block_idx.x)
    var t = Int(thread_idx.x)
    for p in range(Int(phases)):
        body(
            p,
            b,
            t,
            Shared(
                generic,
                generic.unsafe_bitcast[Int64](),
                False,
                shared_words,
                p,
                t,
            ),
            op,
        )
        barrier()


def launch_phased[
    Operands: KernelOperands,
    //,
    name: StaticString,
    shared_words: Int,
    body: def(Int, Int, Int, Shared, Operands) thin -> None,
    emulate: Bool,
](op: Operands, shape: Tuple[Int, Int], phases: Int, ctx: DeviceContext) raises:
    """Runs a phased body over `(grid, block)` on `ctx`, or emulated.

    An empty grid launches nothing.

    Parameters:
        Operands: The op's operand struct (inferred).
        name: Kernel name, for profiles and errors.
        shared_words: `UInt32` words of shared memory per block.
        body: `body(phase, block, thread, shared, op)`.
        emulate: Run through `emulate_phases` on the CPU.

    Args:
        op: The call's operands.
        shape: `(grid, block)`.
        phases: Phases of the body.
        ctx: Device context (unused when emulated).

    Raises:
        Error: For a refused launch shape, or (emulated) a broken phase
            model.
    """
    check_kernel_layout[Operands]()
    var grid = shape[0]
    var block = shape[1]
    if grid == 0:
        return
    comptime if emulate:

        def thread_phase(p: Int, b: Int, t: Int, shared: Shared) {imm}:
            body(p, b, t, shared, op)

        emulate_phases(name, grid, block, phases, shared_words, thread_phase)
    else:
        check_launch(name, grid, block)
        ctx.enqueue_function[
            gpu_phased_kernel[name, Operands, shared_words, body]
        ](op, Int64(phases), grid_dim=grid, block_dim=block)
